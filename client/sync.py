"""The blocking client: `BatonClient`.

    with BatonClient("localhost:50051") as client:
        result = client.generate("What is the capital of France?", max_tokens=32)
        for chunk in client.stream("Write a haiku.", temperature=0.7, seed=1):
            print(chunk.text_delta, end="", flush=True)

A channel is thread-safe: share one client between threads (generate_many does).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from baton.v1 import router_pb2, router_pb2_grpc
from baton.client.channel import (DEFAULT_KEEPALIVE_S, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_RETRIES,
                                  DEFAULT_READY_TIMEOUT_S, DEFAULT_TIMEOUT_S, READY_POLL_S, ConnectionConfig,
                                  PemSource)
from baton.client.convert import (ResultAssembler, build_request, chunk_from_proto, cluster_status_from_proto,
                            model_info_from_proto)
from baton.client.errors import BatonError, DeadlineExceeded, Unavailable, error_from_rpc
from baton.client.many import BatchCollector, batch_request, finish_batch, prepare_batch
from baton.client.types import BatchOutcome, ClusterStatus, GenerationResult, ModelInfo, StreamChunk


class ChunkStream:
    """The chunks of one streaming request, as an iterator.

    Closing it cancels the RPC, so the router frees the request's decode row at once: call
    close(), leave a `with` block, or break out of `for chunk in client.stream(...)` (the
    unreferenced stream is closed when dropped). A stream kept in a variable after `break`
    stays open until closed or dropped. result() reads what is left and returns the whole."""

    def __init__(self, call: Any, request_id: str | None):
        self._call = call
        self._assembler = ResultAssembler(request_id)
        self._done = False

    def __iter__(self) -> "ChunkStream":
        return self

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        try:
            response = next(self._call)
        except StopIteration:
            self._done = True
            self._assembler.check_finished()
            raise
        except grpc.RpcError as error:
            self._done = True
            raise error_from_rpc(error, self._assembler.request_id) from error
        chunk = chunk_from_proto(response)
        self._assembler.add(chunk)
        return chunk

    @property
    def request_id(self) -> str | None:
        """The request's id: the caller's, or the router's once the first chunk arrived."""
        return self._assembler.request_id

    def result(self) -> GenerationResult:
        for _ in self:
            pass
        return self._assembler.result()

    def close(self) -> None:
        """Cancel the RPC if it is still running; a finished stream is left as it is."""
        if not self._done:
            self._done = True
            self._call.cancel()

    def __enter__(self) -> "ChunkStream":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_call"):  # __init__ may not have run to the end
            try:
                self.close()
            except Exception:  # at interpreter exit grpc may be gone; nothing is left to free then
                pass


class BatonClient:
    """A connection to a Baton router.

    target: "host:port". timeout: the default deadline of every call, in seconds (default 600;
    None = none; a call's own timeout= wins). keepalive_s: while calls are open, ping the router
    this often (default 10 s) and fail them with UNAVAILABLE when it stops answering (None: never). tls: use TLS; root_certificates (PEM bytes or a path; None =
    system roots), client_cert + client_key for mutual TLS, tls_server_name to check the
    certificate for another name. token: sent as `authorization: Bearer <token>`.
    load_balancing="round_robin" spreads calls over every router a `dns:///` target resolves to
    (the chart's headless `<release>-router-headless` Service); the default pins one. When the
    application traces with OpenTelemetry, each call carries its current span's context.
    max_retries: a call refused UNAVAILABLE before any answer (no connection yet, a router
    draining or still loading, a worker that just left) is made again up to this many times
    (default 2, at most 4; 0: never), after 0.2 s growing to 2 s, within its deadline; a stream
    that has sent a token is not. Failed calls raise client.errors.BatonError subclasses; bad
    arguments raise ValueError before anything is sent."""

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, tls: bool = False,
                 root_certificates: PemSource = None, client_cert: PemSource = None,
                 client_key: PemSource = None, token: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls_server_name: str | None = None,
                 keepalive_s: float | None = DEFAULT_KEEPALIVE_S, load_balancing: str | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES):
        self._config = ConnectionConfig.from_args(
            target, timeout=timeout, tls=tls, root_certificates=root_certificates, client_cert=client_cert,
            client_key=client_key, token=token, max_message_bytes=max_message_bytes,
            tls_server_name=tls_server_name, keepalive_s=keepalive_s, load_balancing=load_balancing,
            max_retries=max_retries)
        credentials = self._config.credentials()
        options = self._config.options()
        self._channel = (grpc.secure_channel(self._config.target, credentials, options=options) if credentials
                         else grpc.insecure_channel(self._config.target, options=options))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    @property
    def target(self) -> str:
        return self._config.target

    def generate(self, prompt: str | None = None, *, messages: Sequence[Any] | None = None,
                 token_ids: Sequence[int] | None = None, raw: bool = False, request_id: str | None = None,
                 timeout: float | None = None, **sampling: Any) -> GenerationResult:
        """Run one request to the end and return it whole.

        Exactly one of prompt (sent as one user chat message; raw=True sends it as plain text
        without the chat template), messages ([{"role": ..., "content": ...}]) or token_ids.
        sampling: max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids,
        ignore_eos, priority, logprobs, presence_penalty, frequency_penalty, repetition_penalty,
        min_tokens, logit_bias ({token_id: bias}). max_tokens, temperature, top_p, top_k,
        repetition_penalty and min_p left unset get the model's defaults
        (model_info().sampling_defaults), else 256 tokens, greedy."""
        with self.stream(prompt, messages=messages, token_ids=token_ids, raw=raw, request_id=request_id,
                         timeout=timeout, **sampling) as chunks:
            return chunks.result()

    def stream(self, prompt: str | None = None, *, messages: Sequence[Any] | None = None,
               token_ids: Sequence[int] | None = None, raw: bool = False, request_id: str | None = None,
               timeout: float | None = None, **sampling: Any) -> ChunkStream:
        """Start one request and return its chunks as they are decoded (same arguments as
        generate). The timeout covers the whole stream. Closing the stream cancels the RPC."""
        request = build_request(prompt, messages=messages, token_ids=token_ids, raw=raw,
                                request_id=request_id, **sampling)
        call = self._stub.Generate(request, timeout=self._config.deadline(timeout),
                                   metadata=self._config.metadata())
        return ChunkStream(call, request.request_id)

    def generate_many(self, requests: Sequence[str | Mapping[str, Any]], *, max_concurrency: int = 16,
                      timeout: float | None = None, return_exceptions: bool = False,
                      **defaults: Any) -> list[GenerationResult | BatonError]:
        """Run many requests at once, at most max_concurrency in flight; results in input order.

        Each entry is a prompt string or a dict of generate() keywords; defaults (raw, sampling
        options) apply to every entry that does not set its own. timeout is per request. Every
        entry is checked before any is sent. All requests run to the end even when some fail;
        then, with return_exceptions=False (default), the first failure in input order is
        raised with every slot in its .batch_results; with True, failed slots hold their
        BatonError instead."""
        calls = prepare_batch(requests, max_concurrency, timeout, defaults)
        if not calls:
            return []

        def run_one(kwargs: dict[str, Any]) -> GenerationResult | BatonError:
            try:
                return self.generate(**kwargs)
            except BatonError as error:
                return error

        pool = ThreadPoolExecutor(max_workers=min(max_concurrency, len(calls)), thread_name_prefix="baton-generate")
        try:
            outcomes = list(pool.map(run_one, calls))
        finally:
            # On Ctrl-C do not wait for the queue: drop what has not started; close() cancels the rest.
            pool.shutdown(wait=False, cancel_futures=True)
        return finish_batch(outcomes, return_exceptions)

    def generate_batch(self, requests: Sequence[str | Mapping[str, Any]], *, max_concurrency: int = 0,
                       timeout: float | None = None, on_result=None, **defaults: Any) -> BatchOutcome:
        """A large offline batch through Router.GenerateBatch: the router finds shared prefixes
        ahead of time and computes each once (BatchLLM). Entries as for generate_many; results
        come back in input order with the router's summary. on_result(index, result_or_error)
        is called as each request finishes (results stream back as they are done)."""
        request = batch_request(requests, max_concurrency, defaults)
        if not request.requests:
            return BatchOutcome([], {})
        call = self._stub.GenerateBatch(request, timeout=self._config.deadline(timeout), metadata=self._config.metadata())
        collected = BatchCollector(len(request.requests), on_result)
        try:
            for item in call:
                collected.add(item)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        finally:
            call.cancel()
        return collected.outcome()

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The model served: name, context length, fingerprint, vocabulary size."""
        return model_info_from_proto(self._unary(self._stub.GetModelInfo, router_pb2.ModelInfoRequest(), timeout))

    def cluster_status(self, *, timeout: float | None = None) -> ClusterStatus:
        """Health and load of every worker the router knows."""
        return cluster_status_from_proto(
            self._unary(self._stub.GetClusterStatus, router_pb2.ClusterStatusRequest(), timeout))

    def wait_ready(self, timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Block until the router can serve a request: connected, its model loaded, and a healthy
        prefill and decode worker behind it. Raise Unavailable, saying what is missing, after
        `timeout` seconds; another refusal (a wrong token) is raised at once."""
        deadline = time.monotonic() + timeout
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable("UNAVAILABLE", f"no connection to the router at {self.target} "
                              f"within {timeout} s; is it running and is tls= right?") from None
        while True:
            try:
                missing = self.cluster_status(timeout=max(READY_POLL_S, deadline - time.monotonic())).waiting_for()
            except (Unavailable, DeadlineExceeded) as exc:  # the router's own model is still loading
                missing = exc.message
            if missing is None:
                return
            if time.monotonic() >= deadline:
                raise Unavailable("UNAVAILABLE", f"the router at {self.target} could not serve within {timeout} s: "
                                  f"{missing}")
            time.sleep(READY_POLL_S)

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._config.deadline(timeout), metadata=self._config.metadata())
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        self._channel.close()

    def __enter__(self) -> "BatonClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
