"""Several hosts on one machine: a Linux network namespace per host, all joined by a bridge.

    root namespace (this process)       bridge namespace: br0 with ports   host namespaces
    baton-<tag> 10.X.Y.1 ----- veth ----- root
                                          h0 ----- veth ----- eth0 10.X.Y.2 (names[0])
                                          h1 ----- veth ----- eth0 10.X.Y.3 (names[1]) ...

Each host has its own loopback, ports and abstract Unix sockets, so processes in two hosts talk
only over the bridge, as on two machines (a KV push between them goes over gRPC, not shared
memory). With a rate, each host's link is held to it by a `tbf` qdisc on both ends of its veth.
Needs root and iproute2 (`ip`, `tc`); standard library only. `baton.launch.up.LocalCluster(hosts=...)`
runs a cluster across them.
"""
from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import sys

# tbf's queue, as the time a full queue takes to drain: deep enough that TCP keeps the link busy
# (the veth round trip is microseconds), shallow enough that a message queued behind a bulk
# transfer waits about as long as behind a switch's buffer, not seconds.
TBF_LATENCY_MS = 20
# tbf's bucket: at least what the rate brings in one kernel timer tick (rate/HZ, tc's rule; HZ is
# 100 to 1000, so rate/100 covers them all) and at least one packet, which on a veth is a GSO
# packet of up to 64 KiB (tbf would split bigger ones). So 10 ms of data, 100 KB at 80 Mbit, may
# pass at once after an idle spell; past that the rate holds.
TBF_MIN_BURST_BYTES = 64 * 1024
TIMER_HZ = 100

_NAME = re.compile(r"^[a-z][a-z0-9]{0,19}$")


def available() -> tuple[bool, str]:
    """(True, '') where this process may make network namespaces, else (False, why): tests skip
    with that reason."""
    if not sys.platform.startswith("linux"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (ip netns add)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"iproute2's {' and '.join(missing)} not installed"
    probe = f"baton-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return True, ""


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 destination the root namespace routes, in any table (connected subnets included)."""
    routes = json.loads(_run("ip", "-j", "-4", "route", "show", "table", "all") or "[]")
    return [ipaddress.ip_network(r["dst"], strict=False) for r in routes if r.get("dst", "default") != "default"]


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{random.randrange(1, 255)}.{random.randrange(1, 255)}.0/24")
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise RuntimeError("no free 10.X.Y.0/24 subnet: the routes here cover them all")


class Hosts:
    """Hosts named `names`, each a network namespace with its own address on a private /24 (the
    root namespace holds the first address, so this process reaches every host). A context
    manager; `start()` and `close()` otherwise. Stop the processes running in the hosts before
    closing: a namespace outlives its deletion while a process is in it (without its links).

    `rate_mbit` limits each host's link, both directions, to that many megabits per second
    (`set_rate` changes it later); traffic between two hosts passes both of their links."""

    def __init__(self, names: list[str], rate_mbit: float | None = None):
        names = list(names)
        bad = [n for n in names if not _NAME.match(n)]
        if not 0 < len(names) < 254 or bad or len(set(names)) != len(names):
            raise ValueError(f"1 to 253 host names, distinct, lowercase letters and digits, 1-20 characters each; "
                             f"got {names}")
        self.names = names
        self.rate_mbit = rate_mbit
        self.tag = secrets.token_hex(3)
        self.bridge_namespace = f"baton-{self.tag}"
        self.namespaces = {name: f"baton-{self.tag}-{name}" for name in names}
        self.root_link = f"baton-{self.tag}"  # the root namespace's end of its veth (15 characters at most)
        self.subnet: ipaddress.IPv4Network | None = None
        self._made_namespaces: list[str] = []  # what close() deletes: only what was made
        self._made_root_link = False
        self._limited = False

    def start(self) -> "Hosts":
        """Make the namespaces, the bridge and the links; on any failure, undo what was made."""
        try:
            self.subnet = _free_subnet()
            prefix = self.subnet.prefixlen
            bridge = self.bridge_namespace
            self._add_namespace(bridge)
            _run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", bridge, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                ns = self.namespaces[name]
                self._add_namespace(ns)
                # made inside the namespaces, so no name is ever taken in the root namespace
                _run("ip", "-n", bridge, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "-n", bridge, "link", "set", f"h{i}", "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(name)}/{prefix}", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "link", "add", self.root_link, "type", "veth", "peer", "name", "root", "netns", bridge)
            self._made_root_link = True
            _run("ip", "-n", bridge, "link", "set", "root", "master", "br0", "up")
            _run("ip", "addr", "add", f"{self.root_address}/{prefix}", "dev", self.root_link)
            _run("ip", "link", "set", self.root_link, "up")
            self.set_rate(self.rate_mbit)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made_namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    @property
    def root_address(self) -> str:
        """This (the root) namespace's address on the hosts' subnet."""
        return str(self._subnet().network_address + 1)

    def address(self, name: str) -> str:
        """The IPv4 address of host `name`."""
        return str(self._subnet().network_address + 2 + self.names.index(name))

    def _subnet(self) -> ipaddress.IPv4Network:
        if self.subnet is None:
            raise RuntimeError("the hosts are not started")
        return self.subnet

    def command(self, name: str, argv: list[str]) -> list[str]:
        """argv run in host `name`. `ip netns exec` execs it in place: the process started is argv's
        own (its PID, its parent), as if started directly."""
        return ["ip", "netns", "exec", self.namespaces[name], *argv]

    def _links(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every host's veth."""
        return [end for i, name in enumerate(self.names)
                for end in ((self.namespaces[name], "eth0"), (self.bridge_namespace, f"h{i}"))]

    def set_rate(self, mbit: float | None) -> None:
        """Limit every host's link to `mbit` megabits per second each way; None: no limit."""
        if mbit is None:
            if self._limited:
                for ns, dev in self._links():
                    _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")
            self._limited = False
        else:
            if mbit <= 0:
                raise ValueError(f"rate_mbit must be positive, got {mbit}")
            bits = int(mbit * 1e6)
            burst = max(TBF_MIN_BURST_BYTES, bits // 8 // TIMER_HZ)
            for ns, dev in self._links():
                _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                     "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms")
            self._limited = True
        self.rate_mbit = mbit

    def close(self) -> None:
        """Delete every link and namespace this object made (even a partial setup's); idempotent.
        The veths go first and explicitly: a deleted namespace's own links vanish only later, as
        the kernel gets to it."""
        failures = []
        if self._made_root_link:
            failures += self._try("ip", "link", "del", self.root_link)
            self._made_root_link = False
        for ns in reversed(self._made_namespaces):
            if ns != self.bridge_namespace:
                self._try("ip", "-n", ns, "link", "del", "eth0")  # absent if setup failed before it
            failures += self._try("ip", "netns", "delete", ns)
        self._made_namespaces.clear()
        self._limited = False
        if failures:
            raise RuntimeError("could not remove every network namespace and link: " + "; ".join(failures))

    @staticmethod
    def _try(*argv: str) -> list[str]:
        try:
            _run(*argv)
        except RuntimeError as exc:
            return [str(exc)]
        return []

    def __enter__(self) -> "Hosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
