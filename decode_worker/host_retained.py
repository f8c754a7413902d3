"""Retained conversations' KV in host memory: where a retained entry goes when its device pages
are needed (`scheduler.SchedulerOutput.demoted`), within the host KV pool's bound.

The pool holds these bytes as yielding (`kvtransfer.staging.StagingPool.hold(yields=True)`):
landed KV, parked rows and newer entries take them back, oldest first, whenever they need the
room, and the worker forgets the entry then (its KV events say so). A local prefill finding more
of its prompt here than in the device pages copies it from here (`find`).

Thread-safe: the decode loop adds and finds, the pool's threads take back.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from baton.block_hash import common_prefix
from baton.engine.kv import SequenceKV


class HostRetained:
    def __init__(self):
        self._entries: OrderedDict[str, tuple[tuple[int, ...], SequenceKV]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def add(self, key: str, tokens: Sequence[int], kv: SequenceKV) -> None:
        """Keep `kv`, the KV of `tokens`, under `key` (its bytes already held in the pool)."""
        with self._lock:
            self._entries[key] = (tuple(tokens), kv)
            self._entries.move_to_end(key)

    def pop(self, key: str) -> bool:
        with self._lock:
            return self._entries.pop(key, None) is not None

    def find(self, prompt: Sequence[int], limit: int) -> tuple[int, SequenceKV] | None:
        """The entry holding the most of `prompt`'s leading tokens, at most `limit` of them: (how
        many, its KV, of which that many tokens are the prompt's). None if none holds any."""
        with self._lock:
            best, best_key = None, None
            for key, (tokens, kv) in self._entries.items():
                count = min(common_prefix(prompt, tokens), limit)
                if count and (best is None or count > best[0]):
                    best, best_key = (count, kv), key
            if best_key is not None:
                self._entries.move_to_end(best_key)
            return best

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
