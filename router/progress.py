"""How far each request the router holds has come, so that one which stops moving is told.

A request waiting for a decode row, for its KV or for its next token normally moves within
seconds; one that has not moved for `router.stall_log_s` is logged once (a WARNING naming where it
waits and on which workers) and counted in `baton_router_stalled_requests`, so a hang shows in the
logs before its deadline ends it. A stage may have a pulse, a sign of the work behind it that
changes while that work advances (a long prompt's prefill: its worker's forwarded prompt tokens,
a chunk at a time); while it changes, the request is moving. Plain Python: the dispatcher
reports, a timer asks.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Progress:
    key: str  # the router's own id of the request (what workers see)
    label: str  # the caller's request id
    stage: str  # where it waits now, in words
    since: float  # when it last moved (monotonic seconds)
    tokens: int = 0  # tokens sent to the caller so far
    detail: Callable[[], str] | None = field(default=None, repr=False)  # more, asked only when logged
    told: bool = False  # its current stall was logged
    pulse: Callable[[], object] | None = field(default=None, repr=False)  # changes while the stage's work advances
    beat: object = None  # the pulse's value when last read


class InFlight:
    """Thread-safe: the request threads report, the timer reads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, Progress] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def begin(self, key: str, label: str, stage: str) -> None:
        with self._lock:
            self._requests[key] = Progress(key, label, stage, self._clock())

    def moved(self, key: str, stage: str | None = None, tokens: int | None = None,
              detail: Callable[[], str] | None = None, pulse: Callable[[], object] | None = None) -> None:
        """The request got somewhere: a new stage (with what describes it and its pulse), more
        tokens (None keeps the old)."""
        with self._lock:
            progress = self._requests.get(key)
            if progress is None:
                return
            if stage is not None:
                progress.stage, progress.detail, progress.pulse = stage, detail, pulse
                progress.beat = _read(pulse)
            if tokens is not None:
                progress.tokens = tokens
            progress.since, progress.told = self._clock(), False

    def end(self, key: str) -> None:
        with self._lock:
            self._requests.pop(key, None)

    def stalled(self, after_s: float) -> list[Progress]:
        """Requests that have not moved for `after_s` seconds, longest first."""
        now = self._clock()
        with self._lock:
            for p in self._requests.values():
                if p.pulse is not None and (beat := _read(p.pulse)) != p.beat:  # its work went on
                    p.beat, p.since, p.told = beat, now, False
            found = [p for p in self._requests.values() if now - p.since >= after_s]
        return sorted(found, key=lambda p: p.since)

    def newly_stalled(self, after_s: float) -> list[Progress]:
        """As `stalled`, but each stall once: those not reported since they last moved."""
        found = [p for p in self.stalled(after_s) if not p.told]
        for p in found:
            p.told = True
        return found

    def describe(self, progress: Progress) -> str:
        """One line for the log: where it waits, how long, what else is known."""
        extra = ""
        if progress.detail is not None:
            try:
                extra = f"; {progress.detail()}"
            except Exception as exc:  # noqa: BLE001 - a description must never fail the timer
                extra = f"; ({type(exc).__name__} describing it)"
        return (f"request {progress.label} ({progress.key}) has not moved for {self._clock() - progress.since:.0f} s: "
                f"{progress.stage}, {progress.tokens} tokens sent{extra}")


def _read(pulse: Callable[[], object] | None) -> object:
    if pulse is None:
        return None
    try:
        return pulse()
    except Exception as exc:  # noqa: BLE001 - a pulse must never fail the timer: it reads as no change
        return type(exc).__name__


class StallWatch:
    """A timer thread: every few seconds, logs each request newly stalled for `after_s`."""

    def __init__(self, inflight: InFlight, after_s: float):
        self.inflight = inflight
        self.after_s = after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> "StallWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.after_s / 3)):
            for progress in self.inflight.newly_stalled(self.after_s):
                log.warning(self.inflight.describe(progress),
                            extra={"request_id": progress.label, "stage": progress.stage, "tokens": progress.tokens})
