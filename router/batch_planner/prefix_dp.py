"""Choose each request's one shared prefix: BatchLLM's prefix-enlarging dynamic program.

BatchLLM keeps a single level of sharing: every request belongs to exactly one
prefix-sharing group, the group's prefix is computed once, and each member then
computes only its own distinct tokens. Grouping by the first-level nodes of the
prefix tree alone wastes reuse when a short first-level prefix (say, a system
prompt) hides long deeper prefixes (documents) shared by subsets of its requests.
The paper's Algorithm 1 therefore enlarges first-level prefixes by merging deeper
shared nodes into them, forking the first-level node where that saves more.

What is optimised here (exactly)
--------------------------------
A plan is a set ``S`` of tree nodes ("group nodes"). Each request joins the group
of its deepest ancestor-or-self in ``S``; a request with no such node is alone
and shares nothing. A group at node ``u`` shares the root-to-``u`` path,
``depth(u)`` tokens, computed once for the group::

    saved(S) = sum over u in S with c(u) > 0 of (c(u) - 1) * depth(u)

where ``c(u)`` is the number of requests in ``u``'s group. The dynamic program
returns an ``S`` that maximises ``saved(S)`` over all subsets of nodes.

This is also the optimum over *every* partition of the batch into groups whose
prefix is the members' longest common prefix: two groups with the same prefix
node save more merged, and a request always gains by moving to its deepest chosen
ancestor. (A test checks this against exhaustive set partitions.) Sharing between
groups, i.e. multi-level reuse, is deliberately out of scope; its extra value is
the gap between :func:`groups.optimum_saving_ratio` and the plan's ratio.

Recurrence
----------
For node ``v`` and the token depth ``D`` of the nearest chosen proper ancestor
(``D = 0``: none), let ``g(v, D)`` be the best saving inside ``v``'s subtree,
counting ``D`` tokens for every request that flows up to that ancestor::

    keep(v, D)  = e(v) * D        + sum_c g(c, D)
    group(v)    = (e(v) - 1) * depth(v) + sum_c g(c, depth(v))
    g(v, D)     = max(keep(v, D), group(v))

with ``e(v)`` the requests ending at ``v``. Only ancestor depths are ever asked
for, so a node at level ``h`` stores ``h`` values: O(sum of node levels) time.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from .prefix_tree import PrefixNode, PrefixTree


@dataclass(frozen=True)
class PrefixChoice:
    """The DP's answer: group nodes (ids, pre-order) and the tokens they save."""

    group_nodes: tuple[int, ...]
    saved_tokens: int


def maximize_prefix_reuse(tree: PrefixTree) -> PrefixChoice:
    """Exact optimum of ``saved(S)``; ties prefer fewer group nodes (no empty forks)."""
    # contexts[id]: token depths of the node's proper ancestors that could be chosen,
    # the root (depth 0, "no group") first. Children share the parent's list plus one.
    contexts: dict[int, list[int]] = {}
    for node in tree.pre_order():
        if node.is_root:
            continue
        parent = node.parent
        assert parent is not None
        contexts[node.node_id] = (
            [0] if parent.is_root else contexts[parent.node_id] + [parent.depth]
        )

    best: dict[int, list[int]] = {}
    child_sums: dict[int, list[int]] = {}
    group_value: dict[int, int] = {}
    for node in tree.post_order():
        if node.is_root:
            continue
        context = contexts[node.node_id]
        level = len(context)
        sums = [0] * (level + 1)
        for child in node.children.values():
            for k, value in enumerate(best[child.node_id]):
                sums[k] += value
        ending = len(node.ending)
        as_group = (ending - 1) * node.depth + sums[level]
        best[node.node_id] = [
            max(ending * context[k] + sums[k], as_group) for k in range(level)
        ]
        child_sums[node.node_id] = sums
        group_value[node.node_id] = as_group

    chosen: list[int] = []
    stack: list[tuple[PrefixNode, int]] = [(child, 0) for child in tree.first_level()]
    while stack:
        node, k = stack.pop()
        keep = len(node.ending) * contexts[node.node_id][k] + child_sums[node.node_id][k]
        if group_value[node.node_id] > keep:
            chosen.append(node.node_id)
            k = len(contexts[node.node_id])
        stack.extend((child, k) for child in node.children.values())
    saved = sum(best[child.node_id][0] for child in tree.first_level())
    order = {node.node_id: i for i, node in enumerate(tree.pre_order())}
    return PrefixChoice(tuple(sorted(chosen, key=order.__getitem__)), saved)


def assign_requests(
    tree: PrefixTree, group_nodes: tuple[int, ...] | list[int]
) -> tuple[dict[int, list[int]], list[int]]:
    """Members of each group node (deepest chosen ancestor) and the ungrouped requests.

    Groups that end up with no member are omitted. Member lists are sorted.
    """
    chosen = set(group_nodes)
    members: dict[int, list[int]] = {}
    alone: list[int] = []
    stack: list[tuple[PrefixNode, int | None]] = [(tree.root, None)]
    while stack:
        node, owner = stack.pop()
        if node.node_id in chosen:
            owner = node.node_id
        if node.ending:
            if owner is None:
                alone.extend(node.ending)
            else:
                members.setdefault(owner, []).extend(node.ending)
        stack.extend((child, owner) for child in node.children.values())
    for ids in members.values():
        ids.sort()
    alone.sort()
    return members, alone


def saved_tokens_for(tree: PrefixTree, group_nodes: tuple[int, ...] | list[int]) -> int:
    """``saved(S)`` evaluated directly, for any set of group nodes."""
    members, _ = assign_requests(tree, group_nodes)
    return sum((len(ids) - 1) * tree.nodes[node_id].depth for node_id, ids in members.items())


def first_level_saved_tokens(tree: PrefixTree) -> int:
    """Saving without enlarging: one group per first-level node."""
    return saved_tokens_for(tree, [node.node_id for node in tree.first_level()])


def brute_force_prefix_reuse(tree: PrefixTree, max_nodes: int = 14) -> int:
    """Best ``saved(S)`` by trying every subset of nodes. For tests on small trees."""
    candidates = [node.node_id for node in tree.nodes if not node.is_root]
    if len(candidates) > max_nodes:
        raise ValueError(
            f"brute force over {len(candidates)} nodes would try 2**{len(candidates)} "
            f"subsets; use a tree with at most {max_nodes} non-root nodes"
        )
    best = 0
    for size in range(1, len(candidates) + 1):
        for subset in combinations(candidates, size):
            best = max(best, saved_tokens_for(tree, subset))
    return best
