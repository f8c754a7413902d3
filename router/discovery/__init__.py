"""Worker discovery: which prefill and decode workers exist, kept current in a WorkerSet.

`StaticDiscovery` fills it from configuration; `KubernetesDiscovery` follows EndpointSlices.
Both have `start(worker_set)` / `stop()`. `KubernetesDiscovery` is imported on first use, so
routing code that only needs `WorkerSet` does not load the kubernetes client.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from baton.router.discovery.static import StaticDiscovery
from baton.router.discovery.worker_set import ROLES, WorkerSet

if TYPE_CHECKING:
    from baton.config import RouterSettings
    from baton.router.discovery.kubernetes_watch import KubernetesDiscovery

__all__ = ["ROLES", "Discovery", "KubernetesDiscovery", "StaticDiscovery", "WorkerSet", "discovery_from_settings"]

log = logging.getLogger(__name__)


class Discovery(Protocol):
    def start(self, worker_set: WorkerSet) -> None: ...

    def stop(self) -> None: ...


def discovery_from_settings(settings: RouterSettings) -> Discovery:
    """The discovery the router's settings ask for: 'static' (the default), 'kubernetes' or 'file'."""
    if settings.discovery == "static":
        return StaticDiscovery(settings.prefill_workers, settings.decode_workers)
    if settings.discovery == "kubernetes":
        if settings.prefill_workers or settings.decode_workers:
            log.warning("router.prefill_workers/decode_workers are ignored with router.discovery=kubernetes")
        from baton.router.discovery.kubernetes_watch import KubernetesDiscovery
        return KubernetesDiscovery(namespace=settings.namespace, labels=settings.discovery_labels)
    if settings.discovery == "file":
        from baton.router.discovery.file import FileDiscovery
        return FileDiscovery(settings.workers_file)
    raise ValueError(f"router.discovery is {settings.discovery!r}; set it to 'static' (addresses from "
                     "router.prefill_workers/decode_workers), 'kubernetes' (EndpointSlices) or 'file' "
                     "(router.workers_file)")


def __getattr__(name: str):
    if name == "KubernetesDiscovery":
        from baton.router.discovery.kubernetes_watch import KubernetesDiscovery
        return KubernetesDiscovery
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
