"""Reading OpenAI request bodies and writing answers: plain Python, no server."""
from __future__ import annotations

import json

import pytest

from baton.router.openai_api.protocol import (APIError, DEFAULT_SERVED_NAME, IGNORED, MAX_PROMPTS, NEUTRAL, READ,
                                              READ_CHAT, READ_COMPLETIONS, best, body, chunk, logprobs, parse,
                                              served_names, usage, usage_chunk)
from baton.sampling import TokenLogprob

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(raw, chat=True) -> APIError:
    with pytest.raises(APIError) as err:
        parse(raw, chat=chat)
    assert err.value.status == 400
    return err.value


def test_chat_defaults_follow_openai():
    request = parse(CHAT, chat=True)
    assert request.chat and request.model == "m" and request.n == 1 and not request.stream
    assert request.prompts == [[{"role": "user", "content": "hi"}]]
    assert request.sampling.temperature == 1.0  # OpenAI samples unless told otherwise
    assert not request.max_tokens_given  # the server gives it the rest of the context


def test_the_models_default_sampling_fills_what_the_body_leaves_unset():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 64}
    unset = parse(CHAT, chat=True, defaults=defaults).sampling
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.2, 0.9, 40)
    chosen = parse({**CHAT, "temperature": 0.7, "top_k": -1}, chat=True, defaults=defaults).sampling
    assert (chosen.temperature, chosen.top_p, chosen.top_k) == (0.7, 0.9, 0)  # per field; -1 is "off"
    assert parse({**CHAT, "temperature": 0}, chat=True, defaults=defaults).sampling.is_greedy
    assert parse(CHAT, chat=True, defaults={"top_p": 0.5}).sampling.temperature == 1.0  # then OpenAI's


def test_chat_reads_text_parts_developer_role_and_max_completion_tokens():
    request = parse({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                                      {"type": "text", "text": "brief"}]},
                                  {"role": "user", "content": "hi"}],
                     "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5, "top_k": -1,
                     "seed": 4, "stop": "\n", "stream": True, "stream_options": {"include_usage": True}}, chat=True)
    assert request.prompts[0][0] == {"role": "system", "content": "be brief"}
    assert request.sampling.max_tokens == 7 and request.max_tokens_given
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k) == (0.0, 0.5, 0)
    assert request.sampling.seed == 4 and request.sampling.stop == ("\n",)
    assert request.stream and request.include_usage


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompts_in_every_shape(prompt, expected):
    assert parse({"prompt": prompt, "n": 2}, chat=False).prompts == expected
    assert parse({"prompt": prompt, "n": 2}, chat=False).choices == 2 * len(expected)


@pytest.mark.parametrize("raw, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                       "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "temperature": float("nan")}, "temperature"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "n": 17}, "n"),
    ({**CHAT, "seed": -1}, "seed"),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "logprobs": 3}, "logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": "x"}, "frequency_penalty"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CHAT, "min_p": 1.5}, "min_p"),
    ({**CHAT, "min_tokens": -1}, "min_tokens"),
    ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**CHAT, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({**CHAT, "best_of": 0}, "best_of"),
    ({**CHAT, "n": 3, "best_of": 2}, "best_of"),
    ({**CHAT, "best_of": 2, "stream": True}, "best_of"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools[0].function.parameters"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({**CHAT, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format"),
    ({**CHAT, "guided_regex": "("}, "guided_regex"),
    ({**CHAT, "guided_choice": []}, "guided_choice"),
    ({**CHAT, "guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({**CHAT, "structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({**CHAT, "ignore_eos": True, "guided_regex": "a+"}, "ignore_eos"),
    ({**CHAT, "model": 5}, "model"),
])
def test_bad_chat_fields_name_themselves(raw, param):
    error = refused(raw)
    assert error.param == param and error.body()["error"]["type"] == "invalid_request_error"


def test_penalties_biases_min_p_and_min_tokens_are_read():
    sampling = parse({**CHAT, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
                      "min_p": 0.05, "min_tokens": 3, "logit_bias": {"50": -100, "7": 2.5}}, chat=True).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -0.25, 1.2)
    assert (sampling.min_p, sampling.min_tokens, sampling.logit_bias) == (0.05, 3, ((7, 2.5), (50, -100)))
    assert parse(CHAT, chat=True, defaults={"repetition_penalty": 1.1}).sampling.repetition_penalty == 1.1


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("fields,kind,spec", [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"choice": ["a \"b\"", "c"]}}, "choice", ["a \"b\"", "c"]),
    ({"guided_grammar": 'start: "x" NUM\nNUM: /[0-9]+/'}, "grammar", 'start: "x" NUM\nNUM: /[0-9]+/'),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_structured_outputs_are_read_in_every_spelling(fields, kind, spec, chat):
    base = CHAT if chat else {"prompt": "hi"}
    guide = parse({**base, **fields}, chat=chat).sampling.guide
    assert guide.kind == kind
    assert (json.loads(guide.spec) if kind in ("json_schema", "choice") else guide.spec) == spec
    assert parse({**base, "response_format": {"type": "text"}}, chat=chat).sampling.guide is None


def test_best_of_keeps_each_prompts_likeliest_candidates():
    request = parse({"prompt": ["a", "b"], "n": 2, "best_of": 3}, chat=False)
    assert (request.n, request.best_of) == (2, 3) and parse({"prompt": "a", "n": 2}, chat=False).best_of == 2
    candidates = [{"index": i, "prompt_index": i // 3, "text": f"t{i}", "score": score, "logprobs": {"x": 1}}
                  for i, score in enumerate([-3.0, -1.0, -2.0, -0.5, -9.0, -0.1])]
    kept = best(request, candidates)
    assert [c["text"] for c in kept] == ["t1", "t2", "t5", "t3"] and [c["index"] for c in kept] == [0, 1, 2, 3]
    assert all(c["logprobs"] is None for c in kept)  # scored with logprobs the request did not ask for


def test_neutral_values_of_unsupported_fields_pass():
    parse({**CHAT, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "tools": [],
           "response_format": {"type": "text"}, "logit_bias": {}, "guided_decoding_backend": "guidance"}, chat=True)


@pytest.mark.parametrize("prompt", [None, "", [], [1, -2], ["a", ""], [True], 5, ["a"] * (MAX_PROMPTS + 1)])
def test_bad_completion_prompts(prompt):
    assert refused({"prompt": prompt}, chat=False).param.startswith("prompt")


def test_logprobs_are_asked_as_each_endpoint_asks():
    assert parse(CHAT, chat=True).sampling.logprobs is None
    assert parse({**CHAT, "logprobs": False}, chat=True).sampling.logprobs is None
    assert parse({**CHAT, "logprobs": True}, chat=True).sampling.logprobs == 0
    assert parse({**CHAT, "logprobs": True, "top_logprobs": 5}, chat=True).sampling.logprobs == 5
    assert parse({"prompt": "x", "logprobs": 2}, chat=False).sampling.logprobs == 2
    assert refused({"prompt": "x", "logprobs": True}, chat=False).param == "logprobs"
    assert refused({"prompt": "x", "logprobs": 21}, chat=False).param == "logprobs"


def test_logprobs_answers_have_openai_shapes():
    text_of = {1: "Hel", 2: "lo", 3: "é"}.__getitem__
    entries = [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))), TokenLogprob(3, -0.25, ((3, -0.25), (1, -2.0)))]
    chat = parse({**CHAT, "logprobs": True, "top_logprobs": 2}, chat=True)
    assert logprobs(chat, entries, text_of) == {"content": [
        {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
         "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                          {"token": "lo", "logprob": -1.5, "bytes": [108, 111]}]},
        {"token": "é", "logprob": -0.25, "bytes": [195, 169],
         "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]},
                          {"token": "Hel", "logprob": -2.0, "bytes": [72, 101, 108]}]}]}
    text = parse({"prompt": "x", "logprobs": 2}, chat=False)
    assert logprobs(text, entries, text_of, offset=4) == {
        "tokens": ["Hel", "é"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hel": -0.5, "lo": -1.5}, {"é": -0.25, "Hel": -2.0}], "text_offset": [4, 7]}
    assert logprobs(parse(CHAT, chat=True), entries, text_of) is None  # not asked
    shaped = logprobs(text, entries, text_of)
    assert body(text, "id", 1, "m", [{"index": 0, "text": "Helé", "finish_reason": "stop", "logprobs": shaped}],
                usage(1, 2, 0))["choices"][0]["logprobs"] == shaped
    assert chunk(chat, "id", 1, "m", 0, text="Hel", token_logprobs={"content": []})["choices"][0]["logprobs"] == {
        "content": []}


def test_a_body_that_is_not_an_object():
    assert refused([1, 2]).message == "the request body must be a JSON object"


def test_answers_have_openai_shapes():
    chat, text = parse(CHAT, chat=True), parse({"prompt": "x", "stream": True,
                                               "stream_options": {"include_usage": True}}, chat=False)
    totals = usage(5, 3, 2)
    assert totals == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 2}}
    whole = body(chat, "id", 1, "m", [{"index": 0, "text": "hey", "finish_reason": "stop"}], totals)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    first = chunk(chat, "id", 1, "m", 0, role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and "usage" not in first
    piece = chunk(text, "id", 1, "m", 2, text="ab", finish_reason="length")
    assert piece["choices"][0] == {"index": 2, "text": "ab", "logprobs": None, "finish_reason": "length"}
    assert piece["usage"] is None  # include_usage: every chunk has the key, the last one the value
    assert usage_chunk(text, "id", 1, "m", totals) == {"id": "id", "object": "text_completion", "created": 1,
                                                       "model": "m", "choices": [], "usage": totals}


def test_served_names():
    assert served_names("default", "") == [DEFAULT_SERVED_NAME, "default"]
    assert served_names("/models/qwen", "") == ["/models/qwen", "qwen"]
    assert served_names("org/name", "") == ["org/name", "name"]
    assert served_names("default", "chat") == ["chat", "default"]


# The request fields OpenAI documents for each endpoint, and those vLLM's OpenAI server adds.
OPENAI_CHAT_FIELDS = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
    "top_p", "user", "verbosity", "web_search_options"}
OPENAI_COMPLETION_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"}
VLLM_EXTRA_FIELDS = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs"}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_documented_request_field_is_read_neutral_only_or_ignored_on_purpose(chat):
    documented = (OPENAI_CHAT_FIELDS if chat else OPENAI_COMPLETION_FIELDS) | VLLM_EXTRA_FIELDS
    handled = READ | (READ_CHAT if chat else READ_COMPLETIONS) | IGNORED | set(NEUTRAL)
    assert documented - handled == set()
    base = CHAT if chat else {"prompt": "hi"}
    for name in sorted(IGNORED):  # accepted, and nothing changes
        assert parse({**base, name: "x"}, chat=chat).sampling == parse(base, chat=chat).sampling
    for name, neutral in NEUTRAL.items():
        for value in neutral:
            parse({**base, name: value}, chat=chat)
        assert refused({**base, name: "something"}, chat=chat).param == name
    unknown = refused({**base, "temprature": 0.5}, chat=chat)  # a typo is not silently ignored
    assert unknown.param == "temprature" and "remove it" in unknown.message


def test_the_readme_lists_the_fields_accepted_and_ignored():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for name in IGNORED:
        assert f"`{name}`" in readme, name
