"""The prefill worker's numbered stream of prefix-cache changes (plain Python, no gRPC)."""
from __future__ import annotations

import itertools
import queue
import threading

import pytest

from baton.prefill_worker.cache_events import CacheEvent, CacheEventLog


def _take(log: CacheEventLog, n: int, epoch: str = "", after: int = 0) -> list[CacheEvent]:
    return list(itertools.islice(log.follow(epoch, after, poll_s=0.01), n))


def test_a_new_follower_starts_from_a_snapshot_then_gets_each_change_in_order():
    log = CacheEventLog(epoch="e1")
    log.publish(stored=[1, 2, 3])
    log.publish(stored=[4], evicted=[3])
    snapshot, = _take(log, 1)
    assert snapshot == CacheEvent("e1", 2, stored=(1, 2, 4), snapshot=True)
    log.publish(evicted=[4])
    log.publish(stored=[5])
    assert _take(log, 2, "e1", 2) == [CacheEvent("e1", 3, evicted=(4,)), CacheEvent("e1", 4, stored=(5,))]


def test_a_follower_resumes_where_it_left_off_within_the_history():
    log = CacheEventLog(epoch="e1")
    for h in range(10):
        log.publish(stored=[h])
    assert [e.seq for e in _take(log, 3, "e1", 7)] == [8, 9, 10]


@pytest.mark.parametrize("epoch, after", [("another-process", 3), ("e1", 99), ("e1", 1)])
def test_a_follower_that_cannot_resume_gets_a_snapshot(epoch, after):
    """Another epoch (the worker restarted), a number never reached, or one fallen out of the
    bounded history: the first event is a snapshot of everything held."""
    log = CacheEventLog(epoch="e1", max_history=4)
    for h in range(10):
        log.publish(stored=[h])
    log.publish(evicted=[0])
    first, = _take(log, 1, epoch, after)
    assert first.snapshot and first.seq == 11 and first.stored == tuple(range(1, 10))


def test_an_empty_change_is_not_numbered():
    log = CacheEventLog()
    assert log.publish() is None and log.seq == 0
    assert log.publish(stored=[1]) == 1


def test_a_waiting_follower_wakes_on_a_change_and_ends_on_close():
    log = CacheEventLog(epoch="e1")
    got: queue.Queue[CacheEvent] = queue.Queue()
    follower = threading.Thread(target=lambda: [got.put(e) for e in log.follow("e1", 0, poll_s=5)])
    follower.start()
    log.publish(stored=[7])
    assert got.get(timeout=2) == CacheEvent("e1", 1, stored=(7,))  # long before poll_s
    log.close()
    follower.join(timeout=2)
    assert not follower.is_alive()


def test_should_stop_ends_an_idle_follower():
    log = CacheEventLog()
    events = list(log.follow(should_stop=lambda: True, poll_s=0.01))
    assert [e.snapshot for e in events] == [True]


def test_an_idle_follower_of_an_empty_log_waits_without_error():
    log = CacheEventLog()
    polls = iter(range(3))
    events = list(log.follow(should_stop=lambda: next(polls) == 2, poll_s=0.01))
    assert [(e.seq, e.snapshot) for e in events] == [(0, True)]
