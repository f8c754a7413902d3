"""The planner at work: every interval it reads the cluster through its router, asks the policy
for each pool's workers, and has a scaler add or remove them (or, dry, only says what it would do).

Scalers: `LocalScaler` for `baton up --planner` (worker processes of a dynamic LocalCluster: a
worker removed is drained, so a decode worker's streams move to the others with their KV) and
planner.kubernetes.KubernetesScaler (the scale subresource and the pod deletion cost). Every
decision is a log line with its reasons and its inputs, and Prometheus metrics.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from baton.planner.observe import Reading, observe, worker_loads
from baton.planner.policy import Decision, Planner, choose_removals

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


class Scaler(Protocol):
    def replicas(self, pool: str) -> int: ...

    def scale(self, pool: str, replicas: int, remove: list[str] = ()) -> None: ...


class LocalScaler:
    """The worker processes of a LocalCluster made with dynamic=True."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster

    def _addresses(self, pool: str) -> list[str]:
        return self.cluster.prefill_addrs if pool == "prefill" else self.cluster.decode_addrs

    def replicas(self, pool: str) -> int:
        return len(self._addresses(pool))

    def scale(self, pool: str, replicas: int, remove: list[str] = ()) -> None:
        while self.replicas(pool) < replicas:
            address = self.cluster.add_worker(pool)
            log.info("%s worker %s started", pool, address, extra={"pool": pool, "worker": address})
        present = self._addresses(pool)
        going = [a for a in remove if a in present] + [a for a in reversed(present) if a not in remove]
        while self.replicas(pool) > max(replicas, 1):
            address = going.pop(0)
            status = self.cluster.remove_worker(address)
            log.info("%s worker %s drained and stopped (exit %s)", pool, address, status,
                     extra={"pool": pool, "worker": address, "exit": status})


def reading_from(status, at: float) -> Reading:
    """A Reading of the SDK's ClusterStatus (healthy workers only, and the router's TTFT histogram)."""
    routing = status.routing or {}
    return Reading(at, {w.address: w.prefill for w in status.workers if w.role == "prefill" and w.healthy and w.prefill},
                   {w.address: w.decode for w in status.workers if w.role == "decode" and w.healthy and w.decode},
                   tuple(zip(routing.get("ttft_bounds_s", ()), routing.get("ttft_counts", ()))))


class PlannerLoop:
    """Runs `planner` every `planner.config.interval_s` on readings from `read()` (e.g. a BatonClient's
    cluster_status through reading_from), applying its decisions through `scaler` unless dry_run."""

    def __init__(self, planner: Planner, read: Callable[[], Reading], scaler: Scaler, dry_run: bool = False,
                 registry: CollectorRegistry | None = None, say: Callable[[str], None] | None = None) -> None:
        self.planner, self.read, self.scaler, self.dry_run = planner, read, scaler, dry_run
        self.say = say  # also tell each change here (baton up prints it), besides the log
        self.registry = registry or CollectorRegistry()
        self.decisions: list[Decision] = []
        self._previous: Reading | None = None
        self._desired = Gauge("baton_planner_desired_workers", "Workers the planner wants, by pool", ["pool"],
                              registry=self.registry)
        self._workers = Gauge("baton_planner_workers", "Workers provisioned when the planner last looked", ["pool"],
                              registry=self.registry)
        self._changes = Counter("baton_planner_changes", "Scalings the planner made (or, dry, would make)",
                                ["pool", "direction"], registry=self.registry)
        self._inputs = Gauge("baton_planner_input", "What the planner's last decision saw", ["name"],
                             registry=self.registry)

    def step(self) -> Decision | None:
        """One interval: read, decide, scale. None for the first reading (nothing to compare yet)."""
        reading = self.read()
        previous, self._previous = self._previous, reading
        if previous is None:
            return None
        # What is provisioned is the scaler's count (a pod still starting is not in the router's yet).
        seen = replace(observe(previous, reading), prefill_workers=self.scaler.replicas("prefill"),
                       decode_workers=self.scaler.replicas("decode"))
        decision = self.planner.decide(seen, reading.at)
        self.decisions.append(decision)
        for name in ("requests", "prompt_tokens", "output_tokens", "prefill_backlog_tokens"):
            self._inputs.labels(name).set(getattr(seen, name) / (1 if name.endswith("backlog_tokens") else seen.seconds))
        self._inputs.labels("itl_s").set(seen.itl_s or 0.0)
        self._inputs.labels("ttft_s").set(seen.ttft_s or 0.0)
        self._inputs.labels("kv_usage").set(seen.kv_usage)
        loads = worker_loads(reading)
        for pool in POOLS:
            want, current = getattr(decision, pool), getattr(seen, f"{pool}_workers")
            self._desired.labels(pool).set(want)
            self._workers.labels(pool).set(current)
            if want == current:
                continue
            remove = choose_removals(loads[pool], current - want) if want < current else []
            self._changes.labels(pool, "up" if want > current else "down").inc()
            change = f"{pool} workers {current} -> {want}{' (dry run)' if self.dry_run else ''}: {decision.reasons[pool]}"
            log.info("%s", change, extra={"pool": pool, "from": current, "to": want, "remove": remove,
                                          "dry_run": self.dry_run, "observed": seen.__dict__})
            if self.say is not None:
                self.say(f"planner: {change}")
            if not self.dry_run:
                self.scaler.scale(pool, want, remove)
        return decision

    def run(self, wait: Callable[[float], bool]) -> None:
        """Step every interval until `wait(seconds)` says to stop (an Event's wait, say). Run it in
        the thread that started the cluster's processes: the kernel ties a worker process to the
        thread that spawned it (lifeline), and one a planner thread started would be drained when
        that thread ended."""
        while True:
            started = time.monotonic()
            try:
                self.step()
            except Exception:  # a failed reading or scaling must not end the planner
                log.exception("planner interval failed")
            if wait(max(0.0, self.planner.config.interval_s - (time.monotonic() - started))):
                return


def run_kubernetes(args, client_kwargs: dict) -> int:
    """`baton planner`: the planner as a process of its own beside a Kubernetes release, scaling the
    worker Deployments through their scale subresource (dry run: logging only)."""
    from kubernetes import client as kube_client, config as kube_config
    from prometheus_client import start_http_server

    from baton.client import BatonClient
    from baton.lifeline import StopSignals
    from baton.planner.kubernetes import KubernetesScaler
    from baton.planner.policy import Objectives, PlannerConfig, load_profile

    profile = load_profile(args.profile)
    config = PlannerConfig(Objectives(ttft_s=args.ttft_target, itl_s=args.itl_target), min_prefill=args.min_prefill,
                           max_prefill=args.max_prefill, min_decode=args.min_decode, max_decode=args.max_decode,
                           interval_s=args.interval, cooldown_s=args.cooldown, startup_s=args.worker_startup)
    stop = StopSignals()
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        try:
            kube_config.load_kube_config()
        except kube_config.ConfigException as exc:
            raise ValueError(f"no Kubernetes API to scale through: not in a pod, and no kubeconfig ({exc})") from None
    namespace = args.namespace or _own_namespace()
    scaler = KubernetesScaler(kube_client.ApiClient(), namespace,
                              {"prefill": args.prefill_deployment, "decode": args.decode_deployment},
                              {"prefill": args.prefill_selector, "decode": args.decode_selector})
    with BatonClient(args.router, **client_kwargs) as client:
        loop = PlannerLoop(Planner(config, profile), lambda: reading_from(client.cluster_status(), time.monotonic()),
                           scaler, dry_run=args.dry_run)
        if args.metrics_port:
            start_http_server(args.metrics_port, registry=loop.registry)
        log.info("planner watching %s in namespace %s%s", args.router, namespace, " (dry run)" if args.dry_run else "")
        loop.run(lambda seconds: stop.wait(timeout=seconds) is not None)
    return 0


def _own_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return "default"
