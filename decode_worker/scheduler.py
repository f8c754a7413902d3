"""The BATON decode scheduler: plain Python over ints and lists, no tensors.

It owns every request's life on a decode worker, from the moment the router registers it
until it ends:

    WAITING --KV landed--> STAGED --row free--> RUNNING --stop/length--> FINISHED_*
                             ^                     |
                             +--- PARKED <--parked-+    (any state) --cancel--> FINISHED_ABORTED
    STAGED/PARKED/RUNNING --drain--> MOVING --handed off--> MOVED

A request arrives with its KV already computed elsewhere. Its KV lives in pages
(`decode_worker.kv_pages.PagePool`, owned here): each iteration every running row takes room for
the token it decodes, staged requests are admitted while a row is free and their KV plus a small
growth reserve fits in free pages (never by what `max_tokens` might reach), the runner decodes
one token for every running row, and finished rows give their pages back at once.

Rows leave their pages for host memory (PARKED, re-embedded later with nothing recomputed) when
the pages run out mid-decode (the lowest-priority, latest row goes first), when a staged request
of higher priority finds no row free, and above the high watermark. Host memory is bounded too:
`can_park(seq)` (the decode worker's host pool) may refuse; the row then drops its KV and waits
to have it computed again (`recompute`), so nothing is failed or lost.

Rows whose prompts begin with the same tokens share those full pages (`share_min_tokens`): a
request registered while such pages are held keeps them (`held_tokens`), and its prefill sends
only the KV after them. With `retain`, a request that finishes leaves its pages behind, holding
its prompt's and answer's KV (`kv_pages.PagePool.retain`): the next turn of its conversation finds
them the same way, and may have the decode worker compute the short rest itself (`local`: no
prefill worker, no transfer). Retained pages go first whenever pages are needed, least recently
used first, each entry handed to the core (`SchedulerOutput.demoted`) to keep in host memory if
it can; `listener` hears of every prompt or entry whose KV begins or stops being held here, for
the worker's KV events.

Thread-safety: registration, lookups, counts and taking a moving request may come from any
thread (RPC threads); the rest is the decode loop's. One lock keeps each call atomic, and no
call holds it for longer than list bookkeeping.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Sequence

from baton.decode_worker.kv_pages import RETAINED, PagePool, PageUsage


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
    # Leading prompt tokens whose KV this worker held at registration (shared pages): its KV as
    # it lands covers only the tokens after them.
    held_tokens: int = 0
    recompute: bool = False  # its KV was dropped for memory (the host pool was full): compute it again
    # Its KV is computed here (conditional disaggregation), not pushed by a prefill worker; `tail`:
    # a retained page's leading tokens it continues, (page, tokens), pinned until they are copied.
    local: bool = False
    tail: tuple[int, int] | None = None

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
    num_pages: int  # KV pages, the null page included (kv_pages)
    page_size: int = 8  # tokens a page holds
    max_row_tokens: int = 0  # KV tokens one request may reach (0: every page)
    # Pages a joining row must find free beyond its KV and its first token: growth room, so a row
    # is not parked the moment it joins.
    growth_reserve_tokens: int = 32
    # Used-page watermarks; 0 turns them off: above high, rows are parked; new rows are admitted
    # only while the used pages stay at or below low.
    high_watermark_pages: int = 0
    low_watermark_pages: int = 0
    # Registrations refused beyond these (0: unbounded): requests whose KV has not landed, and
    # requests here at all (each one holds a Decode call's server thread).
    max_waiting: int = 0
    max_requests: int = 0
    # Rows whose prompts begin with at least this many equal tokens share those full pages; 0
    # turns sharing off.
    share_min_tokens: int = 0
    # Finished requests' pages stay, retained, until pages are needed (their KV serves a
    # conversation's next turn).
    retain: bool = False

    def __post_init__(self):
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (got {self.max_rows})")
        if self.num_pages < 2 or self.page_size < 1:
            raise ValueError(f"the KV needs at least 2 pages of at least 1 token (got {self.num_pages} pages of "
                             f"{self.page_size})")
        if self.max_row_tokens < 0 or self.growth_reserve_tokens < 0:
            raise ValueError("max_row_tokens and growth_reserve_tokens must be >= 0")
        if self.low_watermark_pages > self.high_watermark_pages > 0:
            raise ValueError("the low KV watermark must not exceed the high one")
        if self.max_waiting < 0 or self.max_requests < 0:
            raise ValueError("max_waiting and max_requests must be >= 0 (0: unbounded)")
        if self.share_min_tokens < 0:
            raise ValueError(f"share_min_tokens must be >= 0 (got {self.share_min_tokens}; 0 turns sharing off)")


@dataclass
class Parked:
    """A row leaving for the host: read its KV, `tokens` tokens in `table`'s pages, before the
    step writes (its pages may already be another row's)."""

    seq: DecodeSequence
    table: list[int]
    tokens: int


@dataclass
class Admitted:
    """A row joining: write its KV into `table`'s pages from token `shared_tokens` on (the pages
    before it are shared, written already)."""

    seq: DecodeSequence
    table: list[int]
    shared_tokens: int


@dataclass
class Demoted:
    """A retained entry whose pages were needed: read the KV of its `tokens` from `table` before the
    step writes (the pages may be a row's now), to keep it on the host, or `forget` it."""

    key: str
    table: list[int]
    tokens: tuple[int, ...]


@dataclass
class SchedulerOutput:
    parked: list[Parked] = field(default_factory=list)  # read these first
    unheld: list[Parked] = field(default_factory=list)  # and these: staged, their held pages given up
    demoted: list[Demoted] = field(default_factory=list)  # and these
    dropped: list[DecodeSequence] = field(default_factory=list)  # left their row without their KV (recompute)
    admitted: list[Admitted] = field(default_factory=list)  # then write these, in this order
    resumed: list[DecodeSequence] = field(default_factory=list)  # the admitted that were parked or dropped
    running: list[DecodeSequence] = field(default_factory=list)  # row i decodes running[i].next_input
    tables: list[list[int]] = field(default_factory=list)  # row i's pages and tokens, this step's included
    lengths: list[int] = field(default_factory=list)


class KVListener:
    """Told whose tokens' KV begins or stops being held here: a running row's prompt (keyed by its
    request id) or a retained entry (its own key). Called under the scheduler's lock: no waiting."""

    def held(self, key: str, tokens: Sequence[int]) -> None: ...

    def dropped(self, key: str) -> None: ...


TAIL = "tail:"  # pins the retained page whose leading tokens a local prefill copies


class DecodeScheduler:
    def __init__(self, config: SchedulerConfig, can_park: Callable[[DecodeSequence], bool] = lambda seq: True,
                 listener: KVListener | None = None):
        self.config = config
        self.listener = listener or KVListener()
        self.retaining = config.retain
        self.can_park = can_park  # asked before a row is parked: host room for its KV, claimed if True
        self.pages = PagePool(config.num_pages, config.page_size)
        self.max_row_tokens = config.max_row_tokens or self.pages.total_pages * config.page_size
        self.park_refused_total = 0  # rows whose KV was dropped instead (recomputed later)
        self.requests: dict[str, DecodeSequence] = {}  # every request here, whatever its status
        self.staged: list[DecodeSequence] = []  # STAGED and PARKED: highest priority first, arrival order within one
        self.rows: list[DecodeSequence] = []  # RUNNING, in row order
        self.parked_total = 0  # rows that left their pages: for the host, or dropped
        self.parked_for_memory_total = 0  # of them, because pages ran out or past the high watermark
        self.resumed_total = 0
        self.rows_sharing_total = 0  # rows admitted onto pages another request holds
        self.finished_total = 0  # ended here: stopped, length or aborted (not moved, not cancelled while waiting)
        self.retained_total = 0  # finished requests whose pages stayed
        self.reclaimed_total = 0  # retained entries released because pages were needed
        self.unheld_total = 0  # staged requests that gave their held pages up for the one ahead
        self._lock = threading.RLock()

    def fits_ever(self, seq: DecodeSequence) -> bool:
        return seq.max_kv_tokens <= self.max_row_tokens

    def _check_fits(self, seq: DecodeSequence) -> None:
        if not self.fits_ever(seq):
            raise ValueError(
                f"request {seq.request_id} needs {seq.max_kv_tokens} KV tokens but this decode worker's KV holds "
                f"{self.max_row_tokens} for one row; lower max_tokens or shorten the prompt"
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
            # Shared pages held now stay until this request's KV lands or it ends: its prefill
            # need send only the rest (a prefill computes at least the prompt's last token).
            # what a local prefill finds here is worth any whole page: it is not computed again
            shared = self._shared_pages(seq, len(seq.prompt_ids) - 1, least=1 if seq.local else None)
            if shared:
                self.pages.hold(seq.request_id, shared)
                seq.held_tokens = len(shared) * self.config.page_size
            if seq.local and self.config.retain:
                tail = self.pages.tail(seq.prompt_ids[:len(seq.prompt_ids) - 1], shared)
                if tail is not None:
                    key, page, count = tail
                    self.pages.touch(key)
                    self.pages.hold(TAIL + seq.request_id, [page])
                    seq.tail = (page, count)

    def untail(self, seq: DecodeSequence) -> None:
        """The tail's tokens are copied: its page need not stay for this request."""
        with self._lock:
            seq.tail = None
            self.pages.free(TAIL + seq.request_id)

    def _shared_pages(self, seq: DecodeSequence, max_tokens: int, least: int | None = None) -> list[int]:
        """Held pages holding the prompt's leading tokens, if they hold at least `least` tokens
        (None: share_min_tokens)."""
        if not self.config.share_min_tokens or not seq.prompt_ids:
            return []
        pages = self.pages.matching(seq.prompt_ids, max_tokens)
        least = self.config.share_min_tokens if least is None else least
        return pages if len(pages) * self.config.page_size >= least else []

    def held_tokens(self, request_id: str) -> int:
        """Leading prompt tokens of a waiting request whose KV this worker holds already (any thread)."""
        with self._lock:
            seq = self.requests.get(request_id)
            return seq.held_tokens if seq is not None and seq.status is Status.WAITING else 0

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

    def _admit(self, seq: DecodeSequence, out: SchedulerOutput) -> bool:
        """Into a new row if one is free and its KV, this step's token and the growth reserve fit
        in free pages (an empty batch needs no reserve: one long request must not wait forever)."""
        if len(self.rows) >= self.config.max_rows:
            return False
        rid, pool = seq.request_id, self.pages
        # Retaining, a row shares any whole page it can: its own pages then chain from the ones it
        # shares, so they can be found (published) when it finishes, whatever prefix it shares
        # with others (a chat template's first page, say).
        shared = [] if pool.holds(rid) else self._shared_pages(seq, seq.num_kv_tokens,
                                                                 least=1 if self.retaining else None)
        held = len(pool.page_table(rid)) if pool.holds(rid) else len(shared)
        needed = seq.num_kv_tokens + 1
        reserve = self.config.growth_reserve_tokens if self.rows else 0
        new_pages = pool.pages_for(needed + reserve) - held
        if shared:  # held before counting and reclaiming: retained pages it shares must stay
            pool.hold(rid, shared)
        # below the low watermark, or the high one when no low one is set (else a row parked above
        # high would be admitted again at once)
        low = self.config.low_watermark_pages or self.config.high_watermark_pages
        if new_pages > pool.num_available_pages() or (low and self.rows and self._used_pages() + new_pages > low):
            if shared:
                pool.free(rid)
            return False
        self._reclaim(new_pages, out)
        shared_tokens = pool.tokens(rid)
        self.rows_sharing_total += shared_tokens > 0
        taken = pool.allocate_slots(rid, needed - shared_tokens)
        assert taken is not None, "pages counted free were not"
        self.staged.remove(seq)
        if seq.status is Status.PARKED:
            out.resumed.append(seq)
            self.resumed_total += 1
        seq.status = Status.RUNNING
        seq.row = len(self.rows)
        self.rows.append(seq)
        out.admitted.append(Admitted(seq, pool.page_table(rid), shared_tokens))
        if self.config.share_min_tokens and seq.prompt_ids:
            # Shareable at once: the core writes every admitted row's KV before the step, in
            # order, and a request matching them now is admitted at a later step.
            pool.publish(rid, seq.prompt_ids)
            self.listener.held(rid, seq.prompt_ids)
        return True

    def _used_pages(self) -> int:
        """Pages requests hold (retained ones are free for the taking)."""
        return self.pages.total_pages - self.pages.num_available_pages()

    def _reclaim(self, num_free: int, out: SchedulerOutput) -> None:
        """Release retained entries until `num_free` pages are free; each goes to `out.demoted`."""
        for key, entry in self.pages.reclaim(num_free):
            self.reclaimed_total += 1
            out.demoted.append(Demoted(key, entry.table, entry.tokens))

    def forget(self, key: str) -> None:
        """A retained entry is gone (not kept on the host, or taken back from there)."""
        with self._lock:
            self.listener.dropped(key)

    def release_retained(self) -> int:
        """Forget every retained entry and retain no more (a draining worker); returns how many
        there were."""
        with self._lock:
            self.retaining = False
            keys = [key for key, _ in self.pages.retained_entries()]
            for key in keys:
                self.pages.release(key)
                self.listener.dropped(key)
            return len(keys)

    def schedule(self) -> SchedulerOutput:
        """Park for priority and memory, give every running row room for this step's token, then
        admit in priority order while requests fit."""
        with self._lock:
            out = SchedulerOutput()
            pool = self.pages
            while self.staged and len(self.rows) >= self.config.max_rows:
                victim = self._lowest_priority_row()
                if self.staged[0].priority <= victim.priority or not self._park(victim, out):
                    break
            high = self.config.high_watermark_pages
            while high and len(self.rows) > 1 and self._used_pages() > high:
                self._park(self._lowest_priority_row(), out, for_memory=True)
            for seq in list(self.rows):
                if pool.new_pages_for(seq.request_id, pool.tokens(seq.request_id) + 1):
                    self._reclaim(1, out)
                while seq.status is Status.RUNNING and pool.allocate_slots(seq.request_id, 1) is None:
                    self._park(self._lowest_priority_row(), out, for_memory=True)
            while self.staged and self._admit(self.staged[0], out):
                pass
            if not self.rows:  # the head cannot join an empty batch: pages it needs are held by a
                # request queued behind it (shared pages held since registration); that one goes first
                next((s for s in self.staged[1:] if self._admit(s, out)), None)
                if not self.rows and self.staged:
                    self._unhold_for_head(out)
                while self.staged and self._admit(self.staged[0], out):
                    pass
            out.running = list(self.rows)
            out.tables = [pool.page_table(s.request_id) for s in self.rows]
            out.lengths = [pool.tokens(s.request_id) for s in self.rows]
            return out

    def _unhold_for_head(self, out: SchedulerOutput) -> None:
        """No row decodes and no staged request fits: those queued behind the head hold pages it
        needs (two conversations' next turns, each holding its earlier turn's pages). The latest
        of them give their held pages up, their KV read to the host first (as a parked row's),
        until the head fits; each shares whatever is still there when its own turn comes."""
        head = self.staged[0]
        for seq in reversed(self.staged[1:]):
            if not self.pages.holds(seq.request_id):
                continue
            out.unheld.append(Parked(seq, self.pages.page_table(seq.request_id), seq.held_tokens))
            self.pages.free(seq.request_id)
            seq.held_tokens = 0
            self.unheld_total += 1
            if self._admit(head, out):
                return

    def _lowest_priority_row(self) -> DecodeSequence:
        # Among the lowest priority, the latest admitted: it has the least work to lose in waiting.
        return min(reversed(self.rows), key=lambda s: s.priority)

    def _park(self, seq: DecodeSequence, out: SchedulerOutput, for_memory: bool = False) -> bool:
        """Out of its row, back to the front of the queue, its KV to the host if the host has room
        for it. If not: for memory, its KV is dropped, to be computed again when it resumes; for
        priority, it keeps its row (False)."""
        if self.can_park(seq):
            out.parked.append(Parked(seq, self.pages.page_table(seq.request_id), seq.num_kv_tokens))
        else:
            self.park_refused_total += 1
            if not for_memory:
                return False
            seq.recompute = True
            out.dropped.append(seq)
        self._release(seq)
        self._queue(seq, Status.PARKED, front=True)
        self.parked_total += 1
        self.parked_for_memory_total += for_memory
        return True

    def append_tokens(self, token_ids: list[int]) -> None:
        """Record the token each row sampled this step."""
        with self._lock:
            if len(token_ids) != len(self.rows):
                raise ValueError(f"{len(self.rows)} rows ran but {len(token_ids)} tokens came back")
            for seq, token in zip(self.rows, token_ids):
                seq.output_ids.append(token)

    # -- leaving ----------------------------------------------------------------------------------

    def finish(self, seq: DecodeSequence, status: Status) -> None:
        """End a request wherever it is (finished, aborted, or moved away); its row and pages are
        free. LookupError if it had already ended (a handoff and a cancel may race for a moving
        request)."""
        assert status.is_finished
        with self._lock:
            if self.requests.get(seq.request_id) is not seq:
                raise LookupError(f"request {seq.request_id!r} already ended here ({seq.status.name.lower()})")
            if status in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH) and self.retaining and seq.prompt_ids:
                self._retain(seq)
            self._leave(seq)
            if status is not Status.MOVED and not (status is Status.FINISHED_ABORTED and seq.status is Status.WAITING):
                self.finished_total += 1
            seq.status = status
            self.requests.pop(seq.request_id, None)

    def move(self, seq: DecodeSequence) -> None:
        """Take a request out of the batch (or the staged queue) to be handed to another decode
        worker; it stays here as MOVING until `take_moving`. The caller has read its KV."""
        with self._lock:
            if seq.status not in (Status.STAGED, Status.PARKED, Status.RUNNING):
                raise ValueError(f"request {seq.request_id} is {seq.status.name}; only staged, parked or "
                                 "running requests can move")
            self._leave(seq)
            seq.status = Status.MOVING

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

    def _retain(self, seq: DecodeSequence) -> None:
        """A finished row's pages stay, holding the KV of its prompt and every token but the last."""
        if seq.row is None:
            return  # it never had a row (one token was enough)
        tokens = list(seq.prompt_ids) + seq.output_ids[:-1]
        self._vacate_row(seq)
        key, dropped = self.pages.retain(seq.request_id, tokens)
        for other in dropped:
            self.listener.dropped(other)
        if key is not None:
            self.retained_total += 1
            self.listener.held(key, tokens)

    def _leave(self, seq: DecodeSequence) -> None:
        if seq.row is not None:
            self._release(seq)
        if seq in self.staged:
            self.staged.remove(seq)
        self.pages.free(seq.request_id)  # a waiting request may hold shared pages
        if seq.tail is not None:
            seq.tail = None
            self.pages.free(TAIL + seq.request_id)
        self.listener.dropped(seq.request_id)

    def _release(self, seq: DecodeSequence) -> None:
        """Out of its row, its pages given back."""
        self._vacate_row(seq)
        self.pages.free(seq.request_id)

    def _vacate_row(self, seq: DecodeSequence) -> None:
        """Out of its row (its pages untouched); the rows after it move up one."""
        row = seq.row
        seq.row = None
        self.rows.pop(row)
        for index in range(row, len(self.rows)):
            self.rows[index].row = index

    # -- observation (any thread) -----------------------------------------------------------------

    def find(self, request_id: str) -> DecodeSequence | None:
        return self.requests.get(request_id)

    def statuses(self) -> dict[str, Status]:
        with self._lock:
            return {rid: seq.status for rid, seq in self.requests.items()}

    def ids(self, *statuses: Status) -> list[str]:
        with self._lock:
            return [rid for rid, seq in self.requests.items() if seq.status in statuses]

    def kv_usage(self) -> PageUsage:
        with self._lock:
            return self.pages.usage()

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

    def standstill(self) -> str | None:
        """None while rows decode or nothing waits for one; else who holds the KV pages that the
        waiting requests cannot get (with no row decoding, nothing here will free them)."""
        with self._lock:
            if self.rows or not self.staged:
                return None
            holders = sorted(self.pages.holders().items(), key=lambda kv: -kv[1])
            named = ", ".join(f"{key} ({n} pages, {self._holder_state(key)})" for key, n in holders[:8])
            return (f"no row decodes and {len(self.staged)} waiting for one cannot start: {self.pages.num_available_pages()} "
                    f"of {self.pages.total_pages} pages free, the first needs "
                    f"{self.pages.pages_for(self.staged[0].num_kv_tokens + 1)}; held by {named or 'nobody'}")

    def _holder_state(self, key: str) -> str:
        seq = self.requests.get(key)
        return seq.status.name.lower() if seq is not None else "retained" if key.startswith(RETAINED) else \
            "a tail pin" if key.startswith(TAIL) else "unknown"
