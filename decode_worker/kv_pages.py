"""The decode worker's KV memory in pages: which page holds which request's tokens. Plain Python
over ints, no tensors: the tensor lives in the engine (`engine.paged_kv.PagedKV`), this decides.

Memory is `num_pages` pages of `page_size` tokens. A request holds a page table, its pages in
token order: token t lives in page `table[t // page_size]` at slot `t % page_size`. Pages are
taken as tokens arrive (`allocate_slots`) and given back when the request leaves (`free`), so
a row holds what it has, never what it might reach (`max_tokens`), and wastes less than a page.

Pages full of prompt tokens are shared: a request whose prompt begins with the same tokens as a
held one refers to the same pages (reference counted; a page is free when its last holder
leaves). A page is known by its parent page and its tokens, so a match is exact, never a hash
collision. Only full pages are shared: every holder writes its own tokens past them.

Page 0 is never given out: padded page tables and captured graphs point there.

Not thread-safe on its own: the decode scheduler calls it under its lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

NULL_PAGE = 0


@dataclass(frozen=True)
class PageUsage:
    total: int  # pages requests can hold (the null page excluded)
    used: int  # held by at least one request
    shared: int  # held by more than one
    tokens: int  # tokens of KV the held pages have room for, a shared page's once
    page_size: int

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def allocated_over_useful(self) -> float:
        """Page slots held per token they hold: 1.0 is no waste (an idle pool counts as 1.0)."""
        return self.used * self.page_size / self.tokens if self.tokens else 1.0


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {page_size})")
        if num_pages < 2:
            raise ValueError(f"a page pool needs the null page and at least one more (got {num_pages} pages)")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # a stack: low page ids go first
        self._refs = [0] * num_pages
        # Kept as holds change: a load report (5 a second) must not scan a million pages.
        self._shared = 0  # pages held by more than one request
        self._extra_holders = 0  # holds beyond each shared page's first
        self._tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}
        self._known: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent page, its tokens) -> page
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}

    def reverse_order(self) -> None:
        """Give out high page ids first (tests and benchmarks: pages not in address order)."""
        self._free.reverse()

    # -- sizes --------------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def total_pages(self) -> int:
        return self.num_pages - 1

    def new_pages_for(self, request_id: str, num_tokens: int) -> int:
        """Pages a request must still take to hold `num_tokens` tokens in all."""
        return max(0, self.pages_for(num_tokens) - len(self._tables.get(request_id, ())))

    # -- holding ------------------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_new_tokens: int, shared_pages: Sequence[int] = ()) -> list[int] | None:
        """Room for `num_new_tokens` more tokens of `request_id`; a request not held yet starts with
        `shared_pages` (full pages it shares). Returns the pages taken (maybe none), or None, taking
        nothing, when too few pages are free: the scheduler then parks a row."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0 (got {num_new_tokens})")
        table = self._tables.get(request_id)
        fresh = table is None
        if fresh:
            if shared_pages:
                self.hold(request_id, shared_pages)
                table = self._tables[request_id]
            else:
                table = []
        tokens = self._tokens.get(request_id, 0) + num_new_tokens
        need = self.pages_for(tokens) - len(table)
        if need > len(self._free):
            if fresh:
                self.free(request_id)  # the shared pages it was to start with
            return None
        new = [self._free.pop() for _ in range(max(0, need))]
        for page in new:
            self._refs[page] = 1
        table.extend(new)
        self._tables[request_id] = table
        self._tokens[request_id] = tokens
        return new

    def hold(self, request_id: str, shared_pages: Sequence[int]) -> None:
        """Start `request_id`'s table with full pages others hold (a shared prompt prefix)."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds pages")
        for page in shared_pages:
            if self._refs[page] < 1:
                raise ValueError(f"page {page} is free: only held pages can be shared")
            self._refs[page] += 1
            self._extra_holders += 1
            self._shared += self._refs[page] == 2
        self._tables[request_id] = list(shared_pages)
        self._tokens[request_id] = len(shared_pages) * self.page_size

    def free(self, request_id: str) -> None:
        """The request left: each of its pages whose last holder it was is free again."""
        for page in self._tables.pop(request_id, ()):
            self._refs[page] -= 1
            if self._refs[page] >= 1:
                self._extra_holders -= 1
                self._shared -= self._refs[page] == 1
            elif self._refs[page] == 0:
                key = self._key_of.pop(page, None)
                if key is not None:
                    del self._known[key]
                self._free.append(page)
        self._tokens.pop(request_id, None)

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def page_table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def tokens(self, request_id: str) -> int:
        """Tokens the request's pages have room for (written, or opened for this step)."""
        return self._tokens.get(request_id, 0)

    # -- sharing full prompt pages ------------------------------------------------------------

    def publish(self, request_id: str, prompt: Sequence[int]) -> None:
        """Make the request's full pages of prompt tokens findable by `matching` (once its KV is in them)."""
        table = self._tables.get(request_id, ())
        parent = NULL_PAGE
        for index in range(min(len(prompt) // self.page_size, len(table))):
            page = table[index]
            key = (parent, tuple(prompt[index * self.page_size:(index + 1) * self.page_size]))
            known = self._known.get(key)
            if known is None and page not in self._key_of:
                self._known[key] = page
                self._key_of[page] = key
            elif known != page:
                break  # another page holds these tokens: the chain after it is that page's
            parent = page

    def matching(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """The held pages that hold `prompt`'s leading tokens, whole pages only, covering at most
        `max_tokens` tokens."""
        pages: list[int] = []
        parent = NULL_PAGE
        for index in range(min(len(prompt), max_tokens) // self.page_size):
            page = self._known.get((parent, tuple(prompt[index * self.page_size:(index + 1) * self.page_size])))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def usage(self) -> PageUsage:
        tokens = sum(self._tokens.values()) - self._extra_holders * self.page_size  # shared pages are full
        return PageUsage(self.total_pages, self.total_pages - len(self._free), self._shared, tokens, self.page_size)
