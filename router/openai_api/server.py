"""The OpenAI-compatible HTTP API on the router: /v1/chat/completions, /v1/completions, /v1/models,
/health and /metrics, served by uvicorn in a thread of the router process. It translates HTTP
and JSON to the router's Front and back; requests run through the same dispatcher, admission,
prefix index and metrics as gRPC ones.

Each choice runs the Front's blocking generator in a worker thread that hands its messages to
the event loop; a client that disconnects ends its requests the way a cancelled gRPC call does
(the decode row and its KV are freed)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import re
import socket
import ssl
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from baton import tracing
from baton.auth import TokenCheck
from baton.engine.request import RequestError
from baton.messages import logprob_from_proto, sampling_to_proto
from baton.router.dispatch import DispatchError
from baton.router.front import RETRY_AFTER_SECONDS, Front, Refused
from baton.router.openai_api import protocol
from baton.router.openai_api import tools as tools_api
from baton.router.openai_api.protocol import APIError, APIRequest

log = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
STATUS_OF = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
             grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
             grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499}
_DONE = object()  # a choice's worker thread has nothing more to say


def load_chat_template(value: str) -> str:
    """`router.chat_template`: a Jinja template, or a file holding one."""
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise ValueError(f"router.chat_template {value!r} is neither a file nor a Jinja template")
    return value


def api_error(error: Exception) -> APIError:
    """The HTTP answer for an error from the Front, the dispatcher or the request checks."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (RequestError, ValueError)):
        return APIError(400, str(error), code="invalid_value")
    if isinstance(error, Refused):
        if error.draining:
            return APIError(503, str(error), code="draining")
        return APIError(429, str(error), code="overloaded", headers={"retry-after": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, DispatchError):
        status = STATUS_OF.get(error.code, 500)
        headers = {"retry-after": str(RETRY_AFTER_SECONDS)} if status in (429, 503) else {}
        return APIError(status, error.message, code=error.code.name.lower(), headers=headers)
    log.exception("unexpected error in an OpenAI API request", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}; see the router's log")


class Choice:
    """One generation of a request: its prompt, its sampling and what it has produced so far."""

    def __init__(self, index: int, prompt_index: int, prompt: list[int], sampling):
        self.index, self.prompt_index, self.prompt, self.sampling = index, prompt_index, prompt, sampling
        self.text: list[str] = []
        self.tokens = 0
        self.cached = 0
        self.finish_reason: str | None = None
        self.logprobs: list = []  # TokenLogprob per token, when the request asked
        self._shaped = 0  # logprobs already sent in stream chunks
        self._offset = 0  # characters of their tokens' text (completions' text_offset)

    def new_logprobs(self, request: APIRequest, text_of) -> dict | None:
        """The logprobs not yet streamed, shaped for a chunk (None when the request did not ask)."""
        entries, self._shaped = self.logprobs[self._shaped:], len(self.logprobs)
        shaped = protocol.logprobs(request, entries, text_of, self._offset)
        self._offset += sum(len(text_of(e.token_id)) for e in entries)
        return shaped


class Run:
    """The worker threads of one HTTP request's choices, pumping into one asyncio queue."""

    def __init__(self, front: Front, executor, request_id: str, choices: list[Choice], timeout: float | None,
                 trace_context: dict[str, str] | None = None):
        self.front, self.executor, self.request_id, self.choices = front, executor, request_id, choices
        self.timeout = timeout
        self.trace_context = trace_context  # the caller's traceparent/tracestate headers, if any
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancels: list = []
        self.cancelled = False
        self.lock = threading.Lock()
        self.open = len(choices)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for choice in self.choices:
            rid = self.request_id if len(self.choices) == 1 else f"{self.request_id}-{choice.index}"
            self.executor.submit(self._pump, loop, rid, choice)

    def _pump(self, loop, rid: str, choice: Choice) -> None:
        put = lambda item: loop.call_soon_threadsafe(self.queue.put_nowait, item)  # noqa: E731
        try:
            for msg in self.front.generate(rid, choice.prompt, choice.sampling, self.timeout, on_done=self._on_done,
                                           carrier=self.trace_context):
                put((choice, msg))
        except Exception as exc:  # noqa: BLE001 - handed to the event loop, answered there
            put((choice, exc))
        finally:
            put((choice, _DONE))

    def _on_done(self, cancel) -> None:
        with self.lock:
            if not self.cancelled:
                self.cancels.append(cancel)
                return
        cancel()  # the client left before this choice had started

    async def next(self):
        """(choice, message | exception), or None once every choice has ended."""
        while self.open:
            choice, item = await self.queue.get()
            if item is _DONE:
                self.open -= 1
                continue
            if not isinstance(item, Exception):
                choice.text.append(item.text_delta)
                choice.tokens += len(item.token_ids)
                choice.logprobs.extend(logprob_from_proto(lp) for lp in item.logprobs)
                if item.finish_reason:
                    choice.finish_reason = item.finish_reason
                    choice.cached = item.usage.cached_tokens
            return choice, item
        return None

    def cancel(self) -> None:
        """End every choice still running (what a cancelled gRPC call does); safe to call twice."""
        with self.lock:
            self.cancelled = True
            cancels, self.cancels = self.cancels, []
        for cancel in cancels:
            try:
                cancel()
            except Exception:  # noqa: BLE001 - one failing cancel must not keep the others
                log.exception("cancelling a request failed")

    def usage(self) -> dict[str, Any]:
        prompts: dict[int, Choice] = {}
        for c in self.choices:
            prompts.setdefault(c.prompt_index, c)
        cached = {c.prompt_index: 0 for c in self.choices}
        for c in self.choices:
            cached[c.prompt_index] = max(cached[c.prompt_index], c.cached)
        return protocol.usage(sum(len(c.prompt) for c in prompts.values()), sum(c.tokens for c in self.choices),
                              sum(cached.values()))


class OpenAIServer:
    """The app and its uvicorn server; `start()` serves in a daemon thread, `stop()` ends it."""

    def __init__(self, front: Front, *, host: str, port: int, served: list[str], token: str = "",
                 tls=None, require_client_cert: bool = True, max_threads: int = 1024, timeout: float = 0):
        self.front, self.served = front, served
        self.token = TokenCheck(token) if token else None  # the gRPC port's bearer token, checked the same way
        self.timeout = timeout or None  # seconds a request may run; past it, 504
        self.token_text = functools.lru_cache(maxsize=1 << 16)(front.model.token_text)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="openai")
        self.socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                           reuse_port=False)
        self.port = self.socket.getsockname()[1]
        tls_options = {}
        if tls is not None and tls.enabled:  # the same certificate (and client CA) as the gRPC API
            tls_options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
            if tls.ca_file and require_client_cert:
                tls_options.update(ssl_ca_certs=tls.ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, **tls_options)
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "OpenAIServer":
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="openai-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the OpenAI HTTP API did not start on port {self.port}")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)
        self.socket.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- the app -----------------------------------------------------------------------------

    def app(self):
        return Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], middleware=[Middleware(_Guard, server=self)])

    def authorized(self, headers) -> bool:
        if not self.token:
            return True
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.token.matches(given.strip())

    async def health(self, request):
        if self.front.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.front.ready():
            return JSONResponse({"status": "no healthy prefill and decode worker"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        return Response(generate_latest(self.front.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{
            "id": self.served[0], "object": "model", "created": 0, "owned_by": "baton", "root": self.front.model.name,
            "max_model_len": self.front.max_context(),
            # Baton's extension: what a request leaving these unset gets (then OpenAI's temperature 1)
            "sampling_defaults": self.front.sampling_defaults}]})

    async def chat(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    async def _complete(self, request, *, chat: bool):
        request_id = request.headers.get("x-request-id", "")
        if not REQUEST_ID.match(request_id):
            request_id = uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        stack = contextlib.ExitStack()
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise APIError(400, f"the request body is not JSON: {exc}") from None
            parsed = protocol.parse(body, chat=chat, defaults=self.front.sampling_defaults)
            if parsed.model is not None and parsed.model not in self.served:
                raise APIError(404, f"the model {parsed.model!r} does not exist here; this server serves "
                                    f"{self.served[0]!r} (GET /v1/models)", param="model", code="model_not_found")
            choices = self._choices(parsed)
            stack.enter_context(self.front.admitted(len(choices)))
        except Exception as exc:  # noqa: BLE001 - every refusal is an HTTP answer
            stack.close()
            return _error_response(api_error(exc), headers)
        run = Run(self.front, self.executor, request_id, choices, self.timeout,
                  {k: request.headers[k] for k in tracing.TRACE_HEADERS if k in request.headers})
        prefix = "chatcmpl-" if chat else "cmpl-"
        response_id, created, name = prefix + request_id, int(time.time()), parsed.model or self.served[0]
        run.start()
        if parsed.stream:
            first = await run.next()
            if first is not None and isinstance(first[1], Exception):
                run.cancel()
                stack.close()
                return _error_response(api_error(first[1]), headers)
            events = self._events(run, parsed, response_id, created, name, first, stack)
            return _Stream(events, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"},
                           cleanup=lambda: (run.cancel(), stack.close()))
        try:
            outcome = await _until_disconnect(request, self._collect(run))
            if outcome is None:  # the client left: nobody to answer
                return JSONResponse({}, status_code=499, headers=headers)
            if isinstance(outcome, Exception):
                return _error_response(api_error(outcome), headers)
            results = protocol.best(parsed, [
                {"index": c.index, "prompt_index": c.prompt_index, "text": "".join(c.text),
                 "finish_reason": c.finish_reason, "score": sum(lp.logprob for lp in c.logprobs),
                 "logprobs": protocol.logprobs(parsed, c.logprobs, self.token_text)} for c in run.choices])
            return JSONResponse(protocol.body(parsed, response_id, created, name, results, run.usage()),
                                headers=headers)
        finally:
            run.cancel()
            stack.close()

    def _choices(self, parsed: APIRequest) -> list[Choice]:
        """Tokenize and check every prompt; `n` choices each, seeds spread so they differ."""
        choices = []
        limit = self.front.max_context()
        for p, prompt in enumerate(parsed.prompts):
            where = f"prompt[{p}]" if len(parsed.prompts) > 1 else ("messages" if parsed.chat else "prompt")
            try:
                if parsed.chat:
                    ids = self.front.encode_chat(prompt)
                else:
                    ids = self.front.encode_text(prompt) if isinstance(prompt, str) else list(prompt)
            except (RequestError, ValueError) as exc:
                raise APIError(400, f"{where}: {exc}", param=where, code="invalid_value") from None
            sampling = parsed.sampling
            if not parsed.max_tokens_given:  # up to the context (as OpenAI servers do), or the model's default
                if len(ids) >= limit:
                    raise APIError(400, f"{where}: the prompt is {len(ids)} tokens; this model's context is {limit}",
                                   param=where, code="context_length_exceeded")
                room = min(self.front.sampling_defaults.get("max_tokens", limit), limit - len(ids))
                if sampling.min_tokens > room:
                    raise APIError(400, f"{where}: min_tokens is {sampling.min_tokens} but only {room} new tokens fit "
                                        f"after this {len(ids)}-token prompt", param="min_tokens",
                                   code="context_length_exceeded")
                sampling = replace(sampling, max_tokens=room)
            if parsed.best_of > parsed.n and sampling.logprobs is None:  # each candidate's score: its tokens' logprobs
                sampling = replace(sampling, logprobs=0)
            for k in range(parsed.best_of):
                seeded = sampling if sampling.seed is None or k == 0 else replace(sampling, seed=sampling.seed + k)
                proto = sampling_to_proto(seeded)
                try:
                    self.front.validate(ids, proto)
                except (RequestError, ValueError) as exc:
                    code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
                    raise APIError(400, f"{where}: {exc}", param=where, code=code) from None
                choices.append(Choice(len(choices), p, ids, proto))
        return choices

    async def _collect(self, run: Run):
        """Every choice to its end; the first error instead, if any."""
        while (item := await run.next()) is not None:
            if isinstance(item[1], Exception):
                return item[1]
        return run

    async def _events(self, run: Run, parsed: APIRequest, response_id: str, created: int, name: str, first,
                      stack: contextlib.ExitStack):
        """The SSE stream; its `finally` runs when it ends or the client leaves, and frees everything."""
        def event(data) -> str:
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

        # with tools, each choice's text is split into content and whole calls as it arrives
        splitters = {c.index: tools_api.Splitter(parsed.tools) for c in run.choices} \
            if parsed.chat and parsed.tools is not None and parsed.tools.shown else {}
        try:
            if parsed.chat:
                for c in run.choices:
                    yield event(protocol.chunk(parsed, response_id, created, name, c.index, role=True))
            item = first
            while item is not None:
                choice, msg = item
                if isinstance(msg, Exception):
                    yield event(api_error(msg).body())
                    break
                shaped = choice.new_logprobs(parsed, self.token_text) if msg.logprobs else None
                text, finish, calls = msg.text_delta, msg.finish_reason or None, []
                splitter = splitters.get(choice.index)
                if splitter is not None:
                    text, calls = splitter.feed(text)
                    if finish:
                        text += splitter.finish()
                        finish = protocol.finish_with_calls(finish) if splitter.calls else finish
                    calls = [{"index": splitter.calls - len(calls) + k, **call} for k, call in enumerate(calls)]
                if text or shaped or (finish and not calls):
                    yield event(protocol.chunk(parsed, response_id, created, name, choice.index, text=text,
                                               finish_reason=None if calls else finish, token_logprobs=shaped))
                if calls:
                    yield event(protocol.chunk(parsed, response_id, created, name, choice.index, tool_calls=calls,
                                               finish_reason=finish))
                item = await run.next()
            else:
                if parsed.include_usage:
                    yield event(protocol.usage_chunk(parsed, response_id, created, name, run.usage()))
            yield "data: [DONE]\n\n"
        finally:
            run.cancel()
            stack.close()


async def _until_disconnect(request, work):
    """`work`'s result, or None if the client disconnects first (then `work` is cancelled)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


class _Stream(StreamingResponse):
    """A stream whose `cleanup` runs however the response ends, even if its body never started
    (an async generator that never ran never reaches its own `finally`)."""

    def __init__(self, content, *, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cleanup()


def _error_response(error: APIError, headers: dict[str, str]):
    return JSONResponse(error.body(), status_code=error.status, headers={**headers, **error.headers})


class _Guard:
    """ASGI middleware: the bearer token on every route but /health (what probes reach)."""

    def __init__(self, app, server: OpenAIServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and not self.server.authorized(Headers(scope=scope)):
            error = APIError(401, "missing or wrong bearer token: send `Authorization: Bearer <token>`",
                             code="invalid_api_key")
            response = JSONResponse(error.body(), status_code=401, headers={"www-authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
