"""Large-batch planner (BatchLLM): global prefix sharing and memory-centric token batching.

Policy code: plain Python over ints and lists, no torch, grpc, redis or kubernetes.
"""

from .groups import (
    PrefixGroup,
    build_groups,
    form_groups,
    optimum_saving_ratio,
    order_groups,
    prefill_saving_ratio,
)
from .levels import GroupLevels, branch_points, group_levels
from .lru_baseline import LruResult, simulate_lru_prefix_cache
from .planner import BatchPlan, plan_batch
from .prefix_dp import (
    PrefixChoice,
    assign_requests,
    brute_force_prefix_reuse,
    first_level_saved_tokens,
    maximize_prefix_reuse,
    saved_tokens_for,
)
from .prefix_tree import PrefixNode, PrefixTree
from .synthetic import shared_document_batch, synthetic_batch
from .token_batching import Iteration, WorkItem, plan_token_batches, token_batch_sizes

__all__ = [
    "BatchPlan",
    "GroupLevels",
    "branch_points",
    "group_levels",
    "Iteration",
    "LruResult",
    "PrefixChoice",
    "PrefixGroup",
    "PrefixNode",
    "PrefixTree",
    "WorkItem",
    "assign_requests",
    "brute_force_prefix_reuse",
    "build_groups",
    "first_level_saved_tokens",
    "form_groups",
    "maximize_prefix_reuse",
    "optimum_saving_ratio",
    "order_groups",
    "plan_batch",
    "plan_token_batches",
    "prefill_saving_ratio",
    "saved_tokens_for",
    "simulate_lru_prefix_cache",
    "shared_document_batch",
    "synthetic_batch",
    "token_batch_sizes",
]
