"""``plan_batch``: the one call a caller needs to plan a large batch's prefill.

Ahead of time, over the whole batch: build the compact prefix tree, choose each
request's one shared prefix with the prefix DP, order the prefix-sharing groups
by BatchLLM's R, and pack their prefill into memory-bounded token batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .groups import (
    PrefixGroup,
    build_groups,
    optimum_saving_ratio,
    prefill_saving_ratio,
)
from .prefix_tree import PrefixTree
from .token_batching import Iteration, plan_token_batches, token_batch_sizes


@dataclass(frozen=True)
class BatchPlan:
    """What to prefill, in which order, in which iterations, and what it saves."""

    # Prefix-sharing groups in dispatch order; WorkItem.group_index indexes this.
    groups: tuple[PrefixGroup, ...]
    # Prefill iterations, each bounded by the KV and per-iteration token budgets.
    iterations: tuple[Iteration, ...]
    # Tokens in all prompts, and tokens the plan actually prefills.
    total_prompt_tokens: int
    computed_tokens: int
    # BatchLLM Eq. 2 for this plan, and for computing every tree node once.
    saving_ratio: float
    optimum_saving_ratio: float

    @property
    def token_batch_sizes(self) -> list[int]:
        """Tokens per iteration, for plotting the token-batch timeline."""
        return token_batch_sizes(self.iterations)

    @property
    def peak_kv_tokens(self) -> int:
        return max((it.kv_tokens_reserved for it in self.iterations), default=0)


def plan_batch(
    prompts: Sequence[Sequence[int]], *, kv_token_budget: int, max_tokens_per_iteration: int
) -> BatchPlan:
    """Plan the prefill of ``prompts`` (request ``i`` is ``prompts[i]``).

    Raises ValueError for an empty prompt or for budgets too small to hold one
    group's prefix together with its longest member.
    """
    for index, prompt in enumerate(prompts):
        if any(not isinstance(token, int) or token < 0 for token in prompt):
            raise ValueError(f"prompt {index} must be a list of non-negative int token ids")
    tree = PrefixTree(prompts)
    groups = build_groups(tree)
    iterations = plan_token_batches(
        groups, kv_token_budget=kv_token_budget, max_tokens_per_iteration=max_tokens_per_iteration
    )
    total = tree.total_prompt_tokens()
    return BatchPlan(
        groups=tuple(groups),
        iterations=tuple(iterations),
        total_prompt_tokens=total,
        computed_tokens=sum(group.prefill_tokens for group in groups),
        saving_ratio=prefill_saving_ratio(groups, total),
        optimum_saving_ratio=optimum_saving_ratio(tree),
    )
