"""Routing decisions: plain Python over what the router knows of each worker.

A decode worker is chosen by how full it would be: the larger of its rows' fill (rows in use, KV
waiting, and the requests this router already sent but the last load poll did not yet see) and
its KV budget's once the prompt's KV lands there. A prefill worker is chosen by its backlog of
prompt tokens (`prefill_backlog`) less the prompt tokens it holds cached. Ties go round-robin, so
idle workers share the work.

A decode worker that holds a prompt's prefix (a conversation's earlier turns, kept after they
finished) and has room is chosen over the others (`pick_holder`): its KV need not travel again,
and when the rest is short it prefills that rest itself (conditional disaggregation).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class WorkerView:
    address: str
    healthy: bool = True
    inflight: int = 0  # requests this router has in flight on it
    inflight_tokens: int = 0  # prefill: prompt tokens of this router's requests it has not finished prefilling
    # From the worker's last load report:
    active: int = 0  # decode: rows in use + staged + waiting for KV; prefill: queued prompts
    capacity: int = 1  # decode: max rows; prefill: max queue
    queued_tokens: int = 0  # prefill only
    predicted_cached_tokens: int = 0  # prefix blocks the index says it holds, in tokens
    kv_used_bytes: int = 0  # decode only: KV of its rows plus landed KV waiting for one
    kv_capacity_bytes: int = 0  # decode only: its KV budget (0: not reported, rows alone decide)
    kv_bytes_per_token: int = 0  # decode only
    pulls_kv: bool = False  # prefill only: reads the KV a decode worker holds of a prompt (prefill.pull_kv)


@dataclass(frozen=True)
class RoutingWeights:
    load: float = 1.0  # cost per unit of load
    cached_tokens: float = 1.0  # prefill: cost saved per cached prompt token, relative to a queued token


class NoWorkers(RuntimeError):
    """No healthy worker of the needed role."""


class Picker:
    def __init__(self, weights: RoutingWeights = RoutingWeights()):
        self.weights = weights
        self._turns = {"decode": itertools.count(), "prefill": itertools.count()}  # one rotation per role

    def pick_decode(self, workers: list[WorkerView], prompt_tokens: int = 0) -> WorkerView:
        return self._cheapest(workers, lambda w: decode_fill(w, prompt_tokens), "decode")

    @staticmethod
    def prefill_here(holder: WorkerView, prefill: WorkerView | None, prompt_tokens: int,
                     most: int) -> tuple[bool, str]:
        """Whether the decode worker holding most of a prompt should prefill the rest itself, and why.

        In tokens of waiting, summed over the requests that wait: there, every row decoding on that
        worker waits for each chunk of the rest as well as the request itself (rest x (1 + rows); the
        rest's chunks alternate with their steps); on the prefill worker, whose core nothing else
        needs, the prompt runs after its queue from what it holds: its own cache, or, where it reads
        the decode worker's KV (`pulls_kv`), the held prefix too (a transfer, counted as free: the
        worker reads only when that is measured faster than computing); the rest's KV then travels.
        At 8 concurrent conversations on 2 cores, weighing the request's own wait alone (twice the
        rest) kept turns on a busy decode worker and cost 18% of the tokens per second
        (docs/bench.md, chat)."""
        held = holder.predicted_cached_tokens
        rest = prompt_tokens - held
        said = f"decode worker {holder.address} holds {held} of {prompt_tokens} prompt tokens"
        if rest > most:
            return False, f"{said}, but the other {rest} are more than router.local_prefill_max_tokens ({most}): " \
                          "prefilled on a prefill worker, which pushes only them"
        if prefill is None:
            return True, f"{said}: prefills the other {rest} there (no prefill worker is available)"
        here = rest * (1 + holder.active)
        found = max(prefill.predicted_cached_tokens, held if prefill.pulls_kv else 0)
        there = prompt_tokens - found + prefill_backlog(prefill)
        if here <= there:
            return True, f"{said}: prefills the other {rest} there (about {here} tokens of waiting, against " \
                         f"{there} on prefill worker {prefill.address})"
        reads = ", which reads the held KV and pushes back only the rest" if prefill.pulls_kv else \
            ", which pushes only them"
        return False, f"{said}, but prefilling the other {rest} there (about {here} tokens of waiting, its rows " \
                      f"decoding) costs more than on prefill worker {prefill.address} ({there}){reads}"

    def pick_holder(self, workers: list[WorkerView], prompt_tokens: int) -> WorkerView | None:
        """The healthy decode worker holding the most of the prompt (`predicted_cached_tokens`) with
        a row and KV room for the rest; None if none holds any."""
        holders = [w for w in workers if w.healthy and w.predicted_cached_tokens > 0
                   and decode_fill(w, prompt_tokens - w.predicted_cached_tokens, joining=True) <= 1.0]
        return max(holders, key=lambda w: (w.predicted_cached_tokens, -decode_fill(w, prompt_tokens)), default=None)

    def pick_prefill(self, workers: list[WorkerView], prompt_tokens: int) -> WorkerView:
        w_load, w_cache = self.weights.load, self.weights.cached_tokens

        def cost(w: WorkerView) -> float:
            # Tokens it must still compute before this prompt is done, less what it has cached.
            return w_load * prefill_backlog(w) + prompt_tokens - w_cache * w.predicted_cached_tokens

        return self._cheapest(workers, cost, "prefill")

    def _cheapest(self, workers, cost, role: str) -> WorkerView:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            raise NoWorkers(f"no healthy {role} worker is available; check that {role} workers are running")
        turn = next(self._turns[role])
        rotated = healthy[turn % len(healthy):] + healthy[:turn % len(healthy)]
        return min(rotated, key=cost)


def prefill_backlog(w: WorkerView) -> int:
    """Prompt tokens a prefill worker has to compute before a new prompt: the larger of what its
    last load report said waits in its queue (every router's prompts, up to a poll old, less the one
    it is computing) and what this router has sent it and not yet seen prefilled. Summed, this
    router's queued prompts would count twice."""
    return max(w.queued_tokens, w.inflight_tokens)


def decode_fill(w: WorkerView, prompt_tokens: int = 0, joining: bool = False) -> float:
    """How full a decode worker would be with a prompt of `prompt_tokens` more KV tokens (1.0: its
    rows or KV are full); `joining` counts the request's own row."""
    rows = (max(w.active, w.inflight) + joining) / max(1, w.capacity)
    if not w.kv_capacity_bytes:
        return rows
    kv = (w.kv_used_bytes + prompt_tokens * w.kv_bytes_per_token) / w.kv_capacity_bytes
    return max(rows, kv)


class PendingPrefixes:
    """Prompt prefixes just sent to a prefill worker, before its cache events say it holds them.

    A request arriving meanwhile with the same prefix is predicted to find it there, so concurrent
    same-prefix requests meet on one worker instead of each computing the prefix. An entry lasts
    `ttl_s` (the worker's events take over by then); at most `max_entries` (worker, block) pairs
    are kept, the oldest dropped first. Thread-safe."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 65_536, clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0 or max_entries < 1:
            raise ValueError(f"PendingPrefixes needs ttl_s > 0 and max_entries >= 1, got {ttl_s}, {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._expiry: OrderedDict[tuple[str, int], float] = OrderedDict()  # (worker, block) -> expiry, oldest first
        self._holders: dict[int, set[str]] = {}

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, worker: str, block_hashes: Sequence[int]) -> None:
        """`worker` is computing this chain of blocks (a prompt's, from its first)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            for h in block_hashes:
                key = (worker, h)
                self._expiry.pop(key, None)
                self._expiry[key] = now + self.ttl_s
                self._holders.setdefault(h, set()).add(worker)
            while len(self._expiry) > self.max_entries:
                self._drop(*self._expiry.popitem(last=False)[0])

    def forget(self, worker: str) -> None:
        """`worker` is gone (or restarted): it computes nothing we sent it."""
        with self._lock:
            for key in [k for k in self._expiry if k[0] == worker]:
                del self._expiry[key]
                self._drop(*key)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of `block_hashes` it is computing."""
        with self._lock:
            self._expire(self._clock())
            matched: dict[str, int] = {}
            active: set[str] | None = None
            for depth, h in enumerate(block_hashes):
                holders = self._holders.get(h, set())
                still = set(holders) if active is None else active & holders
                for worker in (active or set()) - still:
                    matched[worker] = depth
                active = still
                if not active:
                    break
            else:
                for worker in active or ():
                    matched[worker] = len(block_hashes)
            return matched

    def _expire(self, now: float) -> None:
        while self._expiry:
            key, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                return
            del self._expiry[key]
            self._drop(*key)

    def _drop(self, worker: str, h: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]
