"""The prefill worker's prefix KV cache policy: which blocks to keep, share and evict.

No tensors here (the nano-vllm / SGLang split): a block is a chained block hash
(`baton.block_hash`) with an opaque payload the caller attaches, e.g. the slot or tensor
slice holding its KV. The cache is a tree: a block's parent is the block before it in its
prompt, and a block is kept only while its parent is (prefix-closed), so the index built
from its events can match prefixes.

Policy:
- Capacity is `capacity_bytes // bytes_per_block` blocks; it is never exceeded.
- A request locks the cached prefix it uses (`lock` / `unlock`, counted). Locks always
  cover a chain from the prompt's first block, so a parent is locked at least as often as
  its children and every unlocked block can be evicted leaves-first.
- `insert` evicts exactly the blocks it lacks room for, least recently used first, and only
  unlocked leaves (so chains stay prefix-closed). A block is used when `match` or `insert`
  walks through it or `unlock` releases it. If the unlocked blocks cannot make room,
  `insert` changes nothing and returns None (the scheduler decides what to do).
- Room can also be reserved for KV held outside the tree (`reserve` / `release`: a pinned
  group's partial last block), so everything the cache's owner keeps counts against one budget.
- Every stored and evicted hash becomes a KV event for the router's index
  (`drain_events`); evicted payloads go to `on_evict(block_hash, payload)` so the owner
  can free the memory behind them.
Not thread-safe: one owner (the worker's scheduler loop) drives it.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

EvictCallback = Callable[[int, object], None]


@dataclass
class _Block:
    block_hash: int
    parent: int | None  # None: the prompt's first block
    payload: object
    last_used: int  # logical clock tick
    ref_count: int = 0
    num_children: int = 0


@dataclass(frozen=True)
class KVEvents:
    """Net change since the previous drain; `stored` lists parents before children."""

    stored: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.evicted)


class PrefixCache:
    def __init__(self, capacity_bytes: int, bytes_per_block: int, on_evict: EvictCallback | None = None):
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.bytes_per_block = bytes_per_block
        self.capacity_blocks = capacity_bytes // bytes_per_block
        self._on_evict = on_evict
        self._blocks: dict[int, _Block] = {}
        self._num_unreferenced = 0
        self._reserved = 0  # blocks of room held for KV outside the tree
        self._clock = 0
        # (last_used, hash) of unlocked leaves; stale entries are skipped when popped.
        self._evictable_heap: list[tuple[int, int]] = []
        self._pending: dict[int, bool] = {}  # hash -> True stored / False evicted

    # -- sizes ---------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.bytes_per_block

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return (len(self._blocks) + self._reserved) * self.bytes_per_block

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - len(self._blocks) - self._reserved

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks no request holds: what `insert` may evict."""
        return self._num_unreferenced

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def ref_count(self, block_hash: int) -> int:
        return self._blocks[block_hash].ref_count if block_hash in self._blocks else 0

    # -- lookups -------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` are cached; marks them used."""
        num_cached = self._num_cached(block_hashes)
        self._touch(block_hashes[:num_cached])
        return num_cached

    def cached_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` are cached, without marking them used."""
        return self._num_cached(block_hashes)

    def payloads(self, block_hashes: Sequence[int]) -> list[object]:
        return [self._get(h).payload for h in block_hashes]

    # -- references ----------------------------------------------------------------------
    def lock(self, block_hashes: Sequence[int]) -> list[object]:
        """Hold a cached prefix (blocks 0..n-1 of a prompt) against eviction; returns the
        payloads. Lock only what `match` found; unlock the same hashes when done."""
        self._check_chain(block_hashes, "lock")
        for h in block_hashes:
            block = self._blocks[h]
            if block.ref_count == 0:
                self._num_unreferenced -= 1
            block.ref_count += 1
        return [self._blocks[h].payload for h in block_hashes]

    def unlock(self, block_hashes: Sequence[int]) -> None:
        self._check_chain(block_hashes, "unlock")
        for h in block_hashes:
            if self._blocks[h].ref_count == 0:
                raise ValueError(f"unlock of block {h:#x}, which is not locked: unlock exactly "
                                 "the hashes you locked, once")
        for h in block_hashes:
            block = self._blocks[h]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_unreferenced += 1
        self._touch(block_hashes)

    # -- insertion and eviction ----------------------------------------------------------
    def insert(self, block_hashes: Sequence[int], payloads: Sequence[object] | None = None,
               lock: bool = False) -> list[int] | None:
        """Cache a prompt's chain of blocks (from its first block); `payloads[i]` belongs to
        `block_hashes[i]` and is kept only for blocks not cached yet. Returns the newly
        stored hashes, or None (nothing changed) when unlocked blocks cannot make room.
        With `lock=True` the whole chain is also locked, as by `lock(block_hashes)`."""
        if payloads is not None and len(payloads) != len(block_hashes):
            raise ValueError(f"{len(payloads)} payloads for {len(block_hashes)} block hashes")
        num_cached = self._num_cached(block_hashes)
        new_hashes = list(block_hashes[num_cached:])
        if len(set(new_hashes)) != len(new_hashes) or any(h in self._blocks for h in new_hashes):
            raise ValueError("block_hashes is not one chain: a hash repeats or is cached under "
                             "another parent; pass one prompt's hashes from baton.block_hash")
        cached_prefix = block_hashes[:num_cached]
        self.lock(cached_prefix)  # the blocks we extend must survive our own eviction
        try:
            shortfall = len(new_hashes) - self.free_blocks
            if shortfall > self._num_unreferenced:
                return None
            self._evict(shortfall)
        finally:
            self.unlock(cached_prefix)
        parent = block_hashes[num_cached - 1] if num_cached else None
        for i, h in enumerate(new_hashes, start=num_cached):
            self._blocks[h] = _Block(h, parent, None if payloads is None else payloads[i], self._clock)
            self._num_unreferenced += 1
            if parent is not None:
                self._blocks[parent].num_children += 1
            self._record(h, stored=True)
            parent = h
        self._touch(block_hashes)
        if lock:
            self.lock(block_hashes)
        return new_hashes

    def reserve(self, num_blocks: int) -> bool:
        """Take room for `num_blocks` blocks of KV kept outside the tree, evicting unlocked blocks
        as `insert` would; False (nothing changed) when they cannot make room."""
        shortfall = num_blocks - self.free_blocks
        if shortfall > self._num_unreferenced:
            return False
        self._evict(max(shortfall, 0))
        self._reserved += num_blocks
        return True

    def release(self, num_blocks: int) -> None:
        if not 0 <= num_blocks <= self._reserved:
            raise ValueError(f"release of {num_blocks} blocks, but {self._reserved} are reserved")
        self._reserved -= num_blocks

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` unlocked blocks (LRU leaves first); returns how many."""
        count = min(max(num_blocks, 0), self._num_unreferenced)
        self._evict(count)
        return count

    def drain_events(self) -> KVEvents:
        """The KV events to publish since the last drain, net: a block stored and evicted
        in between is not mentioned; `stored` and `evicted` never share a hash."""
        events = KVEvents(stored=[h for h, stored in self._pending.items() if stored],
                          evicted=[h for h, stored in self._pending.items() if not stored])
        self._pending.clear()
        return events

    # -- helpers -------------------------------------------------------------------------
    def _get(self, block_hash: int) -> _Block:
        block = self._blocks.get(block_hash)
        if block is None:
            raise KeyError(f"block {block_hash:#x} is not cached (evicted, or never inserted)")
        return block

    def _num_cached(self, block_hashes: Sequence[int]) -> int:
        parent = None
        for i, h in enumerate(block_hashes):
            block = self._blocks.get(h)
            if block is None or block.parent != parent:
                return i
            parent = h
        return len(block_hashes)

    def _check_chain(self, block_hashes: Sequence[int], action: str) -> None:
        parent = None
        for h in block_hashes:
            if self._get(h).parent != parent:
                raise ValueError(f"{action} takes a prompt's leading blocks (first block first); "
                                 f"block {h:#x} does not follow the block before it")
            parent = h

    def _touch(self, block_hashes: Sequence[int]) -> None:
        # Deepest first, so parents count as used later than their children.
        for h in reversed(block_hashes):
            block = self._blocks[h]
            self._clock += 1
            block.last_used = self._clock
            self._push_if_evictable(block)
        if len(self._evictable_heap) > 2 * len(self._blocks) + 64:
            self._evictable_heap = [(b.last_used, b.block_hash) for b in self._blocks.values()
                                    if b.ref_count == 0 and b.num_children == 0]
            heapq.heapify(self._evictable_heap)

    def _push_if_evictable(self, block: _Block) -> None:
        if block.ref_count == 0 and block.num_children == 0:
            heapq.heappush(self._evictable_heap, (block.last_used, block.block_hash))

    def _evict(self, count: int) -> None:
        # Unlocked blocks are closed under "child of" (locks cover chains from the first
        # block), so while any remain, one of them is an unlocked leaf in the heap.
        for _ in range(count):
            while True:
                last_used, h = heapq.heappop(self._evictable_heap)
                block = self._blocks.get(h)
                if (block is not None and block.last_used == last_used
                        and block.ref_count == 0 and block.num_children == 0):
                    break
            del self._blocks[h]
            self._num_unreferenced -= 1
            if block.parent is not None:
                parent = self._blocks[block.parent]
                parent.num_children -= 1
                self._push_if_evictable(parent)
            self._record(h, stored=False)
            if self._on_evict is not None:
                self._on_evict(h, block.payload)

    def _record(self, block_hash: int, stored: bool) -> None:
        # An opposite pending event cancels out: the index never saw this change.
        if self._pending.get(block_hash) is (not stored):
            del self._pending[block_hash]
        else:
            self._pending[block_hash] = stored
