"""Which prompts prefill together, and in what order: plain Python, milliseconds."""
from __future__ import annotations

import pytest

from baton.prefill_worker.batching import BACKGROUND_BATCH_TOKENS, PrefillQueue, pick_batch
from baton.router.batch import BATCH_PRIORITY_OFFSET, batch_priority
from baton.v1 import common_pb2


def test_the_oldest_prompt_leads_and_similar_lengths_join_it():
    assert pick_batch([10, 100, 12, 14, 9], max_batch_tokens=1000, max_batch_size=8) == [0, 2, 3, 4]
    assert pick_batch([10, 12, 14], max_batch_tokens=28, max_batch_size=8) == [0, 1]  # the closest; 3 x 14 > 28
    assert pick_batch([], 100, 8) == []


def test_a_higher_priority_prompt_goes_first_and_takes_only_its_own_priority_along():
    lengths = [10, 10, 11, 10]
    priorities = [-BATCH_PRIORITY_OFFSET, 0, -BATCH_PRIORITY_OFFSET, 0]  # batch, interactive, batch, interactive
    assert pick_batch(lengths, 1000, 8, priorities) == [1, 3]
    assert pick_batch(lengths, 1000, 8, [0] * 4) == [0, 1, 2, 3]


def test_batch_members_prefill_in_short_forwards_so_an_interactive_prompt_waits_little():
    lengths = [50] * 8
    assert len(pick_batch(lengths, 4096, 8, [0] * 8)) == 8
    background = pick_batch(lengths, 4096, 8, [-BATCH_PRIORITY_OFFSET] * 8)
    assert len(background) * 50 <= BACKGROUND_BATCH_TOKENS and background == [0]
    assert pick_batch([1000], 4096, 8, [-1]) == [0]  # a long member still goes, alone


class Job:
    def __init__(self, request_id: str):
        self.request = type("Request", (), {"request_id": request_id})()


def test_the_queue_serves_interactive_prompts_before_batch_members_that_came_first():
    queue = PrefillQueue(max_queue=8, max_batch_tokens=1000, max_batch_size=8)
    for i in range(3):
        queue.put(Job(f"batch-{i}"), 10, priority=-BATCH_PRIORITY_OFFSET)
    queue.put(Job("chat"), 400, priority=0)
    assert [j.request.request_id for j in queue.take_batch(0.01)] == ["chat"]
    assert [j.request.request_id for j in queue.take_batch(0.01)] == ["batch-0", "batch-1", "batch-2"]


def test_only_urgent_prompts_are_taken_inside_a_paused_forward():
    queue = PrefillQueue(max_queue=8, max_batch_tokens=1000, max_batch_size=8)
    queue.put(Job("batch-0"), 10, priority=-BATCH_PRIORITY_OFFSET)
    assert queue.take_batch(5.0, min_priority=0) == []  # nothing urgent: at once, nothing taken
    queue.put(Job("chat"), 40, priority=0)
    assert [j.request.request_id for j in queue.take_batch(5.0, min_priority=0)] == ["chat"]
    assert [j.request.request_id for j in queue.take_batch(0.01)] == ["batch-0"]


def test_batch_members_run_below_interactive_requests_and_keep_their_order():
    asked = [common_pb2.SamplingParams(max_tokens=3, priority=p) for p in (0, 5, -(1 << 31))]
    lowered = [batch_priority(s) for s in asked]
    assert [s.priority for s in lowered] == [-BATCH_PRIORITY_OFFSET, 5 - BATCH_PRIORITY_OFFSET, -(1 << 31)]
    assert all(s.max_tokens == 3 for s in lowered) and asked[1].priority == 5  # a copy


def test_chunk_tokens_is_a_setting_that_refuses_a_negative_budget():
    from baton.config import load_settings

    assert load_settings(env={}).prefill.chunk_tokens == 256  # on by default
    assert load_settings(env={"BATON_PREFILL_CHUNK_TOKENS": "0"}).prefill.chunk_tokens == 0  # off
    with pytest.raises(ValueError, match="prefill.chunk_tokens must be >= 0"):
        load_settings(env={"BATON_PREFILL_CHUNK_TOKENS": "-1"})


def test_prompts_sharing_a_new_prefix_block_never_prefill_together():
    """Together each would compute the shared block; one batch later the second finds it cached."""
    keys = {0: "blockA", 1: "blockA", 2: None, 3: "blockB", 4: None}
    assert pick_batch([40, 40, 40, 40, 40], 4096, 8, key=keys.get) == [0, 2, 3, 4]
    assert pick_batch([40, 40], 4096, 8, key={0: None, 1: None}.get) == [0, 1]  # nothing new: no conflict


def test_the_queue_defers_a_prompt_whose_new_prefix_is_being_computed():
    queue = PrefillQueue(max_queue=8, max_batch_tokens=4096, max_batch_size=8)
    jobs = [Job(f"r{i}") for i in range(3)]
    for job in jobs:
        queue.put(job, 40)
    new_block = {"r0": 7, "r1": 7, "r2": 9}
    key = lambda job: new_block[job.request.request_id]  # noqa: E731
    assert queue.take_batch(0, key=key) == [jobs[0], jobs[2]]
    assert queue.take_batch(0, key=key) == [jobs[1]]


def test_a_prompt_waits_while_its_new_prefix_is_computed_in_chunks():
    keys = {0: "doc", 1: None, 2: "doc"}
    assert pick_batch([40, 40, 40], 4096, 8, key=keys.get, busy={"doc"}) == [1]
    assert pick_batch([40, 40], 4096, 8, key={0: "doc", 1: "doc"}.get, busy={"doc"}) == []


def test_the_kv_memory_left_bounds_a_batch_and_may_hold_it_back():
    queue = PrefillQueue(max_queue=8, max_batch_tokens=4096, max_batch_size=8)
    for i, length in enumerate([100, 100, 100, 300]):
        queue.put(Job(f"job{i}"), length, 0)

    def ids(jobs):
        return [j.request.request_id for j in jobs]

    assert ids(queue.take_batch(0, max_tokens=250)) == ["job0", "job1"]  # 3 x 100 would not fit 250
    assert queue.take_batch(0, max_tokens=50, at_least_one=False) == []  # not even one: wait for pushes
    assert ids(queue.take_batch(0, max_tokens=50)) == ["job2"]  # nothing held: a lone prompt always goes
    assert ids(queue.take_batch(0, max_tokens=None)) == ["job3"]
