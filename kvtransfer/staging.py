"""A bounded CPU staging pool: where received KV waits until the decode scheduler takes it.

The pool bounds bytes (never more than `capacity_bytes` reserved, even transiently) and
entries. Every request id moves through one lifecycle; each step names who calls it:

    expect(id, token)           decode worker, when the router opens Decode (the allow-list;
                                required before reserve when `require_expected`; a push must
                                then present the same token, so only the push the router
                                meant for this request takes room)
    reserve(id, n, timeout)     receiver, at header time: waits FIFO for room, or refuses
      land(reservation, kv, m)  receiver, after the last verified chunk: RESERVED -> LANDED,
                                then `on_landed(id)` wakes the scheduler
      abort(reservation)        receiver, on any failure: frees this reservation only (a
                                retried push for the same id may then reserve again)
    take(id) -> StagedKV        consumer: LANDED -> TAKEN; it now owns the tensor...
    release(id)                 ...and hands the bytes back when done with it
    hold(id, n) -> bool         consumer, for KV it keeps on the host itself (a parked row):
                                TAKEN at once if there is room now and no push waits for
                                room, else False; release(id) gives the bytes back
    hold(id, n, yields=True)    the same for KV kept only in case it serves again (a finished
                                conversation's): the pool takes such bytes back, oldest first,
                                whenever anything else needs room, and tells `on_yield(id)`
    cancel(id)                  anyone, any time: frees whatever the id holds in any state,
                                wakes a waiting reserve and stops an in-flight receiver

Nothing leaks: a receiver always ends in land or abort (try/finally); a landed KV nobody
takes within `landed_ttl_s` is dropped; a taken KV is the consumer's until release or
cancel, visible meanwhile in `stats().taken_bytes`. release/cancel of an unknown id is a
no-op, so cleanup paths may call them twice.
"""
from __future__ import annotations

import enum
import hmac
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from baton.engine.kv import SequenceKV
from baton.kvtransfer.errors import (KVCancelled, KVDuplicate, KVNotLanded, KVPoolFull, KVTooLarge, KVUnexpected,
                                     KVWrongToken)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagingConfig:
    capacity_bytes: int
    max_entries: int = 256  # reserved + landed + taken; also bounds reserve() calls waiting
    require_expected: bool = False  # refuse KV for request ids not announced with expect()
    max_expected: int = 4096  # bounds the allow-list itself
    landed_ttl_s: float | None = 300.0  # landed but never taken -> dropped; None keeps forever

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.max_entries <= 0 or self.max_expected <= 0:
            raise ValueError(f"StagingConfig needs positive capacity and limits, got {self}")


class EntryState(enum.IntEnum):
    RESERVED = 0  # bytes held, KV arriving
    LANDED = 1  # complete, waiting for take()
    TAKEN = 2  # handed to the consumer, bytes held until release()


@dataclass(eq=False)
class Reservation:
    """One request id's claim on the pool; the receiver holds it while the KV arrives."""

    request_id: str
    nbytes: int
    state: EntryState = EntryState.RESERVED
    cancelled: bool = False  # set by cancel(); an in-flight receiver checks it per chunk
    yields: bool = False  # a consumer's hold the pool takes back when something else needs room
    kv: SequenceKV | None = None
    metadata: bytes = b""
    landed_at: float = 0.0


@dataclass(frozen=True)
class StagedKV:
    """A landed KV handed to its consumer by take()."""

    request_id: str
    kv: SequenceKV
    metadata: bytes
    nbytes: int


@dataclass(frozen=True)
class StagingStats:
    capacity_bytes: int
    reserved_bytes: int
    landed_bytes: int
    taken_bytes: int
    reserved_entries: int
    landed_entries: int
    taken_entries: int
    waiting: int  # reserve() calls blocked for room
    expected: int
    peak_used_bytes: int  # high-water mark of reserved + landed + taken
    expired_total: int  # landed KVs dropped by landed_ttl_s
    yielding_bytes: int = 0  # of taken_bytes, held with `yields`: free for the taking

    @property
    def used_bytes(self) -> int:
        return self.reserved_bytes + self.landed_bytes + self.taken_bytes

    @property
    def needed_bytes(self) -> int:
        """Bytes nothing else can have: used, less the yielding holds."""
        return self.used_bytes - self.yielding_bytes

    @property
    def entries(self) -> int:
        return self.reserved_entries + self.landed_entries + self.taken_entries


@dataclass(eq=False)
class _Waiter:
    request_id: str
    nbytes: int
    cancelled: bool = False


@dataclass
class _Counters:
    used_bytes: int = 0
    peak_used_bytes: int = 0
    expired_total: int = 0


class StagingPool:
    """Thread-safe; one per decode worker, shared by every concurrent receiver."""

    def __init__(self, config: StagingConfig, on_landed: Callable[[str], None] | None = None,
                 on_yield: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._on_landed = on_landed
        self.on_yield = on_yield or (lambda request_id: None)  # a yielding hold was taken back
        self._lock = threading.Condition()
        self._entries: dict[str, Reservation] = {}
        self._waiters: deque[_Waiter] = deque()  # FIFO, so a large KV is not starved by small ones
        self._expected: dict[str, str] = {}  # request id -> the push token its KV must carry ("" any)
        self._counters = _Counters()

    # -- allow-list ---------------------------------------------------------------------------
    def expect(self, request_id: str, push_token: str = "") -> None:
        with self._lock:
            expected = self._expected
            if request_id not in expected and len(expected) >= self.config.max_expected:
                raise KVPoolFull(f"staging pool already expects {len(expected)} requests (max_expected)")
            expected[request_id] = push_token

    def is_expected(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._expected

    def expects_token(self, request_id: str, push_token: str) -> bool:
        """Whether request_id is expected with exactly this push token (a non-empty one)."""
        with self._lock:
            wanted = self._expected.get(request_id)
        return bool(wanted) and hmac.compare_digest(wanted.encode(), push_token.encode())

    # -- receiver side ------------------------------------------------------------------------
    def reserve(self, request_id: str, nbytes: int, timeout_s: float | None, push_token: str = "") -> Reservation:
        """Claim nbytes for request_id, waiting up to timeout_s (None: forever) for room. With
        `require_expected`, the id must be expected and `push_token` be the token it was expected with."""
        if nbytes <= 0:
            raise ValueError(f"reserve needs a positive byte count, got {nbytes}")
        capacity = self.config.capacity_bytes
        if nbytes > capacity:
            raise KVTooLarge(
                f"KV for {request_id!r} is {nbytes} bytes but the staging pool holds only {capacity}; "
                "raise the decode worker's staging capacity or send a shorter prompt"
            )
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        yielded: list[str] = []
        try:
            return self._reserve(request_id, nbytes, push_token, deadline, timeout_s, yielded)
        finally:
            self._tell_yielded(yielded)  # outside the lock: the consumer's hook takes its own

    def _reserve(self, request_id: str, nbytes: int, push_token: str, deadline: float | None,
                 timeout_s: float | None, yielded: list[str]) -> Reservation:
        capacity = self.config.capacity_bytes
        with self._lock:
            self._expire_landed_locked()
            if self.config.require_expected:
                if request_id not in self._expected:
                    raise KVUnexpected(f"this decode worker is not expecting KV for request {request_id!r}")
                wanted = self._expected[request_id]
                if wanted and not hmac.compare_digest(wanted.encode(), push_token.encode()):
                    raise KVWrongToken(f"KV for request {request_id!r} does not carry the push token its "
                                       "Decode call registered")
            if request_id in self._entries or any(w.request_id == request_id for w in self._waiters):
                raise KVDuplicate(f"KV for request {request_id!r} is already staged or arriving")
            if len(self._waiters) >= self.config.max_entries:
                raise KVPoolFull(f"{len(self._waiters)} transfers already wait for staging room; retry later")
            waiter = _Waiter(request_id, nbytes)
            self._waiters.append(waiter)
            try:
                while True:
                    if waiter.cancelled:
                        raise KVCancelled(f"request {request_id!r} was cancelled while waiting for staging room")
                    if self._waiters[0] is waiter:
                        yielded += self._make_room_locked(nbytes)
                        if self._fits_locked(nbytes):
                            break
                    if self._expire_landed_locked():
                        continue
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        free = capacity - self._counters.used_bytes
                        raise KVPoolFull(
                            f"no room in the staging pool for {nbytes} bytes within {timeout_s:.3g}s "
                            f"({free} of {capacity} bytes free, {len(self._entries)} entries); retry later"
                        )
                    self._lock.wait(remaining)
            finally:
                self._waiters.remove(waiter)
                self._lock.notify_all()  # the next waiter may now be at the head
            reservation = Reservation(request_id, nbytes)
            self._entries[request_id] = reservation
            self._add_used_locked(nbytes)
            return reservation

    def land(self, reservation: Reservation, kv: SequenceKV, metadata: bytes) -> None:
        if kv.nbytes > reservation.nbytes:
            raise ValueError(f"KV of {kv.nbytes} bytes does not fit its {reservation.nbytes}-byte reservation")
        with self._lock:
            if reservation.cancelled or self._entries.get(reservation.request_id) is not reservation:
                raise KVCancelled(f"request {reservation.request_id!r} was cancelled while its KV arrived")
            reservation.state = EntryState.LANDED
            reservation.kv, reservation.metadata = kv, metadata
            reservation.landed_at = time.monotonic()
        if self._on_landed is not None:
            try:
                self._on_landed(reservation.request_id)
            except Exception:  # the KV has landed; a failing hook must not undo that
                log.exception("on_landed hook failed for request %r", reservation.request_id)

    def abort(self, reservation: Reservation) -> None:
        """Free a reservation that will not land; a no-op if cancel() already freed it."""
        with self._lock:
            if self._entries.get(reservation.request_id) is reservation:
                self._remove_locked(reservation)

    # -- consumer side ------------------------------------------------------------------------
    def take(self, request_id: str) -> StagedKV:
        with self._lock:
            self._expire_landed_locked()
            entry = self._entries.get(request_id)
            if entry is None or entry.state is not EntryState.LANDED:
                state = "absent" if entry is None else entry.state.name.lower()
                raise KVNotLanded(f"no landed KV for request {request_id!r} (it is {state})")
            entry.state = EntryState.TAKEN
            assert entry.kv is not None
            return StagedKV(request_id, entry.kv, entry.metadata, entry.nbytes)

    def release(self, request_id: str) -> int:
        """Return a landed or taken KV's bytes to the pool; returns the bytes freed."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                self._expected.pop(request_id, None)
                return 0
            if entry.state is EntryState.RESERVED:
                raise KVNotLanded(f"KV for request {request_id!r} is still arriving; use cancel() to stop it")
            self._remove_locked(entry)
            self._expected.pop(request_id, None)
            return entry.nbytes

    def cancel(self, request_id: str) -> int:
        """Forget request_id everywhere; returns the bytes freed (0 if it held none)."""
        with self._lock:
            self._expected.pop(request_id, None)
            for waiter in self._waiters:
                if waiter.request_id == request_id:
                    waiter.cancelled = True
                    self._lock.notify_all()
            entry = self._entries.get(request_id)
            if entry is None:
                return 0
            entry.cancelled = True
            self._remove_locked(entry)
            return entry.nbytes

    # -- the consumer's own host KV (parked rows) -------------------------------------------------
    def hold(self, request_id: str, nbytes: int, yields: bool = False) -> bool:
        """Claim nbytes at once for KV the consumer keeps on the host itself (a row parked out of
        the batch), inside the same bound as staged KV. False when there is no room now, or when
        pushes already wait for room (they came first). release() gives the bytes back.
        `yields`: KV kept only in case it serves again; the pool takes it back (on_yield) when
        anything else needs the room, the oldest such hold first."""
        if nbytes <= 0:
            raise ValueError(f"hold needs a positive byte count, got {nbytes}")
        yielded: list[str] = []
        try:
            with self._lock:
                self._expire_landed_locked()
                if request_id in self._entries:
                    raise KVDuplicate(f"request {request_id!r} already holds staging room")
                if self._waiters or nbytes > self.config.capacity_bytes:
                    return False
                yielded = self._make_room_locked(nbytes)
                if not self._fits_locked(nbytes):
                    return False
                self._entries[request_id] = Reservation(request_id, nbytes, state=EntryState.TAKEN, yields=yields)
                self._add_used_locked(nbytes)
                return True
        finally:
            self._tell_yielded(yielded)

    def _make_room_locked(self, nbytes: int) -> list[str]:
        """Take back yielding holds, oldest first, until `nbytes` fit (or none is left)."""
        taken = []
        for entry in [e for e in self._entries.values() if e.yields]:
            if self._fits_locked(nbytes):
                break
            self._remove_locked(entry)
            taken.append(entry.request_id)
        return taken

    def _tell_yielded(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            try:
                self.on_yield(request_id)
            except Exception:  # the bytes are back either way
                log.exception("on_yield hook failed for %r", request_id)

    # -- observation --------------------------------------------------------------------------
    def landed_ids(self) -> list[str]:
        with self._lock:
            self._expire_landed_locked()
            return [rid for rid, e in self._entries.items() if e.state is EntryState.LANDED]

    def stats(self) -> StagingStats:
        with self._lock:
            self._expire_landed_locked()
            by_state = {state: [0, 0] for state in EntryState}  # state -> [bytes, entries]
            for entry in self._entries.values():
                by_state[entry.state][0] += entry.nbytes
                by_state[entry.state][1] += 1
            reserved, landed, taken = (by_state[s] for s in EntryState)
            return StagingStats(
                capacity_bytes=self.config.capacity_bytes,
                reserved_bytes=reserved[0],
                landed_bytes=landed[0],
                taken_bytes=taken[0],
                reserved_entries=reserved[1],
                landed_entries=landed[1],
                taken_entries=taken[1],
                waiting=len(self._waiters),
                expected=len(self._expected),
                peak_used_bytes=self._counters.peak_used_bytes,
                expired_total=self._counters.expired_total,
                yielding_bytes=sum(e.nbytes for e in self._entries.values() if e.yields),
            )

    # -- private ------------------------------------------------------------------------------
    def _fits_locked(self, nbytes: int) -> bool:
        return (
            self._counters.used_bytes + nbytes <= self.config.capacity_bytes
            and len(self._entries) < self.config.max_entries
        )

    def _add_used_locked(self, nbytes: int) -> None:
        counters = self._counters
        counters.used_bytes += nbytes
        counters.peak_used_bytes = max(counters.peak_used_bytes, counters.used_bytes)
        assert counters.used_bytes <= self.config.capacity_bytes, "staging pool over-allocated"

    def _remove_locked(self, entry: Reservation) -> None:
        del self._entries[entry.request_id]
        entry.kv = None  # drop the pool's reference so the tensor can be freed
        self._counters.used_bytes -= entry.nbytes
        self._lock.notify_all()

    def _expire_landed_locked(self) -> bool:
        """Drop landed KVs nobody took in time; True if any room was freed."""
        ttl = self.config.landed_ttl_s
        if ttl is None:
            return False
        cutoff = time.monotonic() - ttl
        stale = [e for e in self._entries.values() if e.state is EntryState.LANDED and e.landed_at < cutoff]
        for entry in stale:
            log.warning("dropping KV for request %r: landed %.0fs ago and never taken", entry.request_id, ttl)
            self._remove_locked(entry)
            self._expected.pop(entry.request_id, None)
            self._counters.expired_total += 1
        return bool(stale)
