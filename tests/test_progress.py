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
