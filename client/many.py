"""What both clients share for many requests: generate_many's checks before sending and its rule
for failures, and generate_batch's request and the folding of its result stream."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from baton.v1 import router_pb2
from baton.client.channel import check_timeout
from baton.client.convert import batch_item_from_proto, build_request, message_fields, split_request_args
from baton.client.errors import BatonError
from baton.client.types import BatchOutcome, GenerationResult

_BATCH_WIDE_FORBIDDEN = ("prompt", "messages", "token_ids", "request_id")


def _check_list(requests) -> None:
    if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Sequence):
        raise ValueError("requests must be a list of prompt strings or dicts of generate() arguments")


def _check_shared(defaults: Mapping[str, Any], forbidden: Sequence[str], hint: str) -> None:
    """Keywords given for every entry that only make sense for one."""
    shared = [name for name in forbidden if name in defaults]
    if shared:
        raise ValueError(f"{', '.join(shared)} cannot apply to a whole batch; set them per entry{hint}")


def prepare_batch(requests: Sequence[str | Mapping[str, Any]], max_concurrency: int, timeout: float | None,
                  defaults: Mapping[str, Any]) -> list[dict[str, Any]]:
    """generate() keyword arguments for every entry, all checked before any is sent; a bad
    entry raises ValueError/TypeError naming its index."""
    _check_list(requests)
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an integer >= 1 (got {max_concurrency!r})")
    _check_shared(defaults, _BATCH_WIDE_FORBIDDEN, "")
    check_timeout(timeout)
    calls = []
    for index, item in enumerate(requests):
        kwargs = split_request_args(index, item, {**defaults, "timeout": timeout})
        try:
            build_request(**{k: v for k, v in kwargs.items() if k != "timeout"})
            check_timeout(kwargs.get("timeout"))
        except (ValueError, TypeError) as error:
            raise type(error)(f"requests[{index}]: {error}") from error
        calls.append(kwargs)
    return calls


def finish_batch(outcomes: list[GenerationResult | BatonError],
                 return_exceptions: bool) -> list[GenerationResult | BatonError]:
    """The outcomes as they are, or raise the first failure (input order) carrying them all."""
    if not return_exceptions:
        for outcome in outcomes:
            if isinstance(outcome, BatonError):
                outcome.batch_results = list(outcomes)
                raise outcome
    return outcomes


def batch_request(requests: Sequence[str | Mapping[str, Any]], max_concurrency: int,
                  defaults: Mapping[str, Any]) -> router_pb2.GenerateBatchRequest:
    """The GenerateBatch request for generate_batch(), every entry checked before any is sent (a
    bad entry raises ValueError/TypeError naming its index). A per-entry timeout makes no sense
    in one call: the call's own timeout covers the whole batch."""
    _check_list(requests)
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 0:
        raise ValueError(f"max_concurrency must be an integer >= 0 (got {max_concurrency!r}; 0 lets the router "
                         "choose)")
    _check_shared(defaults, (*_BATCH_WIDE_FORBIDDEN, "timeout"), " (the call's timeout= covers the whole batch)")
    built = []
    for index, item in enumerate(requests):
        kwargs = split_request_args(index, item, defaults)
        if "timeout" in kwargs:
            raise ValueError(f"requests[{index}]: timeout applies to the whole batch, not to one entry")
        try:
            built.append(build_request(**kwargs))
        except (ValueError, TypeError) as error:
            raise type(error)(f"requests[{index}]: {error}") from error
    return router_pb2.GenerateBatchRequest(requests=built, max_concurrency=max_concurrency)


class BatchCollector:
    """Folds a GenerateBatch stream into a BatchOutcome: results in input order as they finish,
    `on_result(index, result_or_error)` called for each, then the router's summary."""

    def __init__(self, size: int, on_result=None):
        self.results: list = [None] * size
        self.summary: dict[str, Any] = {}
        self.on_result = on_result

    def add(self, item: router_pb2.GenerateBatchResponse):
        """Take one streamed item; returns what on_result returned (an awaitable, for async callers)."""
        if item.HasField("summary"):
            self.summary = message_fields(item.summary)
            return None
        self.results[item.index] = batch_item_from_proto(item)
        return None if self.on_result is None else self.on_result(item.index, self.results[item.index])

    def outcome(self) -> BatchOutcome:
        return BatchOutcome(self.results, self.summary)
