"""Static discovery: worker addresses fixed in configuration (one machine, docker-compose)."""
from __future__ import annotations

import logging

from baton.router.discovery.worker_set import WorkerSet

log = logging.getLogger(__name__)


def check_address(address: str, role: str) -> str:
    """`host:port` (IPv6 as `[addr]:port`), or a ValueError saying what to write instead."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{role} worker address {address!r} is not host:port (e.g. 127.0.0.1:50061); "
                         f"set router.{role}_workers to a comma-separated list of host:port")
    return address.strip()


class StaticDiscovery:
    """Fills the worker set once with the configured addresses; nothing changes afterwards."""

    def __init__(self, prefill: list[str], decode: list[str]):
        self.addresses = {"prefill": [check_address(a, "prefill") for a in prefill],
                          "decode": [check_address(a, "decode") for a in decode]}

    def start(self, worker_set: WorkerSet) -> None:
        for role, addresses in self.addresses.items():
            worker_set.replace(role, addresses)
            log.info("static %s workers: %s", role, addresses,
                     extra={"role": role, "workers": addresses, "discovery": "static"})

    def stop(self) -> None:
        pass  # nothing runs in the background
