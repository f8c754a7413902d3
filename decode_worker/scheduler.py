"""The BATON decode scheduler: plain Python over ints and lists, no tensors.

A request arrives with its KV already computed elsewhere (staged). Each iteration the
scheduler admits staged requests into free rows while a row and KV columns are free, the
runner decodes one token for every running row, and finished rows are released so that the
next staged request takes the row at the next iteration. Rows stay dense: releasing row r
moves the last row into r, exactly as `engine.batch_kv.BatchKV.release` does.

Two pressures park a running row (its KV goes to host memory, to be re-embedded later with
nothing recomputed): a staged request of higher priority when no row is free, and batch KV
above the high watermark. Below the low watermark the scheduler admits again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class Status(IntEnum):
    # Ordered so that `is_finished` is one comparison.
    STAGED = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    MOVED = 5  # left unfinished, its KV handed to another decode worker

    @property
    def is_finished(self) -> bool:
        """Done here: finished, or moved to another worker."""
        return self >= Status.FINISHED_STOPPED


FINISH_REASONS = {Status.FINISHED_STOPPED: "stop", Status.FINISHED_LENGTH: "length", Status.FINISHED_ABORTED: "abort"}


@dataclass
class DecodeSequence:
    request_id: str
    prompt_len: int
    max_new_tokens: int  # new tokens in all, the prefill's first token included
    output_ids: list[int]  # generated so far; the last one is the next input
    priority: int = 0
    status: Status = Status.STAGED
    row: int | None = None

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

    def __post_init__(self):
        if self.max_rows < 1 or self.max_columns < 1:
            raise ValueError(f"max_rows and max_columns must be >= 1 (got {self.max_rows}, {self.max_columns})")
        if self.low_watermark_slots > self.high_watermark_slots > 0:
            raise ValueError("the low KV watermark must not exceed the high one")


@dataclass
class SchedulerOutput:
    # Park these first, in order: (sequence, its row at that moment); each release compacts rows.
    parked: list[tuple[DecodeSequence, int]] = field(default_factory=list)
    admitted: list[DecodeSequence] = field(default_factory=list)  # embed these, in this order, into new rows
    running: list[DecodeSequence] = field(default_factory=list)  # row i decodes running[i].next_input


class DecodeScheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.staged: list[DecodeSequence] = []  # highest priority first, arrival order within one
        self.rows: list[DecodeSequence] = []
        self.parked_total = 0

    def fits_ever(self, seq: DecodeSequence) -> bool:
        return seq.max_kv_tokens <= self.config.max_columns

    def add_staged(self, seq: DecodeSequence, front: bool = False) -> None:
        if not self.fits_ever(seq):
            raise ValueError(
                f"request {seq.request_id} needs {seq.max_kv_tokens} KV columns but the decode batch allows "
                f"{self.config.max_columns}; lower max_tokens or shorten the prompt"
            )
        seq.status = Status.STAGED
        # Before the first staged request of lower priority (or, from the front, of equal or lower).
        at = next((i for i, s in enumerate(self.staged)
                   if s.priority < seq.priority or (front and s.priority == seq.priority)), len(self.staged))
        self.staged.insert(at, seq)

    def window_slots(self, extra: DecodeSequence | None = None) -> int:
        """Token slots of the padded batch KV: rows x the longest row (leading columns are released)."""
        rows = self.rows + ([extra] if extra else [])
        return len(rows) * max((s.num_kv_tokens + 1 for s in rows), default=0)

    def can_admit(self, seq: DecodeSequence) -> bool:
        # The KV budget buys max_columns for every row, and leading columns are released as rows
        # finish, so the window never exceeds the longest row: a staged request (which fits_ever)
        # needs a free row, and the batch must stay under the low watermark (an empty batch
        # always admits, so one long request cannot wait forever).
        if len(self.rows) >= self.config.max_rows:
            return False
        low = self.config.low_watermark_slots
        return not (low and self.rows and self.window_slots(seq) > low)

    def schedule(self) -> SchedulerOutput:
        """Park for memory or priority, then admit in priority order while requests fit."""
        out = SchedulerOutput()
        high = self.config.high_watermark_slots
        while high and len(self.rows) > 1 and self.window_slots() > high:
            self._park(self._lowest_priority_row(), out)
        while self.staged and len(self.rows) >= self.config.max_rows:
            victim = self._lowest_priority_row()
            if self.staged[0].priority <= victim.priority:
                break
            self._park(victim, out)
        while self.staged and self.can_admit(self.staged[0]):
            seq = self.staged.pop(0)
            seq.status = Status.RUNNING
            seq.row = len(self.rows)
            self.rows.append(seq)
            out.admitted.append(seq)
        out.running = list(self.rows)
        return out

    def _lowest_priority_row(self) -> DecodeSequence:
        # Among the lowest priority, the latest admitted: it has the least work to lose in waiting.
        return min(reversed(self.rows), key=lambda s: s.priority)

    def _park(self, seq: DecodeSequence, out: SchedulerOutput) -> None:
        out.parked.append((seq, seq.row))
        self._release(seq)
        self.add_staged(seq, front=True)
        self.parked_total += 1

    def append_tokens(self, token_ids: list[int]) -> None:
        """Record the token each row sampled this step."""
        if len(token_ids) != len(self.rows):
            raise ValueError(f"{len(self.rows)} rows ran but {len(token_ids)} tokens came back")
        for seq, token in zip(self.rows, token_ids):
            seq.output_ids.append(token)

    def finish(self, seq: DecodeSequence, status: Status) -> int | None:
        """Mark a sequence finished (or moved away); if it held a row, release it. Returns the row
        that moved into its place, if any."""
        assert status.is_finished
        seq.status = status
        if seq.row is None:
            if seq in self.staged:
                self.staged.remove(seq)
            return None
        return self._release(seq)

    def _release(self, seq: DecodeSequence) -> int | None:
        row, last = seq.row, len(self.rows) - 1
        seq.row = None
        moved = None
        if row != last:
            mover = self.rows[last]
            mover.row = row
            self.rows[row] = mover
            moved = last
        self.rows.pop()
        return moved

    def find(self, request_id: str) -> DecodeSequence | None:
        for seq in self.rows:
            if seq.request_id == request_id:
                return seq
        for seq in self.staged:
            if seq.request_id == request_id:
                return seq
        return None

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_staged(self) -> int:
        return len(self.staged)

    def has_work(self) -> bool:
        return bool(self.rows or self.staged)
