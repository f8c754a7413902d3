"""Arrival-order LRU prefix cache: the baseline BatchLLM is measured against.

This models vLLM-style automatic prefix caching fed the batch in arrival order:
KV is cached in fixed-size blocks, a block is identified by its tokens *and*
everything before it (a chained hash), only full blocks are cached, and a request
reuses the longest run of cached blocks from its start. Requests are prefilled
one after another; after each one all its full blocks are cached and marked
most recently used, tail first, so that eviction takes the ends of prefixes
before their beginnings (as vLLM frees a request's blocks in reverse).

As in vLLM, a request whose whole prompt is cached still recomputes its last
token, which is needed for the logits of its first output token.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LruResult:
    total_prompt_tokens: int
    saved_tokens: int
    hit_blocks: int
    evicted_blocks: int

    @property
    def saving_ratio(self) -> float:
        if self.total_prompt_tokens == 0:
            return 0.0
        return self.saved_tokens / self.total_prompt_tokens


def simulate_lru_prefix_cache(
    prompts: Sequence[Sequence[int]], *, block_size: int, capacity_blocks: int
) -> LruResult:
    """Prefill tokens an LRU block cache of ``capacity_blocks`` saves on ``prompts``."""
    if block_size <= 0 or capacity_blocks < 0:
        raise ValueError(
            f"block_size ({block_size}) must be positive and capacity_blocks "
            f"({capacity_blocks}) not negative"
        )
    # (parent block id, block tokens) -> block id: the chained hash, collision-free.
    block_ids: dict[tuple[int, tuple[int, ...]], int] = {}
    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    saved = hits = evicted = total = 0
    for prompt in prompts:
        total += len(prompt)
        chain: list[int] = []
        parent = -1
        for start in range(0, len(prompt) - block_size + 1, block_size):
            key = (parent, tuple(prompt[start : start + block_size]))
            parent = block_ids.setdefault(key, len(block_ids))
            chain.append(parent)
        cached_blocks = 0
        while cached_blocks < len(chain) and chain[cached_blocks] in cache:
            cached_blocks += 1
        hits += cached_blocks
        saved += min(cached_blocks * block_size, len(prompt) - 1)
        if capacity_blocks == 0:
            continue
        for block in reversed(chain):
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
            evicted += 1
    return LruResult(total, saved, hits, evicted)
