"""The prefill worker's prefix-cache changes as a numbered stream for routers to follow.

Each published change (blocks stored, blocks evicted) gets the next sequence number of this
process's epoch, and is sent to every follower at once, whatever becomes of the request that
caused it. The log mirrors the set of blocks held, so a follower that is new, from another epoch
or too far behind the bounded history starts from a snapshot (every block held at sequence n)
and goes on with the changes after n: no change is ever lost or applied twice.

Plain Python; thread-safe (the compute thread publishes, RPC threads follow).
"""
from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

DEFAULT_HISTORY = 4096  # changes kept for followers that reconnect; one that missed more gets a snapshot


@dataclass(frozen=True)
class CacheEvent:
    epoch: str
    seq: int
    stored: tuple[int, ...] = ()  # parents before children
    evicted: tuple[int, ...] = ()
    snapshot: bool = False  # stored is every block held at seq; forget what came before


class CacheEventLog:
    def __init__(self, epoch: str | None = None, max_history: int = DEFAULT_HISTORY):
        if max_history < 1:
            raise ValueError(f"max_history must be >= 1, got {max_history}")
        self.epoch = epoch or uuid.uuid4().hex
        self._cond = threading.Condition()
        self._held: dict[int, None] = {}  # insertion order keeps parents before children
        self._history: deque[CacheEvent] = deque(maxlen=max_history)
        self._seq = 0
        self._closed = False

    @property
    def seq(self) -> int:
        with self._cond:
            return self._seq

    def publish(self, stored: Sequence[int] = (), evicted: Sequence[int] = ()) -> int | None:
        """Number and send one change; returns its sequence number (None for no change)."""
        if not stored and not evicted:
            return None
        with self._cond:
            self._seq += 1
            for h in stored:
                self._held[h] = None
            for h in evicted:
                self._held.pop(h, None)
            self._history.append(CacheEvent(self.epoch, self._seq, tuple(stored), tuple(evicted)))
            self._cond.notify_all()
            return self._seq

    def snapshot(self) -> CacheEvent:
        with self._cond:
            return CacheEvent(self.epoch, self._seq, tuple(self._held), snapshot=True)

    def close(self) -> None:
        """End every follow() (the worker stops)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def follow(self, epoch: str = "", after: int = 0, should_stop: Callable[[], bool] = lambda: False,
               poll_s: float = 0.5) -> Iterator[CacheEvent]:
        """The changes after `after` of `epoch`, as they come, preceded by a snapshot when they
        cannot be resumed from there. Ends on close() or once `should_stop()` (asked every
        `poll_s` while idle)."""
        if epoch != self.epoch:
            after = None
        while True:
            with self._cond:
                if after is not None and not self._covers(after):
                    after = None
                if after is None:
                    event = CacheEvent(self.epoch, self._seq, tuple(self._held), snapshot=True)
                    changes = [event]
                else:
                    self._cond.wait_for(lambda: self._seq > after or self._closed, poll_s)
                    if self._closed:
                        return
                    if not self._covers(after):
                        continue  # fell out of the history while waiting: snapshot
                    changes = []
                    if self._seq > after:
                        oldest = self._history[0].seq
                        changes = list(itertools.islice(self._history, after - oldest + 1, None))
            for event in changes:
                yield event
                after = event.seq
            if self._closed or should_stop():
                return

    def _covers(self, after: int) -> bool:
        """Whether the changes after `after` are all still in the history."""
        oldest = self._history[0].seq if self._history else self._seq + 1
        return oldest - 1 <= after <= self._seq
