"""Every translation between the SDK's dataclasses and the baton.v1 wire messages, in one place.

The sync and asyncio clients share all of it: they differ only in how they wait.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from baton.v1 import common_pb2, router_pb2
from baton.client.errors import BatonError, error_for_code
from baton.client.types import (UINT32_MAX, ClusterStatus, GenerationResult, ModelInfo, SamplingOptions, Setting,
                                StreamChunk, TokenLogprob, Trace, Usage, WorkerStatus)
from baton.messages import logprob_from_proto
from baton.sampling import DEFAULTABLE

# Keyword arguments of generate()/stream() that are not sampling options.
REQUEST_ARG_NAMES = frozenset({"prompt", "messages", "token_ids", "raw", "request_id", "timeout"})

ChatMessages = Sequence[Mapping[str, str] | tuple[str, str] | common_pb2.ChatMessage]


def build_request(prompt: str | None = None, *, messages: ChatMessages | None = None,
                  token_ids: Sequence[int] | None = None, raw: bool = False,
                  request_id: str | None = None, **sampling: Any) -> router_pb2.GenerateRequest:
    """A checked GenerateRequest; ValueError/TypeError say what to change, before any RPC.

    Exactly one of prompt, messages, token_ids. `prompt` goes as one user chat message (the
    model's chat template applied, like `baton generate`), or as raw text when raw=True."""
    given = [name for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
             if value is not None]
    if not given:
        raise ValueError("no prompt: pass exactly one of prompt=, messages= or token_ids=")
    if len(given) > 1:
        raise ValueError(f"pass exactly one of prompt=, messages= or token_ids= (got {' and '.join(given)})")
    if raw and prompt is None:
        raise ValueError("raw=True applies to prompt= only; messages always use the chat template")
    if request_id is not None and not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string or None (got {request_id!r})")
    request = router_pb2.GenerateRequest(request_id=request_id or "")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt must be non-empty text (got {prompt!r}); "
                             "use token_ids= for pre-tokenized input")
        if raw:
            request.text = prompt
        else:
            request.messages.messages.add(role="user", content=prompt)
    elif messages is not None:
        request.messages.SetInParent()  # an empty list is caught below; keep the oneof chosen
        for message in _checked_messages(messages):
            request.messages.messages.append(message)
    else:
        request.token_ids.ids.extend(_checked_token_ids(token_ids))
    given = {name for name, value in sampling.items() if value is not None}
    request.sampling.CopyFrom(sampling_to_proto(SamplingOptions.from_kwargs(sampling), given))
    return request


def sampling_to_proto(options: SamplingOptions, given: set[str] = frozenset()) -> common_pb2.SamplingParams:
    """The wire form. max_tokens, temperature, top_k, top_p, repetition_penalty and min_p go only
    when the caller `given` them, so the router applies the model's defaults otherwise (ModelInfo.sampling_defaults; with
    none: 256 tokens, greedy); no seed means a fresh one per request."""
    proto = common_pb2.SamplingParams(stop=list(options.stop), stop_token_ids=list(options.stop_token_ids),
                                      ignore_eos=options.ignore_eos, priority=options.priority,
                                      presence_penalty=options.presence_penalty,
                                      frequency_penalty=options.frequency_penalty, min_tokens=options.min_tokens,
                                      logit_bias=dict(options.logit_bias))
    for name in DEFAULTABLE:  # the fields a model may default
        if name in given:
            setattr(proto, name, getattr(options, name))
    if options.seed is not None:
        proto.seed = options.seed
    if options.logprobs is not None:
        proto.logprobs = options.logprobs
    if options.guide is not None:  # structured output: Guide(kind, spec), or a {"kind", "spec"} dict
        proto.guide.kind, proto.guide.spec = options.guide.kind, options.guide.spec
    return proto


def _checked_messages(messages: ChatMessages) -> list[common_pb2.ChatMessage]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    checked = []
    for index, message in enumerate(messages):
        if isinstance(message, common_pb2.ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, Mapping):
            extra = set(message) - {"role", "content"}
            if extra:
                raise ValueError(f"messages[{index}] has unknown keys {sorted(extra)}; use 'role' and 'content'")
            role, content = message.get("role"), message.get("content")
        elif isinstance(message, tuple) and len(message) == 2:
            role, content = message
        else:
            raise ValueError(f"messages[{index}] must be a {{'role': ..., 'content': ...}} dict (got {message!r})")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise ValueError(f"messages[{index}] needs a non-empty string 'role' (system, user, assistant) "
                             f"and a string 'content' (got role={role!r}, content={content!r})")
        checked.append(common_pb2.ChatMessage(role=role, content=content))
    return checked


def _checked_token_ids(token_ids: Sequence[int]) -> list[int]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence) or not token_ids:
        raise ValueError("token_ids must be a non-empty list of token ids")
    for index, token in enumerate(token_ids):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= UINT32_MAX:
            raise ValueError(f"token_ids[{index}] must be a token id >= 0 (got {token!r})")
    return list(token_ids)


def chunk_from_proto(response: router_pb2.GenerateResponse) -> StreamChunk:
    return StreamChunk(
        request_id=response.request_id,
        token_ids=list(response.token_ids),
        text_delta=response.text_delta,
        finish_reason=response.finish_reason or None,
        usage=usage_from_proto(response.usage) if response.HasField("usage") else None,
        trace=trace_from_proto(response.trace) if response.HasField("trace") else None,
        prompt_token_ids=list(response.prompt_token_ids) or None,
        logprobs=[logprob_from_proto(lp) for lp in response.logprobs] or None,
    )


def usage_from_proto(usage: common_pb2.Usage) -> Usage:
    return Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 cached_tokens=usage.cached_tokens)


def trace_from_proto(trace: common_pb2.Trace) -> Trace:
    return Trace(stage_seconds=dict(trace.stage_seconds), cached_tokens=trace.cached_tokens,
                 predicted_cached_tokens=trace.predicted_cached_tokens,
                 prefill_worker=trace.prefill_worker, decode_worker=trace.decode_worker, route=trace.route)


def model_info_from_proto(info: router_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(name=info.name, max_context=info.max_context,
                     model_fingerprint=info.model_fingerprint, vocab_size=info.vocab_size,
                     sampling_defaults={k: int(v) if k in ("max_tokens", "top_k") else v
                                        for k, v in sorted(info.sampling_defaults.items())},
                     worker_settings={w.address: [Setting(s.name, s.value, s.chosen_by) for s in w.settings]
                                      for w in info.workers})


def cluster_status_from_proto(status: router_pb2.ClusterStatus) -> ClusterStatus:
    workers = [WorkerStatus(address=w.address, role=w.role, healthy=w.healthy,
                            decode=message_fields(w.decode) if w.HasField("decode") else None,
                            prefill=message_fields(w.prefill) if w.HasField("prefill") else None,
                            cache_synced=w.cache_synced)
               for w in status.workers]
    return ClusterStatus(workers=workers, routing=message_fields(status.routing))


def batch_item_from_proto(item: router_pb2.GenerateBatchResponse) -> GenerationResult | BatonError:
    """One finished request of a GenerateBatch stream (or its error)."""
    if item.error_code:
        hint = {"retry-after-s": f"{item.retry_after_s:g}"} if item.retry_after_s > 0 else None
        return error_for_code(item.error_code, item.error_message, request_id=item.result.request_id or None,
                              trailing_metadata=hint)
    r = item.result
    return GenerationResult(request_id=r.request_id, text=r.text_delta, token_ids=list(r.token_ids),
                            prompt_token_ids=list(r.prompt_token_ids), finish_reason=r.finish_reason,
                            usage=usage_from_proto(r.usage), trace=trace_from_proto(r.trace),
                            logprobs=[logprob_from_proto(lp) for lp in r.logprobs] or None)


def message_fields(message: Any) -> dict[str, Any]:
    # Not json_format.MessageToDict: it turns uint64 counters into strings.
    def plain(f, value):
        return message_fields(value) if f.message_type is not None else value

    return {f.name: [plain(f, v) for v in getattr(message, f.name)] if f.is_repeated else
            plain(f, getattr(message, f.name)) for f in message.DESCRIPTOR.fields}


class ResultAssembler:
    """Folds a stream's chunks into one GenerationResult, and notices a stream cut short."""

    def __init__(self, request_id: str | None = None):
        self.request_id = request_id or None
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._prompt_token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._finish: StreamChunk | None = None

    def add(self, chunk: StreamChunk) -> None:
        if chunk.request_id:
            self.request_id = chunk.request_id
        if chunk.prompt_token_ids:
            self._prompt_token_ids = chunk.prompt_token_ids
        self._token_ids.extend(chunk.token_ids)
        self._logprobs.extend(chunk.logprobs or ())
        self._text.append(chunk.text_delta)
        if chunk.finish_reason is not None:
            self._finish = chunk

    def check_finished(self) -> None:
        """Raise if the server closed the stream without a last message (finish_reason set)."""
        if self._finish is None:
            raise BatonError("UNKNOWN", "the router ended the token stream without a finish_reason "
                             f"after {len(self._token_ids)} tokens; the response is incomplete",
                             request_id=self.request_id)

    def result(self) -> GenerationResult:
        self.check_finished()
        last = self._finish
        usage = last.usage or Usage(prompt_tokens=len(self._prompt_token_ids),
                                    completion_tokens=len(self._token_ids))
        return GenerationResult(request_id=self.request_id or "", text="".join(self._text),
                                token_ids=list(self._token_ids), prompt_token_ids=list(self._prompt_token_ids),
                                finish_reason=last.finish_reason or "", usage=usage, trace=last.trace or Trace(),
                                logprobs=list(self._logprobs) or None)


def split_request_args(index: int, item: str | Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """One generate_many() entry as generate() keyword arguments: a str is a prompt, a dict
    holds generate()'s keywords; the entry's own values win over the shared defaults."""
    if isinstance(item, str):
        return {**defaults, "prompt": item}
    if not isinstance(item, Mapping):
        raise ValueError(f"requests[{index}] must be a prompt string or a dict of generate() arguments "
                         f"(got {type(item).__name__})")
    merged = {**defaults, **item}
    if "prompt" not in item and "raw" not in item:
        merged.pop("raw", None)  # a shared raw=True concerns prompt strings, not messages/token_ids
    return merged
