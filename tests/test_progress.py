"""router/progress.py: which requests have stopped moving, each stall told once (plain Python)."""
from __future__ import annotations

from baton.router.progress import InFlight


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_request_that_stops_moving_is_told_once_per_stall():
    clock = Clock()
    inflight = InFlight(clock)
    inflight.begin("k1", "a", "waiting for a decode row")
    inflight.begin("k2", "b", "waiting for a decode row")
    clock.now += 10
    inflight.moved("k2", stage="decoding on decode worker d", tokens=3)
    clock.now += 25
    assert [p.label for p in inflight.stalled(30)] == ["a"]  # b moved 25 s ago
    told = inflight.newly_stalled(30)
    assert [p.label for p in told] == ["a"]
    assert "request a (k1) has not moved for 35 s: waiting for a decode row, 0 tokens sent" == inflight.describe(told[0])
    assert inflight.newly_stalled(30) == []  # told already
    clock.now += 10
    assert [p.label for p in inflight.newly_stalled(30)] == ["b"]
    inflight.moved("b-unknown", tokens=1)  # an id it does not hold: nothing happens
    inflight.moved("k1", tokens=1)  # a moves again: a later stall is told again
    clock.now += 31
    assert [p.label for p in inflight.newly_stalled(30)] == ["a"]
    inflight.end("k1")
    inflight.end("k2")
    assert len(inflight) == 0 and inflight.stalled(0) == []


def test_the_description_says_what_is_known_and_never_fails():
    clock = Clock()
    inflight = InFlight(clock)
    inflight.begin("k", "r", "routing")
    inflight.moved("k", stage="waiting for its first token from decode worker d",
                   detail=lambda: "its KV from prefill worker p (try 1: in flight)")
    clock.now += 40
    (stalled,) = inflight.stalled(30)
    assert inflight.describe(stalled).endswith("0 tokens sent; its KV from prefill worker p (try 1: in flight)")
    inflight.moved("k", stage="x", detail=lambda: 1 / 0)
    clock.now += 40
    assert "(ZeroDivisionError describing it)" in inflight.describe(inflight.stalled(30)[0])


def test_a_stage_whose_pulse_changes_is_moving_and_a_still_pulse_is_a_stall():
    """A long prompt's prefill: the prefill worker's forwarded tokens grow a chunk at a time, so
    the request waiting for its KV is not stalled; once they stop (the worker hangs), it is."""
    clock, forwarded = Clock(), [0]
    inflight = InFlight(clock)
    inflight.begin("k", "r", "routing")
    inflight.moved("k", stage="waiting for its first token from decode worker d", pulse=lambda: forwarded[0])
    for _ in range(5):  # 100 s, a chunk every 20 s
        clock.now += 20
        forwarded[0] += 256
        assert inflight.newly_stalled(30) == []
    clock.now += 31  # no chunk since
    (told,) = inflight.newly_stalled(30)
    assert "has not moved for 31 s" in inflight.describe(told)
    forwarded[0] += 256  # it goes on: a later stall is told again
    assert inflight.stalled(30) == []
    clock.now += 30
    assert len(inflight.newly_stalled(30)) == 1
    inflight.moved("k", stage="decoding on decode worker d", tokens=1)  # a stage without a pulse
    forwarded[0] += 256
    clock.now += 30
    assert len(inflight.stalled(30)) == 1


def test_a_pulse_that_fails_reads_as_no_change():
    clock = Clock()
    inflight = InFlight(clock)
    inflight.begin("k", "r", "routing")
    inflight.moved("k", stage="waiting", pulse=lambda: 1 / 0)
    clock.now += 31
    assert len(inflight.stalled(30)) == 1
