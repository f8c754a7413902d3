"""How many requests the router lets into the cluster at once: plain Python, no grpc.

Without a bound, every request is prefilled the moment it arrives; past what the decode workers'
rows take, requests get their first token from the prefill worker and then stall, waiting for
a row (time per output token in seconds, every stream a bad one). With it, a request waits here,
before its prefill, while the decode workers already hold their rows' worth of requests plus
`queue_per_worker` each (requests whose prefill is under way, so a freed row is taken at once):
it queues before its first token, as vLLM's scheduler queues before prefill, and once it starts,
it streams. Which rule serves more requests within both a TTFT and an ITL objective is measured
by `baton bench goodput` (docs/bench.md).

Waiters enter by priority, then arrival. A decode worker's rows come from its load reports; no
healthy decode worker, or none reporting yet, lets requests through (routing then says why).
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Callable, Iterable, Protocol


class DecodeView(Protocol):
    healthy: bool
    capacity: int  # the decode worker's rows


class AdmissionTimeout(Exception):
    """The request's deadline passed while it waited for a decode row."""


class AdmissionCancelled(Exception):
    """The request was cancelled while it waited."""


class DecodeAdmission:
    def __init__(self, queue_per_worker: int, poll_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        if queue_per_worker < -1:
            raise ValueError(f"queue_per_worker must be >= 0, or -1 for no bound (got {queue_per_worker})")
        self.queue_per_worker = queue_per_worker  # -1: requests are never held
        self.poll_s = poll_s  # how often a waiter looks again (rows reported by a poll, not an event)
        self.clock = clock
        self.admitted = 0  # requests let in and not finished
        self._waiting: list[tuple[int, int]] = []  # heap of (-priority, arrival)
        self._arrivals = itertools.count()
        self._cond = threading.Condition()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def limit(self, decode: Iterable[DecodeView]) -> int | None:
        """Requests the cluster takes now; None: no bound."""
        if self.queue_per_worker < 0:
            return None
        rows = [v.capacity for v in decode if v.healthy]
        return sum(r + self.queue_per_worker for r in rows) if rows else None

    def enter(self, decode: Callable[[], Iterable[DecodeView]], priority: int = 0, deadline: float | None = None,
              cancelled: threading.Event | None = None) -> None:
        """Wait for room, then count the request in (`leave` once it ends). AdmissionTimeout past
        `deadline` (monotonic seconds), AdmissionCancelled once `cancelled` is set."""
        with self._cond:
            ticket = (-priority, next(self._arrivals))
            heapq.heappush(self._waiting, ticket)
            try:
                while True:
                    limit = self.limit(decode())
                    if self._waiting[0] == ticket and (limit is None or self.admitted < limit):
                        self.admitted += 1
                        return
                    if cancelled is not None and cancelled.is_set():
                        raise AdmissionCancelled("the request was cancelled while it waited for a decode row")
                    wait = self.poll_s
                    if deadline is not None:
                        left = deadline - self.clock()
                        if left <= 0:
                            raise AdmissionTimeout("the deadline passed while the request waited for a decode row")
                        wait = min(wait, left)
                    self._cond.wait(wait)
            finally:
                self._waiting.remove(ticket)
                heapq.heapify(self._waiting)
                self._cond.notify_all()  # the next in line may go

    def leave(self) -> None:
        with self._cond:
            self.admitted -= 1
            self._cond.notify_all()
