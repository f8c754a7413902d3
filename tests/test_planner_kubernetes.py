"""The planner's Kubernetes hands (planner/kubernetes.py) against the loopback API server the
discovery tests use: the scale subresource, and the deletion cost set before a scale-down."""
from __future__ import annotations

import pytest

from baton.planner.kubernetes import DELETION_COST, KubernetesScaler
from fake_kube_api import FakeKubeApi

PREFILL = {"app.kubernetes.io/instance": "prod", "app.kubernetes.io/component": "prefill"}
DECODE = {"app.kubernetes.io/instance": "prod", "app.kubernetes.io/component": "decode"}
# The least privilege the planner needs (its Role in the chart grants this and nothing else), as (verb, resource).
ROLE = {("get", "deployments/scale"), ("patch", "deployments/scale"), ("list", "pods"), ("patch", "pods")}


@pytest.fixture
def cluster():
    with FakeKubeApi() as api:
        api.put_deployment("prod-baton-prefill", PREFILL, ["10.0.0.1", "10.0.0.2"])
        api.put_deployment("prod-baton-decode", DECODE, ["10.0.1.1", "10.0.1.2", "10.0.1.3"])
        client = api.api_client()
        scaler = KubernetesScaler(client, "default", {"prefill": "prod-baton-prefill", "decode": "prod-baton-decode"},
                                  {"prefill": "app.kubernetes.io/instance=prod,app.kubernetes.io/component=prefill",
                                   "decode": "app.kubernetes.io/instance=prod,app.kubernetes.io/component=decode"})
        yield api, scaler
        client.close()


def test_a_scale_down_marks_the_chosen_worker_before_it_patches_the_scale(cluster):
    api, scaler = cluster
    assert scaler.replicas("decode") == 3
    scaler.scale("decode", 2, remove=["10.0.1.2:50071"])
    assert api.pod_ips(DECODE) == ["10.0.1.1", "10.0.1.3"]  # the chosen one went, not the controller's pick
    assert api.calls[1:] == [("get", "deployments/scale", "prod-baton-decode"), ("list", "pods", ""),
                             ("patch", "pods", "prod-baton-decode-1"),
                             ("patch", "deployments/scale", "prod-baton-decode")]
    assert {(verb, resource) for verb, resource, _ in api.calls} <= ROLE


def test_a_scale_up_only_patches_the_scale_and_an_unchanged_count_nothing(cluster):
    api, scaler = cluster
    scaler.scale("prefill", 4)
    assert len(api.pod_ips(PREFILL)) == 4 and scaler.replicas("prefill") == 4
    assert ("list", "pods", "") not in api.calls
    calls = len(api.calls)
    scaler.scale("prefill", 4, remove=["10.0.0.1"])
    assert api.calls[calls:] == [("get", "deployments/scale", "prod-baton-prefill")]
    assert all(DELETION_COST not in pod["annotations"] for pod in api.pods.values())
    with pytest.raises(ValueError, match="replicas"):
        scaler.scale("prefill", -1)


def test_an_address_no_pod_has_leaves_the_choice_to_the_replicaset(cluster, caplog):
    api, scaler = cluster
    scaler.scale("decode", 1, remove=["10.9.9.9:50071"])
    assert len(api.pod_ips(DECODE)) == 1 and "no decode pod has the address" in caplog.text
