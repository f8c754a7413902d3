"""What the router's two public APIs (gRPC and OpenAI HTTP) share: turning a prompt into token
ids and checking it against the context the cluster really serves, admission (the in-flight
bound), and the drain on shutdown. Each API only translates its wire format and its errors."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

from baton import tracing
from baton.engine.request import RequestError, validate_prompt
from baton.messages import sampling_from_proto

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")  # tool: a function's result (tools, Hermes format)
# Seconds an overloaded client is told to wait before retrying: about how long a decode row or a
# prefill queue slot takes to free up.
RETRY_AFTER_SECONDS = 1


class Refused(Exception):
    """A request the router will not take now; `retry_elsewhere` when draining, else overloaded."""

    def __init__(self, message: str, *, draining: bool = False):
        super().__init__(message)
        self.draining = draining


class Front:
    def __init__(self, model, dispatcher, settings, metrics):
        self.model = model  # a TokenizerView
        self.dispatcher = dispatcher
        self.pool = dispatcher.pool
        self.settings = settings
        self.metrics = metrics
        self.inflight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.draining = False

    # -- prompts ---------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text:
            raise RequestError("the prompt text is empty; send a non-empty prompt")
        return self.model.encode_text(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise RequestError("messages is empty; send at least one chat message")
        bad = [m["role"] for m in messages if m["role"] not in CHAT_ROLES]
        if bad:
            raise RequestError(f"unknown chat role {bad[0]!r}; use system, user, assistant or tool")
        return self.model.encode_chat(messages)

    @property
    def sampling_defaults(self) -> dict:
        """The model's default sampling (model.generation_config and its override)."""
        return self.model.sampling_defaults

    def apply_defaults(self, sampling) -> None:
        """Give a wire SamplingParams the model's default for each of max_tokens, temperature,
        top_k and top_p it leaves unset, in place: workers then see what the request will get."""
        for name, value in self.sampling_defaults.items():
            if not sampling.HasField(name):
                setattr(sampling, name, value)

    def validate(self, prompt: list[int], sampling) -> None:
        """RequestError / ValueError with what to change; `sampling` is the wire message. What no
        retry could ever serve is refused here, before any prefill: a prompt longer than the context
        or whose KV no decode worker could stage."""
        validate_prompt(prompt, sampling_from_proto(sampling), max_context=self.max_context(),
                        vocab_size=self.model.vocab_size)
        self._check_staging(len(prompt))

    def _check_staging(self, tokens: int) -> None:
        """The prompt's KV must fit some healthy decode worker's host staging pool, where it lands."""
        loads = [load for load in self._decode_loads() if load.staging_capacity_bytes and load.kv_bytes_per_token]
        if not loads or any(tokens * load.kv_bytes_per_token <= load.staging_capacity_bytes for load in loads):
            return
        largest = max(loads, key=lambda load: load.staging_capacity_bytes)
        raise RequestError(
            f"the prompt's KV ({tokens} tokens x {largest.kv_bytes_per_token} bytes = "
            f"{tokens * largest.kv_bytes_per_token} bytes) is larger than any decode worker's staging pool "
            f"(at most {largest.staging_capacity_bytes} bytes); raise decode.staging_bytes (--staging-bytes) or "
            f"send at most {largest.staging_capacity_bytes // largest.kv_bytes_per_token} prompt tokens")

    def max_context(self) -> int:
        """The context this cluster serves: the model's, or the smallest a decode worker reports
        (its KV budget may buy fewer columns); what both APIs advertise and hold prompts to."""
        served = [load.max_context for load in self._decode_loads() if load.max_context]
        return min([self.model.max_context, *served])

    def _decode_loads(self) -> list:
        """The last load report of each healthy decode worker that has sent one."""
        return [w.last_load for w in self.pool.all() if w.role == "decode" and w.view.healthy and w.last_load is not None]

    def ready(self) -> bool:
        """Not draining, and at least one healthy prefill and decode worker to send work to."""
        return not self.draining and all(any(v.healthy for v in self.pool.views(role)) for role in ("prefill", "decode"))

    def generate(self, request_id: str, prompt: list[int], sampling, timeout: float | None, on_done,
                 carrier=None):
        """The dispatcher's GenerateResponses for one admitted request, counted in the metrics;
        raises DispatchError. `on_done(cancel)` registers what ends the request if its client leaves.
        `carrier` (the call's metadata or headers) may hold the caller's trace context."""
        started, first = time.monotonic(), True
        span = tracing.request_span("baton.request", carrier, **{"baton.request_id": request_id,
                                                                  "baton.prompt_tokens": len(prompt)})
        outcome = "cancelled"  # unless it finishes or fails
        try:
            for msg in self.dispatcher.run(request_id, prompt, sampling, timeout, on_done=on_done, span=span):
                if first and msg.token_ids:
                    self.metrics.ttft.observe(time.monotonic() - started)
                    self.metrics.vllm_ttft.observe(time.monotonic() - started)
                    first = False
                if msg.finish_reason:
                    self.metrics.requests.labels(msg.finish_reason).inc()
                    self.metrics.vllm_success.labels(msg.finish_reason).inc()
                    self.metrics.vllm_e2e.observe(time.monotonic() - started)
                    self.metrics.prefix_predicted.inc(msg.trace.predicted_cached_tokens)
                    self.metrics.prefix_actual.inc(msg.trace.cached_tokens)
                    outcome = None
                    span.end(**{"baton.finish_reason": msg.finish_reason,
                                "baton.completion_tokens": msg.usage.completion_tokens,
                                "baton.cached_tokens": msg.trace.cached_tokens,
                                "baton.prefill_worker": msg.trace.prefill_worker,
                                "baton.decode_worker": msg.trace.decode_worker})
                yield msg
        except Exception as exc:
            outcome = tracing.error_text(exc)
            raise
        finally:
            if outcome is not None:
                span.end(error=outcome)

    # -- admission ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def admitted(self, count: int = 1):
        """Hold `count` in-flight slots for the body of the `with`, or raise Refused."""
        with self._lock:
            if self.draining:
                raise Refused("this router is draining (shutting down); retry on another router replica",
                              draining=True)
            if self.inflight + count > self.settings.max_inflight:
                self.metrics.overloaded.inc()
                raise Refused(f"the router has {self.inflight} of {self.settings.max_inflight} requests in flight; "
                              "retry later")
            self.inflight += count
        try:
            yield
        finally:
            with self._lock:
                self.inflight -= count
                if self.inflight == 0:
                    self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to `timeout` seconds for those in flight to finish;
        True when none is left. The worker channels stay open until then."""
        with self._lock:
            self.draining = True
            if self.inflight:
                log.info("draining: %d request(s) in flight", self.inflight)
            finished = self._idle.wait_for(lambda: self.inflight == 0, timeout)
        if not finished:
            log.warning("drain timed out after %.0fs with %d request(s) still in flight", timeout, self.inflight)
        return finished
