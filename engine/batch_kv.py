"""The BATON batch KV cache: one padded tensor per layer that decoding never stops for.

Rows are occupied densely from 0 (a released row takes the last row's contents), so a decode
step runs the model on exactly the occupied rows. Columns form a window inside a buffer with
headroom on both sides: each step appends one column for every row; a prefilled KV is embedded
end-aligned into a free row, its front filled with placeholders that attention masks out; a KV
longer than the window grows it on the left; columns that are padding for every row are
released from the left.

Rows that begin with the same tokens may share one copy of that prefix's KV (`add_prefix`,
`embed(..., prefix=)`, `share`): the prefix lives once outside the padded buffer, and each of
its rows keeps only its own tokens in the window. Attention runs the prefix part once for all
of its rows and merges it with each row's part by their log-sum-exps (`engine.attention`).

The buffer follows what it holds: its rows double (up to `max_rows`) as rows join and halve
when three quarters of them are free; its columns grow by a quarter as the window does and
shrink when the window uses under half of them. Each change is one copy of the live KV,
amortised over the steps the headroom lasts, so the allocation stays close to the window.
"""
from __future__ import annotations

import math
import os

import torch

from baton.engine.kv import KVShape, SequenceKV

COLUMN_GROWTH = 1.25  # columns a relayout gives the window, per column it needs
CPU_KV_SHARE = 0.25  # of the host's available memory, for a CPU decode batch's default budget
CUDA_KV_SHARE = 0.9  # of the device memory free once the model is loaded


def default_kv_budget(device: torch.device | str) -> int:
    """The batch KV budget when none is configured: a share of what the device has free now."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(CUDA_KV_SHARE * free)
    try:
        meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo", encoding="ascii"))
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(CPU_KV_SHARE * available)


class BatchKVFull(RuntimeError):
    """The batch has no free row or the window would exceed its column limit."""


class BatchKV:
    def __init__(self, shape: KVShape, max_rows: int, *, max_columns: int, initial_columns: int = 256,
                 initial_rows: int = 1, budget_bytes: int | None = None, device: torch.device | str = "cpu"):
        if max_rows < 1 or max_columns < 1:
            raise ValueError(f"max_rows and max_columns must be >= 1 (got {max_rows}, {max_columns})")
        self.shape = shape
        self.max_rows = max_rows
        self.max_columns = max_columns
        self.initial_columns = min(initial_columns, max_columns)
        self.initial_rows = max(1, min(initial_rows, max_rows))
        self.budget_bytes = budget_bytes  # the buffer never allocates more (None: no limit)
        self.device = torch.device(device)
        self.starts: list[int] = []  # per occupied row: first valid window column
        self.groups: list[int | None] = []  # per occupied row: the shared prefix it continues, if any
        self.prefixes: dict[int, torch.Tensor] = {}  # shared prefix id -> [layers, 2, kv_heads, tokens, head_dim]
        self.offset = 0  # buffer column where the window begins
        self.length = 0  # window columns
        # Counted so tests and metrics can see the layout at work.
        self.reallocations = 0
        self.left_growths = 0
        self.released_columns = 0
        self.embeds = 0
        self.shrinks = 0
        self.prefixes_added = 0
        self.rows_sharing = 0  # rows placed after a shared prefix (embedded so, or converted by `share`)
        self.buffer = self._allocate(self.initial_rows, self.initial_columns)

    # buffer: [layers, 2, row_capacity, kv_heads, capacity, head_dim]
    def _allocate(self, rows: int, columns: int) -> torch.Tensor:
        s = self.shape
        return torch.zeros(s.num_layers, 2, rows, s.num_kv_heads, columns, s.head_dim,
                           dtype=s.dtype, device=self.device)

    @property
    def row_capacity(self) -> int:
        return self.buffer.shape[2]

    @property
    def num_rows(self) -> int:
        return len(self.starts)

    @property
    def capacity(self) -> int:
        return self.buffer.shape[4]

    @property
    def row_bytes_per_column(self) -> int:
        return self.shape.bytes_per_token()

    def allocated_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size() + self.prefix_bytes()

    def prefix_bytes(self) -> int:
        # list() takes the values at once: metrics and load reports read this from other threads
        return sum(p.numel() * p.element_size() for p in list(self.prefixes.values()))

    def window_bytes(self) -> int:
        """Bytes of the padded batch KV that attention reads: rows x window columns."""
        return self.num_rows * self.length * self.row_bytes_per_column

    def useful_bytes(self) -> int:
        return sum(self.length - s for s in self.starts) * self.row_bytes_per_column + self.prefix_bytes()

    def row_tokens(self, row: int) -> int:
        """The row's own tokens in the window (its shared prefix excluded)."""
        return self.length - self.starts[row]

    def prefix_tokens(self, row: int) -> int:
        group = self.groups[row]
        return 0 if group is None else self.prefixes[group].shape[3]

    def sequence_tokens(self, row: int) -> int:
        """Tokens of KV the row's sequence has: its shared prefix and its own."""
        return self.prefix_tokens(row) + self.row_tokens(row)

    def shared_groups(self) -> dict[int, list[int]]:
        """Shared prefix id -> the rows continuing it, for the prefixes some row uses."""
        rows: dict[int, list[int]] = {}
        for row, group in enumerate(self.groups):
            if group is not None:
                rows.setdefault(group, []).append(row)
        return rows

    # -- shared prefixes ----------------------------------------------------------------------

    def add_prefix(self, group: int, kv: SequenceKV) -> None:
        """Hold `kv` once as shared prefix `group`; rows refer to it through `embed` or `share`.
        It stays until `drop_prefix` (the decode scheduler says when no row nor waiting request
        needs it any more)."""
        if kv.shape != self.shape:
            raise ValueError(f"KV shape {kv.shape} does not match the batch {self.shape}")
        if group in self.prefixes:
            raise ValueError(f"shared prefix {group} exists already")
        if self.budget_bytes is not None and self.allocated_bytes() + kv.nbytes > self.budget_bytes:
            # The buffer's headroom goes first: the scheduler counted only the rows and window in use.
            self._relayout(0, 0, rows=max(1, self.num_rows), columns=max(1, self.length))
            if self.allocated_bytes() + kv.nbytes > self.budget_bytes:
                raise BatchKVFull(f"a {kv.nbytes}-byte shared prefix exceeds the {self.budget_bytes}-byte KV budget")
        data = torch.empty(kv.data.shape, dtype=kv.data.dtype, device=self.device)  # its own, contiguous copy
        self.prefixes[group] = data.copy_(kv.data)
        self.prefixes_added += 1

    def drop_prefix(self, group: int) -> None:
        """Forget a shared prefix no row refers to."""
        if group in self.groups:
            raise ValueError(f"shared prefix {group} is still in use")
        self.prefixes.pop(group, None)

    def share(self, row: int, group: int) -> None:
        """Row `row` begins with shared prefix `group`'s tokens: it drops its own copy of them (the
        columns become padding, released once no row needs them) and refers to the prefix."""
        tokens = self.prefixes[group].shape[3]
        if self.groups[row] is not None:
            raise ValueError(f"row {row} already continues shared prefix {self.groups[row]}")
        if tokens > self.row_tokens(row):
            raise ValueError(f"row {row} has {self.row_tokens(row)} tokens, fewer than the {tokens}-token prefix")
        self.starts[row] += tokens
        self.groups[row] = group
        self.rows_sharing += 1
        self.release_leading_columns()
        self._shrink_if_sparse()

    # -- layout changes ---------------------------------------------------------------------

    def embed(self, kv: SequenceKV, prefix: int | None = None) -> int:
        """Place a prefilled KV end-aligned into the next free row; returns the row. With `prefix`,
        kv holds only the tokens after that shared prefix's."""
        if prefix is not None and prefix not in self.prefixes:
            raise ValueError(f"no shared prefix {prefix} in this batch")
        if kv.shape != self.shape:
            raise ValueError(f"KV shape {kv.shape} does not match the batch {self.shape}")
        if self.num_rows >= self.max_rows:
            raise BatchKVFull(f"all {self.max_rows} rows are occupied")
        tokens = kv.num_tokens
        if self.num_rows == self.row_capacity:  # room for one more row: double, up to max_rows
            self._relayout(0, 0, rows=min(self.max_rows, 2 * self.row_capacity), least_rows=self.num_rows + 1)
        if tokens > self.length:
            self._grow_left(tokens - self.length)
        row = self.num_rows
        start = self.length - tokens
        first = self.offset + start
        # data: [layers, 2, kv_heads, tokens, head_dim] -> row slot, end-aligned
        self.buffer[:, :, row, :, first:first + tokens].copy_(kv.data.to(self.device, non_blocking=True))
        self.starts.append(start)
        self.groups.append(prefix)
        self.embeds += 1
        self.rows_sharing += prefix is not None
        return row

    def append_column(self) -> int:
        """Open one new column for every row (the model writes into it); returns its window index."""
        if self.num_rows == 0:
            raise BatchKVFull("no rows to decode")
        if self.length + 1 > self.max_columns:
            raise BatchKVFull(f"window would exceed {self.max_columns} columns")
        if self.offset + self.length + 1 > self.capacity:
            self._relayout(extra_left=0, extra_right=1)
        self.length += 1
        return self.length - 1

    def write_column(self, layer: int, column: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        # keys, values: [rows, kv_heads, head_dim]
        col = self.offset + column
        self.buffer[layer, 0, :self.num_rows, :, col].copy_(keys)
        self.buffer[layer, 1, :self.num_rows, :, col].copy_(values)

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the occupied rows: [rows, kv_heads, window, head_dim] views."""
        window = slice(self.offset, self.offset + self.length)
        n = self.num_rows
        return self.buffer[layer, 0, :n, :, window], self.buffer[layer, 1, :n, :, window]

    def step_views(self, column: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a whole step: the opened column [layers, 2, rows, kv_heads, head_dim] to write new keys
        and values into, and the window [layers, 2, rows, kv_heads, window, head_dim] to attend over."""
        n, col = self.num_rows, self.offset + column
        return self.buffer[:, :, :n, :, col], self.buffer[:, :, :n, :, self.offset:self.offset + self.length]

    def release(self, row: int) -> int | None:
        """Free a row; the last row moves into it. Returns the moved row's old index, if any."""
        last = self.num_rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} is not occupied")
        moved = None
        if row != last:
            self.buffer[:, :, row].copy_(self.buffer[:, :, last])
            self.starts[row] = self.starts[last]
            self.groups[row] = self.groups[last]
            moved = last
        self.starts.pop()
        self.groups.pop()
        if not self.starts:
            self._reset()
        else:
            self.release_leading_columns()
            self._shrink_if_sparse()
        return moved

    def release_leading_columns(self) -> int:
        """Drop window columns that are padding for every row; returns how many."""
        drop = min(self.starts, default=0)
        if drop:
            self.offset += drop
            self.length -= drop
            self.starts = [s - drop for s in self.starts]
            self.released_columns += drop
        return drop

    def extract(self, row: int) -> SequenceKV:
        """A copy of one row's whole KV, its shared prefix included (for preemption or migration)."""
        first = self.offset + self.starts[row]
        own = self.buffer[:, :, row, :, first:self.offset + self.length]
        group = self.groups[row]
        if group is None:
            return SequenceKV(own.clone())
        return SequenceKV(torch.cat([self.prefixes[group], own], dim=3))

    # -- buffer management --------------------------------------------------------------------

    def _grow_left(self, extra: int) -> None:
        if self.length + extra > self.max_columns:
            raise BatchKVFull(f"a {self.length + extra}-column window exceeds {self.max_columns} columns")
        if extra > self.offset:
            self._relayout(extra_left=extra, extra_right=0)
        self.offset -= extra
        self.length += extra
        self.left_growths += 1
        self.starts = [s + extra for s in self.starts]

    def _shrink_if_sparse(self) -> None:
        """Rows left or the window narrowed: give back what is three quarters unused (keeping
        twice what is used, so a row or column joining next does not reallocate at once)."""
        rows, columns = self.row_capacity, self.capacity
        if rows > self.initial_rows and 4 * self.num_rows <= rows:
            rows = max(self.initial_rows, 2 * self.num_rows)
        if columns > self.initial_columns and 2 * (self.length + 1) <= columns:
            columns = max(self.initial_columns, math.ceil(COLUMN_GROWTH * (self.length + 1)))
        if (rows, columns) != (self.row_capacity, self.capacity):
            self._relayout(0, 0, rows=rows, columns=columns)
            self.shrinks += 1

    def _relayout(self, extra_left: int, extra_right: int, rows: int | None = None,
                  columns: int | None = None, least_rows: int | None = None) -> None:
        """Move the live rows and window into a new buffer: with room for the requested growth
        (doubling), or of the given rows and columns."""
        needed = extra_left + self.length + extra_right
        if columns is None:
            columns = self.capacity
            if needed > columns:
                columns = min(max(needed, math.ceil(COLUMN_GROWTH * needed)), self.max_columns)
        rows = self.row_capacity if rows is None else rows
        rows, columns = self._within_budget(rows, columns, needed,
                                            self.num_rows if least_rows is None else least_rows)
        assert rows >= self.num_rows and columns >= needed, "a relayout must keep every live row and column"
        new_offset = extra_left
        # Zeroed, not empty: masked placeholder columns are multiplied by a zero attention weight,
        # and 0 * NaN from uninitialised memory would poison the row.
        buffer = self._allocate(rows, columns)
        if self.length and self.num_rows:
            old = slice(self.offset, self.offset + self.length)
            live = slice(0, self.num_rows)
            buffer[:, :, live, :, new_offset:new_offset + self.length].copy_(self.buffer[:, :, live, :, old])
        self.buffer = buffer
        self.offset = new_offset
        self.reallocations += 1

    def _within_budget(self, rows: int, columns: int, needed_columns: int, least_rows: int) -> tuple[int, int]:
        """Trim a growth's headroom so the buffer stays within budget_bytes; BatchKVFull if even
        the rows and columns in use (and a joining row: least_rows) do not fit."""
        per_slot = self.row_bytes_per_column
        if self.budget_bytes is None:
            return rows, columns
        budget = self.budget_bytes - self.prefix_bytes()  # shared prefixes are inside the same bound
        if rows * columns * per_slot <= budget:
            return rows, columns
        columns = max(needed_columns, min(columns, budget // (rows * per_slot)))
        if rows * columns * per_slot > budget:  # fewer spare rows, then
            rows = max(least_rows, min(rows, budget // (columns * per_slot)))
        if rows * columns * per_slot > budget:
            raise BatchKVFull(f"{rows} rows x {columns} columns and {self.prefix_bytes()} bytes of shared prefixes "
                              f"exceed the {self.budget_bytes}-byte KV budget")
        return rows, columns

    def _reset(self) -> None:
        """The batch emptied: start over at the initial size."""
        self.offset = 0
        self.length = 0
        if (self.row_capacity, self.capacity) != (self.initial_rows, self.initial_columns):
            self.buffer = self._allocate(self.initial_rows, self.initial_columns)
