"""The decode worker's KV events: which prefix blocks its pages hold, for the routers' prefix index.

The scheduler says whose tokens' KV begins or stops being held here (a running row's prompt, a
finished request's retained prompt and answer); this turns that into the same numbered block
events prefill workers publish (`prefill_worker.cache_events`): a block is stored when the first
key holding it arrives and evicted when the last one leaves, under the same chained block hashes
(`baton.block_hash`), so the router matches a prompt against decode and prefill workers alike.

Plain Python; called under the scheduler's lock (publishing never waits on a follower).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from baton.block_hash import BlockHasher
from baton.decode_worker.scheduler import KVListener
from baton.prefill_worker.cache_events import CacheEventLog


class HeldBlocks(KVListener):
    def __init__(self, hasher: BlockHasher, events: CacheEventLog):
        self.hasher = hasher
        self.events = events
        self._keys: dict[str, list[int]] = {}  # key -> its full blocks' hashes, parents first
        self._refs: Counter[int] = Counter()

    def held(self, key: str, tokens: Sequence[int]) -> None:
        hashes = self.hasher.hash_prompt(tokens)
        if not hashes:
            return
        previous = self._keys.pop(key, [])
        stored = [h for h in hashes if not self._refs[h]]
        self._refs.update(hashes)
        self._keys[key] = hashes
        evicted = self._unref(previous)
        self.events.publish(stored=stored, evicted=evicted)

    def dropped(self, key: str) -> None:
        hashes = self._keys.pop(key, None)
        if hashes:
            self.events.publish(evicted=self._unref(hashes))

    def _unref(self, hashes: list[int]) -> list[int]:
        gone = []
        for h in reversed(hashes):  # children before parents
            self._refs[h] -= 1
            if not self._refs[h]:
                del self._refs[h]
                gone.append(h)
        return gone
