"""The router process: the public API. It validates and tokenizes, picks a decode and a prefill
worker, opens the decode stream, starts the prefill that ships KV there, and relays tokens."""
from __future__ import annotations

import logging
import threading
import time
import uuid

import grpc

from baton.config import ModelSettings, RouterSettings, TLSSettings
from baton.messages import sampling_from_proto
from baton.server import GrpcServer, NotReady
from baton.v1 import common_pb2, router_pb2, router_pb2_grpc, workers_pb2
from engine.model import TokenizerView, load_tokenizer_view
from engine.request import RequestError, validate_prompt
from router.policy import NoWorkers, Picker
from router.workers import WorkerPool

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, model: TokenizerView, pool: WorkerPool, settings: RouterSettings):
        self.model = model
        self.pool = pool
        self.settings = settings
        self.picker = Picker()
        self._inflight = 0
        self._lock = threading.Lock()

    # -- translating the request ----------------------------------------------------------

    def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise RequestError("text is empty; send a non-empty prompt")
            return self.model.encode_text(request.text)
        if kind == "messages":
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            if not messages:
                raise RequestError("messages is empty; send at least one chat message")
            bad = [m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")]
            if bad:
                raise RequestError(f"unknown chat role {bad[0]!r}; use system, user or assistant")
            return self.model.encode_chat(messages)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise RequestError("no prompt: set one of text, messages or token_ids")

    # -- the public API -----------------------------------------------------------------------

    def Generate(self, request, context):
        try:
            prompt = self._prompt_ids(request)
            params = sampling_from_proto(request.sampling)
            validate_prompt(prompt, params, max_context=self.model.max_context, vocab_size=self.model.vocab_size)
        except (RequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self._lock:
            if self._inflight >= self.settings.max_inflight:
                context.set_trailing_metadata((("retry-after-s", "1"),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the router has {self.settings.max_inflight} requests in flight; retry later")
            self._inflight += 1
        try:
            yield from self._generate(request.request_id or uuid.uuid4().hex, prompt, request.sampling, context)
        finally:
            with self._lock:
                self._inflight -= 1

    def _generate(self, request_id: str, prompt: list[int], sampling, context):
        arrived = time.monotonic()
        try:
            decode = self.pool.get("decode", self.picker.pick_decode(self.pool.views("decode")).address)
            prefill = self.pool.get("prefill", self.picker.pick_prefill(self.pool.views("prefill"), len(prompt)).address)
        except NoWorkers as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if decode is None or prefill is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "a chosen worker just left; retry")
        timeout = context.time_remaining()
        self.pool.acquire(decode)
        self.pool.acquire(prefill)
        decode_call = None
        prefill_call = None
        try:
            decode_call = decode.stub.Decode(
                workers_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling),
                timeout=timeout)
            next(decode_call)  # registered: its KV will be accepted
            prefill_call = prefill.stub.Prefill.future(
                workers_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                           decode_target=decode.view.address, model_fingerprint=decode.fingerprint),
                timeout=timeout)
            # A failed prefill means the KV never comes: stop waiting for it at once.
            prefill_call.add_done_callback(lambda f: f.exception() is not None and decode_call.cancel())
            context.add_callback(lambda: (decode_call.cancel(), prefill_call.cancel()))
            yield router_pb2.GenerateResponse(request_id=request_id, prompt_token_ids=prompt)
            completion = 0
            for msg in decode_call:
                completion += len(msg.token_ids)
                out = router_pb2.GenerateResponse(request_id=request_id, token_ids=msg.token_ids,
                                                  text_delta=msg.text_delta, finish_reason=msg.finish_reason)
                if msg.finish_reason:
                    reply = prefill_call.result(timeout=5)
                    stages = dict(msg.stage_seconds)
                    stages.update(queue=reply.queue_seconds, prefill=reply.prefill_seconds,
                                  transfer=reply.transfer_seconds)
                    stages["total"] = time.monotonic() - arrived
                    out.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=completion,
                                                        cached_tokens=reply.cached_tokens))
                    out.trace.CopyFrom(common_pb2.Trace(stage_seconds=stages, cached_tokens=reply.cached_tokens,
                                                        prefill_worker=prefill.view.address,
                                                        decode_worker=decode.view.address))
                yield out
        except grpc.RpcError as err:
            self._abort_with_cause(context, err, prefill_call)
        finally:
            if decode_call is not None:
                decode_call.cancel()
            if prefill_call is not None and not prefill_call.done():
                prefill_call.cancel()
            self.pool.release(decode)
            self.pool.release(prefill)

    def _abort_with_cause(self, context, err: grpc.RpcError, prefill_call) -> None:
        """Report the first real cause: a failed prefill explains a cancelled decode stream."""
        if prefill_call is not None and prefill_call.done() and not prefill_call.cancelled():
            cause = prefill_call.exception()
            if cause is not None:
                err = cause
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.INTERNAL
        if code == grpc.StatusCode.CANCELLED and not context.is_active():
            return  # the client left; nothing to tell it
        context.abort(code, f"{err.details() if hasattr(err, 'details') else err}")

    def GetModelInfo(self, request, context):
        fingerprints = {w.fingerprint for w in self.pool.all() if w.fingerprint}
        return router_pb2.ModelInfo(name=self.model.name, max_context=self.model.max_context,
                                    model_fingerprint=",".join(sorted(fingerprints)), vocab_size=self.model.vocab_size)

    def GetClusterStatus(self, request, context):
        status = router_pb2.ClusterStatus()
        for w in self.pool.all():
            entry = status.workers.add(address=w.view.address, role=w.role, healthy=w.view.healthy)
            if w.last_load is not None:
                (entry.decode if w.role == "decode" else entry.prefill).CopyFrom(w.last_load)
        return status


def serve(model: ModelSettings, settings: RouterSettings, tls: TLSSettings | None = None, *, block: bool = True):
    server = GrpcServer(settings.host, settings.port, tls=tls)
    api = NotReady()
    router_pb2_grpc.add_RouterServicer_to_server(api, server.server)
    server.add_service("baton.v1.Router")
    server.start()
    view = load_tokenizer_view(model.name)
    pool = WorkerPool(tls, settings.load_poll_seconds)
    pool.set_workers("prefill", settings.prefill_workers)
    pool.set_workers("decode", settings.decode_workers)
    pool.poll_once()
    pool.start()
    api.target = RouterServicer(view, pool, settings)
    server.set_serving()
    log.info("router serving on port %d", server.port)
    if not block:
        return server, pool
    server.wait_for_signal(on_stop=pool.stop)
