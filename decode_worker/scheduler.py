"""The BATON decode scheduler: plain Python over ints and lists, no tensors.

A request arrives with its KV already computed elsewhere (staged). Each iteration the
scheduler admits staged requests into free rows while a row and KV columns are free, the
runner decodes one token for every running row, and finished rows are released so that the
next staged request takes the row at the next iteration. Rows stay dense: releasing row r
moves the last row into r, exactly as `engine.batch_kv.BatchKV.release` does.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum


class Status(IntEnum):
    # Ordered so that `is_finished` is one comparison.
    STAGED = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4

    @property
    def is_finished(self) -> bool:
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

    def __post_init__(self):
        if self.max_rows < 1 or self.max_columns < 1:
            raise ValueError(f"max_rows and max_columns must be >= 1 (got {self.max_rows}, {self.max_columns})")


@dataclass
class SchedulerOutput:
    admitted: list[DecodeSequence] = field(default_factory=list)  # embed these, in this order, into new rows
    running: list[DecodeSequence] = field(default_factory=list)  # row i decodes running[i].next_input


class DecodeScheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.staged: deque[DecodeSequence] = deque()
        self.rows: list[DecodeSequence] = []

    def fits_ever(self, seq: DecodeSequence) -> bool:
        return seq.max_kv_tokens <= self.config.max_columns

    def add_staged(self, seq: DecodeSequence) -> None:
        if not self.fits_ever(seq):
            raise ValueError(
                f"request {seq.request_id} needs {seq.max_kv_tokens} KV columns but the decode batch allows "
                f"{self.config.max_columns}; lower max_tokens or shorten the prompt"
            )
        seq.status = Status.STAGED
        self.staged.append(seq)

    def can_admit(self, seq: DecodeSequence) -> bool:
        # The KV budget buys max_columns for every row, and leading columns are released as rows
        # finish, so the window never exceeds the longest row: a staged request (which fits_ever)
        # needs only a free row.
        return len(self.rows) < self.config.max_rows

    def schedule(self) -> SchedulerOutput:
        """Admit staged requests in arrival order while they fit; head-of-line waits (no starvation)."""
        out = SchedulerOutput()
        while self.staged and self.can_admit(self.staged[0]):
            seq = self.staged.popleft()
            seq.status = Status.RUNNING
            seq.row = len(self.rows)
            self.rows.append(seq)
            out.admitted.append(seq)
        out.running = list(self.rows)
        return out

    def append_tokens(self, token_ids: list[int]) -> None:
        """Record the token each row sampled this step."""
        if len(token_ids) != len(self.rows):
            raise ValueError(f"{len(self.rows)} rows ran but {len(token_ids)} tokens came back")
        for seq, token in zip(self.rows, token_ids):
            seq.output_ids.append(token)

    def finish(self, seq: DecodeSequence, status: Status) -> int | None:
        """Mark a sequence finished; if it held a row, release it. Returns the row that moved, if any."""
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
