"""Worker discovery: the WorkerSet, static discovery, and Kubernetes discovery driven through the real
`kubernetes` client against a loopback API server speaking the EndpointSlice list/watch protocol."""
from __future__ import annotations

import threading
import time

import kubernetes
import pytest
import yaml
from fake_kube_api import FakeKubeApi, endpoint, label_selector_matches

from baton.config import RouterSettings, load_settings
from baton.router.discovery import KubernetesDiscovery, StaticDiscovery, WorkerSet, discovery_from_settings
from baton.router.discovery.endpoint_slices import routable_addresses

NAMESPACE = "serving"
PREFILL = {"app.kubernetes.io/name": "baton", "baton.io/role": "prefill"}
DECODE = {"app.kubernetes.io/name": "baton", "baton.io/role": "decode"}
GRPC = [{"name": "grpc", "port": 50061, "protocol": "TCP"}]
DECODE_GRPC = [{"name": "grpc", "port": 50071, "protocol": "TCP"}]


@pytest.fixture(autouse=True)
def no_leftover_threads():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2.0
    while (extra := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not extra, f"threads left running: {[t.name for t in extra]}"


@pytest.fixture
def kube_api():
    with FakeKubeApi() as api:
        yield api


@pytest.fixture
def api_client(kube_api):
    client = kube_api.api_client()
    yield client
    client.close()


@pytest.fixture
def workers():
    return WorkerSet()


def start_discovery(api_client, workers, **options) -> KubernetesDiscovery:
    options = {"namespace": NAMESPACE, "initial_backoff_s": 0.02, "max_backoff_s": 0.2, **options}
    discovery = KubernetesDiscovery(api_client=api_client, **options)
    discovery.start(workers)
    return discovery


@pytest.fixture
def discovery(kube_api, api_client, workers):
    discovery = start_discovery(api_client, workers)
    assert wait_until(lambda: len(kube_api.watch_requests()) == 2), "each role lists, then watches"
    yield discovery
    discovery.stop()


def assert_workers(workers: WorkerSet, role: str, expected: set[str], within_s: float = 1.0) -> None:
    held = workers.wait_for(lambda current: current[role] == frozenset(expected), timeout=within_s)
    assert held, f"{role} workers are {sorted(workers.get(role))}, expected {sorted(expected)} within {within_s}s"


def wait_until(condition, within_s: float = 1.0) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def put(api: FakeKubeApi, name: str, endpoints: list[dict], labels=PREFILL, ports=GRPC, **kwargs) -> dict:
    return api.put_slice(name, endpoints, ports=ports, labels=labels, namespace=NAMESPACE, **kwargs)


# --- WorkerSet and static discovery --------------------------------------------------------------

def test_worker_set_replaces_and_announces_changes_in_order():
    workers, seen = WorkerSet(), []
    unsubscribe = workers.subscribe(lambda role, added, removed: seen.append((role, set(added), set(removed))))
    workers.replace("prefill", ["a:1", "b:1"])
    workers.replace("prefill", ["b:1", "c:1"])
    workers.replace("prefill", ["c:1", "b:1"])  # no change: no announcement
    unsubscribe()
    workers.replace("decode", ["d:1"])
    assert seen == [("prefill", {"a:1", "b:1"}, set()), ("prefill", {"c:1"}, {"a:1"})]
    assert workers.get("prefill") == {"b:1", "c:1"} and workers.get("decode") == {"d:1"}
    with pytest.raises(ValueError, match="unknown worker role 'embed'"):
        workers.get("embed")


def test_worker_set_wait_for_wakes_on_change_and_times_out():
    workers = WorkerSet()
    timer = threading.Timer(0.05, workers.replace, ("decode", ["d:1"]))
    timer.start()
    assert workers.wait_for(lambda current: current["decode"] == {"d:1"}, timeout=1.0)
    timer.join()
    started = time.monotonic()
    assert not workers.wait_for(lambda current: bool(current["prefill"]), timeout=0.05)
    assert time.monotonic() - started < 0.5


def test_a_failing_subscriber_does_not_stop_the_others():
    workers, seen = WorkerSet(), []
    workers.subscribe(lambda *change: 1 / 0)
    workers.subscribe(lambda role, added, removed: seen.append(role))
    workers.replace("prefill", ["a:1"])
    assert seen == ["prefill"]


def test_static_discovery_fills_the_worker_set_from_settings():
    settings = RouterSettings(prefill_workers=["127.0.0.1:50061", "[::1]:50062"], decode_workers=["h:50071"])
    discovery, workers = discovery_from_settings(settings), WorkerSet()
    assert isinstance(discovery, StaticDiscovery)
    discovery.start(workers)
    discovery.stop()
    assert workers.snapshot() == {"prefill": {"127.0.0.1:50061", "[::1]:50062"}, "decode": {"h:50071"}}
    with pytest.raises(ValueError, match="not host:port"):
        StaticDiscovery(prefill=["localhost"], decode=[])


def test_discovery_from_settings_chooses_kubernetes_or_says_what_is_allowed():
    discovery = discovery_from_settings(RouterSettings(discovery="kubernetes", namespace="serving"))
    assert isinstance(discovery, KubernetesDiscovery) and discovery.namespace == "serving"
    assert discovery.selectors["decode"] == "app.kubernetes.io/name=baton,baton.io/role=decode"
    with pytest.raises(ValueError, match="'static'.*'kubernetes'"):
        discovery_from_settings(RouterSettings(discovery="consul"))


def test_endpoint_rules_on_real_client_models():
    api_client = kubernetes.client.ApiClient()

    def model(ports, endpoints, address_type="IPv4"):
        body = {"metadata": {"name": "s"}, "addressType": address_type, "ports": ports, "endpoints": endpoints}
        return api_client._ApiClient__deserialize(body, "V1EndpointSlice")

    two_ports = [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": 50061}]
    endpoints = [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=None), endpoint("10.0.0.3", ready=False),
                 endpoint("10.0.0.4", ready=None, serving=True, terminating=True), {"addresses": ["10.0.0.5"]}]
    assert routable_addresses(model(two_ports, endpoints), "grpc") == {"10.0.0.1:50061", "10.0.0.2:50061",
                                                                       "10.0.0.5:50061"}
    only_port = [{"port": 8000}]
    assert routable_addresses(model(only_port, [endpoint("fd00::7")], "IPv6"), "grpc") == {"[fd00::7]:8000"}
    assert routable_addresses(model(two_ports[:1] + [{"name": "http", "port": 80}], endpoints), "grpc") == set()
    api_client.close()


def test_fake_api_label_selector_grammar():
    labels = {"app": "baton", "tier": "gpu"}
    assert label_selector_matches("app=baton,tier in (gpu, cpu)", labels)
    assert label_selector_matches("app==baton,!zone,tier notin (cpu),app", labels)
    assert not label_selector_matches("app!=baton", labels)
    assert not label_selector_matches("zone", labels)


# --- Kubernetes discovery against the loopback API server -----------------------------------------

def test_existing_and_added_slices_become_workers(kube_api, workers):
    put(kube_api, "prefill-a", [endpoint("10.0.0.1")])
    client = kube_api.api_client()
    discovery = start_discovery(client, workers)
    try:
        assert_workers(workers, "prefill", {"10.0.0.1:50061"})  # from the initial list
        put(kube_api, "decode-a", [endpoint("10.0.1.1"), endpoint("10.0.1.2")], labels=DECODE, ports=DECODE_GRPC)
        assert_workers(workers, "decode", {"10.0.1.1:50071", "10.0.1.2:50071"})  # from a watch ADDED
        assert workers.get("prefill") == {"10.0.0.1:50061"}
        lists = kube_api.list_requests()
        assert sorted(request.query["labelSelector"] for request in lists) == [
            "app.kubernetes.io/name=baton,baton.io/role=decode", "app.kubernetes.io/name=baton,baton.io/role=prefill"]
        assert all(request.namespace == NAMESPACE for request in kube_api.requests)
    finally:
        discovery.stop()
        client.close()


def test_not_ready_workers_leave_and_come_back(kube_api, workers, discovery):
    put(kube_api, "prefill-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=None)])
    assert_workers(workers, "prefill", {"10.0.0.1:50061", "10.0.0.2:50061"})  # missing `ready` means ready
    put(kube_api, "prefill-a", [endpoint("10.0.0.1", ready=False), endpoint("10.0.0.2", ready=None)])
    assert_workers(workers, "prefill", {"10.0.0.2:50061"})
    put(kube_api, "prefill-a", [endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2", ready=None)])
    assert_workers(workers, "prefill", {"10.0.0.1:50061", "10.0.0.2:50061"})


def test_terminating_workers_leave(kube_api, workers, discovery):
    put(kube_api, "decode-a", [endpoint("10.0.1.1"), endpoint("10.0.1.2")], labels=DECODE)
    assert_workers(workers, "decode", {"10.0.1.1:50061", "10.0.1.2:50061"})
    put(kube_api, "decode-a", [endpoint("10.0.1.1"), endpoint("10.0.1.2", ready=None, serving=True,
                                                               terminating=True)], labels=DECODE)
    assert_workers(workers, "decode", {"10.0.1.1:50061"})


def test_deleted_slice_drops_only_its_workers(kube_api, workers, discovery):
    put(kube_api, "prefill-a", [endpoint("10.0.0.1"), endpoint("10.0.0.9")])
    put(kube_api, "prefill-b", [endpoint("10.0.0.2"), endpoint("10.0.0.9")])  # .9 listed by both slices
    put(kube_api, "decode-a", [endpoint("10.0.1.1")], labels=DECODE)
    assert_workers(workers, "prefill", {"10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.9:50061"})
    assert_workers(workers, "decode", {"10.0.1.1:50061"})
    kube_api.delete_slice("prefill-a", namespace=NAMESPACE)
    assert_workers(workers, "prefill", {"10.0.0.2:50061", "10.0.0.9:50061"})
    put(kube_api, "prefill-b", [endpoint("10.0.0.2"), endpoint("10.0.0.3")])
    assert_workers(workers, "prefill", {"10.0.0.2:50061", "10.0.0.3:50061"})
    kube_api.delete_slice("prefill-b", namespace=NAMESPACE)
    assert_workers(workers, "prefill", set())
    assert workers.get("decode") == {"10.0.1.1:50061"}


def test_only_the_roles_slices_in_the_namespace_count(kube_api, workers, discovery):
    put(kube_api, "prefill-a", [endpoint("10.0.0.1")])
    kube_api.put_slice("elsewhere", [endpoint("10.9.0.1")], ports=GRPC, labels=PREFILL, namespace="other")
    put(kube_api, "other-app", [endpoint("10.9.0.2")], labels={**PREFILL, "app.kubernetes.io/name": "other"})
    put(kube_api, "metrics-only", [endpoint("10.9.0.3")], ports=[{"name": "metrics", "port": 9090},
                                                                   {"name": "http", "port": 80}])
    put(kube_api, "prefill-b", [endpoint("10.0.0.2")])
    assert_workers(workers, "prefill", {"10.0.0.1:50061", "10.0.0.2:50061"})
    put(kube_api, "prefill-b", [endpoint("10.0.0.2")], labels=DECODE)  # relabelled: leaves prefill, joins decode
    assert_workers(workers, "prefill", {"10.0.0.1:50061"})
    assert_workers(workers, "decode", {"10.0.0.2:50061"})


def test_broken_watch_resumes_from_the_last_resource_version(kube_api, workers, discovery):
    put(kube_api, "prefill-a", [endpoint("10.0.0.1")])
    last = put(kube_api, "prefill-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    assert_workers(workers, "prefill", {"10.0.0.1:50061", "10.0.0.2:50061"})
    watches_before = len(kube_api.watch_requests())
    kube_api.break_watches()
    put(kube_api, "prefill-a", [endpoint("10.0.0.2"), endpoint("10.0.0.3")])  # while the watch is down
    assert_workers(workers, "prefill", {"10.0.0.2:50061", "10.0.0.3:50061"})
    resumed = [r for r in kube_api.watch_requests()[watches_before:] if "role=prefill" in r.query["labelSelector"]]
    assert resumed and resumed[0].query["resourceVersion"] == last["metadata"]["resourceVersion"]
    assert len(kube_api.list_requests()) == 2  # resumed, not relisted
    put(kube_api, "prefill-b", [endpoint("10.0.0.4")])  # and the resumed watch keeps following
    assert_workers(workers, "prefill", {"10.0.0.2:50061", "10.0.0.3:50061", "10.0.0.4:50061"})


def test_bookmarks_move_the_resume_point(kube_api, workers, discovery):
    put(kube_api, "prefill-a", [endpoint("10.0.0.1")])
    assert_workers(workers, "prefill", {"10.0.0.1:50061"})
    bookmark_version = kube_api.send_bookmarks()
    assert wait_until(lambda: all(w.resource_version == bookmark_version for w in discovery._watchers))
    kube_api.break_watches()
    assert wait_until(lambda: any(r.query.get("resourceVersion") == bookmark_version
                                  for r in kube_api.watch_requests()))


def test_expired_resource_version_relists(kube_api, workers, discovery):
    put(kube_api, "prefill-a", [endpoint("10.0.0.1")])
    assert_workers(workers, "prefill", {"10.0.0.1:50061"})
    kube_api.compact()  # the open watches get an ERROR event with a 410 Status
    assert wait_until(lambda: len(kube_api.list_requests()) == 4)
    put(kube_api, "prefill-a", [endpoint("10.0.0.2")])  # and the new watches follow
    assert_workers(workers, "prefill", {"10.0.0.2:50061"})


def test_changes_missed_while_disconnected_arrive_by_relist(kube_api, workers, discovery):
    put(kube_api, "prefill-a", [endpoint("10.0.0.1")])
    put(kube_api, "decode-a", [endpoint("10.0.1.1")], labels=DECODE)
    assert_workers(workers, "prefill", {"10.0.0.1:50061"})
    kube_api.refuse_watches()  # the apiserver is unreachable for watches...
    put(kube_api, "prefill-b", [endpoint("10.0.0.2")])
    kube_api.delete_slice("prefill-a", namespace=NAMESPACE)
    kube_api.delete_slice("decode-a", namespace=NAMESPACE)
    kube_api.compact()  # ...and those events are compacted away before it returns
    assert workers.get("prefill") == {"10.0.0.1:50061"}
    kube_api.refuse_watches(False)
    assert_workers(workers, "prefill", {"10.0.0.2:50061"})
    assert_workers(workers, "decode", set())


def test_http_410_answer_relists(workers):
    with FakeKubeApi(gone_as_http_status=True) as kube_api:
        client = kube_api.api_client()
        discovery = start_discovery(client, workers)
        try:
            put(kube_api, "prefill-a", [endpoint("10.0.0.1")])
            assert_workers(workers, "prefill", {"10.0.0.1:50061"})
            kube_api.refuse_watches()
            put(kube_api, "prefill-a", [endpoint("10.0.0.5")])
            kube_api.compact()
            kube_api.refuse_watches(False)
            assert_workers(workers, "prefill", {"10.0.0.5:50061"})
        finally:
            discovery.stop()
            client.close()


def test_discovery_labels_keep_two_releases_in_one_namespace_apart(kube_api, api_client, workers):
    discovery = start_discovery(api_client, workers, labels="app.kubernetes.io/instance=blue")
    try:
        put(kube_api, "blue", [endpoint("10.0.0.1")], labels={**PREFILL, "app.kubernetes.io/instance": "blue"})
        put(kube_api, "green", [endpoint("10.0.0.2")], labels={**PREFILL, "app.kubernetes.io/instance": "green"})
        assert_workers(workers, "prefill", {"10.0.0.1:50061"})
    finally:
        discovery.stop()
    settings = RouterSettings(discovery="kubernetes", namespace="x", discovery_labels="app.kubernetes.io/instance=blue")
    assert discovery_from_settings(settings).selectors["decode"] == (
        "app.kubernetes.io/name=baton,baton.io/role=decode,app.kubernetes.io/instance=blue")
    with pytest.raises(ValueError, match="discovery_labels must be label terms"):
        load_settings(env={"BATON_ROUTER_DISCOVERY_LABELS": "instance in (a)"})


def test_custom_selector_service_name_and_port_name(kube_api, api_client, workers):
    discovery = start_discovery(api_client, workers, port_name="rpc",
                                selectors={"prefill": "tier in (prefill-gpu)"},
                                service_names={"decode": "baton-decode"})
    try:
        two_ports = [{"name": "metrics", "port": 9090}, {"name": "rpc", "port": 7000}]
        put(kube_api, "p", [endpoint("10.0.0.1")], labels={"tier": "prefill-gpu"}, ports=two_ports)
        put(kube_api, "d", [endpoint("10.0.1.1")], labels={"kubernetes.io/service-name": "baton-decode"},
            ports=two_ports)
        assert_workers(workers, "prefill", {"10.0.0.1:7000"})
        assert_workers(workers, "decode", {"10.0.1.1:7000"})
    finally:
        discovery.stop()
    with pytest.raises(ValueError, match="both a service name and a label selector"):
        KubernetesDiscovery(namespace="x", selectors={"decode": "a=b"}, service_names={"decode": "svc"})


def test_kubeconfig_is_loaded_outside_a_cluster(kube_api, workers, tmp_path, monkeypatch):
    kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "loopback",
                  "clusters": [{"name": "loopback", "cluster": {"server": kube_api.url}}],
                  "users": [{"name": "tester", "user": {"token": "not-checked"}}],
                  "contexts": [{"name": "loopback", "context": {"cluster": "loopback", "user": "tester"}}]}
    (tmp_path / "config").write_text(yaml.safe_dump(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    put(kube_api, "prefill-a", [endpoint("10.0.0.1")])
    discovery = KubernetesDiscovery(namespace=NAMESPACE)
    discovery.start(workers)
    try:
        assert_workers(workers, "prefill", {"10.0.0.1:50061"})
    finally:
        discovery.stop()


def test_stop_ends_a_blocked_watch_promptly(kube_api, api_client, workers):
    discovery = start_discovery(api_client, workers, watch_timeout_s=600)
    assert wait_until(lambda: len(kube_api.watch_requests()) == 2)  # both roles blocked reading their watch
    started = time.monotonic()
    discovery.stop()
    assert time.monotonic() - started < 1.0
    assert not any(thread.name.startswith("baton-discovery") for thread in threading.enumerate())


def test_file_discovery_follows_the_workers_file_and_keeps_the_last_good_set(tmp_path, workers):
    from baton.router.discovery.file import FileDiscovery, write_workers_file

    path = str(tmp_path / "workers.json")
    with pytest.raises(ValueError, match="cannot read the workers file"):
        FileDiscovery(path).start(workers)
    write_workers_file(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    discovery = FileDiscovery(path, poll_s=0.02)
    discovery.start(workers)
    try:
        assert workers.snapshot() == {"prefill": {"127.0.0.1:1"}, "decode": {"127.0.0.1:2"}}
        write_workers_file(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2", "127.0.0.1:3"]})
        assert workers.wait_for(lambda w: w["decode"] == {"127.0.0.1:2", "127.0.0.1:3"}, timeout=5)
        with open(path, "w") as f:
            f.write('{"decode": ["no port"]}')  # a bad edit: ignored, the last good set stays
        time.sleep(0.2)
        assert workers.get("decode") == {"127.0.0.1:2", "127.0.0.1:3"}
        write_workers_file(path, {"prefill": [], "decode": ["127.0.0.1:3"]})
        assert workers.wait_for(lambda w: w["decode"] == {"127.0.0.1:3"} and not w["prefill"], timeout=5)
    finally:
        discovery.stop()
    assert not [t for t in threading.enumerate() if t.name == "file-discovery"]
