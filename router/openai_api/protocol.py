"""The OpenAI HTTP API's shapes as plain dicts: reading a request body (a 400 a person can act on
for every bad field) and writing the bodies, stream chunks and errors Baton answers with. No web
framework and no grpc here: `server.py` does the HTTP, `baton.sampling` the sampling checks."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from baton.router.openai_api import tools as tools_api
from baton.sampling import (INT32_MAX, INT32_MIN, MAX_LOGPROBS, MAX_SEED, Guide, SamplingParams, TokenLogprob,
                            fill_unset)

# What the default model is called on the wire (its Hugging Face name), as vLLM would serve it.
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
MAX_CHOICES = 16  # n: completions per prompt
MAX_PROMPTS = 64  # /v1/completions: prompts in one request
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Every request field is read, accepted at a neutral value only, or ignored on purpose; any other
# is refused with a 400 naming it (as OpenAI does), so a client never silently gets something
# other than what it asked for. tests/test_openai_protocol.py walks OpenAI's and vLLM's fields.
READ = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "stop", "seed", "logprobs",
        "presence_penalty", "frequency_penalty", "logit_bias", "user",
        # vLLM's extensions
        "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "priority", "best_of",
        # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (one at most)
        "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
READ_CHAT = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
READ_COMPLETIONS = {"prompt"}
# Bookkeeping for the caller's side that changes nothing in the answer.
IGNORED = {"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "request_id"}
# Not implemented: accepted only at these values (the default, or its explicit "off").
NEUTRAL = {"functions": (None, []), "function_call": (None, "none"),  # the deprecated form of tools
           "echo": (None, False), "suffix": (None, ""), "modalities": (None, ["text"]),
           "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
           "web_search_options": (None,),
           # vLLM's
           "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "include_stop_str_in_output": (None, False),
           "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
           "add_generation_prompt": (None, True), "continue_final_message": (None, False),
           "add_special_tokens": (None, False), "allowed_token_ids": (None,), "bad_words": (None, []),
           "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "chat_template": (None,),
           "chat_template_kwargs": (None, {}), "documents": (None,), "mm_processor_kwargs": (None,),
           # Baton's one grammar engine is llguidance, vLLM's "guidance"
           "guided_decoding_backend": (None, "auto", "guidance", "llguidance"), "guided_whitespace_pattern": (None,),
           "structural_tag": (None,), "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
           "logits_processors": (None,), "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None,)}


def served_names(model: str, configured: str) -> list[str]:
    """The names a request may give as `model`: the configured one (or the model's own), first."""
    if configured:
        return [configured, model]
    if model == "default":
        return [DEFAULT_SERVED_NAME, model]
    return [model, Path(model).name] if Path(model).name and Path(model).name != model else [model]


class APIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass
class APIRequest:
    """One chat or completions request, read and checked: `prompts` are message lists (chat) or
    text / token id lists (completions); every prompt gets `n` choices."""

    chat: bool
    model: str | None
    prompts: list[Any]
    sampling: SamplingParams
    max_tokens_given: bool
    n: int = 1
    best_of: int = 1  # candidates generated per prompt, of which the n likeliest are answered
    stream: bool = False
    include_usage: bool = False
    user: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    tools: tools_api.Tools | None = None  # chat: the functions the model may call, and how

    @property
    def choices(self) -> int:
        return self.n * len(self.prompts)


def _int(body: dict, name: str, low: int, high: int, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(name, f"must be an integer in [{low}, {high}] (got {value!r})")
    return value


def _number(body: dict, name: str, low: float, high: float, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise bad(name, f"must be a number in [{low:g}, {high:g}] (got {value!r})")
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false (got {value!r})")
    return value


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (what newer clients send)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{i}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are "
                                                   "supported; this model reads text only")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content", f"must be a string or a list of text parts (got {type(content).__name__})")


def _messages(body: dict) -> list[dict[str, Any]]:
    """{"role", "content"} each, plus an assistant message's earlier tool calls as `tool_calls`
    [{"name", "arguments": {...}}] (tools.render writes them for the template)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, "must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"{role!r} is not supported; use system, developer, user, assistant or tool")
        content = message.get("content")
        entry: dict[str, Any] = {"role": CHAT_ROLES[role],
                                 "content": "" if content is None else _text_content(content, where)}
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls", "is a list, on assistant messages only")
            entry["tool_calls"] = [_earlier_call(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(calls)]
        elif content is None:
            raise bad(f"{where}.content", "is missing (only an assistant message with tool_calls may leave it out)")
        out.append(entry)
    return out


def _earlier_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad(where, "must be {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}")
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise bad(f"{where}.function.arguments", "must be a JSON object (as text)") from None
    if not isinstance(arguments, dict):
        raise bad(f"{where}.function.arguments", "must be a JSON object (as text)")
    return {"name": function["name"], "arguments": arguments}


def _completion_prompts(body: dict) -> list[str | list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of token id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of token id "
                            f"lists (got {type(prompt).__name__ if prompt is not None else 'nothing'})")
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request (got {len(prompts)}); split the request")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise bad(f"prompt[{i}]" if len(prompts) > 1 else "prompt", "is empty; send a non-empty prompt")
        elif not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise bad(f"prompt[{i}]", "a token id list must be non-empty and hold integers >= 0")
    return prompts


def _check_fields(body: dict, chat: bool) -> None:
    """Refuse a field this server would not honour: an unknown one, or one it does not implement
    set to anything but its neutral value."""
    endpoint = READ_CHAT if chat else READ_COMPLETIONS
    for name, value in body.items():
        if name in READ or name in endpoint or name in IGNORED:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise bad(name, f"{value!r} is not supported by this server; leave it unset")
            continue
        where = "/v1/chat/completions" if chat else "/v1/completions"
        raise bad(name, f"is not a request field of {where} that this server knows; remove it (README: the OpenAI API)")


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to a bias in [-100, 100]."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad("logit_bias", f"must be an object mapping token ids to biases (got {raw!r})")
    try:
        return {int(token): bias for token, bias in raw.items()}
    except ValueError:
        raise bad("logit_bias", f"keys must be token ids such as \"50256\" (got {sorted(raw)!r})") from None


def _schema_text(value: Any, param: str) -> str:
    """A JSON Schema given as an object (or as JSON text, which vLLM also takes)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad(param, "must be a JSON Schema object (or its JSON text)") from None
    if not isinstance(value, (dict, bool)):
        raise bad(param, f"must be a JSON Schema object (got {type(value).__name__})")
    return json.dumps(value)


def _guide(body: dict, tools: tools_api.Tools | None = None) -> Guide | None:
    """What the output must match: OpenAI's response_format, or vLLM's structured_outputs or
    guided_json / guided_regex / guided_choice / guided_grammar, or the calls tool_choice
    requires. At most one of them."""
    given: list[tuple[str, Guide]] = []
    calls = tools_api.guide(tools)
    if calls is not None:
        given.append(("tool_choice", calls))
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            given.append(("response_format", Guide("json_object")))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad("response_format", "a json_schema response_format needs "
                                             "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
            given.append(("response_format", Guide("json_schema", _schema_text(spec["schema"], "response_format"))))
        elif kind != "text":
            raise bad("response_format", f"type must be text, json_object or json_schema (got {fmt!r})")
    guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    outputs = body.get("structured_outputs")
    if outputs is not None and not isinstance(outputs, dict):
        raise bad("structured_outputs", "must be an object with one of json, regex, choice, grammar, json_object")
    fields = [(name, key, body[name]) for name, key in guided.items() if body.get(name) is not None]
    fields += [(f"structured_outputs.{key}", key, value) for key, value in (outputs or {}).items()
               if value is not None and value is not False]
    for param, key, value in fields:
        if key == "json":
            given.append((param, Guide("json_schema", _schema_text(value, param))))
        elif key == "json_object" and value is True:
            given.append((param, Guide("json_object")))
        elif key in ("regex", "grammar") and isinstance(value, str) and value:
            given.append((param, Guide(key, value)))
        elif key == "choice" and isinstance(value, list) and value and all(isinstance(c, str) and c for c in value):
            given.append((param, Guide("choice", json.dumps(value))))
        else:
            raise bad(param, f"is not a valid {key} guide (got {value!r})")
    if len(given) > 1:
        raise bad(given[1][0], f"give one structured output at most ({', '.join(p for p, _ in given)} given)")
    if not given:
        return None
    param, guide = given[0]
    from baton.guides import grammar_of

    try:
        grammar_of(guide)
    except ValueError as exc:
        raise bad(param, str(exc)) from None
    return guide


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token to return with its log probability; None = none. Chat says
    `logprobs: true` and `top_logprobs: N`; completions say `logprobs: N`."""
    if not chat:
        return _int(body, "logprobs", 0, MAX_LOGPROBS)
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise bad("top_logprobs", "needs \"logprobs\": true")
    return (top or 0) if wanted else None


# OpenAI's own default where neither the request nor the model's default sampling sets one.
OPENAI_TEMPERATURE = 1.0


def parse(body: Any, *, chat: bool, defaults: dict | None = None) -> APIRequest:
    """Read a /v1/chat/completions (`chat`) or /v1/completions body; raise APIError(400).
    `defaults` (the model's default sampling) fill what the body leaves unset, then OpenAI's
    temperature 1; an unset max_tokens is set per prompt by the server."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string (got {model!r})")
    _check_fields(body, chat)
    try:
        tools = tools_api.read(body) if chat else None
    except tools_api.ToolError as exc:
        raise bad(exc.param, str(exc)) from None
    prompts = [tools_api.render(_messages(body), tools)] if chat else _completion_prompts(body)
    max_tokens = _int(body, "max_completion_tokens", 1, 2**31 - 1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 2**31 - 1)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("stop", f"must be a string or a list of strings (got {stop!r})")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not isinstance(stop_token_ids, list):
        raise bad("stop_token_ids", "must be a list of token ids")
    top_k = _int(body, "top_k", -1, 2**31 - 1)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("stream_options", "is an object, allowed only with \"stream\": true")
    user = body.get("user") or ""
    if not isinstance(user, str):
        raise bad("user", "must be a string")
    try:
        given = fill_unset({"temperature": _number(body, "temperature", 0.0, 2.0),
                            "top_p": _number(body, "top_p", 0.0, 1.0),
                            "top_k": None if top_k is None else max(top_k, 0),
                            "repetition_penalty": _number(body, "repetition_penalty", 0.0, 10.0),
                            "min_p": _number(body, "min_p", 0.0, 1.0)},
                           {k: v for k, v in (defaults or {}).items() if k != "max_tokens"})
        if given["temperature"] is None:
            given["temperature"] = OPENAI_TEMPERATURE
        sampling = SamplingParams.from_kwargs({
            "max_tokens": max_tokens,  # unset: up to the context (or the model's default), set per prompt
            **given,
            "seed": _int(body, "seed", -(2**63), MAX_SEED),
            "stop": stop, "stop_token_ids": stop_token_ids, "ignore_eos": _bool(body, "ignore_eos"),
            "priority": _int(body, "priority", INT32_MIN, INT32_MAX, 0), "logprobs": _logprobs(body, chat),
            "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
            "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
            "min_tokens": _int(body, "min_tokens", 0, 2**31 - 1), "logit_bias": _logit_bias(body),
            "guide": _guide(body, tools)})
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=name, code="invalid_value") from None
    if sampling.seed is not None and sampling.seed < 0:
        raise bad("seed", f"must be >= 0 here (got {sampling.seed})")
    n = _int(body, "n", 1, MAX_CHOICES, 1)
    best_of = _int(body, "best_of", 1, MAX_CHOICES, n)
    if best_of < n:
        raise bad("best_of", f"must be at least n={n} (got {best_of})")
    if best_of > n and stream:
        raise bad("best_of", "cannot be used with stream: the best candidates are known only at the end")
    return APIRequest(chat=chat, model=model, prompts=prompts, sampling=sampling,
                      max_tokens_given=max_tokens is not None, n=n, best_of=best_of, stream=stream,
                      include_usage=_bool(options or {}, "include_usage"), user=user, tools=tools)


# -- answers ------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


TokenText = Callable[[int], str]  # a token id's own text (the tokenizer's decode of that one id)


def logprobs(request: APIRequest, entries: Sequence[TokenLogprob], text_of: TokenText,
             offset: int = 0) -> dict[str, Any] | None:
    """The `logprobs` of a choice (or of a stream chunk's tokens) in the endpoint's shape, or None
    when the request did not ask. Completions give `text_offset` from `offset`, the characters of
    the choice's tokens before these."""
    if request.sampling.logprobs is None:
        return None
    if request.chat:
        def token(token_id: int, value: float) -> dict[str, Any]:
            text = text_of(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, v) for t, v in e.top]}
                            for e in entries]}
    tokens = [text_of(e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text_of(t): v for t, v in e.top} for e in entries], "text_offset": offsets}


def best(request: APIRequest, candidates: list[dict]) -> list[dict]:
    """best_of: each prompt's n candidates of the highest cumulative log probability ("score"),
    in that order, indexed anew; their logprobs kept only where the request asked for them."""
    if request.best_of == request.n:
        return candidates
    kept = []
    for p in range(len(request.prompts)):
        mine = [c for c in candidates if c["prompt_index"] == p]
        kept += sorted(mine, key=lambda c: -c["score"])[:request.n]
    return [{**c, "index": i, "logprobs": c["logprobs"] if request.sampling.logprobs is not None else None}
            for i, c in enumerate(kept)]


def body(request: APIRequest, response_id: str, created: int, model: str, choices: list[dict],
         totals: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streaming) answer; `choices` hold index, text, finish_reason and logprobs
    (already shaped by `logprobs`)."""
    if request.chat:
        shaped = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                   "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]} for c in choices]
        if request.tools is not None and request.tools.shown:  # the calls the text holds, as tool_calls
            for entry in shaped:
                content, calls = tools_api.extract(entry["message"]["content"], request.tools)
                if calls:
                    entry["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    entry["finish_reason"] = finish_with_calls(entry["finish_reason"])
        kind = "chat.completion"
    else:
        shaped = [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                   "finish_reason": c["finish_reason"]} for c in choices]
        kind = "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": shaped,
            "usage": totals}


def finish_with_calls(reason: str | None) -> str | None:
    """OpenAI's finish_reason for an answer that ended in tool calls."""
    return "tool_calls" if reason == "stop" else reason


def chunk(request: APIRequest, response_id: str, created: int, model: str, index: int, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None, token_logprobs: dict | None = None,
          tool_calls: list[dict] | None = None) -> dict[str, Any]:
    """One stream event for one choice; `token_logprobs` as `logprobs` shapes them; `tool_calls`
    as deltas that each carry a whole call ({"index", "id", "type", "function"})."""
    if request.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": token_logprobs, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": token_logprobs, "finish_reason": finish_reason}
        kind = "text_completion"
    out = {"id": response_id, "object": kind, "created": created, "model": model, "choices": [choice]}
    if request.include_usage:
        out["usage"] = None
    return out


def usage_chunk(request: APIRequest, response_id: str, created: int, model: str,
                totals: dict[str, Any]) -> dict[str, Any]:
    """The last event with stream_options.include_usage: no choices, the request's usage."""
    kind = "chat.completion.chunk" if request.chat else "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": [], "usage": totals}
