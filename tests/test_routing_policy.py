"""The router's routing cost and its pending-prefix table: plain Python, milliseconds."""
from __future__ import annotations

import pytest

from baton.router.policy import NoWorkers, PendingPrefixes, Picker, RoutingWeights, WorkerView

MB = 1 << 20


def decode(address, active=0, capacity=8, used=0, budget=0, per_token=0, inflight=0, healthy=True):
    return WorkerView(address, healthy=healthy, inflight=inflight, active=active, capacity=capacity,
                      kv_used_bytes=used, kv_capacity_bytes=budget, kv_bytes_per_token=per_token)


def prefill(address, queued_tokens=0, cached=0, inflight=0, inflight_tokens=0):
    return WorkerView(address, inflight=inflight, inflight_tokens=inflight_tokens, queued_tokens=queued_tokens,
                      predicted_cached_tokens=cached)


def test_decode_goes_where_fewer_rows_are_taken():
    assert Picker().pick_decode([decode("a", active=6), decode("b", active=2)]).address == "b"


def test_decode_counts_requests_sent_since_the_last_load_report():
    assert Picker().pick_decode([decode("a", active=1, inflight=5), decode("b", active=3)]).address == "b"


def test_decode_weighs_free_kv_bytes_not_only_rows():
    """b has more free rows but long contexts hold much of its KV budget: a long prompt goes to a."""
    a = decode("a", active=4, used=100 * MB, budget=1024 * MB, per_token=MB // 8)
    b = decode("b", active=1, used=300 * MB, budget=1024 * MB, per_token=MB // 8)
    picker = Picker()
    assert picker.pick_decode([a, b], prompt_tokens=2000).address == "a"
    assert picker.pick_decode([a, b], prompt_tokens=0).address == "b"  # rows decide when the KV fits


def test_decode_without_a_reported_budget_falls_back_to_rows():
    assert Picker().pick_decode([decode("a", active=3), decode("b", active=1, used=5 * MB)],
                                prompt_tokens=4000).address == "b"


def test_prefill_credit_for_cached_tokens_beats_a_small_backlog():
    picker = Picker()
    workers = [prefill("a", queued_tokens=100), prefill("b", queued_tokens=200, cached=512)]
    assert picker.pick_prefill(workers, prompt_tokens=600).address == "b"


def test_prefill_backlog_outweighs_a_small_cache_hit():
    picker = Picker()
    workers = [prefill("a", queued_tokens=0), prefill("b", queued_tokens=5000, cached=64)]
    assert picker.pick_prefill(workers, prompt_tokens=600).address == "a"


def test_prefill_weights_change_the_balance():
    workers = [prefill("a", queued_tokens=0), prefill("b", queued_tokens=300, cached=256)]
    assert Picker().pick_prefill(workers, 400).address == "a"
    assert Picker(RoutingWeights(load=0.5, cached_tokens=1.0)).pick_prefill(workers, 400).address == "b"


def test_a_prompt_this_router_sent_counts_once_in_a_prefill_workers_backlog():
    """Worker a holds 1,200 of the prompt's 1,500 tokens; its last report counts 1,000 queued
    tokens, this router's own prompt there among them. Counted once, a has 1,000 + 300 tokens to
    compute against b's 700 + 1,500; counted twice (queue plus this router's prompts) it looked
    the busier, and the prompt lost its cached prefix."""
    workers = [prefill("a", queued_tokens=1000, cached=1200, inflight=1, inflight_tokens=1000),
               prefill("b", queued_tokens=700)]
    assert Picker().pick_prefill(workers, prompt_tokens=1500).address == "a"
    # before a poll reports it, what this router sent counts: a then has 2,500 + 300 to compute
    workers[0].queued_tokens, workers[0].inflight_tokens = 0, 2500
    assert Picker().pick_prefill(workers, prompt_tokens=1500).address == "b"


def test_ties_go_round_robin_and_unhealthy_workers_are_skipped():
    picker = Picker()
    workers = [decode("a"), decode("b"), decode("c", healthy=False)]
    assert {picker.pick_decode(workers).address for _ in range(4)} == {"a", "b"}
    with pytest.raises(NoWorkers, match="no healthy decode worker"):
        picker.pick_decode([decode("x", healthy=False)])


def test_each_role_keeps_its_own_rotation():
    """A request picks a decode and a prefill worker: with one shared turn counter, two idle
    prefill workers would get every request on the same one."""
    picker = Picker()
    chosen = []
    for _ in range(4):
        picker.pick_decode([decode("d")])
        chosen.append(picker.pick_prefill([prefill("a"), prefill("b")], 100).address)
    assert chosen == ["a", "b", "a", "b"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_pending_prefix_is_matched_like_a_cached_one_until_it_expires():
    clock = Clock()
    pending = PendingPrefixes(ttl_s=5, clock=clock)
    pending.add("w1", [1, 2, 3])
    pending.add("w2", [1, 2])
    assert pending.match([1, 2, 3, 4]) == {"w1": 3, "w2": 2}
    assert pending.match([9, 1]) == {}
    clock.now = 4
    pending.add("w2", [1, 2])  # seen again: lasts longer
    clock.now = 6
    assert pending.match([1, 2, 3]) == {"w2": 2}
    clock.now = 10
    assert pending.match([1, 2, 3]) == {} and len(pending) == 0


def test_pending_prefixes_are_bounded_oldest_first():
    pending = PendingPrefixes(ttl_s=60, max_entries=4, clock=Clock())
    pending.add("w1", [1, 2, 3])
    pending.add("w2", [7, 8])
    assert len(pending) == 4
    assert pending.match([1, 2, 3]) == {}  # its first block went first: nothing matches from the start
    assert pending.match([7, 8]) == {"w2": 2}


def test_a_worker_that_died_computes_nothing_it_was_sent():
    pending = PendingPrefixes(clock=Clock())
    pending.add("w1", [1, 2])
    pending.add("w2", [1])
    pending.forget("w1")
    assert pending.match([1, 2]) == {"w2": 1} and len(pending) == 1


def test_pending_prefixes_validate_their_bounds():
    with pytest.raises(ValueError):
        PendingPrefixes(ttl_s=0)
    with pytest.raises(ValueError):
        PendingPrefixes(max_entries=0)


def holding(view: WorkerView, tokens: int) -> WorkerView:
    view.predicted_cached_tokens = tokens
    return view


def test_a_decode_worker_holding_the_prompts_prefix_is_chosen_while_it_has_room():
    picker = Picker()
    a, b = decode("a"), holding(decode("b", active=5), 96)
    assert picker.pick_holder([a, b], 120).address == "b"  # busier, but it holds the conversation so far
    assert picker.pick_holder([a, holding(decode("c"), 32), b], 120).address == "b"  # the most held wins
    assert picker.pick_holder([a, decode("d")], 120) is None  # nobody holds any of it


def test_a_holder_without_a_free_row_or_kv_for_the_rest_is_passed_over():
    picker = Picker()
    assert picker.pick_holder([holding(decode("full", active=8), 96)], 120) is None
    # its KV budget holds what it has, not the prompt's rest on top
    tight = holding(decode("tight", active=1, used=90 * MB, budget=100 * MB, per_token=MB), 96)
    assert picker.pick_holder([tight], 96 + 24) is None
    assert picker.pick_holder([holding(decode("roomy", active=1, used=10 * MB, budget=100 * MB, per_token=MB), 96)],
                              96 + 24).address == "roomy"
    assert picker.pick_holder([holding(decode("sick", healthy=False), 96)], 120) is None


def test_a_short_rest_is_prefilled_where_the_rest_of_the_prompt_is_unless_that_costs_more():
    here = Picker.prefill_here
    idle, busy = holding(decode("d"), 400), holding(decode("d", active=6), 400)
    fresh = prefill("p", cached=32)  # the prefill worker has the first turn's prompt, not the answers
    assert here(idle, fresh, 420, 512)[0]  # 20 there, against 388 on the prefill worker
    assert here(busy, fresh, 420, 512)[0]  # 20 for it and for each of 6 rows decoding there: 140, still less
    assert not here(holding(decode("d", active=30, capacity=64), 400), fresh, 420, 512)[0]  # 620: more
    ok, why = here(idle, fresh, 420 + 600, 512)
    assert not ok and "router.local_prefill_max_tokens" in why  # too long a rest, whatever the costs
    warm = prefill("p", cached=400)  # a prefill worker holding as much (it prefilled the same prompt)
    ok, why = here(busy, warm, 500, 512)
    assert not ok and "costs more" in why  # 7 x 100 there against 100 on it
    assert here(idle, warm, 500, 512)[0]  # nothing decoding there: as cheap, and no transfer
    assert here(busy, prefill("p", cached=400, queued_tokens=700), 500, 512)[0]  # its queue counts
    assert here(busy, None, 500, 512)[0]  # no prefill worker: there it is


def test_a_prefill_worker_that_reads_the_held_kv_costs_only_the_rest():
    """A prefill worker reading the decode worker's KV (prefill.pull_kv) computes only the rest, so
    a busy holder gives the turn to it; an idle one keeps it (as cheap, and nothing travels)."""
    here = Picker.prefill_here
    busy, idle = holding(decode("d", active=6), 400), holding(decode("d"), 400)
    reading = prefill("p", cached=32)
    reading.pulls_kv = True
    assert here(busy, prefill("p", cached=32), 420, 512)[0]  # 140 there, against 388 computing the answers
    ok, why = here(busy, reading, 420, 512)
    assert not ok and "reads the held KV" in why  # 140 there, against 20 on a worker that reads them
    assert here(idle, reading, 420, 512)[0]  # 20 against 20
    reading.queued_tokens = 200
    assert here(busy, reading, 420, 512)[0]  # its queue counts: 140 against 220
