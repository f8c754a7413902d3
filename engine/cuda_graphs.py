"""The decode step captured as CUDA graphs: a small model's step is hundreds of kernel launches
whose launch cost dwarfs their work; a replay launches them all at once.

A graph replays fixed kernels on fixed addresses, so what changes from step to step is read from
device memory instead of passed as arguments: the rows' tokens, lengths and page tables (padded
to the most pages a row can hold). The paged KV is allocated once (`engine.paged_kv`), so its
address never changes and a graph serves the worker's whole life. Graphs are kept per row bucket
(the rows rounded up to a power of two; padding rows write and attend one slot of the null page
and are discarded).

Not captured: any step after a capture failed (one warning; the worker goes on eagerly).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from baton.engine.paged_kv import DecodeStep, PagedKV

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # before capture, on a side stream: Triton compiles, cuBLAS picks its kernels

# body(pages, ids, lengths, table) -> logits [rows, vocab] float32, with every argument but the
# pages a device tensor of the graph's
StepBody = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def step_inputs(step: DecodeStep, input_ids: list[int], rows: int, width: int) -> list[int]:
    """A step's inputs as one list (one copy to the device): ids and lengths of `rows` rows, then
    their page tables, `width` pages each. Padding rows feed token 0 at position 0 of the null page."""
    pad = rows - step.num_rows
    tables = [page for table in step.tables for page in table + [0] * (width - len(table))]
    return (input_ids + [0] * pad) + (step.lengths + [1] * pad) + tables + [0] * (pad * width)


def step_arguments(inputs: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """The body's arguments from `step_inputs` as a device tensor: ids, lengths, table."""
    return inputs[:rows], inputs[rows:2 * rows], inputs[2 * rows:].view(rows, width)


class _Graph:
    def __init__(self, rows: int, width: int, device: torch.device):
        self.rows = rows
        self.host = torch.zeros(rows * (2 + width), dtype=torch.int64, pin_memory=True)
        self.inputs = torch.zeros(rows * (2 + width), dtype=torch.int64, device=device)
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
    def __init__(self, body: StepBody, device: torch.device, max_context: int):
        self.body = body
        self.device = device
        self.max_context = max_context  # tokens a row can reach: its page table's width
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # the memory pool the graphs of one KV share
        self.pages_key: tuple | None = None
        self.captures = 0  # counted so tests and metrics can see the graphs at work
        self.replays = 0

    def step(self, kv: PagedKV, step: DecodeStep, input_ids: list[int]) -> torch.Tensor:
        """One decode step by replaying a graph -> logits [rows, vocab]."""
        rows = step.num_rows
        key = (kv.pages.data_ptr(), tuple(kv.pages.shape))
        if key != self.pages_key:  # another paged KV: every graph holds the old address
            self.graphs.clear()  # a pool whose graphs are all gone cannot take another capture:
            self.pool = torch.cuda.graph_pool_handle()  # a new one (the old one's memory is freed with them)
            self.pages_key = key
        width = -(-self.max_context // kv.page_size)
        if any(len(table) > width for table in step.tables):
            raise ValueError(f"a page table is wider than the {width} pages a {self.max_context}-token row needs")
        bucket = 1 << (rows - 1).bit_length()
        graph = self.graphs.get(bucket)
        inputs = step_inputs(step, input_ids, bucket, width)
        if graph is None:
            graph = self.graphs[bucket] = self._capture(kv.pages, bucket, width, inputs)
        else:
            graph.load(inputs)
        graph.graph.replay()
        self.replays += 1
        return graph.logits[:rows].clone()

    def _capture(self, pages: torch.Tensor, rows: int, width: int, inputs: list[int]) -> _Graph:
        graph = _Graph(rows, width, self.device)
        graph.load(inputs)
        # warm-up runs compute this very step (the same KV writes the replay then repeats)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.body(pages, *step_arguments(graph.inputs, rows, width))
        torch.cuda.current_stream(self.device).wait_stream(side)
        # thread_local: other threads of this process (a prefill worker beside this decode worker,
        # the KV receivers) keep launching work while this thread captures; in the default
        # global mode their launches failed ("operation not permitted when stream is capturing")
        with torch.cuda.graph(graph.graph, pool=self.pool, capture_error_mode="thread_local"):
            graph.logits = self.body(pages, *step_arguments(graph.inputs, rows, width))
        self.captures += 1
        log.debug("captured the decode step for %d rows", rows)
        return graph
