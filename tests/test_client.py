"""The client SDK against a real gRPC server on 127.0.0.1: a small scripted Router servicer
(deterministic tokens, deadlines honoured, statuses on request, cancellations counted)."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from baton.v1 import common_pb2, router_pb2, router_pb2_grpc
from baton.client import (AsyncBatonClient, BatonClient, BatonError, Cancelled, DeadlineExceeded, GenerationResult,
                    InvalidRequest, Overloaded, PermissionDenied, Unauthenticated, Unavailable)

DEFAULT_MAX_TOKENS = 4
SLOW_TOKEN_SECONDS = 0.05


def prompt_of(request: router_pb2.GenerateRequest) -> tuple[str, list[int]]:
    """The text that scripts the servicer, and the prompt's 'token ids' (code points)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text, [ord(c) for c in request.text]
    if kind == "messages":
        joined = "".join(f"{m.role}:{m.content}" for m in request.messages.messages)
        return request.messages.messages[-1].content, [ord(c) for c in joined]
    return "", list(request.token_ids.ids)


def expected_tokens(prompt_ids: list[int], count: int) -> list[int]:
    base = sum(prompt_ids) % 1000
    return [base + step for step in range(count)]


def chat_ids(prompt: str) -> list[int]:
    return [ord(c) for c in f"user:{prompt}"]


class ScriptedRouter(router_pb2_grpc.RouterServicer):
    """Behaviour chosen by the prompt: "slow ..." streams a token every 50 ms; "abort CODE words"
    fails with that status (RESOURCE_EXHAUSTED adds retry-after-s 2.5); "midstream CODE" fails
    after two tokens; "noend" closes without a finish_reason; "flaky N" fails UNAVAILABLE the
    first N times its request id is asked; anything else streams max_tokens (default 4) tokens
    sum(prompt_ids) % 1000 + step and finishes "length"."""

    def __init__(self, required_token: str | None = None):
        self.required_token = required_token
        self.lock = threading.Lock()
        self.requests: dict[str, router_pb2.GenerateRequest] = {}
        self.attempts: dict[str, int] = {}  # Generate calls by request id
        self.authorization: dict[str, str | None] = {}
        self.cancelled: set[str] = set()  # cancelled by the client before the stream finished
        self.expired: set[str] = set()  # stopped unfinished because the deadline passed
        self.in_flight = 0
        self.max_in_flight = 0
        self._ids = itertools.count()
        self.loading = False  # answer GetClusterStatus as a router whose model is still loading does
        self.decode_healthy = False

    def _check_token(self, context) -> str | None:
        authorization = dict(context.invocation_metadata()).get("authorization")
        if self.required_token and authorization != f"Bearer {self.required_token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        return authorization

    def Generate(self, request, context):
        request_id = request.request_id or f"router-{next(self._ids)}"
        with self.lock:
            self.requests[request_id] = request
            attempt = self.attempts[request_id] = self.attempts.get(request_id, 0) + 1
        authorization = self._check_token(context)
        with self.lock:
            self.authorization[request_id] = authorization
        text, prompt_ids = prompt_of(request)
        words = text.split()
        if words[:1] == ["abort"]:
            code = grpc.StatusCode[words[1]]
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                context.set_trailing_metadata((("retry-after-s", "2.5"),))
            context.abort(code, " ".join(words[2:]))
        if words[:1] == ["flaky"] and attempt <= int(words[1]):
            context.abort(grpc.StatusCode.UNAVAILABLE, "a chosen worker just left; retry")
        finished = threading.Event()
        context.add_callback(lambda: self._ended(request_id, finished, context))
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        count = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        for step, token in enumerate(expected_tokens(prompt_ids, count)):
            if words[:1] == ["slow"]:
                time.sleep(SLOW_TOKEN_SECONDS)
            if context.time_remaining() is not None and context.time_remaining() <= 0:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")  # no work for a caller gone
            if words[:1] == ["midstream"] and step == 2:
                finished.set()
                context.abort(grpc.StatusCode[words[1]], "worker lost mid-stream")
            response = router_pb2.GenerateResponse(request_id=request_id, token_ids=[token], text_delta=f" t{token}")
            if step == 0:
                response.prompt_token_ids.extend(prompt_ids)
            if step == count - 1 and words[:1] != ["noend"]:
                response.finish_reason = "length"
                response.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=count,
                                                         cached_tokens=1))
                response.trace.CopyFrom(common_pb2.Trace(stage_seconds={"prefill": 0.5, "decode": 0.25},
                                                         cached_tokens=1, predicted_cached_tokens=2,
                                                         prefill_worker="p0:1", decode_worker="d0:2"))
            yield response
        finished.set()

    def _ended(self, request_id: str, finished: threading.Event, context) -> None:
        remaining = context.time_remaining()
        with self.lock:
            self.in_flight -= 1
            if not finished.is_set():
                expired = remaining is not None and remaining <= 0
                (self.expired if expired else self.cancelled).add(request_id)

    def GetModelInfo(self, request, context):
        self._check_token(context)
        return router_pb2.ModelInfo(name="scripted", max_context=2048, model_fingerprint="fp-1", vocab_size=49152)

    def GetClusterStatus(self, request, context):
        self._check_token(context)
        if self.loading:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        return router_pb2.ClusterStatus(workers=[
            router_pb2.WorkerStatus(address="p0:1", role="prefill", healthy=True,
                                    prefill=common_pb2.PrefillLoad(queued=3, prompt_tokens_forwarded=2**40)),
            router_pb2.WorkerStatus(address="d0:2", role="decode", healthy=self.decode_healthy,
                                    decode=common_pb2.DecodeLoad(rows_in_use=2, max_rows=8)),
        ])


@contextlib.contextmanager
def serving(servicer: ScriptedRouter, credentials: grpc.ServerCredentials | None = None, port: int = 0):
    server = grpc.server(ThreadPoolExecutor(max_workers=32))
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = (server.add_secure_port(f"127.0.0.1:{port}", credentials) if credentials
            else server.add_insecure_port(f"127.0.0.1:{port}"))
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(5)


@pytest.fixture
def router():
    servicer = ScriptedRouter()
    with serving(servicer) as target:
        yield servicer, target


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def check_result(result: GenerationResult, prompt_ids: list[int], count: int = DEFAULT_MAX_TOKENS) -> None:
    tokens = expected_tokens(prompt_ids, count)
    assert result.token_ids == tokens
    assert result.text == "".join(f" t{t}" for t in tokens)
    assert result.prompt_token_ids == prompt_ids
    assert result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_tokens) == (
        len(prompt_ids), count, 1)
    assert result.trace.stage_seconds == {"prefill": 0.5, "decode": 0.25}
    assert (result.trace.prefill_worker, result.trace.decode_worker) == ("p0:1", "d0:2")
    assert (result.trace.cached_tokens, result.trace.predicted_cached_tokens) == (1, 2)


# --- sync generate / stream / generate_many ---

def test_generate_assembles_the_stream_and_sends_the_prompt_kinds(router):
    servicer, target = router
    with BatonClient(target) as client:
        check_result(client.generate("hello", request_id="chat"), chat_ids("hello"))
        check_result(client.generate("hello", raw=True, request_id="raw", max_tokens=6), [ord(c) for c in "hello"], 6)
        messages = [{"role": "system", "content": "be brief"}, ("user", "hi")]
        check_result(client.generate(messages=messages, request_id="msgs"), [ord(c) for c in "system:be briefuser:hi"])
        check_result(client.generate(token_ids=[5, 6, 7], request_id="ids"), [5, 6, 7])
        unnamed = client.generate("hello")
        assert unnamed.request_id.startswith("router-")  # the router names requests sent without an id
    assert servicer.requests["chat"].messages.messages[0].role == "user"
    assert servicer.requests["raw"].text == "hello"
    assert [m.content for m in servicer.requests["msgs"].messages.messages] == ["be brief", "hi"]
    assert list(servicer.requests["ids"].token_ids.ids) == [5, 6, 7]


def test_sampling_options_reach_the_wire_and_unset_ones_stay_unset(router):
    servicer, target = router
    with BatonClient(target) as client:
        client.generate("x", request_id="set", max_tokens=2, temperature=0.7, top_p=0.9, top_k=40, seed=11,
                        stop="END", stop_token_ids=[2], ignore_eos=True, priority=-3)
        client.generate("x", request_id="unset")
    sent = servicer.requests["set"].sampling
    assert (sent.max_tokens, sent.top_k, sent.seed, list(sent.stop), list(sent.stop_token_ids)) == (
        2, 40, 11, ["END"], [2])
    assert sent.temperature == pytest.approx(0.7) and sent.top_p == pytest.approx(0.9)
    assert sent.ignore_eos and sent.priority == -3
    unset = servicer.requests["unset"].sampling
    assert not any(unset.HasField(name) for name in ("max_tokens", "top_p", "seed"))


def test_stream_yields_chunks_first_with_prompt_ids_last_with_finish(router):
    _, target = router
    with BatonClient(target) as client:
        chunks = list(client.stream("hi", max_tokens=3))
    assert [len(c.token_ids) for c in chunks] == [1, 1, 1]
    assert chunks[0].prompt_token_ids == chat_ids("hi") and chunks[1].prompt_token_ids is None
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].trace.decode_worker == "d0:2"
    assert chunks[0].usage is None and chunks[0].trace is None


def test_breaking_out_of_a_stream_cancels_it_on_the_server(router):
    servicer, target = router
    with BatonClient(target) as client:
        for chunk in client.stream("slow", request_id="broken", max_tokens=200):
            break
        assert wait_until(lambda: "broken" in servicer.cancelled)
        with client.stream("slow", request_id="closed", max_tokens=200) as chunks:
            next(chunks)
        assert wait_until(lambda: "closed" in servicer.cancelled)
        assert client.generate("after", request_id="done").finish_reason == "length"
    assert "done" not in servicer.cancelled


def test_generate_many_keeps_input_order_and_bounds_concurrency(router):
    servicer, target = router
    prompts = [f"slow {i}" for i in range(8)]
    with BatonClient(target) as client:
        results = client.generate_many(prompts, max_concurrency=3, max_tokens=3)
        mixed = client.generate_many(["a", {"token_ids": [1, 2], "max_tokens": 2}, {"prompt": "b", "raw": True}])
    for prompt, result in zip(prompts, results):
        check_result(result, chat_ids(prompt), 3)
    assert servicer.max_in_flight <= 3
    check_result(mixed[1], [1, 2], 2)
    check_result(mixed[2], [ord("b")])


def test_generate_many_one_failure_does_not_hide_the_others(router):
    _, target = router
    batch = ["a", "abort INVALID_ARGUMENT prompt too long", "abort RESOURCE_EXHAUSTED full", "c"]
    with BatonClient(target) as client:
        outcomes = client.generate_many(batch, return_exceptions=True)
        with pytest.raises(InvalidRequest) as raised:
            client.generate_many(batch)
    assert isinstance(outcomes[1], InvalidRequest) and isinstance(outcomes[2], Overloaded)
    check_result(outcomes[0], chat_ids("a"))
    check_result(outcomes[3], chat_ids("c"))
    slots = raised.value.batch_results
    assert [type(s) for s in slots] == [GenerationResult, InvalidRequest, Overloaded, GenerationResult]


def test_model_info_and_cluster_status(router):
    _, target = router
    with BatonClient(target) as client:
        info = client.model_info()
        status = client.cluster_status()
    assert (info.name, info.max_context, info.model_fingerprint, info.vocab_size) == ("scripted", 2048, "fp-1", 49152)
    prefill, decode = status.workers
    assert (prefill.role, prefill.healthy, prefill.decode) == ("prefill", True, None)
    assert prefill.prefill["queued"] == 3 and prefill.prefill["prompt_tokens_forwarded"] == 2**40
    assert (decode.healthy, decode.decode["rows_in_use"], decode.decode["max_rows"]) == (False, 2, 8)


def test_wait_ready_waits_until_the_router_can_serve_and_says_what_it_waited_for(router):
    """Connected is not ready: the router's model loads, then it needs a healthy prefill and decode worker."""
    servicer, target = router
    servicer.loading = True
    with BatonClient(target) as client:
        with pytest.raises(Unavailable, match="still loading"):
            client.wait_ready(timeout=0.6)
        servicer.loading = False
        with pytest.raises(Unavailable, match=r"no healthy decode worker yet \(1 known\)") as raised:
            client.wait_ready(timeout=0.6)
        assert "prefill" not in raised.value.message
        threading.Timer(0.5, setattr, (servicer, "decode_healthy", True)).start()
        started = time.monotonic()
        client.wait_ready(timeout=10)
        assert time.monotonic() - started >= 0.4  # it waited for the decode worker


def test_async_wait_ready_waits_the_same_way(router):
    servicer, target = router
    servicer.loading = True

    async def main():
        async with AsyncBatonClient(target) as client:
            with pytest.raises(Unavailable, match="still loading"):
                await client.wait_ready(timeout=0.6)
            servicer.loading = False
            with pytest.raises(Unavailable, match="no healthy decode worker"):
                await client.wait_ready(timeout=0.6)
            threading.Timer(0.5, setattr, (servicer, "decode_healthy", True)).start()
            await client.wait_ready(timeout=10)

    asyncio.run(main())


def test_wait_ready_raises_a_refusal_at_once():
    """A wrong token will not heal by waiting."""
    with serving(ScriptedRouter(required_token="right")) as target, BatonClient(target, token="wrong") as client:
        started = time.monotonic()
        with pytest.raises(Unauthenticated):
            client.wait_ready(timeout=30)
        assert time.monotonic() - started < 10


def test_wait_ready_without_a_router_says_so():
    with BatonClient("127.0.0.1:1") as client, pytest.raises(Unavailable, match="no connection to the router"):
        client.wait_ready(timeout=0.5)


def test_a_router_back_at_its_address_serves_a_client_that_kept_calling_and_a_new_one_at_once():
    """A router that restarts (a rolling update, a crash) comes back at its address. A client whose
    calls were refused while it was down reaches it again within about a second of its return (gRPC's
    own backoff grows to two minutes: after 6 s down it waits about 3 s more), and a client made
    then is served on its first call (gRPC would hand it the other client's refused connection)."""
    with serving(ScriptedRouter()) as target:
        pass
    port = int(target.rsplit(":", 1)[1])
    with BatonClient(target, timeout=5) as client:
        down_until, refused = time.monotonic() + 6, 0
        while time.monotonic() < down_until:
            with pytest.raises(Unavailable):
                client.generate("hi", max_tokens=1)
            refused += 1
            time.sleep(0.1)
        with serving(ScriptedRouter(), port=port):
            back = time.monotonic()
            with BatonClient(target, timeout=5) as fresh:
                check_result(fresh.generate(token_ids=[5, 6, 7]), [5, 6, 7])
            while True:
                try:
                    check_result(client.generate(token_ids=[5, 6, 7]), [5, 6, 7])
                    break
                except Unavailable:
                    assert time.monotonic() - back < 30, "the client never reached the router again"
                    time.sleep(0.05)
            waited = time.monotonic() - back
    assert refused >= 3
    assert waited < 2.5, f"the client reached the router {waited:.2f} s after it was back"


def test_calls_refused_before_any_answer_are_made_again_and_a_started_stream_is_not(router):
    """A call refused UNAVAILABLE before its first token (a worker that just left, a router still
    loading or draining) is made again, up to max_retries more times; one that has streamed a token
    fails as it is, since the tokens it sent cannot be taken back; and retries stop while most
    calls fail."""
    servicer, target = router
    with BatonClient(target) as client:
        check_result(client.generate("flaky 2", raw=True, request_id="twice"), [ord(c) for c in "flaky 2"])
        with pytest.raises(Unavailable, match="just left"):
            client.generate("flaky 3", raw=True, request_id="thrice")
        with pytest.raises(Unavailable, match="mid-stream"):
            client.generate("midstream UNAVAILABLE", raw=True, request_id="cut")
        assert client.model_info().name == "scripted"
    with BatonClient(target, max_retries=0) as client, pytest.raises(Unavailable):
        client.generate("flaky 1", raw=True, request_id="never")

    async def scenario():
        async with AsyncBatonClient(target, max_retries=1) as client:
            check_result(await client.generate("flaky 1", raw=True, request_id="async"), [ord(c) for c in "flaky 1"])

    asyncio.run(scenario())
    assert servicer.attempts == {"twice": 3, "thrice": 3, "cut": 1, "never": 1, "async": 2}
    # While most calls fail (a router down for long), a client stops retrying rather than triple its load
    down = ScriptedRouter()
    with serving(down) as other, BatonClient(other) as client:
        for i in range(8):
            with pytest.raises(Unavailable):
                client.generate("flaky 9", raw=True, request_id=f"down{i}")
    attempts = [down.attempts[f"down{i}"] for i in range(8)]
    assert attempts[0] == 3 and attempts[-3:] == [1, 1, 1], attempts


# --- errors ---

@pytest.mark.parametrize("code, error_class", [
    ("INVALID_ARGUMENT", InvalidRequest), ("RESOURCE_EXHAUSTED", Overloaded), ("UNAVAILABLE", Unavailable),
    ("CANCELLED", Cancelled), ("UNAUTHENTICATED", Unauthenticated), ("PERMISSION_DENIED", PermissionDenied),
    ("INTERNAL", BatonError),
])
def test_statuses_map_to_error_classes_with_code_and_message(router, code, error_class):
    _, target = router
    with BatonClient(target) as client, pytest.raises(error_class) as raised:
        client.generate(f"abort {code} the server says why", request_id="r1")
    error = raised.value
    assert (type(error), error.code, error.message, error.request_id) == (
        error_class, code, "the server says why", "r1")
    assert code in str(error) and "the server says why" in str(error)
    if error_class is Overloaded:
        assert error.retry_after_s == 2.5
    if error_class is InvalidRequest:
        assert isinstance(error, ValueError)


def test_errors_after_tokens_and_streams_cut_short(router):
    _, target = router
    with BatonClient(target) as client:
        received = []
        with pytest.raises(BatonError) as raised:
            for chunk in client.stream("midstream INTERNAL", request_id="mid", max_tokens=10):
                received.append(chunk)
        assert len(received) == 2 and (raised.value.code, raised.value.request_id) == ("INTERNAL", "mid")
        with pytest.raises(BatonError, match="without a finish_reason"):
            client.generate("noend")


def test_deadline_exceeded_per_call_and_by_client_default(router):
    servicer, target = router
    with BatonClient(target) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as raised:
            client.generate("slow", request_id="late", max_tokens=100, timeout=0.2)
        assert time.monotonic() - started < 2 and raised.value.code == "DEADLINE_EXCEEDED"
    with BatonClient(target, timeout=0.2) as client, pytest.raises(DeadlineExceeded):
        client.generate("slow", max_tokens=100)
    assert wait_until(lambda: "late" in servicer.expired)  # the server stopped working for it


def test_bearer_token_arrives_and_a_missing_one_is_refused():
    servicer = ScriptedRouter(required_token="s3cret")
    with serving(servicer) as target:
        with BatonClient(target, token="s3cret") as client:
            client.generate("hi", request_id="authed")
            assert client.model_info().name == "scripted"
        assert servicer.authorization["authed"] == "Bearer s3cret"
        for token in (None, "wrong"):
            with BatonClient(target, token=token) as client:
                with pytest.raises(Unauthenticated, match="bearer token"):
                    client.generate("hi")
                with pytest.raises(Unauthenticated):
                    client.cluster_status()


# --- client-side validation ---

@pytest.mark.parametrize("args, kwargs, match", [
    ((), {}, "no prompt"),
    (("hi",), {"token_ids": [1]}, "exactly one"),
    ((), {"messages": [{"role": "user", "content": "x"}], "token_ids": [1]}, "exactly one"),
    (("",), {}, "non-empty"),
    ((), {"messages": []}, "non-empty list"),
    ((), {"messages": [{"role": "user"}]}, "content"),
    ((), {"token_ids": [1, -2]}, r"token_ids\[1\]"),
    (("hi",), {"max_tokens": 0}, "max_tokens"),
    (("hi",), {"temperature": -0.1}, "temperature"),
    (("hi",), {"top_p": 0.0}, "top_p"),
    (("hi",), {"top_p": 1.5}, "top_p"),
    (("hi",), {"top_k": -1}, "top_k"),
    (("hi",), {"stop": [""]}, "stop"),
    (("hi",), {"timeout": 0}, "timeout"),
    ((), {"messages": [{"role": "user", "content": "x"}], "raw": True}, "raw"),
])
def test_bad_arguments_raise_value_error_before_any_rpc(router, args, kwargs, match):
    servicer, target = router
    with BatonClient(target) as client:
        with pytest.raises(ValueError, match=match):
            client.generate(*args, **kwargs)
        with pytest.raises(ValueError, match=match):
            client.stream(*args, **kwargs)
        with pytest.raises(ValueError, match=r"requests\[1\]"):
            client.generate_many([{"prompt": "fine"}, {"prompt": args[0] if args else None, **kwargs}])
    assert servicer.requests == {}


def test_bad_client_settings_and_unknown_options_fail_early(router):
    _, target = router
    with BatonClient(target) as client, pytest.raises(TypeError, match="temprature"):
        client.generate("hi", temprature=0.5)
    with pytest.raises(ValueError, match="client_key"):
        BatonClient(target, tls=True, client_cert=b"pem")
    with pytest.raises(ValueError, match="tls=True"):
        BatonClient(target, root_certificates=b"pem")
    with pytest.raises(ValueError, match="cannot read"):
        BatonClient(target, tls=True, root_certificates="/nonexistent/ca.pem")
    with pytest.raises(ValueError, match="load_balancing must be one of"):
        BatonClient(target, load_balancing="random")
    for retries in (-1, 5, 1.5, True):
        with pytest.raises(ValueError, match="max_retries must be an integer from 0 to 4"):
            BatonClient(target, max_retries=retries)


# --- asyncio ---

def test_async_generate_stream_many_and_info(router):
    servicer, target = router

    async def scenario():
        async with AsyncBatonClient(target) as client:
            check_result(await client.generate("hello", request_id="a1"), chat_ids("hello"))
            chunks = [chunk async for chunk in client.stream(token_ids=[9], max_tokens=3)]
            assert [c.finish_reason for c in chunks] == [None, None, "length"]
            results = await client.generate_many([f"slow {i}" for i in range(6)], max_concurrency=2, max_tokens=2)
            for i, result in enumerate(results):
                check_result(result, chat_ids(f"slow {i}"), 2)
            outcomes = await client.generate_many(["a", "abort UNAVAILABLE gone"], return_exceptions=True)
            assert isinstance(outcomes[1], Unavailable) and outcomes[1].message == "gone"
            assert (await client.model_info()).vocab_size == 49152
            assert len((await client.cluster_status()).workers) == 2

    asyncio.run(scenario())
    assert servicer.max_in_flight <= 2


def test_async_errors_deadlines_and_cancellation(router):
    servicer, target = router

    async def scenario():
        async with AsyncBatonClient(target) as client:
            with pytest.raises(Overloaded) as raised:
                await client.generate("abort RESOURCE_EXHAUSTED full")
            assert raised.value.retry_after_s == 2.5
            with pytest.raises(DeadlineExceeded):
                await client.generate("slow", max_tokens=100, timeout=0.2)
            with pytest.raises(ValueError, match="top_p"):
                client.stream("hi", top_p=2.0)
            async for chunk in client.stream("slow", request_id="abroken", max_tokens=200):
                break
            async with client.stream("slow", request_id="aclosed", max_tokens=200) as chunks:
                await chunks.__anext__()
            for _ in range(500):
                if {"abroken", "aclosed"} <= servicer.cancelled:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert {"abroken", "aclosed"} <= servicer.cancelled


# --- cli_support and packaging ---

def test_baton_generate_through_a_router_sends_the_command_lines_sampling(router, capsys):
    """`baton generate --router`, in-process: the prompts go through the SDK with the flags'
    sampling parameters, and a refused request is a usage error (status 2) with the router's message."""
    import json

    from baton import cli

    servicer, target = router
    assert cli.main(["generate", "--router", target, "--raw", "--json", "--max-tokens", "3", "--seed", "4",
                     "one", "two"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in lines] == ["one", "two"]
    assert [r["token_ids"] for r in lines] == [expected_tokens([ord(c) for c in p], 3) for p in ("one", "two")]
    sent = next(iter(servicer.requests.values()))
    assert sent.WhichOneof("prompt") == "text" and sent.sampling.seed == 4 and sent.sampling.top_p == 1.0
    assert cli.main(["generate", "--router", target, "--raw", "ok", "abort INVALID_ARGUMENT no"]) == cli.USAGE_ERROR
    assert "baton generate: error:" in capsys.readouterr().err


def test_client_package_imports_no_torch_or_engine():
    code = ("import sys, baton.client, baton.client.cli_support; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith(('baton.engine', 'baton.router', 'baton.decode_worker', 'baton.prefill_worker'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- TLS, with certificates made here by the openssl command line ---

def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """A test CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("TLS tests make their certificates with the `openssl` command, which is not installed")
    folder = tmp_path_factory.mktemp("tls")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=baton-test-ca",
            cwd=folder)
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=baton-{name}",
                cwd=folder)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=folder)
    return folder


def test_tls_and_plaintext_to_tls_fails(certificates):
    read = lambda name: (certificates / name).read_bytes()  # noqa: E731
    credentials = grpc.ssl_server_credentials([(read("server.key"), read("server.pem"))])
    with serving(ScriptedRouter(), credentials) as target:
        with BatonClient(target, tls=True, root_certificates=certificates / "ca.pem", timeout=5) as client:
            check_result(client.generate("secure"), chat_ids("secure"))
        with BatonClient(target, timeout=5) as client, pytest.raises(Unavailable):
            client.generate("plaintext")
        untrusted = certificates / "client.pem"  # not the CA that signed the server's certificate
        with BatonClient(target, tls=True, root_certificates=untrusted, timeout=5) as client:
            with pytest.raises(Unavailable):
                client.generate("unverified server")


def test_mutual_tls_sync_and_async(certificates):
    read = lambda name: (certificates / name).read_bytes()  # noqa: E731
    credentials = grpc.ssl_server_credentials([(read("server.key"), read("server.pem"))],
                                              root_certificates=read("ca.pem"), require_client_auth=True)
    with serving(ScriptedRouter(), credentials) as target:
        tls = dict(tls=True, root_certificates=read("ca.pem"), timeout=5)
        with BatonClient(target, client_cert=certificates / "client.pem", client_key=certificates / "client.key",
                         **tls) as client:
            check_result(client.generate("mutual"), chat_ids("mutual"))
        with BatonClient(target, **tls) as client, pytest.raises(Unavailable):
            client.generate("no client certificate")

        async def scenario():
            async with AsyncBatonClient(target, client_cert=read("client.pem"), client_key=read("client.key"),
                                        tls_server_name="localhost", **tls) as client:
                check_result(await client.generate("async mutual"), chat_ids("async mutual"))

        asyncio.run(scenario())


def test_a_batch_member_refused_for_overload_carries_the_retry_hint():
    from baton.client.convert import batch_item_from_proto

    refused = batch_item_from_proto(router_pb2.GenerateBatchResponse(
        index=3, error_code="RESOURCE_EXHAUSTED", error_message="queue full", retry_after_s=1.0))
    assert isinstance(refused, BatonError) and refused.code == "RESOURCE_EXHAUSTED" and refused.retry_after_s == 1.0
    unhinted = batch_item_from_proto(router_pb2.GenerateBatchResponse(index=0, error_code="RESOURCE_EXHAUSTED",
                                                                      error_message="full"))
    assert unhinted.retry_after_s is None
