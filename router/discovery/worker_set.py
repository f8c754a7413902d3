"""The router's view of which workers exist, per role: plain Python, shared between threads.

Discovery writes it (`replace` a role's whole set at a time); routing reads it (`get`) or
subscribes to changes; startup and tests wait on it (`wait_for`).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")

# callback(role, added, removed), called after every change that adds or removes an address
ChangeCallback = Callable[[str, frozenset, frozenset], None]


class WorkerSet:
    """Current worker addresses (`host:port`) per role."""

    def __init__(self, roles: Iterable[str] = ROLES):
        self._workers: dict[str, frozenset[str]] = {role: frozenset() for role in roles}
        self._changed = threading.Condition()
        # Held while a change is applied and announced, so subscribers see changes in order.
        self._announcing = threading.RLock()
        self._subscribers: list[ChangeCallback] = []

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def get(self, role: str) -> frozenset[str]:
        self._check_role(role)
        with self._changed:
            return self._workers[role]

    def snapshot(self) -> dict[str, frozenset[str]]:
        with self._changed:
            return dict(self._workers)

    def replace(self, role: str, addresses: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
        """Make `addresses` the role's whole set; returns (added, removed) and tells subscribers."""
        self._check_role(role)
        new = frozenset(addresses)
        with self._announcing:
            with self._changed:
                old = self._workers[role]
                self._workers[role] = new
                self._changed.notify_all()
                subscribers = list(self._subscribers)
            added, removed = new - old, old - new
            if added or removed:
                for callback in subscribers:
                    try:
                        callback(role, added, removed)
                    except Exception:  # one broken subscriber must not stop discovery
                        log.exception("worker set subscriber %r failed on a %s change", callback, role)
        return added, removed

    def subscribe(self, callback: ChangeCallback) -> Callable[[], None]:
        """Call `callback(role, added, removed)` on every later change; returns an unsubscribe function."""
        with self._changed:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._changed:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def wait_for(self, predicate: Callable[[Mapping[str, frozenset[str]]], bool], timeout: float) -> bool:
        """Block until `predicate(snapshot)` holds or `timeout` seconds pass; returns whether it held."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(dict(self._workers)), timeout=timeout)

    def _check_role(self, role: str) -> None:
        if role not in self._workers:
            raise ValueError(f"unknown worker role {role!r}; known roles: {list(self._workers)}")
