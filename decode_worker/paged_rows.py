"""Rows of a decode batch on paged KV without a scheduler, for benchmarks and tests that drive an
executor directly: the decode worker's PagePool decides the pages, as in a worker. Pages are
taken from the top of the pool down, so a row's pages run backwards through memory (a layout
no kernel may assume away)."""
from __future__ import annotations

from baton.decode_worker.kv_pages import PagePool
from baton.engine.kv import KVShape, SequenceKV
from baton.engine.paged_kv import DecodeStep, PagedKV


class PagedRows:
    def __init__(self, shape: KVShape, num_pages: int = 256, page_size: int = 8, device="cpu"):
        self.kv = PagedKV(shape, num_pages, page_size, device)
        self.pool = PagePool(num_pages, page_size)
        self.pool.reverse_order()
        self.rows: list[str] = []

    def add(self, kv: SequenceKV) -> int:
        """A new row holding `kv`; returns its index."""
        rid = f"row{len(self.rows)}"
        self.pool.allocate_slots(rid, kv.num_tokens)
        self.kv.write(self.pool.page_table(rid), kv)
        self.rows.append(rid)
        return len(self.rows) - 1

    def step(self) -> DecodeStep:
        """Room for one more token in every row: the step that feeds it."""
        for rid in self.rows:
            assert self.pool.allocate_slots(rid, 1) is not None, "the test's page pool is full"
        return DecodeStep([self.pool.page_table(r) for r in self.rows], [self.pool.tokens(r) for r in self.rows])

    def read(self, row: int) -> SequenceKV:
        rid = self.rows[row]
        return self.kv.read(self.pool.page_table(rid), self.pool.tokens(rid))
