"""Large-batch planner (BatchLLM): prefix tree, prefix DP, groups, token batching, LRU baseline."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.router.batch_planner import (
    PrefixGroup,
    PrefixTree,
    brute_force_prefix_reuse,
    build_groups,
    first_level_saved_tokens,
    form_groups,
    maximize_prefix_reuse,
    optimum_saving_ratio,
    order_groups,
    plan_batch,
    plan_token_batches,
    prefill_saving_ratio,
    saved_tokens_for,
    simulate_lru_prefix_cache,
    synthetic_batch,
)


def span(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def random_prompts(rng: random.Random, count: int, max_len: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


# --------------------------------------------------------------------------- prefix tree
def test_tree_compacts_shared_spans_and_keeps_requests_ending_inside():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2], [9], [1, 2, 3, 4]]
    tree = PrefixTree(prompts)
    (one, nine) = tree.first_level()
    assert tree.tokens(one) == [1, 2] and one.num_requests == 4
    assert one.ending == [2]  # prompt [1, 2] ends where the shared span ends
    (three,) = one.children.values()
    assert tree.tokens(three) == [3] and three.num_requests == 3
    assert sorted(tree.tokens(c) for c in three.children.values()) == [[4], [5]]
    assert tree.end_node(0) is tree.end_node(4)  # duplicates end at one node
    assert tree.requests_under(three) == [0, 1, 4]
    assert tree.tokens(nine) == [9] and tree.requests_under(nine) == [3]
    assert tree.unique_tokens() == 2 + 1 + 1 + 1 + 1
    assert tree.total_prompt_tokens() == 4 + 4 + 2 + 1 + 4


def test_tree_reproduces_every_prompt_on_random_batches():
    rng = random.Random(7)
    for _ in range(50):
        prompts = random_prompts(rng, rng.randint(1, 20), 12, 3)
        tree = PrefixTree(prompts)
        for request_id, prompt in enumerate(prompts):
            assert tree.path_tokens(tree.end_node(request_id)) == prompt
        for node in tree.nodes[1:]:
            assert node.parent is not None and node.start == node.parent.depth
            assert node.span_len > 0
            assert node.num_requests == len(tree.requests_under(node))
        assert tree.root.num_requests == len(prompts)


def test_tree_rejects_empty_prompt_with_its_index():
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        PrefixTree([[1], []])


# --------------------------------------------------------------------------- prefix DP
def figure4_like_batch() -> list[list[int]]:
    """Closest example to BatchLLM's Figure 4 we can justify from the paper's text.

    The stored copy of the paper did not include the figure itself, so this is a
    reconstruction of the situation the text describes: a short first-level prefix
    A (10 tokens, an instruction) hides two long documents B and C (40 tokens
    each) shared by subsets of its requests; enlarging A into AB and AC forks the
    first-level node and saves more than sharing A alone. A second first-level
    prefix E (30 tokens) has a 2-token child F shared by two of its four requests,
    where enlarging would lose: E stays the group's prefix.
    """
    a, b, c, e, f = span(100, 10), span(200, 40), span(300, 40), span(400, 30), span(500, 2)
    distinct = [span(1000 + 10 * i, 5) for i in range(9)]
    return [
        a + b + distinct[0], a + b + distinct[1], a + b + distinct[2],
        a + c + distinct[3], a + c + distinct[4],
        e + f + distinct[5], e + f + distinct[6],
        e + distinct[7], e + distinct[8],
    ]  # fmt: skip


def test_dp_on_figure4_like_example_enlarges_only_where_it_pays():
    prompts = figure4_like_batch()
    tree = PrefixTree(prompts)
    choice = maximize_prefix_reuse(tree)
    # AB shared by 3: 2*50; AC shared by 2: 1*50; E shared by 4: 3*30.
    assert choice.saved_tokens == 100 + 50 + 90 == 240
    assert first_level_saved_tokens(tree) == 4 * 10 + 3 * 30  # without enlarging: 130
    groups = {g.request_ids: g.prefix_len for g in form_groups(tree, choice.group_nodes)}
    assert groups == {(0, 1, 2): 50, (3, 4): 50, (5, 6, 7, 8): 30}
    total = tree.total_prompt_tokens()
    assert total == 3 * 55 + 2 * 55 + 2 * 37 + 2 * 35
    assert prefill_saving_ratio(build_groups(tree), total) == pytest.approx(240 / total)
    # Multi-level optimum also reuses A across AB and AC (10 more tokens) and F (2 more).
    assert optimum_saving_ratio(tree) == pytest.approx(252 / total)


def best_partition_saving(prompts: list[list[int]]) -> int:
    """Best grouping over every set partition, each group sharing its longest common prefix."""

    def common_prefix_len(members: list[int]) -> int:
        length = min(len(prompts[m]) for m in members)
        for position in range(length):
            if len({prompts[m][position] for m in members}) > 1:
                return position
        return length

    def partitions(items: list[int]):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for partial in partitions(rest):
            yield [[first]] + partial
            for i in range(len(partial)):
                yield partial[:i] + [[first] + partial[i]] + partial[i + 1 :]

    return max(
        sum((len(block) - 1) * common_prefix_len(block) for block in partition)
        for partition in partitions(list(range(len(prompts))))
    )


def test_dp_matches_brute_force_on_many_small_random_trees():
    rng = random.Random(2024)
    checked = 0
    while checked < 150:
        prompts = random_prompts(rng, rng.randint(2, 6), 6, 2)
        tree = PrefixTree(prompts)
        if len(tree.nodes) - 1 > 10:
            continue
        choice = maximize_prefix_reuse(tree)
        assert choice.saved_tokens == saved_tokens_for(tree, choice.group_nodes)
        assert choice.saved_tokens == brute_force_prefix_reuse(tree)
        assert choice.saved_tokens == best_partition_saving(prompts)
        checked += 1


def test_dp_stays_between_first_level_grouping_and_the_multi_level_optimum():
    rng = random.Random(11)
    for _ in range(40):
        prompts = random_prompts(rng, rng.randint(1, 40), 10, 3)
        tree = PrefixTree(prompts)
        saved = maximize_prefix_reuse(tree).saved_tokens
        multi_level = tree.total_prompt_tokens() - tree.unique_tokens()
        assert first_level_saved_tokens(tree) <= saved <= multi_level
        groups = build_groups(tree)
        assert sorted(r for g in groups for r in g.request_ids) == list(range(len(prompts)))
        assert sum(g.saved_tokens for g in groups) == saved


def test_brute_force_refuses_trees_too_large_to_enumerate():
    tree = PrefixTree([[i] for i in range(20)])
    with pytest.raises(ValueError, match="at most 14"):
        brute_force_prefix_reuse(tree)


# --------------------------------------------------------------------------- groups
def test_groups_are_dispatched_by_r_largest_first_with_deterministic_ties():
    groups = [
        PrefixGroup(100, (4, 9), (10, 10)),  # 120 tokens
        PrefixGroup(0, (7,), (30,)),  # 30 tokens
        PrefixGroup(20, (2, 3), (5, 5)),  # 30 tokens, earlier request than 7
        PrefixGroup(0, (0,), (400,)),  # 400 tokens
    ]
    ordered = order_groups(groups)
    assert [g.request_ids for g in ordered] == [(2, 3), (7,), (4, 9), (0,)]
    priorities = [g.priority for g in ordered]
    assert priorities == sorted(priorities, reverse=True)
    assert ordered[0].priority == pytest.approx(1 / 30)
    assert order_groups(reversed(groups)) == ordered


def test_group_exposes_its_prefix_and_distinct_tokens():
    prompts = figure4_like_batch()
    group = next(g for g in build_groups(PrefixTree(prompts)) if g.request_ids == (3, 4))
    assert group.prefix_tokens(prompts) == span(100, 10) + span(300, 40)
    assert group.distinct_tokens(prompts, 4) == span(1040, 5)
    with pytest.raises(KeyError):
        group.distinct_tokens(prompts, 0)


# --------------------------------------------------------------------------- token batching
def check_token_plan(groups, iterations, prompts, kv_budget, max_tokens):
    """Independent checks of a token-batching plan against its invariants."""
    covered: dict[tuple[int, int | None], list[tuple[int, int, int]]] = defaultdict(list)
    for t, iteration in enumerate(iterations):
        assert 0 < iteration.num_tokens <= max_tokens or all(i.tokens == 0 for i in iteration.items)
        assert iteration.kv_tokens_reserved <= kv_budget
        for item in iteration.items:
            covered[(item.group_index, item.request_id)].append((t, item.start, item.end))

    member_chunks = {key: chunks for key, chunks in covered.items() if key[1] is not None}
    prefix_done: dict[int, int] = {}
    first_prefix_iteration: dict[int, int] = {}
    group_end: dict[int, int] = {}
    for index, group in enumerate(groups):
        if group.prefix_len:
            chunks = covered.pop((index, None))
            assert [c[1:] for c in chunks] == contiguous(0, [c[2] for c in chunks])
            assert chunks[-1][2] == group.prefix_len
            first_prefix_iteration[index], prefix_done[index] = chunks[0][0], chunks[-1][0]
        for request_id in group.request_ids:
            chunks = covered.pop((index, request_id))
            # Every distinct token exactly once, in order, after the prefix is complete.
            assert [c[1:] for c in chunks] == contiguous(group.prefix_len, [c[2] for c in chunks])
            assert chunks[-1][2] == len(prompts[request_id])
            assert len({c[0] for c in chunks}) == len(chunks)
            if group.prefix_len:
                assert chunks[0][0] > prefix_done[index]
            group_end[index] = max(group_end.get(index, 0), chunks[-1][0])
    assert not covered, f"work for unknown requests: {sorted(covered)}"
    starts = [first_prefix_iteration[i] for i in sorted(first_prefix_iteration)]
    assert starts == sorted(starts), "groups must start in dispatch order"

    # KV resident per iteration: a prefix from its first chunk until its group's last
    # member finishes; a member's computed tokens until the iteration that finishes it.
    for t in range(len(iterations)):
        resident = sum(
            groups[i].prefix_len
            for i in first_prefix_iteration
            if first_prefix_iteration[i] <= t <= group_end[i]
        )
        for chunks in member_chunks.values():
            if chunks[0][0] <= t <= chunks[-1][0]:
                resident += sum(end - start for when, start, end in chunks if when <= t)
        assert resident <= kv_budget, f"iteration {t} holds {resident} KV tokens"


def contiguous(start: int, ends: list[int]) -> list[tuple[int, int]]:
    bounds = [start] + ends
    return list(zip(bounds[:-1], bounds[1:]))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    count=st.integers(1, 25),
    extra_kv=st.integers(0, 60),
    max_tokens=st.integers(1, 48),
)
def test_token_batching_respects_budgets_and_schedules_every_token_once(
    seed, count, extra_kv, max_tokens
):
    rng = random.Random(seed)
    stems = [[rng.randrange(50) for _ in range(rng.randint(1, 15))] for _ in range(3)]
    prompts = [
        rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(0, 8))]
        for _ in range(count)
    ]
    groups = build_groups(PrefixTree(prompts))
    kv_budget = max(g.prefix_len + g.max_distinct_len for g in groups) + extra_kv
    iterations = plan_token_batches(
        groups, kv_token_budget=kv_budget, max_tokens_per_iteration=max_tokens
    )
    check_token_plan(groups, iterations, prompts, kv_budget, max_tokens)


def test_token_batching_fills_iterations_when_memory_allows():
    prompts = synthetic_batch(12, 7, 256, 64, seed=3)
    plan = plan_batch(prompts, kv_token_budget=1 << 20, max_tokens_per_iteration=512)
    assert sum(plan.token_batch_sizes) == plan.computed_tokens
    # Bounded by tokens, not requests: all but the tail iterations are full.
    fewest = -(-plan.computed_tokens // 512)
    assert fewest <= len(plan.iterations) <= fewest + 2
    tight = plan_batch(prompts, kv_token_budget=700, max_tokens_per_iteration=512)
    check_token_plan(list(tight.groups), tight.iterations, prompts, 700, 512)
    assert len(tight.iterations) > len(plan.iterations)


def test_token_batching_names_the_budget_a_group_needs():
    groups = [PrefixGroup(100, (0, 1), (30, 50))]
    with pytest.raises(ValueError, match="at least 150"):
        plan_token_batches(groups, kv_token_budget=149, max_tokens_per_iteration=64)
    with pytest.raises(ValueError, match="must both be positive"):
        plan_token_batches(groups, kv_token_budget=150, max_tokens_per_iteration=0)


def test_member_with_no_distinct_tokens_finishes_after_its_prefix():
    prompts = [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5]]
    plan = plan_batch(prompts, kv_token_budget=8, max_tokens_per_iteration=2)
    (group,) = plan.groups
    assert group.prefix_len == 3 and group.distinct_lens == (0, 1, 1)
    check_token_plan(list(plan.groups), plan.iterations, prompts, 8, 2)
    assert [it.num_tokens for it in plan.iterations] == [2, 1, 2]


# --------------------------------------------------------------------------- LRU baseline
def test_lru_baseline_counts_block_hits_in_arrival_order():
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 8, 9], [1, 2, 3, 4, 7]]
    result = simulate_lru_prefix_cache(prompts, block_size=2, capacity_blocks=2)
    # p1 hits both blocks of p0; p2 evicts (3, 4), the tail, keeping (1, 2) for p3.
    assert (result.saved_tokens, result.hit_blocks, result.evicted_blocks) == (6, 3, 2)
    assert result.saving_ratio == pytest.approx(6 / 18)
    whole = simulate_lru_prefix_cache([[1, 2, 3, 4], [1, 2, 3, 4]], block_size=2, capacity_blocks=4)
    assert whole.saved_tokens == 3  # the last token is recomputed for its logits
    none = simulate_lru_prefix_cache(prompts, block_size=2, capacity_blocks=0)
    assert none.saved_tokens == 0


# --------------------------------------------------------------------------- synthetic + façade
def test_synthetic_batch_is_shaped_like_the_industry_case():
    prompts = synthetic_batch(40, 7, 400, 100, seed=5, vocab=5000)
    assert prompts == synthetic_batch(40, 7, 400, 100, seed=5, vocab=5000)
    assert 240 <= len(prompts) <= 320 and all(0 <= t < 5000 for p in prompts for t in p)
    groups = build_groups(PrefixTree(prompts))
    shared = [g for g in groups if g.prefix_len]
    assert len(shared) == 40
    assert 6 <= sum(g.size for g in shared) / len(shared) <= 8
    mean_distinct = sum(sum(g.distinct_lens) for g in shared) / sum(g.size for g in shared)
    assert sum(g.prefix_len for g in shared) / len(shared) > 3 * mean_distinct
    # Arrival order interleaves groups: neighbours rarely share a group.
    group_of = {r: i for i, g in enumerate(groups) for r in g.request_ids}
    same = sum(group_of[r] == group_of[r + 1] for r in range(len(prompts) - 1))
    assert same < len(prompts) * 0.25


def test_plan_on_300_prompts_nears_the_optimum_and_beats_lru_of_equal_size():
    prompts = synthetic_batch(43, 7, 512, 128, seed=0)
    assert 280 <= len(prompts) <= 320
    kv_budget, block_size = 4096, 16
    plan = plan_batch(prompts, kv_token_budget=kv_budget, max_tokens_per_iteration=1024)
    lru = simulate_lru_prefix_cache(
        prompts, block_size=block_size, capacity_blocks=kv_budget // block_size
    )
    tree = PrefixTree(prompts)
    first_level_only = first_level_saved_tokens(tree) / tree.total_prompt_tokens()
    assert plan.saving_ratio >= 0.99 * plan.optimum_saving_ratio
    assert lru.saving_ratio < plan.saving_ratio
    assert first_level_only < 0.1 < plan.saving_ratio  # the DP's enlarging is what saves
    assert plan.computed_tokens == plan.total_prompt_tokens - round(
        plan.saving_ratio * plan.total_prompt_tokens
    )
    assert plan.peak_kv_tokens <= kv_budget


def test_plan_batch_validates_input_and_handles_an_empty_batch():
    empty = plan_batch([], kv_token_budget=16, max_tokens_per_iteration=16)
    assert (empty.groups, empty.iterations, empty.saving_ratio) == ((), (), 0.0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        plan_batch([[]], kv_token_budget=16, max_tokens_per_iteration=16)
    with pytest.raises(ValueError, match="prompt 1 must be a list of non-negative int"):
        plan_batch([[1], [2, -1]], kv_token_budget=16, max_tokens_per_iteration=16)


def test_planner_imports_no_heavy_runtime():
    code = (
        "import sys, router.batch_planner; "
        "print(sorted(m for m in ('torch', 'grpc', 'redis', 'kubernetes') if m in sys.modules))"
    )
    repo_root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root
    )
    assert out.stdout.strip() == "[]"


def test_levels_above_and_below_groups_are_the_branch_points():
    from baton.router.batch_planner import branch_points, group_levels

    template, doc_a, doc_b = [1, 2, 3, 4, 5, 6], [10] * 20, [11] * 20
    prompts = [template + doc_a + [1, 7], template + doc_a + [2, 8],
               template + doc_b + [3], template + doc_b + [4] * 5 + [9], template + doc_b + [4] * 5 + [8],
               template + [99, 98]]  # a prompt of its own, under the template only
    assert branch_points([p[:-1] for p in prompts[2:5]]) == [tuple(template + doc_b), tuple(template + doc_b + [4] * 5)]
    assert branch_points([[1, 2, 3], [1, 2, 4]]) == []  # shorter than MIN_LEVEL_TOKENS
    levels = group_levels(prompts, [([0, 1], 26), ([2, 3, 4], 26), ([5], 0)])
    assert [a for g in levels for a in g.ancestors] == [tuple(template)] * 3
    assert levels[0].sub_prefixes == () and levels[1].sub_prefixes == (tuple(template + doc_b + [4] * 5),)
    assert levels[2].sub_prefixes == ()
