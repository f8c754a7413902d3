"""The embedded prefix index: plain Python dicts in the router's process (the default)."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from .base import DEFAULT_MAX_BLOCKS, Clock, IndexStats, PrefixIndex


class InMemoryPrefixIndex(PrefixIndex):
    """Block hash -> holders, plus an LRU order of entries. Thread-safe (one lock): the
    router's request handlers match while the event consumer applies events."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, ttl_s: float | None = None,
                 clock: Clock = time.monotonic):
        super().__init__(max_blocks, ttl_s, clock)
        self._lock = threading.Lock()
        self._holders: dict[int, set[str]] = {}
        # Oldest touch first; the value is the touch time (for ttl_s).
        self._touched: OrderedDict[int, float] = OrderedDict()
        self._blocks_of: dict[str, set[int]] = {}
        self._block_workers = 0
        self._capacity_evictions = 0
        self._expirations = 0

    def _apply_event(self, worker_id: str, stored: list[int], evicted: list[int]) -> None:
        with self._lock:
            now = self._now()
            self._expire(now)
            if stored:
                held = self._blocks_of.setdefault(worker_id, set())
                for h in stored:
                    holders = self._holders.setdefault(h, set())
                    if worker_id not in holders:
                        holders.add(worker_id)
                        held.add(h)
                        self._block_workers += 1
                self._touch(stored, now)
            for h in evicted:
                self._forget(worker_id, h)
            while len(self._holders) > self.max_blocks:
                oldest, _ = self._touched.popitem(last=False)
                self._drop(oldest)
                self._capacity_evictions += 1

    def _match(self, hashes: list[int]) -> dict[str, int]:
        with self._lock:
            now = self._now()
            self._expire(now)
            matched: dict[str, int] = {}
            active: set[str] | None = None
            depth = 0
            for h in hashes:
                holders = self._holders.get(h)
                if not holders:
                    break
                if active is None:
                    active = set(holders)
                elif not active <= holders:
                    for worker_id in active - holders:
                        matched[worker_id] = depth
                    active &= holders
                    if not active:
                        break
                depth += 1
            for worker_id in active or ():
                matched[worker_id] = depth
            self._touch(hashes[:depth], now)
            return matched

    def _remove_worker(self, worker_id: str) -> None:
        with self._lock:
            for h in list(self._blocks_of.get(worker_id, ())):
                self._forget(worker_id, h)

    def workers(self) -> set[str]:
        with self._lock:
            self._expire(self._now())
            return set(self._blocks_of)

    def stats(self) -> IndexStats:
        with self._lock:
            self._expire(self._now())
            return IndexStats(blocks=len(self._holders), block_workers=self._block_workers,
                              workers=len(self._blocks_of), max_blocks=self.max_blocks,
                              capacity_evictions=self._capacity_evictions,
                              expirations=self._expirations)

    def _touch(self, chain: list[int], now: float) -> None:
        # Deepest first, so the chain's first block ends up the most recently touched.
        for h in reversed(chain):
            self._touched[h] = now
            self._touched.move_to_end(h)

    def _expire(self, now: float) -> None:
        if self.ttl_s is None:
            return
        deadline = now - self.ttl_s
        while self._touched:
            oldest, touched_at = next(iter(self._touched.items()))
            if touched_at > deadline:
                break
            del self._touched[oldest]
            self._drop(oldest)
            self._expirations += 1

    def _forget(self, worker_id: str, h: int) -> None:
        holders = self._holders.get(h)
        if holders is None or worker_id not in holders:
            return
        holders.remove(worker_id)
        self._block_workers -= 1
        self._release(worker_id, h)
        if not holders:
            del self._holders[h]
            del self._touched[h]

    def _drop(self, h: int) -> None:
        """Remove entry `h` for every holder (its LRU slot is already gone)."""
        holders = self._holders.pop(h)
        self._block_workers -= len(holders)
        for worker_id in holders:
            self._release(worker_id, h)

    def _release(self, worker_id: str, h: int) -> None:
        held = self._blocks_of[worker_id]
        held.discard(h)
        if not held:
            del self._blocks_of[worker_id]
