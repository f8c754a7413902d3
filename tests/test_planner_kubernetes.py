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


@pytest.mark.slow
def test_baton_planner_scales_a_release_down_to_its_load_marking_the_pod_it_chose(tmp_path):
    """`baton planner` as a process: the load reports of a real (idle) cluster's router, a
    kubeconfig for the loopback API server holding Deployments of 3 pods each. Idle, both pools
    shrink to their minimum one pod at a time; the decode pod that goes first is the one at the
    address of the decode worker the planner chose (the cluster's own, at 127.0.0.1)."""
    import subprocess
    import sys
    import time

    import yaml

    from baton.launch.up import LocalCluster

    with FakeKubeApi() as api, LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=2) as cluster:
        api.put_deployment("rel-prefill", PREFILL, ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
        api.put_deployment("rel-decode", DECODE, ["10.0.1.1", "127.0.0.1", "10.0.1.3"])
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}]}))
        command = [sys.executable, "-m", "baton.cli", "--log-level", "info", "planner", "--router",
                   cluster.router_address, "--namespace", "default",
                   "--prefill-deployment", "rel-prefill", "--decode-deployment", "rel-decode",
                   "--prefill-selector", "app.kubernetes.io/component=prefill",
                   "--decode-selector", "app.kubernetes.io/component=decode",
                   "--interval", "0.5", "--cooldown", "0", "--max-prefill", "4", "--max-decode", "4"]
        planner = subprocess.Popen(command, env={**__import__("os").environ, "KUBECONFIG": str(kubeconfig)},
                                   stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while (len(api.pod_ips(DECODE)), len(api.pod_ips(PREFILL))) != (1, 1):
                assert time.monotonic() < deadline and planner.poll() is None, "the planner did not scale down"
                time.sleep(0.2)
            decode_left = api.pod_ips(DECODE)
        finally:
            planner.terminate()
            _, logs = planner.communicate(timeout=30)
    assert planner.returncode == 0, logs[-2000:]
    assert "127.0.0.1" not in decode_left  # the pod of the worker it chose went first
    assert {(verb, resource) for verb, resource, _ in api.calls} <= ROLE
    patched = [name for verb, resource, name in api.calls if (verb, resource) == ("patch", "pods")]
    assert patched[0] == "rel-decode-1"  # marked before the first decode scale-down
    assert "decode workers 3 -> 2" in logs and "prefill workers 3 -> 2" in logs
