"""The planner's hands on a Kubernetes cluster: a worker Deployment's replica count through its
scale subresource, and, before a scale-down, the pod deletion cost of the workers chosen to go.

The ReplicaSet controller removes the pods with the lowest `controller.kubernetes.io/pod-deletion-cost`
first, so the pods the planner chose (policy.choose_removals: no pinned batch group, fewest rows,
least cached prefix) are the ones that get SIGTERM; a decode worker's drain then moves its streams
with their KV to the others (the drain handoff), and the router stops sending to it as soon as it
reports draining. What this needs, and all the chart's planner Role grants: get and patch
`deployments/scale` of the two worker Deployments; list pods and patch them (the annotation).
"""
from __future__ import annotations

import logging

from kubernetes import client

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
REMOVE_FIRST = "-1000"  # below the default of 0: these go before any other pod


class KubernetesScaler:
    """`deployments` maps pool ("prefill", "decode") to its Deployment's name, `selectors` to the
    label selector of its pods."""

    def __init__(self, api_client: client.ApiClient, namespace: str, deployments: dict[str, str],
                 selectors: dict[str, str]) -> None:
        if set(deployments) != {"prefill", "decode"} or set(selectors) != {"prefill", "decode"}:
            raise ValueError("name the prefill and the decode Deployment and their pods' label selectors")
        self._apps, self._core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
        self.namespace, self.deployments, self.selectors = namespace, deployments, selectors

    def replicas(self, pool: str) -> int:
        scale = self._apps.read_namespaced_deployment_scale(self.deployments[pool], self.namespace)
        return scale.spec.replicas or 0

    def scale(self, pool: str, replicas: int, remove: list[str] = ()) -> None:
        """Set the pool's replicas; scaling down, first mark the pods at the `remove` addresses
        (host or host:port, most preferred first) to go first."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        current = self.replicas(pool)
        if replicas < current:
            self._mark(pool, list(remove)[:current - replicas])
        if replicas != current:
            self._apps.patch_namespaced_deployment_scale(self.deployments[pool], self.namespace,
                                                         {"spec": {"replicas": replicas}})
            log.info("%s workers: %d -> %d", pool, current, replicas,
                     extra={"pool": pool, "from": current, "to": replicas, "removing": list(remove)})

    def _mark(self, pool: str, addresses: list[str]) -> None:
        hosts = {address.rpartition(":")[0] if ":" in address else address for address in addresses}
        pods = self._core.list_namespaced_pod(self.namespace, label_selector=self.selectors[pool]).items
        for pod in pods:
            if pod.status is not None and pod.status.pod_ip in hosts:
                self._core.patch_namespaced_pod(pod.metadata.name, self.namespace,
                                                {"metadata": {"annotations": {DELETION_COST: REMOVE_FIRST}}})
        missing = hosts - {pod.status.pod_ip for pod in pods if pod.status is not None}
        if missing:
            log.warning("no %s pod has the address of %s; the ReplicaSet picks which pods go", pool, sorted(missing))
