"""generate_many's checks before sending and its rule for failures, shared by both clients."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from baton.client.channel import check_timeout
from baton.client.convert import build_request, split_request_args
from baton.client.errors import BatonError
from baton.client.types import GenerationResult

_BATCH_WIDE_FORBIDDEN = ("prompt", "messages", "token_ids", "request_id")


def prepare_batch(requests: Sequence[str | Mapping[str, Any]], max_concurrency: int, timeout: float | None,
                  defaults: Mapping[str, Any]) -> list[dict[str, Any]]:
    """generate() keyword arguments for every entry, all checked before any is sent; a bad
    entry raises ValueError/TypeError naming its index."""
    if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Sequence):
        raise ValueError("requests must be a list of prompt strings or dicts of generate() arguments")
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an integer >= 1 (got {max_concurrency!r})")
    shared = [name for name in _BATCH_WIDE_FORBIDDEN if name in defaults]
    if shared:
        raise ValueError(f"{', '.join(shared)} cannot apply to a whole batch; set them per entry")
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
