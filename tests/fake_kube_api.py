"""A loopback Kubernetes API server for EndpointSlices: the list/watch protocol subset, over real HTTP.

It serves `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` as the apiserver does:
a list answers an `EndpointSliceList` carrying the current resourceVersion; `watch=true` answers a
chunked stream of newline-delimited JSON events (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR) after
the given resourceVersion, filtered by `labelSelector` (equality, set and existence forms), ended
after `timeoutSeconds`. A watch from a compacted resourceVersion gets the apiserver's ERROR event
with a 410 `Expired` Status (or, with `gone_as_http_status`, an HTTP 410 answer).

For the planner it also serves a Deployment's `scale` subresource (GET, PATCH) and pods (list by
label selector, PATCH of their metadata): a scale-down deletes the Deployment's pods with the
lowest `controller.kubernetes.io/pod-deletion-cost` first, as the ReplicaSet controller does, and
every call is recorded in `calls` as (verb, resource, name).

Tests drive it with `put_slice` / `delete_slice`, and break things with `break_watches` (drop
every open watch connection mid-stream), `refuse_watches` (drop new watch connections unanswered,
as an unreachable apiserver) and `compact` (expire every resourceVersion seen so far).
"""
from __future__ import annotations

import copy
import json
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import kubernetes

SLICES_PATH = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")
SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
PODS_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
SET_REQUIREMENT = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def endpoint(ip: str, ready: bool | None = True, terminating: bool | None = None,
             serving: bool | None = None) -> dict:
    """One EndpointSlice endpoint; a condition given as None is left out of the object."""
    conditions = {key: value for key, value in
                  (("ready", ready), ("serving", serving), ("terminating", terminating)) if value is not None}
    return {"addresses": [ip], "conditions": conditions}


def label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """The apiserver's label selector grammar: k=v, k==v, k!=v, k in (a,b), k notin (a), k, !k."""
    for requirement in _split_requirements(selector):
        set_form = SET_REQUIREMENT.match(requirement)
        if set_form:
            key, operator, values = set_form.groups()
            inside = labels.get(key) in {value.strip() for value in values.split(",")}
            if inside != (operator == "in"):
                return False
        elif "!=" in requirement:
            key, value = (part.strip() for part in requirement.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in requirement:
            key, value = (part.strip() for part in requirement.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif requirement.startswith("!"):
            if requirement[1:].strip() in labels:
                return False
        elif requirement not in labels:
            return False
    return True


def _split_requirements(selector: str) -> list[str]:
    """Split at the commas that separate requirements, not those inside `in (a,b)`."""
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return [part for part in parts if part]


@dataclass
class Event:
    resource_version: int
    type: str  # ADDED, MODIFIED or DELETED
    object: dict
    previous: dict | None  # the object before this change: a watch whose selector it leaves sees DELETED


@dataclass
class RecordedRequest:
    namespace: str
    query: dict[str, str]

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


class FakeKubeApi:
    """An EndpointSlice store with a resourceVersion history, served on 127.0.0.1 (a free port)."""

    def __init__(self, gone_as_http_status: bool = False):
        self.gone_as_http_status = gone_as_http_status
        self.requests: list[RecordedRequest] = []
        self.calls: list[tuple[str, str, str]] = []  # planner calls: (verb, resource, name)
        self.deployments: dict[tuple[str, str], dict] = {}  # (namespace, name) -> replicas, pod labels
        self.pods: dict[tuple[str, str], dict] = {}  # (namespace, name) -> labels, ip, annotations
        self._changed = threading.Condition()
        self._slices: dict[tuple[str, str], dict] = {}
        self._history: list[Event] = []
        self._resource_version = 1000
        self._compacted_version = self._resource_version  # watches from before this get 410
        self._bookmark_version = 0
        self._break_epoch = 0
        self._refusing_watches = False
        self._stopped = False
        self._connections: set[socket.socket] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = False  # server_close() joins every handler thread
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),  # 50 ms to shut down
                                        name="fake-kube-api", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def api_client(self) -> kubernetes.client.ApiClient:
        """A real `kubernetes` ApiClient pointed at this server."""
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        return kubernetes.client.ApiClient(configuration)

    def start(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
            connections = list(self._connections)
        self._server.shutdown()
        for connection in connections:  # idle keep-alive connections would hold their handler threads
            _shutdown(connection)
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # --- Deployments and pods (the planner) ---------------------------------------------------

    def put_deployment(self, name: str, labels: dict[str, str], ips: list[str], namespace: str = "default") -> None:
        """A Deployment whose pods carry `labels`, one running pod per address."""
        self.deployments[(namespace, name)] = {"replicas": len(ips), "labels": dict(labels)}
        for i, ip in enumerate(ips):
            self.pods[(namespace, f"{name}-{i}")] = {"labels": dict(labels), "ip": ip, "annotations": {}}

    def pod_ips(self, labels: dict[str, str], namespace: str = "default") -> list[str]:
        return sorted(pod["ip"] for (ns, _), pod in self.pods.items()
                      if ns == namespace and labels.items() <= pod["labels"].items())

    def _scale(self, namespace: str, name: str) -> dict:
        deployment = self.deployments[(namespace, name)]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": deployment["replicas"]},
                "status": {"replicas": deployment["replicas"],
                           "selector": ",".join(f"{k}={v}" for k, v in deployment["labels"].items())}}

    def _set_replicas(self, namespace: str, name: str, replicas: int) -> None:
        """The ReplicaSet controller's part: pods made or deleted, the lowest deletion cost first."""
        deployment = self.deployments[(namespace, name)]
        mine = [key for key, pod in self.pods.items()
                if key[0] == namespace and deployment["labels"].items() <= pod["labels"].items()]
        mine.sort(key=lambda key: (int(self.pods[key]["annotations"].get(DELETION_COST, "0")), key[1]))
        for key in mine[:max(len(mine) - replicas, 0)]:
            del self.pods[key]
        for i in range(len(mine), replicas):
            self.pods[(namespace, f"{name}-new-{i}")] = {"labels": dict(deployment["labels"]),
                                                        "ip": f"10.99.0.{i}", "annotations": {}}
        deployment["replicas"] = replicas

    def _pod(self, namespace: str, name: str) -> dict:
        pod = self.pods[(namespace, name)]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": pod["labels"],
                             "annotations": pod["annotations"]},
                "spec": {"containers": [{"name": "baton"}]}, "status": {"phase": "Running", "podIP": pod["ip"]}}

    # --- the store -------------------------------------------------------------------------

    def put_slice(self, name: str, endpoints: list[dict], ports: list[dict] | None = None,
                  labels: dict[str, str] | None = None, namespace: str = "default",
                  address_type: str = "IPv4") -> dict:
        """Create or replace an EndpointSlice; watchers see ADDED or MODIFIED."""
        ports = [{"name": "grpc", "port": 50061, "protocol": "TCP"}] if ports is None else ports
        body = copy.deepcopy({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                              "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
                              "addressType": address_type, "endpoints": endpoints, "ports": ports})
        with self._changed:
            previous = self._slices.get((namespace, name))
            self._record("MODIFIED" if previous else "ADDED", body, previous)
            self._slices[(namespace, name)] = body
        return body

    def delete_slice(self, name: str, namespace: str = "default") -> None:
        with self._changed:
            previous = self._slices.pop((namespace, name))
            self._record("DELETED", copy.deepcopy(previous), previous)

    def compact(self) -> None:
        """Expire every resourceVersion handed out so far, as etcd compaction does; open watches get 410."""
        with self._changed:
            self._resource_version += 1  # other objects moved the cluster-wide revision on
            self._compacted_version = self._resource_version
            self._history.clear()
            self._changed.notify_all()

    def send_bookmarks(self) -> str:
        """Watches that asked for bookmarks and are behind get one; returns its resourceVersion."""
        with self._changed:
            self._resource_version += 1
            self._bookmark_version = self._resource_version
            self._changed.notify_all()
            return str(self._bookmark_version)

    def break_watches(self) -> None:
        """Drop every open watch connection mid-stream, without the closing chunk."""
        with self._changed:
            self._break_epoch += 1
            self._changed.notify_all()

    def refuse_watches(self, refuse: bool = True) -> None:
        """While refusing, new watch connections are closed unanswered (an unreachable apiserver)."""
        with self._changed:
            self._refusing_watches = refuse
            if refuse:
                self._break_epoch += 1
            self._changed.notify_all()

    def list_requests(self) -> list[RecordedRequest]:
        return [request for request in self.requests if not request.is_watch]

    def watch_requests(self) -> list[RecordedRequest]:
        return [request for request in self.requests if request.is_watch]

    def _record(self, kind: str, body: dict, previous: dict | None) -> None:
        self._resource_version += 1
        body["metadata"]["resourceVersion"] = str(self._resource_version)
        snapshot = copy.deepcopy(body)
        self._history.append(Event(self._resource_version, kind, snapshot, previous))
        self._changed.notify_all()

    # --- serving (called from handler threads) -----------------------------------------------

    def _list(self, namespace: str, selector: str) -> dict:
        with self._changed:
            items = [copy.deepcopy(body) for (ns, _), body in sorted(self._slices.items())
                     if ns == namespace and label_selector_matches(selector, body["metadata"]["labels"])]
            return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self._resource_version)}, "items": items}

    def _watch_events(self, namespace: str, selector: str, since: str, deadline: float, bookmarks: bool):
        """Yield watch event dicts until the deadline; None means drop the connection now.

        Events are gathered under the lock and yielded outside it, so a slow reader never blocks writers.
        """
        with self._changed:
            epoch, compacted_at_start = self._break_epoch, self._compacted_version
            if since in ("", "0"):  # "any version": the current state first, as synthetic ADDED events
                batch = [{"type": "ADDED", "object": body} for (ns, _), body in sorted(self._slices.items())
                         if ns == namespace and label_selector_matches(selector, body["metadata"]["labels"])]
                cursor = self._resource_version
            elif int(since) < self._compacted_version:
                batch, cursor = [_gone_event(int(since), self._compacted_version)], None
            else:
                batch, cursor = [], int(since)
            bookmark_seen = cursor or 0  # a watch from before the latest bookmark gets it too
        yield from batch
        while cursor is not None:
            with self._changed:
                self._changed.wait_for(lambda: self._stopped or self._break_epoch != epoch
                                       or self._compacted_version != compacted_at_start
                                       or self._history and self._history[-1].resource_version > cursor
                                       or bookmarks and self._bookmark_version > bookmark_seen,
                                       timeout=max(0.0, deadline - time.monotonic()))
                if self._stopped or self._break_epoch != epoch:
                    batch, cursor = [None], None
                elif self._compacted_version != compacted_at_start:
                    batch, cursor = [_gone_event(cursor, self._compacted_version)], None
                else:
                    batch = []
                    for event in [e for e in self._history if e.resource_version > cursor]:
                        cursor = event.resource_version
                        visible = _visible_type(event, namespace, selector)
                        if visible:
                            batch.append({"type": visible, "object": event.object})
                    if bookmarks and self._bookmark_version > bookmark_seen:
                        bookmark_seen = cursor = self._bookmark_version
                        batch.append({"type": "BOOKMARK", "object": {
                            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                            "metadata": {"resourceVersion": str(cursor)}}})
                    if not batch and time.monotonic() >= deadline:
                        cursor = None
            yield from batch


def _visible_type(event: Event, namespace: str, selector: str) -> str | None:
    """What a watch with this selector sees of a change: objects leaving the selection are DELETED."""
    if event.object["metadata"]["namespace"] != namespace:
        return None
    matches_now = label_selector_matches(selector, event.object["metadata"]["labels"])
    matched_before = event.previous is not None and label_selector_matches(
        selector, event.previous["metadata"]["labels"])
    if event.type == "DELETED":
        return "DELETED" if matches_now else None
    if matches_now:
        return "MODIFIED" if matched_before else "ADDED"
    return "DELETED" if matched_before else None


def _gone_status(since: int, oldest: int) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f"too old resource version: {since} ({oldest})", "reason": "Expired", "code": 410}


def _gone_event(since: int, oldest: int) -> dict:
    return {"type": "ERROR", "object": _gone_status(since, oldest)}


def _shutdown(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer


def _make_handler(api: FakeKubeApi):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive and chunked streams, as the apiserver

        def setup(self):
            super().setup()
            with api._changed:
                api._connections.add(self.connection)

        def finish(self):
            with api._changed:
                api._connections.discard(self.connection)
            super().finish()

        def log_message(self, *args):
            pass  # quiet tests

        def do_PATCH(self):
            url = urlsplit(self.path)
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            scale, pod = SCALE_PATH.match(url.path), POD_PATH.match(url.path)
            with api._changed:
                if scale and (scale.group(1), scale.group(2)) in api.deployments:
                    api.calls.append(("patch", "deployments/scale", scale.group(2)))
                    api._set_replicas(scale.group(1), scale.group(2), int(body["spec"]["replicas"]))
                    return self._send_json(200, api._scale(scale.group(1), scale.group(2)))
                if pod and (pod.group(1), pod.group(2)) in api.pods:
                    api.calls.append(("patch", "pods", pod.group(2)))
                    annotations = body.get("metadata", {}).get("annotations", {})
                    api.pods[(pod.group(1), pod.group(2))]["annotations"].update(annotations)
                    return self._send_json(200, api._pod(pod.group(1), pod.group(2)))
            self._send_json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                  "message": f"the server could not find {url.path}", "code": 404})

        def do_GET(self):
            url = urlsplit(self.path)
            scale, pods = SCALE_PATH.match(url.path), PODS_PATH.match(url.path)
            with api._changed:
                if scale and (scale.group(1), scale.group(2)) in api.deployments:
                    api.calls.append(("get", "deployments/scale", scale.group(2)))
                    return self._send_json(200, api._scale(scale.group(1), scale.group(2)))
                if pods:
                    selector = {k: values[-1] for k, values in parse_qs(url.query).items()}.get("labelSelector", "")
                    api.calls.append(("list", "pods", ""))
                    items = [api._pod(ns, name) for (ns, name), pod in sorted(api.pods.items())
                             if ns == pods.group(1) and label_selector_matches(selector, pod["labels"])]
                    return self._send_json(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {},
                                                 "items": items})
            match = SLICES_PATH.match(url.path)
            if not match:
                return self._send_json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                             "message": f"the server could not find {url.path}",
                                             "reason": "NotFound", "code": 404})
            query = {key: values[-1] for key, values in parse_qs(url.query).items()}
            namespace, selector = match.group(1), query.get("labelSelector", "")
            api.requests.append(RecordedRequest(namespace, query))
            if query.get("watch") not in ("true", "1"):
                return self._send_json(200, api._list(namespace, selector))
            self._serve_watch(namespace, selector, query)

        def _serve_watch(self, namespace: str, selector: str, query: dict[str, str]):
            since = query.get("resourceVersion", "")
            with api._changed:
                refused = api._refusing_watches
                expired = since not in ("", "0") and int(since) < api._compacted_version
            if refused:
                self.close_connection = True
                return _shutdown(self.connection)
            if expired and api.gone_as_http_status:
                return self._send_json(410, _gone_status(int(since), api._compacted_version))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            deadline = time.monotonic() + float(query.get("timeoutSeconds", 1800))
            bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
            try:
                for event in api._watch_events(namespace, selector, since, deadline, bookmarks):
                    if event is None:
                        self.close_connection = True
                        return _shutdown(self.connection)
                    self._write_chunk(json.dumps(event).encode() + b"\n")
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True  # the client went away

        def _write_chunk(self, data: bytes):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _send_json(self, status: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
