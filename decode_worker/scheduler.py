"""The BATON decode scheduler: plain Python over ints and lists, no tensors.

It owns every request's life on a decode worker, from the moment the router registers it
until it ends:

    WAITING --KV landed--> STAGED --row free--> RUNNING --stop/length--> FINISHED_*
                             ^                     |
                             +--- PARKED <--parked-+    (any state) --cancel--> FINISHED_ABORTED
    STAGED/PARKED/RUNNING --drain--> MOVING --handed off--> MOVED

A request arrives with its KV already computed elsewhere. Each iteration the scheduler admits
staged requests into free rows while a row and KV columns are free, the runner decodes one token
for every running row, and finished rows are released so that the next staged request takes
the row at the next iteration. Rows stay dense: releasing row r moves the last row into r,
exactly as `engine.batch_kv.BatchKV.release` does.

Two pressures park a running row (its KV goes to host memory, to be re-embedded later with
nothing recomputed): a staged request of higher priority when no row is free, and batch KV
above the high watermark. Below the low watermark the scheduler admits again. Host memory is
bounded too: `can_park(seq)` (the decode worker's host pool) may refuse, and the row then stays.

Thread-safety: registration, lookups, counts and taking a moving request may come from any
thread (RPC threads); the rest is the decode loop's. One lock keeps each call atomic, and no
call holds it for longer than list bookkeeping.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Sequence

from baton.decode_worker.sharing import Placement, PrefixSharing


class Status(IntEnum):
    # Ordered so that `is_finished` is one comparison.
    WAITING = 0  # registered; its KV has not landed yet
    STAGED = 1  # KV landed (in staging), waiting for a row
    PARKED = 2  # left its row for host memory, waiting for a row again
    RUNNING = 3
    MOVING = 4  # out of the batch with its KV, waiting to be handed to another decode worker
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    MOVED = 8  # left unfinished, its KV handed to another decode worker

    @property
    def is_finished(self) -> bool:
        """Done here: finished, or moved to another worker."""
        return self >= Status.FINISHED_STOPPED


FINISH_REASONS = {Status.FINISHED_STOPPED: "stop", Status.FINISHED_LENGTH: "length", Status.FINISHED_ABORTED: "abort"}


@dataclass(eq=False)
class DecodeSequence:
    request_id: str
    prompt_len: int
    max_new_tokens: int  # new tokens in all, the prefill's first token included
    output_ids: list[int]  # generated so far; the last one is the next input
    priority: int = 0
    status: Status = Status.WAITING
    row: int | None = None
    engine: Any = field(default=None, repr=False)  # what the engine keeps for it; opaque here
    prompt_ids: Sequence[int] = field(default=(), repr=False)  # for prefix sharing (empty: it shares nothing)
    placement: Placement | None = None  # set on admission when its row continues a shared prefix

    @property
    def num_kv_tokens(self) -> int:
        # Every token but the newest has KV: the prompt, then each fed output token.
        return self.prompt_len + len(self.output_ids) - 1

    @property
    def max_kv_tokens(self) -> int:
        """KV columns this sequence can ever need: its last token is never fed back."""
        return self.prompt_len + self.max_new_tokens - 1

    @property
    def next_input(self) -> int:
        return self.output_ids[-1]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)


@dataclass(frozen=True)
class SchedulerConfig:
    max_rows: int  # decode batch rows
    max_columns: int  # KV window columns the memory budget buys for max_rows rows
    # Batch KV watermarks in token slots (rows x window columns); 0 turns them off.
    high_watermark_slots: int = 0  # above: park rows on the host
    low_watermark_slots: int = 0  # admit only while the batch would stay at or below this
    # Registrations refused beyond these (0: unbounded): requests whose KV has not landed, and
    # requests here at all (each one holds a Decode call's server thread).
    max_waiting: int = 0
    max_requests: int = 0
    # The KV budget in token slots (0: none beyond max_columns a row): a row joins only while
    # every row, at its longest (prompt + max_tokens), would still fit it. So max_rows is a cap
    # and memory sets the batch size: many short requests, or a few long ones.
    budget_slots: int = 0
    # Rows whose prompts begin with at least this many equal tokens share one copy of that
    # prefix's KV (decode_worker.sharing); 0 turns sharing off.
    share_min_tokens: int = 0

    def __post_init__(self):
        if self.max_rows < 1 or self.max_columns < 1:
            raise ValueError(f"max_rows and max_columns must be >= 1 (got {self.max_rows}, {self.max_columns})")
        if self.low_watermark_slots > self.high_watermark_slots > 0:
            raise ValueError("the low KV watermark must not exceed the high one")
        if self.max_waiting < 0 or self.max_requests < 0:
            raise ValueError("max_waiting and max_requests must be >= 0 (0: unbounded)")
        if self.share_min_tokens < 0:
            raise ValueError(f"share_min_tokens must be >= 0 (got {self.share_min_tokens}; 0 turns sharing off)")


@dataclass
class SchedulerOutput:
    # Park these first, in order: (sequence, its row at that moment); each release compacts rows.
    parked: list[tuple[DecodeSequence, int]] = field(default_factory=list)
    admitted: list[DecodeSequence] = field(default_factory=list)  # embed these, in this order, into new rows
    resumed: list[DecodeSequence] = field(default_factory=list)  # those of them that were parked
    running: list[DecodeSequence] = field(default_factory=list)  # row i decodes running[i].next_input


class DecodeScheduler:
    def __init__(self, config: SchedulerConfig, can_park: Callable[[DecodeSequence], bool] = lambda seq: True):
        self.config = config
        self.can_park = can_park  # asked before a row is parked: host room for its KV, claimed if True
        self.park_refused_total = 0
        self.requests: dict[str, DecodeSequence] = {}  # every request here, whatever its status
        self.staged: list[DecodeSequence] = []  # STAGED and PARKED: highest priority first, arrival order within one
        self.rows: list[DecodeSequence] = []  # RUNNING, in row order
        self.parked_total = 0
        self.finished_total = 0  # ended here: stopped, length or aborted (not moved, not cancelled while waiting)
        self.sharing = PrefixSharing(config.share_min_tokens) if config.share_min_tokens else None
        self._lock = threading.RLock()

    def fits_ever(self, seq: DecodeSequence) -> bool:
        return seq.max_kv_tokens <= self.config.max_columns

    def _check_fits(self, seq: DecodeSequence) -> None:
        if not self.fits_ever(seq):
            raise ValueError(
                f"request {seq.request_id} needs {seq.max_kv_tokens} KV columns but the decode batch allows "
                f"{self.config.max_columns}; lower max_tokens or shorten the prompt"
            )

    # -- arrival ----------------------------------------------------------------------------------

    def register(self, seq: DecodeSequence) -> None:
        """Expect a request whose KV is on its way (WAITING). ValueError for a duplicate id or one
        that can never fit; OverflowError past the limits, so the caller can retry elsewhere."""
        self._check_fits(seq)
        with self._lock:
            if seq.request_id in self.requests:
                raise ValueError(f"request id {seq.request_id!r} is already being decoded here")
            limit = self.config.max_waiting
            if limit and self.num_waiting >= limit:
                raise OverflowError(f"{limit} requests are already waiting for KV here; retry later")
            limit = self.config.max_requests
            if limit and len(self.requests) >= limit:
                raise OverflowError(f"{limit} requests are already here (waiting for KV or a row, or decoding); "
                                    "retry later")
            seq.status = Status.WAITING
            self.requests[seq.request_id] = seq
            if self.sharing is not None and seq.prompt_ids:
                # A shared prefix held now stays until this request's KV lands or it ends: its
                # prefill need send only the rest (`held_tokens`).
                seq.placement = self.sharing.continuing(seq.prompt_ids)
                if seq.placement is not None:
                    self.sharing.join(seq.request_id, seq.placement, seq.prompt_ids)

    def unshare(self, seq: DecodeSequence, placement: Placement) -> None:
        """Undo a new pair's placement the batch found no room for: both rows keep their own KV."""
        with self._lock:
            self.sharing.leave(seq.request_id)
            self.sharing.leave(placement.partner)
            seq.placement = None

    def held_tokens(self, request_id: str) -> int:
        """Leading prompt tokens of a waiting request whose KV this worker holds already (any thread)."""
        with self._lock:
            seq = self.requests.get(request_id)
            return seq.placement.tokens if seq is not None and seq.placement is not None else 0

    def has_group(self, group: int) -> bool:
        with self._lock:
            return self.sharing is not None and group in self.sharing.groups

    def add_staged(self, seq: DecodeSequence) -> None:
        """Its KV landed: queue it for a row (registering it first if nobody did). ValueError if it
        ended meanwhile (a cancel may race with its landing)."""
        with self._lock:
            if self.requests.get(seq.request_id) is not seq:
                if seq.status is not Status.WAITING:
                    raise ValueError(f"request {seq.request_id} already ended ({seq.status.name.lower()})")
                self.register(seq)
            if seq.status is not Status.WAITING:
                raise ValueError(f"request {seq.request_id} is {seq.status.name}, not waiting for its KV")
            self._queue(seq, Status.STAGED)

    def _queue(self, seq: DecodeSequence, status: Status, front: bool = False) -> None:
        seq.status = status
        # Before the first staged request of lower priority (or, from the front, of equal or lower).
        at = next((i for i, s in enumerate(self.staged)
                   if s.priority < seq.priority or (front and s.priority == seq.priority)), len(self.staged))
        self.staged.insert(at, seq)

    # -- one iteration ----------------------------------------------------------------------------

    def window_slots(self, extra: DecodeSequence | None = None, placement: Placement | None = None) -> int:
        """Token slots of the batch KV: rows x the longest row's own tokens (leading columns are
        released), plus each shared prefix once."""
        return self._slots(lambda s: s.num_kv_tokens + 1, extra, placement)

    def worst_case_slots(self, extra: DecodeSequence | None = None, placement: Placement | None = None) -> int:
        """Token slots the batch (with `extra` joining at `placement`) would take if every row ran
        to its max_tokens."""
        return self._slots(lambda s: s.max_kv_tokens + 1, extra, placement)

    def _slots(self, tokens: Callable[[DecodeSequence], int], extra: DecodeSequence | None,
               placement: Placement | None) -> int:
        rows = self.rows + ([extra] if extra else [])
        shared = {s.request_id: self.sharing.shared_tokens(s.request_id) for s in rows} if self.sharing else {}
        prefixes = self.sharing.prefix_tokens() if self.sharing else 0
        if placement is not None:
            shared[extra.request_id] = placement.tokens
            if placement.partner is not None:
                shared[placement.partner] = placement.tokens
                prefixes += placement.tokens
        return len(rows) * max((tokens(s) - shared.get(s.request_id, 0) for s in rows), default=0) + prefixes

    def can_admit(self, seq: DecodeSequence, placement: Placement | None = None) -> bool:
        # The KV budget buys max_columns for every row, and leading columns are released as rows
        # finish, so the window never exceeds the longest row: a staged request (which fits_ever)
        # needs a free row, and the batch must stay under the low watermark (an empty batch
        # always admits, so one long request cannot wait forever).
        if len(self.rows) >= self.config.max_rows:
            return False
        budget = self.config.budget_slots
        if budget and self.rows and self.worst_case_slots(seq, placement) > budget:
            return False
        low = self.config.low_watermark_slots
        return not (low and self.rows and self.window_slots(seq, placement) > low)

    def _placement(self, seq: DecodeSequence) -> Placement | None:
        if self.sharing is None or not seq.prompt_ids:
            return None
        if seq.placement is not None:  # held since registration
            return seq.placement
        running = {s.request_id: s.prompt_ids for s in self.rows if s.prompt_ids}
        return self.sharing.place(seq.request_id, seq.prompt_ids, running)

    def schedule(self) -> SchedulerOutput:
        """Park for memory or priority, then admit in priority order while requests fit."""
        with self._lock:
            out = SchedulerOutput()
            high = self.config.high_watermark_slots
            while high and len(self.rows) > 1 and self.window_slots() > high:
                if not self._park(self._lowest_priority_row(), out):
                    break
            while self.staged and len(self.rows) >= self.config.max_rows:
                victim = self._lowest_priority_row()
                if self.staged[0].priority <= victim.priority or not self._park(victim, out):
                    break
            while self.staged:
                seq = self.staged[0]
                placement = self._placement(seq)
                if not self.can_admit(seq, placement):
                    break
                self.staged.pop(0)
                seq.placement = placement
                if placement is not None:
                    self.sharing.join(seq.request_id, placement, seq.prompt_ids)
                if seq.status is Status.PARKED:
                    out.resumed.append(seq)
                seq.status = Status.RUNNING
                seq.row = len(self.rows)
                self.rows.append(seq)
                out.admitted.append(seq)
            out.running = list(self.rows)
            return out

    def _lowest_priority_row(self) -> DecodeSequence:
        # Among the lowest priority, the latest admitted: it has the least work to lose in waiting.
        return min(reversed(self.rows), key=lambda s: s.priority)

    def _park(self, seq: DecodeSequence, out: SchedulerOutput) -> bool:
        """Park `seq` if the host has room for its KV; False (it keeps its row) if not."""
        if not self.can_park(seq):
            self.park_refused_total += 1
            return False
        out.parked.append((seq, seq.row))
        self._release(seq)
        self._queue(seq, Status.PARKED, front=True)
        self.parked_total += 1
        return True

    def append_tokens(self, token_ids: list[int]) -> None:
        """Record the token each row sampled this step."""
        with self._lock:
            if len(token_ids) != len(self.rows):
                raise ValueError(f"{len(self.rows)} rows ran but {len(token_ids)} tokens came back")
            for seq, token in zip(self.rows, token_ids):
                seq.output_ids.append(token)

    # -- leaving ----------------------------------------------------------------------------------

    def finish(self, seq: DecodeSequence, status: Status) -> int | None:
        """End a request wherever it is (finished, aborted, or moved away); if it held a row, release
        it. Returns the row that moved into its place, if any; LookupError if it had already ended
        (a handoff and a cancel may race for a moving request)."""
        assert status.is_finished
        with self._lock:
            if self.requests.get(seq.request_id) is not seq:
                raise LookupError(f"request {seq.request_id!r} already ended here ({seq.status.name.lower()})")
            moved = self._leave(seq)
            if status is not Status.MOVED and not (status is Status.FINISHED_ABORTED and seq.status is Status.WAITING):
                self.finished_total += 1
            seq.status = status
            self.requests.pop(seq.request_id, None)
            return moved

    def move(self, seq: DecodeSequence) -> int | None:
        """Take a request out of the batch (or the staged queue) to be handed to another decode
        worker; it stays here as MOVING until `take_moving`. Returns the row that moved into its place."""
        with self._lock:
            if seq.status not in (Status.STAGED, Status.PARKED, Status.RUNNING):
                raise ValueError(f"request {seq.request_id} is {seq.status.name}; only staged, parked or "
                                 "running requests can move")
            moved = self._leave(seq)
            seq.status = Status.MOVING
            return moved

    def take_moving(self, request_id: str) -> DecodeSequence:
        """The moving request, now MOVED (gone from here), for its KV to be handed off; once.
        LookupError if it is not here, ValueError if it is but is not moving."""
        with self._lock:
            seq = self.requests.get(request_id)
            if seq is None:
                raise LookupError(f"no request {request_id!r} on this decode worker")
            if seq.status is not Status.MOVING:
                raise ValueError(f"request {request_id!r} is {seq.status.name.lower()}, not moving")
            self.finish(seq, Status.MOVED)
            return seq

    def _leave(self, seq: DecodeSequence) -> int | None:
        if seq.row is not None:
            return self._release(seq)
        if seq in self.staged:
            self.staged.remove(seq)
        if self.sharing is not None:  # it may hold a shared prefix since registration
            self.sharing.leave(seq.request_id)
        return None

    def _release(self, seq: DecodeSequence) -> int | None:
        row, last = seq.row, len(self.rows) - 1
        seq.row = None
        seq.placement = None
        if self.sharing is not None:
            self.sharing.leave(seq.request_id)
        moved = None
        if row != last:
            mover = self.rows[last]
            mover.row = row
            self.rows[row] = mover
            moved = last
        self.rows.pop()
        return moved

    # -- observation (any thread) -----------------------------------------------------------------

    def find(self, request_id: str) -> DecodeSequence | None:
        return self.requests.get(request_id)

    def statuses(self) -> dict[str, Status]:
        with self._lock:
            return {rid: seq.status for rid, seq in self.requests.items()}

    def ids(self, *statuses: Status) -> list[str]:
        with self._lock:
            return [rid for rid, seq in self.requests.items() if seq.status in statuses]

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return sum(seq.status is Status.WAITING for seq in self.requests.values())

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_staged(self) -> int:
        return len(self.staged)

    def has_work(self) -> bool:
        return bool(self.rows or self.staged)
