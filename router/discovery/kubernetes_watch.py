"""Kubernetes discovery: each role's workers follow its EndpointSlices through list + watch.

Per role, one daemon thread runs the reflector loop client-go runs: list the role's slices,
then watch from the list's resourceVersion. A watch that breaks (connection error, timeout)
resumes from the last resourceVersion seen, after a backoff; a 410 Gone (expired
resourceVersion) or any other API error relists, since the events in between are lost.
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import kubernetes

from baton.router.discovery.endpoint_slices import role_selector, routable_addresses, service_selector
from baton.router.discovery.worker_set import ROLES, WorkerSet

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def current_namespace() -> str:
    """The pod's own namespace when running in a cluster, else 'default'."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def load_api_client() -> kubernetes.client.ApiClient:
    """In-cluster service account config inside a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        try:
            # KUBECONFIG read now, not when the kubernetes package was imported
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                               client_configuration=configuration)
        except (kubernetes.config.ConfigException, OSError) as exc:
            raise RuntimeError(
                f"kubernetes discovery found neither an in-cluster service account nor a kubeconfig ({exc}); "
                "run the router in a pod, point KUBECONFIG at a cluster, or set router.discovery=static") from exc
    return kubernetes.client.ApiClient(configuration)


class Backoff:
    """Exponential backoff with jitter, reset after progress."""

    def __init__(self, initial_s: float, max_s: float):
        self.initial_s, self.max_s = initial_s, max_s
        self._next_s = initial_s

    def next_delay(self) -> float:
        delay = self._next_s
        self._next_s = min(self.max_s, self._next_s * 2)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._next_s = self.initial_s


class KubernetesDiscovery:
    """Keeps a WorkerSet equal to the ready, non-terminating endpoints of each role's EndpointSlices.

    A role's slices are chosen by `service_names[role]` (the slices of that Service), else by
    `selectors[role]`, else by `app.kubernetes.io/name=baton,baton.io/role=<role>` plus `labels`
    (e.g. `app.kubernetes.io/instance=prod`: one release's workers among several in a namespace).
    """

    def __init__(self, namespace: str = "", selectors: Mapping[str, str] | None = None,
                 service_names: Mapping[str, str] | None = None, port_name: str = "grpc",
                 api_client: kubernetes.client.ApiClient | None = None, roles: Iterable[str] = ROLES,
                 watch_timeout_s: float = 300.0, request_timeout_s: float = 10.0,
                 initial_backoff_s: float = 0.1, max_backoff_s: float = 10.0, labels: str = ""):
        selectors, service_names = dict(selectors or {}), dict(service_names or {})
        self.roles = tuple(roles)
        for role in set(selectors) | set(service_names):
            if role not in self.roles:
                raise ValueError(f"selector given for unknown role {role!r}; roles: {list(self.roles)}")
            if role in selectors and role in service_names:
                raise ValueError(f"role {role!r} has both a service name and a label selector; give one")
        self.selectors = {role: service_selector(service_names[role]) if role in service_names
                          else selectors.get(role, ",".join(filter(None, [role_selector(role), labels])))
                          for role in self.roles}
        self.namespace = namespace or current_namespace()
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.initial_backoff_s, self.max_backoff_s = initial_backoff_s, max_backoff_s
        self._api_client = api_client
        self._owns_api_client = api_client is None
        self._stopping = threading.Event()
        self._watchers: list[_RoleWatcher] = []
        self._threads: list[threading.Thread] = []

    def start(self, worker_set: WorkerSet) -> None:
        if self._threads:
            raise RuntimeError("KubernetesDiscovery.start() was already called; make a new one")
        if self._api_client is None:
            self._api_client = load_api_client()
        api = kubernetes.client.DiscoveryV1Api(self._api_client)
        for role in self.roles:
            watcher = _RoleWatcher(self, api, role, worker_set)
            thread = threading.Thread(target=watcher.run, name=f"baton-discovery-{role}", daemon=True)
            self._watchers.append(watcher)
            self._threads.append(thread)
            thread.start()
        log.info("watching EndpointSlices in namespace %s: %s", self.namespace, self.selectors,
                 extra={"namespace": self.namespace, "selectors": self.selectors})

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the watch threads: a blocked watch read is interrupted by closing its socket."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for watcher, thread in zip(self._watchers, self._threads):
            # Repeated: a watch may open its connection just after an interrupt.
            while thread.is_alive() and time.monotonic() < deadline:
                watcher.interrupt()
                thread.join(timeout=0.05)
            if thread.is_alive():
                log.warning("discovery thread %s did not stop within %.1fs", thread.name, timeout_s)
        if self._owns_api_client and self._api_client is not None:
            self._api_client.close()


class _RoleWatcher:
    """The list + watch loop for one role; its state is touched only by its own thread."""

    def __init__(self, owner: KubernetesDiscovery, api: kubernetes.client.DiscoveryV1Api, role: str,
                 worker_set: WorkerSet):
        self.owner, self.api, self.role, self.worker_set = owner, api, role, worker_set
        self.selector = owner.selectors[role]
        self.addresses_by_slice: dict[str, frozenset[str]] = {}
        self.resource_version: str | None = None
        self.backoff = Backoff(owner.initial_backoff_s, owner.max_backoff_s)  # reset by every success
        self._watch: kubernetes.watch.Watch | None = None
        self._fields = {"role": role, "namespace": owner.namespace, "selector": self.selector}

    def interrupt(self) -> None:
        watch = self._watch
        if watch is not None:
            watch.stop()

    def run(self) -> None:
        stopping, must_list = self.owner._stopping, True
        while not stopping.is_set():
            expired = False
            try:
                if must_list:
                    self._relist()
                    must_list = False
                if self._watch_until_closed():
                    continue  # the server ended the watch on time: resume at once
                reason = "the watch ended at once, with no events"
            except kubernetes.client.ApiException as exc:
                must_list = True  # 410 Gone or another API error: the event history can't be trusted
                expired = exc.status == 410  # routine: the apiserver compacted its history
                reason = f"API error {exc.status} {exc.reason}"
            except Exception as exc:  # connection refused, reset, read timeout: resume where we were
                reason = f"{type(exc).__name__}: {exc}"
            if stopping.is_set():
                break
            delay = self.backoff.next_delay()
            log.log(logging.INFO if expired else logging.WARNING, "%s EndpointSlice %s failed (%s); %s in %.2fs",
                    self.role, "list" if self.resource_version is None else "watch", reason,
                    "relisting" if must_list else f"resuming from resourceVersion {self.resource_version}",
                    delay, extra={**self._fields, "reason": reason, "relist": must_list})
            stopping.wait(delay)

    def _relist(self) -> None:
        self.resource_version = None
        listing = self.api.list_namespaced_endpoint_slice(
            self.owner.namespace, label_selector=self.selector, _request_timeout=self.owner.request_timeout_s)
        self.addresses_by_slice = {item.metadata.name: routable_addresses(item, self.owner.port_name)
                                   for item in listing.items or []}
        self.resource_version = listing.metadata.resource_version
        self.backoff.reset()
        log.info("listed %d %s EndpointSlices at resourceVersion %s", len(self.addresses_by_slice), self.role,
                 self.resource_version, extra={**self._fields, "slices": sorted(self.addresses_by_slice),
                                               "resource_version": self.resource_version})
        self._publish()

    def _watch_until_closed(self) -> bool:
        """Apply watch events until the stream ends; True when it ended normally after some use."""
        watch = kubernetes.watch.Watch()
        self._watch = watch
        opened = time.monotonic()
        events = 0
        try:
            if self.owner._stopping.is_set():
                return True
            timeout_s = self.owner.watch_timeout_s * random.uniform(1.0, 1.2)  # spread watch restarts
            stream = watch.stream(
                self.api.list_namespaced_endpoint_slice, self.owner.namespace, label_selector=self.selector,
                resource_version=self.resource_version, allow_watch_bookmarks=True,
                timeout_seconds=int(timeout_s),
                _request_timeout=(self.owner.request_timeout_s, timeout_s + self.owner.request_timeout_s))
            for event in stream:
                if self.owner._stopping.is_set():
                    return True
                self._apply(event)
                events += 1
        finally:
            self._watch = None
        # A stream the server closes at once, again and again, must not spin: count it as a failure.
        if events > 0 or time.monotonic() - opened >= 1.0:
            self.backoff.reset()
            return True
        return False

    def _apply(self, event: dict) -> None:
        kind = event["type"]
        if kind == "BOOKMARK":
            self.resource_version = event["raw_object"]["metadata"]["resourceVersion"]
            return
        endpoint_slice = event["object"]
        name = endpoint_slice.metadata.name
        if kind in ("ADDED", "MODIFIED"):
            self.addresses_by_slice[name] = routable_addresses(endpoint_slice, self.owner.port_name)
        elif kind == "DELETED":
            self.addresses_by_slice.pop(name, None)
        self.resource_version = endpoint_slice.metadata.resource_version
        self.backoff.reset()
        log.debug("%s EndpointSlice %s %s at resourceVersion %s", self.role, name, kind, self.resource_version,
                  extra={**self._fields, "endpoint_slice": name, "event": kind})
        self._publish()

    def _publish(self) -> None:
        current = frozenset().union(*self.addresses_by_slice.values())
        added, removed = self.worker_set.replace(self.role, current)
        if added or removed:
            log.info("%s workers changed: added %s, removed %s; %d now", self.role, sorted(added),
                     sorted(removed), len(current),
                     extra={**self._fields, "added": sorted(added), "removed": sorted(removed),
                            "workers": sorted(current)})
