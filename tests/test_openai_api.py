"""The OpenAI-compatible HTTP API end to end: a real cluster (processes on loopback), the real
`openai` package as the client, compared with what the gRPC SDK gets for the same requests."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from baton.client import BatonClient, InvalidRequest
from baton.client.errors import Unavailable
from baton.server import channel as server_channel
from baton.launch.up import LocalCluster
from baton.v1 import common_pb2, workers_pb2_grpc

openai = pytest.importorskip("openai")

TOKEN = "openai-api-test-token"
MODEL = "tiny-random"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
# The decode worker's host staging pool holds 1,500 tokens of tiny-random's fp32 KV (512 B a
# token), less than the 2,048-token context: a longer prompt fits the context but never the pool.
STAGED_TOKENS = 1500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("openai") / "token"
    token_file.write_text(TOKEN)
    with LocalCluster(prefill=1, decode=1, model=MODEL, max_rows=4, http_port=-1, auth_token_file=str(token_file),
                      router_args=("--max-inflight", "6"),
                      decode_args=("--staging-bytes", str(STAGED_TOKENS * 512))) as running:
        yield running


@pytest.fixture(scope="module")
def api(cluster):
    return openai.OpenAI(base_url=cluster.http_url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sdk(cluster):
    with BatonClient(cluster.router_address, token=TOKEN, timeout=120) as client:
        yield client


def http(cluster, method: str, path: str, body=None, token: str | None = TOKEN, headers=None):
    """(status, headers, parsed JSON) of one raw HTTP call."""
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    request = urllib.request.Request(cluster.http_url.removesuffix("/v1") + path, data=data, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
    if token:
        request.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, response.headers, json.loads(raw) if raw.startswith(b"{") else raw
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


def decode_load(cluster):
    with server_channel(cluster.decode_addrs[0], cluster_token=cluster.cluster_token) as ch:
        return workers_pb2_grpc.DecodeWorkerStub(ch).GetLoad(common_pb2.LoadRequest(), timeout=10)


def wait_decode_idle(cluster, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while (load := decode_load(cluster)).rows_in_use or load.kv_bytes_useful or load.waiting_for_kv or load.staged:
        assert time.monotonic() < deadline, f"the decode worker still holds work: {load}"
        time.sleep(0.05)
    return load


def test_models_lists_the_served_model_with_its_context(api, sdk):
    models = api.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == sdk.model_info().max_context


def test_penalties_and_biases_reach_both_workers_through_both_apis(api, sdk, tiny_reference):
    """repetition_penalty applied by the prefill worker (first token) and the decode worker (the
    rest) equals transformers' generate; the OpenAI API sends the same sampling as the SDK."""
    prompt = [322 + j for j in range(10)]
    penalised = sdk.generate(token_ids=prompt, max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    assert penalised.token_ids == tiny_reference.greedy(prompt, 20, repetition_penalty=1.3)
    assert penalised.token_ids != tiny_reference.greedy(prompt, 20)
    asked = dict(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={penalised.token_ids[3]: -100})
    by_sdk = sdk.generate(token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True, min_tokens=4,
                          repetition_penalty=1.3, **asked)
    by_http = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     presence_penalty=0.5, frequency_penalty=1.0,
                                     logit_bias={str(penalised.token_ids[3]): -100},
                                     extra_body={"ignore_eos": True, "min_tokens": 4, "repetition_penalty": 1.3})
    assert by_http.choices[0].text == by_sdk.text and penalised.token_ids[3] not in by_sdk.token_ids
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logit_bias={"999999": 1})


def test_structured_outputs_hold_through_both_workers_and_both_apis(api, sdk):
    """The prefill worker samples the first token under the grammar and the decode worker the
    rest: even the tiny random model's answers match, streamed or not, in both APIs."""
    import re

    import jsonschema

    from baton.client import Guide
    from test_migration import GUIDED_SCHEMA

    fmt = {"type": "json_schema", "json_schema": {"name": "card", "schema": GUIDED_SCHEMA, "strict": True}}
    whole = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=0,
                                        response_format=fmt)
    jsonschema.validate(json.loads(whole.choices[0].message.content), GUIDED_SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    chunks = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=0.8, seed=3,
                                         response_format=fmt, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), GUIDED_SCHEMA)
    by_sdk = sdk.generate(messages=CHAT, max_tokens=120, temperature=0,
                          guide=Guide("json_schema", json.dumps(GUIDED_SCHEMA)))
    assert by_sdk.text == whole.choices[0].message.content
    picked = api.completions.create(model=MODEL, prompt="The answer is", max_tokens=10, temperature=1.0, n=4,
                                    extra_body={"guided_choice": ["yes", "no", "maybe so"]})
    assert all(c.text in ("yes", "no", "maybe so") for c in picked.choices)
    number = api.completions.create(model=MODEL, prompt="Year:", max_tokens=10, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}})
    assert re.fullmatch("(19|20)[0-9]{2}", number.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": {"type": "objectx"}}})


# bounded arguments, so the tiny random model's calls end within a few dozen tokens
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def test_required_and_named_tool_calls_come_back_as_tool_calls(api):
    """The grammar holds the call's shape and its arguments' schema, so even the tiny random
    model's calls parse; streamed, each call comes as one tool_calls delta."""
    import jsonschema

    answer = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=100, temperature=1.0, seed=4,
                                         tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {"get_weather": CITY, "get_time": TOOLS[1]["function"]["parameters"]}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=100, temperature=0,
                                              tools=TOOLS, tool_choice=named, parallel_tool_calls=False,
                                              stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_time"] * len(deltas) and deltas and deltas[0].index == 0
    jsonschema.validate(json.loads(deltas[0].function.arguments), TOOLS[1]["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # a conversation that went through a call and its result; `auto` lets the model answer in text
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                    "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    after = api.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, tools=TOOLS)
    assert after.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_best_of_answers_the_likeliest_candidates(api):
    answer = api.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=1.0, n=2, best_of=4,
                                    logprobs=0, extra_body={"ignore_eos": True})
    scores = [sum(c.logprobs.token_logprobs) for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1] and scores == sorted(scores, reverse=True)
    assert answer.usage.completion_tokens == 4 * 6  # every candidate was generated
    plain = api.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=1.0, best_of=3,
                                   extra_body={"ignore_eos": True})
    assert len(plain.choices) == 1 and plain.choices[0].logprobs is None


def test_greedy_chat_equals_the_grpc_sdk_token_for_token(api, sdk):
    expected = sdk.generate(messages=CHAT, max_tokens=24, temperature=0, ignore_eos=True)
    answer = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert answer.object == "chat.completion" and answer.model == MODEL
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
    assert answer.usage.completion_tokens == 24 == len(expected.token_ids)


def test_greedy_completion_from_text_and_token_ids_equals_transformers(api, sdk, tiny_reference):
    expected = sdk.generate("The sky is", raw=True, max_tokens=12, temperature=0, ignore_eos=True)
    by_text = api.completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    by_ids = api.completions.create(model=MODEL, prompt=list(expected.prompt_token_ids), max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert by_text.choices[0].text == by_ids.choices[0].text == expected.text
    assert by_text.usage.prompt_tokens == len(expected.prompt_token_ids)
    reference = tiny_reference.greedy(list(expected.prompt_token_ids), 12)
    assert expected.token_ids == reference and by_text.choices[0].text == tiny_reference.loaded.decode(reference)


def test_a_stream_carries_the_same_text_then_usage(api, sdk):
    expected = sdk.generate(messages=CHAT, max_tokens=16, temperature=0, ignore_eos=True)
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert len({c.id for c in chunks}) == 1


def test_logprobs_are_the_models_own_in_every_answer_shape(api, sdk, tiny_reference):
    """Computed by the workers from the logits they sample from (the first token's on the prefill
    worker, the rest on the decode worker), checked against transformers' forward."""
    asked = {"max_tokens": 10, "extra_body": {"ignore_eos": True}}
    grpc = sdk.generate(messages=CHAT, max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    assert [lp.token_id for lp in grpc.logprobs] == grpc.token_ids
    reference = tiny_reference.logprobs(grpc.prompt_token_ids, grpc.token_ids)
    chosen = reference.gather(1, torch.tensor(grpc.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in grpc.logprobs]), chosen, atol=1e-4)
    for lp, row in zip(grpc.logprobs, reference):
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist() and lp.top[0][0] == lp.token_id  # greedy

    chat = api.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, logprobs=True, top_logprobs=3,
                                       **asked)
    content = chat.choices[0].logprobs.content
    text_of = lambda t: tiny_reference.loaded.tokenizer.decode([t])  # noqa: E731
    assert [c.token for c in content] == [text_of(t) for t in grpc.token_ids]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in grpc.logprobs], abs=1e-6)
    assert [[t.token for t in c.top_logprobs] for c in content] == [[text_of(t) for t, _ in lp.top]
                                                                    for lp in grpc.logprobs]
    assert content[0].bytes == list(content[0].token.encode())
    streamed = [c for chunk in api.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, stream=True,
                                                           logprobs=True, top_logprobs=3, **asked)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    plain = api.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, **asked)
    assert plain.choices[0].logprobs is None

    # Completions' shape; sampling at a temperature still reports the model's own distribution.
    text = api.completions.create(model=MODEL, prompt=list(grpc.prompt_token_ids), temperature=1.3, seed=5,
                                  logprobs=2, **asked).choices[0]
    assert len(text.logprobs.tokens) == len(text.logprobs.token_logprobs) == 10
    assert len(text.logprobs.top_logprobs) == 10 and all(len(top) <= 2 for top in text.logprobs.top_logprobs)
    offsets = [0]
    for token in text.logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert text.logprobs.text_offset == offsets
    sampled = sdk.generate(token_ids=list(grpc.prompt_token_ids), max_tokens=10, temperature=1.3, seed=5,
                           ignore_eos=True, logprobs=2)
    assert [text_of(t) for t in sampled.token_ids] == text.logprobs.tokens  # same seed, same draws
    raw = tiny_reference.logprobs(grpc.prompt_token_ids, sampled.token_ids)
    assert text.logprobs.token_logprobs == pytest.approx(
        raw.gather(1, torch.tensor(sampled.token_ids)[:, None])[:, 0].tolist(), abs=1e-4)


def test_several_prompts_and_choices_in_one_request(api):
    answer = api.completions.create(model=MODEL, prompt=["One", "Two"], n=2, max_tokens=6, temperature=0.8, seed=3,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in answer.choices) == [0, 1, 2, 3]
    assert answer.usage.completion_tokens == 24
    again = api.completions.create(model=MODEL, prompt=["One", "Two"], n=2, max_tokens=6, temperature=0.8, seed=3,
                                   extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]  # seeded: reproducible


def test_concurrent_streams_from_the_async_client(cluster):
    async def main():
        client = openai.AsyncOpenAI(base_url=cluster.http_url, api_key=TOKEN, max_retries=0, timeout=120)

        async def one(i: int) -> str:
            stream = await client.completions.create(model=MODEL, prompt=[100 + i, 200 + i, 300 + i], max_tokens=10,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        texts = await asyncio.gather(*(one(i) for i in range(4)))
        singles = [await one(i) for i in range(4)]
        await client.close()
        return texts, singles

    texts, singles = asyncio.run(main())
    assert texts == singles and all(texts)


def test_a_client_that_leaves_mid_stream_frees_its_decode_row_and_kv(api, cluster):
    with api.completions.with_streaming_response.create(model=MODEL, prompt=[11, 12, 13], max_tokens=1500,
                                                        temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert decode_load(cluster).rows_in_use == 1
    # the connection closed after the first token of 1500: the row ends long before the 1500th
    load = wait_decode_idle(cluster)
    assert load.decode_tokens_forwarded < 1500


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": CHAT, "temperature": -1}, "temperature"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": CHAT, "presence_penalty": 3.0}, "presence_penalty"),
    ({"messages": CHAT, "use_beam_search": True}, "use_beam_search"),
    ({"messages": CHAT, "temprature": 0.5}, "temprature"),
    ({"messages": CHAT, "n": 100}, "n"),
])
def test_bad_fields_are_400_naming_the_field(cluster, body, param):
    status, _, answer = http(cluster, "POST", "/v1/chat/completions", {"model": MODEL, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert answer["error"]["type"] == "invalid_request_error" and param in answer["error"]["message"]


def test_a_prompt_past_the_context_and_a_body_that_is_not_json_are_400(api, cluster):
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=[7] * 5000, max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"
    status, _, answer = http(cluster, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]


def test_a_prompt_whose_kv_no_decode_worker_can_stage_is_400_before_its_prefill(api, sdk):
    """Retrying could never serve it: a 400 (INVALID_ARGUMENT) naming the setting to raise, not a
    429 or RESOURCE_EXHAUSTED after a prefill whose KV then found no room."""
    def forwarded() -> int:  # as the router's load polls (5 a second) last saw it, once it stands still
        seen = None
        while (now := sum(w.prefill["prompt_tokens_forwarded"] for w in sdk.cluster_status().workers
                          if w.role == "prefill")) != seen:
            seen = now
            time.sleep(0.5)
        return seen

    before, prompt = forwarded(), [7 + j % 900 for j in range(STAGED_TOKENS + 100)]
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert "staging pool" in err.value.message and "decode.staging_bytes" in err.value.message
    with pytest.raises(InvalidRequest, match=f"send at most {STAGED_TOKENS} prompt tokens"):
        sdk.generate(token_ids=prompt, max_tokens=4)
    assert forwarded() == before, "nothing was prefilled"
    assert len(sdk.generate(token_ids=prompt[:STAGED_TOKENS], max_tokens=2, ignore_eos=True).token_ids) == 2


def test_an_unknown_model_is_404_and_a_wrong_token_401(cluster, api):
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    for token in (None, "wrong"):
        status, headers, answer = http(cluster, "GET", "/v1/models", token=token)
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        assert headers["www-authenticate"] == "Bearer"
    assert http(cluster, "GET", "/health", token=None)[0] == 200  # what probes reach


def test_more_choices_than_the_router_admits_is_429_with_retry_after(cluster):
    status, headers, answer = http(cluster, "POST", "/v1/completions",
                                   {"model": MODEL, "prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 2})
    assert status == 429 and headers["retry-after"] == "1" and answer["error"]["code"] == "overloaded"


def test_dispatch_errors_map_to_openai_statuses():
    """What the dispatcher raises past the point where the test can provoke it cheaply."""
    import grpc

    from baton.router.dispatch import DispatchError
    from baton.router.openai_api.server import api_error

    for code, status in [(grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                         (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.INVALID_ARGUMENT, 400),
                         (grpc.StatusCode.INTERNAL, 500)]:
        error = api_error(DispatchError(code, "why"))
        assert error.status == status and error.message == "why"
        assert ("retry-after" in error.headers) == (status in (429, 503))


def test_request_ids_are_echoed_and_metrics_count_http_requests(cluster, api):
    status, headers, answer = http(cluster, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                                   headers={"x-request-id": "trace-42"})
    assert status == 200 and headers["x-request-id"] == "trace-42" and answer["id"] == "cmpl-trace-42"
    status, _, scraped = http(cluster, "GET", "/metrics")
    assert status == 200 and b"baton_time_to_first_token_seconds_count" in scraped


def test_a_draining_router_finishes_open_streams_and_answers_503(cluster, api):
    """Last: it stops the module's router. SIGTERM while a stream runs: new requests get 503, the
    stream runs to its end, then the router exits."""
    router = cluster.procs[-1][1]
    stream = iter(api.completions.create(model=MODEL, prompt=[21, 22, 23], max_tokens=300, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    chunks = [next(stream)]
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    router.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (status := http(cluster, "GET", "/health", token=None)[0]) != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 503
    status, headers, answer = http(cluster, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert status == 503 and answer["error"]["code"] == "draining"
    reader.join(60)
    assert not reader.is_alive()
    assert router.wait(30) == 0
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 300
    with pytest.raises(Unavailable):  # the router is gone
        with BatonClient(cluster.router_address, token=TOKEN, timeout=5) as client:
            client.model_info()


def test_the_routers_default_sampling_reaches_both_apis(tiny_reference):
    """model.override_generation_config on the router (vLLM's --override-generation-config): a
    request that leaves max_tokens and temperature unset gets the defaults through the SDK and the
    OpenAI API alike, here 5 greedy tokens; /v1/models and GetModelInfo say what they are."""
    defaults = {"max_new_tokens": 5, "temperature": 0}
    prompt = [31, 32, 33, 34]
    with LocalCluster(prefill=1, decode=1, model=MODEL, max_rows=2, http_port=-1,
                      router_args=("--override-generation-config", json.dumps(defaults))) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            assert client.model_info().sampling_defaults == {"max_tokens": 5, "temperature": 0.0}
            by_sdk = client.generate(token_ids=prompt, ignore_eos=True)
            sampled = client.generate(token_ids=prompt, ignore_eos=True, temperature=1.5, seed=3, max_tokens=40)
        api = openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=120)
        by_http = api.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True})
        listed = http(cluster, "GET", "/v1/models", token=None)[2]["data"][0]
    expected = tiny_reference.greedy(prompt, 5)
    assert by_sdk.token_ids == expected and by_sdk.finish_reason == "length"
    assert by_http.usage.completion_tokens == 5 and by_http.choices[0].text == by_sdk.text
    assert listed["sampling_defaults"] == {"max_tokens": 5, "temperature": 0.0}
    assert sampled.token_ids[:5] != expected  # what a request sets wins over the defaults

