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

A finished request's pages can be retained (`retain`): kept under a key of their own, their
tokens (prompt and answer) findable by `matching`, so a conversation's next turn finds the KV of
everything said before. Retained pages are the first to go when pages are needed: `reclaim`
frees the least recently used entries (an entry whose pages a request also holds frees nothing
until that request leaves, but stops being findable as its own). A retained entry's last page
may be partly filled: `tail` finds those tokens, to copy, never to share (whoever shared it would
write its own tokens over the entry's).

Page 0 is never given out: padded page tables and captured graphs point there.

Not thread-safe on its own: the decode scheduler calls it under its lock.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

NULL_PAGE = 0
RETAINED = "retained:"  # a retained entry's key is this and the request id it came from


@dataclass(frozen=True)
class PageUsage:
    total: int  # pages requests can hold (the null page excluded)
    used: int  # held by at least one request
    shared: int  # held by more than one
    tokens: int  # tokens of KV the held pages have room for, a shared page's once
    page_size: int
    retained: int = 0  # held by retained entries alone: free for the taking (not in `used`)

    @property
    def free(self) -> int:
        """Pages a request can take: free, or retained only."""
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
        # Pages given back, a stack (the last given back goes first), then pages never given out,
        # low ids first: a pool of millions of pages starts without listing them.
        self._free: list[int] = []
        self._never_used = num_pages - 1
        self._high_first = False
        self._refs = [0] * num_pages
        # Kept as holds change: a load report (5 a second) must not scan a million pages.
        self._shared = 0  # pages held by more than one request
        self._extra_holders = 0  # holds beyond each shared page's first
        self._tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}
        self._known: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent page, its tokens) -> page
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        # Retained entries, least recently used first, and the pages only they hold.
        self._retained: OrderedDict[str, _Entry] = OrderedDict()
        self._retained_refs = [0] * num_pages
        self._retained_only = 0
        self._tail_after: dict[int, set[str]] = {}  # the page before an entry's last page -> those entries

    def reverse_order(self) -> None:
        """Give out high page ids first (tests and benchmarks: pages not in address order); before
        any page is given out."""
        if self._never_used != self.num_pages - 1:
            raise RuntimeError("reverse_order() after pages were given out")
        self._high_first = True

    def _take_free(self) -> int:
        if self._free:
            return self._free.pop()
        self._never_used -= 1
        return self._never_used + 1 if self._high_first else self.num_pages - 1 - self._never_used

    # -- sizes --------------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_free_pages(self) -> int:
        return len(self._free) + self._never_used

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
        if need > self.num_free_pages():
            if fresh:
                self.free(request_id)  # the shared pages it was to start with
            return None
        new = [self._take_free() for _ in range(max(0, need))]
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
            if self._refs[page] < 1 and self._retained_refs[page] < 1:
                raise ValueError(f"page {page} is free: only held pages can be shared")
        for page in shared_pages:
            self._take(page)
        self._tables[request_id] = list(shared_pages)
        self._tokens[request_id] = len(shared_pages) * self.page_size

    def holders(self) -> dict[str, int]:
        """Pages each holder (a request, a retained entry, a tail pin) holds."""
        return {key: len(table) for key, table in self._tables.items()}

    def free(self, request_id: str) -> None:
        """The request left: each of its pages whose last holder it was is free again."""
        for page in self._tables.pop(request_id, ()):
            self._drop(page)
        self._tokens.pop(request_id, None)

    def _take(self, page: int) -> None:
        """One more request holds `page` (held already, by a request or a retained entry)."""
        if self._refs[page] == 0:
            self._retained_only -= 1
        else:
            self._extra_holders += 1
            self._shared += self._refs[page] == 1
        self._refs[page] += 1

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] >= 1:
            self._extra_holders -= 1
            self._shared -= self._refs[page] == 1
        elif self._retained_refs[page]:
            self._retained_only += 1
        else:
            self._give_back(page)

    def _give_back(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._known[key]
        self._free.append(page)

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

    # -- retained entries: finished requests' KV, kept while nobody needs the pages ------------

    def retain(self, request_id: str, tokens: Sequence[int]) -> tuple[str | None, list[str]]:
        """Keep a leaving request's pages for the KV of `tokens` (its prompt and answer, as far as
        it has KV) instead of freeing them, findable by `matching` and `tail`; the request itself
        is gone from the pool. Entries this one continues (an earlier turn of its conversation)
        are dropped: everything they held is findable through this one. Returns the entry's key
        (None: nothing to keep) and the keys of the entries dropped."""
        table = self._tables.get(request_id)
        count = min(len(tokens), self._tokens.get(request_id, 0))
        if not table or not count:
            self.free(request_id)
            return None, []
        self.publish(request_id, tokens[:count])
        entry = _Entry(table[:self.pages_for(count)], tuple(tokens[:count]))
        key = RETAINED + request_id
        dropped = [key] if self.release(key) else []
        for page in entry.table:
            self._retained_refs[page] += 1
        self.free(request_id)
        for other in {k for page in entry.table for k in self._tail_after.get(page, ())}:
            if self._continues(entry, self._retained[other]):
                self.release(other)
                dropped.append(other)
        self._retained[key] = entry
        if len(entry.table) >= 2:
            self._tail_after.setdefault(entry.table[-2], set()).add(key)
        return key, dropped

    @staticmethod
    def _continues(entry: "_Entry", earlier: "_Entry") -> bool:
        return (len(earlier.tokens) <= len(entry.tokens) and entry.tokens[:len(earlier.tokens)] == earlier.tokens
                and entry.table[:len(earlier.table) - 1] == earlier.table[:-1])

    def release(self, key: str) -> "_Entry | None":
        """Forget a retained entry; its pages no one else holds are free again."""
        entry = self._retained.pop(key, None)
        if entry is None:
            return None
        if len(entry.table) >= 2:
            after = self._tail_after[entry.table[-2]]
            after.discard(key)
            if not after:
                del self._tail_after[entry.table[-2]]
        for page in entry.table:
            self._retained_refs[page] -= 1
            if not self._retained_refs[page] and not self._refs[page]:
                self._retained_only -= 1
                self._give_back(page)
        return entry

    def reclaim(self, num_pages: int) -> list[tuple[str, "_Entry"]]:
        """Release retained entries, least recently used first, until `num_pages` pages are free
        (or none is left). Returns the released entries."""
        released = []
        while self.num_free_pages() < num_pages and self._retained:
            key = next(iter(self._retained))
            released.append((key, self.release(key)))
        return released

    def touch(self, key: str) -> None:
        """A request found this entry's KV: it is the last to go."""
        if key in self._retained:
            self._retained.move_to_end(key)

    def tail(self, prompt: Sequence[int], pages: Sequence[int]) -> tuple[str, int, int] | None:
        """After `prompt`'s matching full `pages`, the retained entry whose last page holds its next
        tokens: (the entry's key, that page, how many of them), the most such tokens; None if none."""
        if not pages:
            return None
        start, best = len(pages) * self.page_size, None
        for key in self._tail_after.get(pages[-1], ()):
            entry = self._retained[key]
            if len(entry.table) != len(pages) + 1:
                continue
            same = 0
            for ours, theirs in zip(prompt[start:start + self.page_size], entry.tokens[start:]):
                if ours != theirs:
                    break
                same += 1
            if same and (best is None or same > best[2]):
                best = (key, entry.table[-1], same)
        return best

    def num_available_pages(self) -> int:
        """Pages free now or once every retained entry is released."""
        return self.num_free_pages() + self._retained_only

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    def retained_entries(self) -> list[tuple[str, "_Entry"]]:
        return list(self._retained.items())

    def usage(self) -> PageUsage:
        tokens = sum(self._tokens.values()) - self._extra_holders * self.page_size  # shared pages are full
        return PageUsage(self.total_pages, self.total_pages - self.num_free_pages() - self._retained_only, self._shared,
                         tokens, self.page_size, self._retained_only)


@dataclass(frozen=True)
class _Entry:
    """A retained entry: the pages holding the KV of `tokens`, the last one maybe partly filled."""

    table: list[int] = field(default_factory=list)
    tokens: tuple[int, ...] = ()
