"""The router's live view of its workers: channels, stubs, polled load and in-flight counts."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from baton.config import TLSSettings
from baton.server import channel
from baton.transport import connect_deadline_options, keepalive_options
from baton.v1 import common_pb2, workers_pb2_grpc
from baton.router.policy import WorkerView

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
# A worker that hangs (stopped process, cut network) answers no RST: without pings, the requests
# it holds would wait for their deadlines. Pinging every 500 ms while calls are open breaks their
# streams within about a second, and the router moves them (UNAVAILABLE is a lost decode worker).
# The router's connection is the one that notices: a KV push into a stopped decode worker fills
# its socket and flow-control window, and then its own pings cannot even be written.
# A connection that does not complete its handshake is given up after WORKER_CONNECT_TIMEOUT_MS:
# a request is not held on its way to a worker that is gone.
WORKER_CONNECT_TIMEOUT_MS = 2000
WORKER_CHANNEL_OPTIONS = [*keepalive_options(ping_every_ms=500, timeout_ms=500),
                          *connect_deadline_options(WORKER_CONNECT_TIMEOUT_MS)]
LEFT_GRACE_S = 1.0  # a worker that left keeps its channel this long after its last call ended


@dataclass
class Worker:
    role: str
    view: WorkerView
    channel: grpc.Channel
    stub: object
    last_load: object = None
    fingerprint: str = ""
    failures: int = field(default=0)
    released_at: float = 0.0  # when its last call ended


class WorkerPool:
    def __init__(self, tls: TLSSettings | None = None, poll_seconds: float = 0.2, cluster_token: str | None = None):
        self.tls = tls
        self.cluster_token = cluster_token  # presented on every call to a worker
        self.poll_seconds = poll_seconds
        self._workers: dict[str, dict[str, Worker]] = {role: {} for role in ROLES}
        # Workers discovery dropped while calls to them were open (a draining pod, a worker the
        # planner removes): no new work goes there, but their channel stays until those calls end,
        # so a draining decode worker's streams can still move to the others with their KV.
        self._leaving: list[Worker] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_forever, name="load-poll", daemon=True)
        # Told of workers joining (address, stub) and leaving (address): the router follows the KV
        # events of prefill and decode workers alike (CacheSync), and forgets what one that left held.
        self.on_joined: Callable[[str, object], None] = lambda address, stub: None
        self.on_left: Callable[[str], None] = lambda address: None

    def start(self) -> "WorkerPool":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            for worker in [w for workers in self._workers.values() for w in workers.values()] + self._leaving:
                worker.channel.close()
            self._leaving.clear()

    def set_workers(self, role: str, addresses) -> None:
        """Follow discovery: open channels to new workers, close those that left."""
        stub_class = workers_pb2_grpc.PrefillWorkerStub if role == "prefill" else workers_pb2_grpc.DecodeWorkerStub
        with self._lock:
            current = self._workers[role]
            gone = [current.pop(address) for address in set(current) - set(addresses)]
            joined = []
            for address in set(addresses) - set(current):
                ch = channel(address, self.tls, extra_options=WORKER_CHANNEL_OPTIONS, cluster_token=self.cluster_token)
                # Not healthy until its first load report says it serves our model.
                current[address] = Worker(role, WorkerView(address, healthy=False), ch, stub_class(ch))
                joined.append(current[address])
                log.info("worker joined role=%s address=%s", role, address)
        for worker in gone:
            self._notify(self.on_left, worker.view.address)
            with self._lock:
                open_calls = worker.view.inflight
                if open_calls:
                    self._leaving.append(worker)
            if not open_calls:
                worker.channel.close()
            log.info("worker left role=%s address=%s open_calls=%d", role, worker.view.address, open_calls)
        for worker in joined:
            self._notify(self.on_joined, worker.view.address, worker.stub)

    def views(self, role: str) -> list[WorkerView]:
        with self._lock:
            return [w.view for w in self._workers[role].values()]

    def get(self, role: str, address: str) -> Worker | None:
        with self._lock:
            return self._workers[role].get(address)

    def all(self) -> list[Worker]:
        with self._lock:
            return [w for workers in self._workers.values() for w in workers.values()]

    def acquire(self, worker: Worker, tokens: int = 0) -> None:
        """Count a request in flight on `worker`; `tokens`: prompt tokens it will prefill there."""
        with self._lock:
            worker.view.inflight += 1
            worker.view.inflight_tokens += tokens

    def release(self, worker: Worker, tokens: int = 0) -> None:
        """Undo `acquire(worker, tokens)`."""
        with self._lock:
            worker.view.inflight -= 1
            worker.view.inflight_tokens -= tokens
            worker.released_at = time.monotonic()
            if worker.role == "decode":
                # Its row is free now; the next load report says so up to a poll later, and a
                # conversation's next turn, sent at once, would see the worker busier than it is.
                worker.view.active = max(0, worker.view.active - 1)

    def _close_left(self) -> None:
        """Close the channels of workers that left once their calls have ended (and stayed ended
        a moment: a drained stream's handoff opens its next call on the same channel)."""
        with self._lock:
            now = time.monotonic()
            done = [w for w in self._leaving if not w.view.inflight and now - w.released_at >= LEFT_GRACE_S]
            self._leaving = [w for w in self._leaving if w not in done]
        for worker in done:
            worker.channel.close()

    def mark_failed(self, worker: Worker) -> None:
        worker.view.healthy = False

    def poll_once(self) -> None:
        for worker in self.all():
            try:
                load = worker.stub.GetLoad(common_pb2.LoadRequest(), timeout=max(1.0, 5 * self.poll_seconds))
            except grpc.RpcError:
                worker.failures += 1
                worker.view.healthy = False
                continue
            worker.failures = 0
            worker.last_load = load
            worker.fingerprint = load.model_fingerprint
            view = worker.view
            if worker.role == "decode":
                view.active = load.rows_in_use + load.staged + load.waiting_for_kv
                view.capacity = max(1, load.max_rows)
                # Landed KV waiting for a row joins the batch: it counts as used.
                view.kv_used_bytes = load.kv_bytes_useful + load.staged_bytes
                view.kv_capacity_bytes = load.kv_budget_bytes
                view.kv_bytes_per_token = load.kv_bytes_per_token
            else:
                view.active = load.queued
                view.capacity = max(1, load.max_queue)
                view.queued_tokens = load.queued_tokens
                view.pulls_kv = load.pulls_kv
            view.healthy = not load.draining

    @staticmethod
    def _notify(hook, *args) -> None:
        try:
            hook(*args)
        except Exception:  # a listener failing must not stop discovery
            log.exception("worker pool listener %s failed", getattr(hook, "__name__", hook))

    def _poll_forever(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self._close_left()
                self.poll_once()
            except Exception:  # polling must outlive any one bad answer
                log.exception("load poll failed")
