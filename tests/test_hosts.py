"""Several hosts on one machine (baton.launch.netns): network namespaces joined by a bridge, links held to a
rate by tbf, nothing left behind; and a LocalCluster across them, whose KV then travels over gRPC
(shared memory stops at a network namespace) and still gives the exact greedy tokens, through a
decode worker's drain too. Needs root: skipped with the reason otherwise."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from test_migration import drain_one_mid_stream

from baton.launch import netns
from baton.client import BatonClient
from baton.kvtransfer.nixl import nixl_installed
from baton.launch.netns import Hosts
from baton.launch.up import LocalCluster, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def netns_available() -> None:
    ok, why = netns.available()
    if not ok:
        pytest.skip(why)


@pytest.fixture
def make_hosts(netns_available):
    """make(names, rate_mbit=None) -> started Hosts; every one is closed after the test."""
    made: list[Hosts] = []

    def make(names: list[str], rate_mbit: float | None = None) -> Hosts:
        hosts = Hosts(names, rate_mbit)
        made.append(hosts)
        return hosts.start()

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()
        assert [line for hosts in made for line in leftovers(hosts)] == []


def leftovers(hosts: Hosts) -> list[str]:
    """The namespaces and root links of `hosts` still there (all of them carry its tag)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    listed += subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return [line for line in listed.splitlines() if f"baton-{hosts.tag}" in line]


def run_in(hosts: Hosts, name: str, code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(hosts.command(name, [sys.executable, "-c", code]), capture_output=True, text=True,
                          timeout=30, **kwargs)


ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
for _ in range(int(sys.argv[2])):
    conn, _ = server.accept()
    conn.sendall(conn.recv(100).upper())
    conn.close()
"""


@contextlib.contextmanager
def echo_server(hosts: Hosts, name: str, address: str, connections: int):
    """An echo server in host `name` on `address`, answering `connections` connections; its port."""
    server = subprocess.Popen(hosts.command(name, [sys.executable, "-c", ECHO_SERVER, address, str(connections)]),
                              stdout=subprocess.PIPE, text=True)
    try:
        yield int(server.stdout.readline())
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def echo_from(hosts: Hosts, name: str, address: str, port: int) -> str:
    """What an echo server at address:port answers a client in host `name` ('' if it cannot connect)."""
    return run_in(hosts, name, f"import socket; s = socket.create_connection(('{address}', {port}), timeout=10); "
                               f"s.sendall(b'from {name}'); print(s.recv(100).decode())").stdout.strip()


def test_hosts_reach_each_other_and_this_namespace_reaches_them(make_hosts):
    hosts = make_hosts(["a", "b"])
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    for ns in [hosts.bridge_namespace, *hosts.namespaces.values()]:
        assert ns in names
        lo = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "lo"], capture_output=True, text=True).stdout
        assert "UP" in lo, (ns, lo)
    assert len({hosts.root_address, hosts.address("a"), hosts.address("b")}) == 3
    # b answers a client in a, and one here in the root namespace.
    with echo_server(hosts, "b", hosts.address("b"), 2) as port:
        assert echo_from(hosts, "a", hosts.address("b"), port) == "FROM A"
        with socket.create_connection((hosts.address("b"), port), timeout=10) as s:
            s.sendall(b"from root")
            assert s.recv(100) == b"FROM ROOT"
    # Each host has a loopback of its own: b's 127.0.0.1 is not a's.
    with echo_server(hosts, "b", "127.0.0.1", 1) as port:
        assert echo_from(hosts, "a", "127.0.0.1", port) == ""
        assert echo_from(hosts, "b", "127.0.0.1", port) == "FROM B"
    hosts.close()
    assert leftovers(hosts) == []


def send_from(hosts: Hosts, name: str, nbytes: int) -> float:
    """Seconds a receiver here took to take `nbytes` sent from host `name`, from its connection on."""
    server = socket.create_server((hosts.root_address, 0))
    elapsed: list[float] = []

    def receive() -> None:
        conn, _ = server.accept()
        started, got = time.monotonic(), 0
        while chunk := conn.recv(1 << 16):
            got += len(chunk)
        elapsed.append(time.monotonic() - started)
        assert got == nbytes
        conn.close()

    receiver = threading.Thread(target=receive)
    receiver.start()
    try:
        sent = run_in(hosts, name, f"import socket; s = socket.create_connection(('{hosts.root_address}', "
                                   f"{server.getsockname()[1]})); s.sendall(bytes({nbytes})); s.close()")
        assert sent.returncode == 0, sent.stderr
        receiver.join(timeout=30)
    finally:
        server.close()
    return elapsed[0]


def tbf_of(hosts: Hosts, name: str) -> str:
    shown = subprocess.run(["tc", "-n", hosts.namespaces[name], "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True, check=True).stdout
    return next((line for line in shown.splitlines() if line.startswith("qdisc tbf")), "")


def test_a_limited_link_holds_its_rate_and_the_rate_can_change(make_hosts):
    """A lower bound only, which no load on the machine can break: 6 MiB at 80 Mbit take at least
    0.8 times the 0.63 s the rate implies (the bucket lets 100 KB through at once)."""
    nbytes, mbit = 6 << 20, 80
    hosts = make_hosts(["a"], rate_mbit=mbit)
    assert "rate 80Mbit" in tbf_of(hosts, "a")
    elapsed = send_from(hosts, "a", nbytes)
    implied = nbytes * 8 / (mbit * 1e6)
    print(f"\n{nbytes >> 20} MiB in {elapsed:.2f} s at {mbit} Mbit ({nbytes * 8 / elapsed / 1e6:.0f} Mbit/s; the rate "
          f"implies {implied:.2f} s)")
    assert elapsed >= 0.8 * implied
    hosts.set_rate(None)
    assert tbf_of(hosts, "a") == ""
    hosts.set_rate(40)
    assert "rate 40Mbit" in tbf_of(hosts, "a")


@pytest.mark.parametrize("failing", ["tc", "veth to the root namespace"])
def test_a_setup_failing_half_way_leaves_nothing_behind(netns_available, monkeypatch, failing):
    """tc fails after everything else is made; the root namespace's veth is the last link made."""
    real = netns._run

    def run(*argv: str) -> str:
        fails = argv[0] == "tc" if failing == "tc" else argv[:3] == ("ip", "link", "add")
        if fails:
            raise RuntimeError(f"`{' '.join(argv)}` failed: made to fail")
        return real(*argv)

    monkeypatch.setattr(netns, "_run", run)
    hosts = Hosts(["a", "b"], rate_mbit=100)
    with pytest.raises(RuntimeError, match="made to fail"):
        hosts.start()
    assert hosts.subnet is not None and leftovers(hosts) == []


def namespace_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()


def assert_each_process_in_its_host(cluster: LocalCluster, hosts: Hosts) -> None:
    """Each process serves in its host's network namespace: forked from the fork server, it
    entered the namespace itself; started fresh (BATON_FORKSERVER=0), `ip netns exec` ran it in
    place, so the PID started is the server's own, a child of this process."""
    for address, proc in cluster.procs:
        assert proc.poll() is None and namespace_of(proc.pid) == hosts.namespaces[cluster.host_of[address]], address
        if isinstance(proc, subprocess.Popen):
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                assert f.read().split(b"\0")[:3] == [sys.executable.encode(), b"-m", b"baton.cli"]
            with open(f"/proc/{proc.pid}/stat") as f:
                assert int(f.read().rpartition(")")[2].split()[1]) == os.getpid()


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_a_cluster_across_three_hosts_gives_exact_tokens(make_hosts, tiny_reference, transport):
    """Router, prefill and decode each in a host of their own, on links held to 200 Mbit; the KV
    crosses over gRPC (the default), or through NIXL over UCX's TCP (kv_transport: nixl)."""
    from prometheus_client.parser import text_string_to_metric_families

    if transport == "nixl" and not nixl_installed():
        pytest.skip("the nixl extra is not installed")
    hosts = make_hosts(LocalCluster.host_names(prefill=1, decode=1), rate_mbit=200)
    metrics_port = free_port()
    prompts = [[300 + 11 * i + j for j in range(6 + 5 * i)] for i in range(4)]
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4, hosts=hosts, http_port=-1,
                      extra_env={"UCX_TLS": "tcp"},  # the link, not UCX's same-machine shortcuts
                      prefill_args=("--metrics-port", str(metrics_port), "--kv-transport", transport)) as cluster:
        assert [a.rpartition(":")[0] for a in (cluster.router_address, *cluster.prefill_addrs, *cluster.decode_addrs)
                ] == [hosts.address(name) for name in ("router", "prefill", "decode")]
        assert cluster.http_url.startswith(f"http://{hosts.address('router')}:")
        assert_each_process_in_its_host(cluster, hosts)
        with BatonClient(cluster.router_address, timeout=60) as client:
            results = [client.generate(token_ids=p, max_tokens=12, ignore_eos=True) for p in prompts]
            workers = {w.address for w in client.cluster_status().workers}
        with urllib.request.urlopen(f"{cluster.http_url}/models", timeout=10) as response:
            models = json.loads(response.read())
        scraped = urllib.request.urlopen(f"http://{hosts.address('prefill')}:{metrics_port}/metrics",
                                         timeout=10).read().decode()
    assert [r.token_ids for r in results] == [tiny_reference.greedy(p, 12) for p in prompts]
    assert workers == {*cluster.prefill_addrs, *cluster.decode_addrs}
    assert models["data"]
    landed = {s.labels["transport"]: s.value for f in text_string_to_metric_families(scraped)
              for s in f.samples if s.name == "baton_kv_transfer_transports_total"}
    assert landed == {transport: len(prompts)}  # on one host it would have been shared memory (test_kv_shm)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_decode_host_drained_or_killed_loses_no_request(make_hosts, tiny_reference, how):
    """test_migration's drain and test_faults' kill across hosts: SIGTERM on a busy decode worker
    moves its requests with their KV over the bridge to the other decode host; SIGKILL leaves them
    to the router, which prefills them again for the other host. Every answer is exact either
    way, and the worker restarted in its host serves again."""
    hosts = make_hosts(LocalCluster.host_names(prefill=1, decode=2))
    prompts = [[100 + 9 * i + j for j in range(5 + 3 * i)] for i in range(4)]
    max_tokens = 256  # long enough that the streams are running when the drain begins (test_migration)
    with LocalCluster(prefill=1, decode=2, model="tiny-random", max_rows=4, hosts=hosts,
                      decode_args=("--drain-move-after-s", "0")) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            run = drain_one_mid_stream(cluster, client, prompts, max_tokens, how)
            time.sleep(1.0)  # a load poll after the last request finished
            moved_in = {w.address: w for w in client.cluster_status().workers}[run["target"]].decode["migrations_in"]
            cluster.restart(run["drained"])
            assert_each_process_in_its_host(cluster, hosts)
    for i, prompt in enumerate(prompts):
        assert run["outcome"].get(i) == "length", f"request {i}: {run['outcome'].get(i)!r}"
        assert run["streamed"][i] == tiny_reference.greedy(prompt, max_tokens), f"request {i} lost or repeated tokens"
    assert moved_in > 0 or how == "SIGKILL"  # drained: the KV moved, nothing was prefilled twice
