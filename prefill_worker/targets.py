"""Where a prefill worker may push KV: only to decode workers of its own cluster, never to any
address a caller names (that would make it a port scanner and an SSRF relay).

Two sources, as for the router: `prefill.decode_workers` (static; `baton up` and compose set it),
or with `prefill.discovery: kubernetes` the decode workers its own EndpointSlice watch sees (the
router's discovery, decode role only), or with `file` those of the workers file `baton up` rewrites. An empty static list allows any target: callers already
hold the cluster token. The router and this worker notice a new decode pod at slightly
different moments, so a target not seen yet is waited for briefly before it is refused.
"""
from __future__ import annotations

import logging
from typing import Iterable

from baton.config import PrefillSettings
from baton.router.discovery.worker_set import WorkerSet

log = logging.getLogger(__name__)

DISCOVERY_GRACE_S = 2.0  # how long a Prefill naming a decode worker not discovered yet waits for it


class DecodeTargets:
    def __init__(self, static: Iterable[str] = (), discovered: WorkerSet | None = None, discovery=None,
                 source: str = "prefill.decode_workers", grace_s: float = DISCOVERY_GRACE_S):
        self.static = frozenset(static)
        self.discovered = discovered
        self.discovery = discovery
        self.source = source
        self.grace_s = grace_s

    @classmethod
    def from_settings(cls, settings: PrefillSettings, api_client=None) -> "DecodeTargets":
        if settings.discovery == "file":
            from baton.router.discovery.file import FileDiscovery
            discovered = WorkerSet(roles=("decode",))
            discovery = FileDiscovery(settings.workers_file, roles=("decode",))
            discovery.start(discovered)
            return cls(discovered=discovered, discovery=discovery, source=f"the decode workers of {settings.workers_file}")
        if settings.discovery != "kubernetes":
            return cls(settings.decode_workers)
        if settings.decode_workers:
            log.warning("prefill.decode_workers is ignored with prefill.discovery=kubernetes")
        from baton.router.discovery.kubernetes_watch import KubernetesDiscovery
        discovered = WorkerSet(roles=("decode",))
        discovery = KubernetesDiscovery(namespace=settings.namespace, roles=("decode",), api_client=api_client,
                                        labels=settings.discovery_labels)
        discovery.start(discovered)
        return cls(discovered=discovered, discovery=discovery,
                   source=f"the decode workers discovered in namespace {discovery.namespace}")

    def allows(self, target: str) -> bool:
        """Whether KV may go to `target` (host:port); may wait up to grace_s for discovery."""
        if self.discovered is None:
            return not self.static or target in self.static
        return self.discovered.wait_for(lambda current: target in current["decode"], timeout=self.grace_s)

    def describe(self) -> str:
        """The decode workers this worker knows, for a log line."""
        known = self.discovered.get("decode") if self.discovered is not None else self.static
        return f"{self.source}: {sorted(known) or 'any'}"

    def stop(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()
