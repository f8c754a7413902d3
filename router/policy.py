"""Routing decisions: plain Python over what the router knows of each worker.

A decode worker is chosen by how full its batch would be (rows in use, KV waiting, and the
requests this router already sent but the last load poll did not yet see); a prefill worker by
its queued prompt tokens. Ties go round-robin, so idle workers share the work.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass
class WorkerView:
    address: str
    healthy: bool = True
    inflight: int = 0  # requests this router has in flight on it
    # From the worker's last load report:
    active: int = 0  # decode: rows in use + staged + waiting for KV; prefill: queued prompts
    capacity: int = 1  # decode: max rows; prefill: max queue
    queued_tokens: int = 0  # prefill only
    predicted_cached_tokens: int = 0  # prefill only: prefix blocks the index says it holds, in tokens


@dataclass(frozen=True)
class RoutingWeights:
    load: float = 1.0  # cost per unit of load
    cached_tokens: float = 1.0  # prefill: cost saved per cached prompt token, relative to a queued token


class NoWorkers(RuntimeError):
    """No healthy worker of the needed role."""


class Picker:
    def __init__(self, weights: RoutingWeights = RoutingWeights()):
        self.weights = weights
        self._turn = itertools.count()

    def pick_decode(self, workers: list[WorkerView]) -> WorkerView:
        def cost(w: WorkerView) -> float:
            return max(w.active, w.inflight) / max(1, w.capacity)

        return self._cheapest(workers, cost, "decode")

    def pick_prefill(self, workers: list[WorkerView], prompt_tokens: int) -> WorkerView:
        w_load, w_cache = self.weights.load, self.weights.cached_tokens

        def cost(w: WorkerView) -> float:
            # Tokens it must still compute before this prompt is done, less what it has cached.
            backlog = w.queued_tokens + w.inflight * prompt_tokens
            return w_load * backlog + prompt_tokens - w_cache * w.predicted_cached_tokens

        return self._cheapest(workers, cost, "prefill")

    def _cheapest(self, workers, cost, role: str) -> WorkerView:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            raise NoWorkers(f"no healthy {role} worker is available; check that {role} workers are running")
        turn = next(self._turn)
        rotated = healthy[turn % len(healthy):] + healthy[:turn % len(healthy)]
        return min(rotated, key=cost)
