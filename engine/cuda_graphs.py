"""The decode step captured as CUDA graphs: a small model's step is hundreds of kernel launches
whose launch cost dwarfs their work; a replay launches them all at once.

A graph replays fixed kernels on fixed addresses, so what changes from step to step is read from
device memory instead of passed as arguments: the rows' tokens, positions, window starts and
ends (absolute buffer columns) and the column this step opens. Attention runs over the batch
buffer's whole capacity, each row stopping at its window's end, so one graph serves every
window length the buffer holds. Graphs are kept per row bucket (the occupied rows rounded up to
a power of two, at most the buffer's row capacity; padding rows attend one column and are
discarded) and dropped when the batch reallocates its buffer, since they hold its address.

Not captured: steps with shared prefixes (their attention merges per prefix group) and any step
after a capture failed (one warning; the worker goes on eagerly).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from baton.engine.batch_kv import BatchKV

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # before capture, on a side stream: Triton compiles, cuBLAS picks its kernels

# body(buffer, ids, positions, starts, ends, column) -> logits [rows, vocab] float32, with every
# argument but the buffer a device tensor of the graph's
StepBody = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    torch.Tensor]


def step_inputs(batch: BatchKV, input_ids: list[int], positions: list[int], column: int, rows: int) -> list[int]:
    """A step's inputs as one list (one copy to the device): ids, positions, window starts and ends
    (absolute buffer columns) of `rows` rows, then the opened column. Padding rows past the batch's
    feed token 0 at position 0 and attend column 0 only."""
    pad = rows - batch.num_rows
    starts = [batch.offset + s for s in batch.starts]
    ends = [batch.offset + batch.length] * batch.num_rows
    return ((input_ids + [0] * pad) + (positions + [0] * pad) + (starts + [0] * pad) + (ends + [1] * pad)
            + [batch.offset + column])


def step_arguments(inputs: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """The body's arguments from `step_inputs` as a device tensor: ids, positions, starts, ends, column."""
    r = rows
    return (inputs[:r], inputs[r:2 * r], inputs[2 * r:3 * r].to(torch.int32), inputs[3 * r:4 * r].to(torch.int32),
            inputs[4 * r:])


class _Graph:
    def __init__(self, rows: int, device: torch.device):
        self.rows = rows
        self.host = torch.zeros(4 * rows + 1, dtype=torch.int64, pin_memory=True)
        self.inputs = torch.zeros(4 * rows + 1, dtype=torch.int64, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def load(self, values: list[int]) -> None:
        if self.copied is not None:  # the last step's copy may still be reading the pinned staging
            self.copied.synchronize()
        self.host.copy_(torch.tensor(values, dtype=torch.int64))
        self.inputs.copy_(self.host, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()


class StepGraphs:
    def __init__(self, body: StepBody, device: torch.device):
        self.body = body
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # the memory pool the graphs of one buffer share
        self.buffer_key: tuple | None = None
        self.captures = 0  # counted so tests and metrics can see the graphs at work
        self.replays = 0

    def step(self, batch: BatchKV, input_ids: list[int], positions: list[int], column: int) -> torch.Tensor:
        """One decode step of `batch` (its column already opened) by replaying a graph -> logits [rows, vocab]."""
        rows = batch.num_rows
        key = (batch.buffer.data_ptr(), tuple(batch.buffer.shape))
        if key != self.buffer_key:  # reallocated: every graph holds the old address
            self.graphs.clear()  # a pool whose graphs are all gone cannot take another capture:
            self.pool = torch.cuda.graph_pool_handle()  # a new one (the old one's memory is freed with them)
            self.buffer_key = key
        bucket = min(1 << (rows - 1).bit_length(), batch.row_capacity)
        graph = self.graphs.get(bucket)
        inputs = step_inputs(batch, input_ids, positions, column, bucket)
        if graph is None:
            graph = self.graphs[bucket] = self._capture(batch.buffer, bucket, inputs)
        else:
            graph.load(inputs)
        graph.graph.replay()
        self.replays += 1
        return graph.logits[:rows].clone()

    def _capture(self, buffer: torch.Tensor, rows: int, inputs: list[int]) -> _Graph:
        graph = _Graph(rows, self.device)
        graph.load(inputs)
        # warm-up runs compute this very step (the same KV writes the replay then repeats)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.body(buffer, *step_arguments(graph.inputs, rows))
        torch.cuda.current_stream(self.device).wait_stream(side)
        # thread_local: other threads of this process (a prefill worker beside this decode worker,
        # the KV receivers) keep launching work while this thread captures; in the default
        # global mode their launches failed ("operation not permitted when stream is capturing")
        with torch.cuda.graph(graph.graph, pool=self.pool, capture_error_mode="thread_local"):
            graph.logits = self.body(buffer, *step_arguments(graph.inputs, rows))
        self.captures += 1
        log.debug("captured the decode step for %d rows", rows)
        return graph
