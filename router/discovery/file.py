"""File discovery: worker addresses from a JSON file that whoever starts and stops the workers
rewrites (`baton up` with its planner: workers come and go on one machine, as pods do).

    {"prefill": ["127.0.0.1:50061"], "decode": ["127.0.0.1:50071", "127.0.0.1:50072"]}

The file is read at start (it must exist and parse) and again whenever it changes; a change that
does not parse is logged and ignored, the last good set kept. Writers replace it whole
(`write_workers_file`: a temporary file renamed over it), so a reader never sees half of one.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping

from baton.router.discovery.static import check_address
from baton.router.discovery.worker_set import ROLES, WorkerSet

log = logging.getLogger(__name__)

POLL_S = 0.2


def read_workers_file(path: str, roles: Iterable[str] = ROLES) -> dict[str, list[str]]:
    """The file's addresses per role; ValueError (saying what is wrong) for anything else."""
    try:
        with open(path, "rb") as f:
            return parse_workers(f.read(), path, roles)
    except OSError as exc:
        raise ValueError(f"cannot read the workers file {path}: {exc}") from None


def parse_workers(raw: bytes, path: str, roles: Iterable[str] = ROLES) -> dict[str, list[str]]:
    """A workers file's bytes as addresses per role; ValueError (saying what is wrong) otherwise."""
    try:
        content = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the workers file {path} is not JSON: {exc}") from None
    if not isinstance(content, dict):
        raise ValueError(f"the workers file {path} must hold an object of role -> [host:port, ...]")
    found = {}
    for role in roles:
        addresses = content.get(role, [])
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ValueError(f"the workers file {path}: {role!r} must be a list of host:port strings")
        found[role] = [check_address(a, role) for a in addresses]
    return found


def write_workers_file(path: str, workers: Mapping[str, Iterable[str]]) -> None:
    """Replace the file with these addresses, atomically."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=".workers-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({role: sorted(addresses) for role, addresses in workers.items()}, f)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


class FileDiscovery:
    def __init__(self, path: str, roles: Iterable[str] = ROLES, poll_s: float = POLL_S) -> None:
        if not path:
            raise ValueError("file discovery needs the workers file's path (workers_file)")
        self.path, self.roles, self.poll_s = path, tuple(roles), poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: tuple | None = None

    def start(self, worker_set: WorkerSet) -> None:
        # What is applied and what later reads compare with are the same bytes: read twice, a
        # change between the reads would be taken as seen and never applied.
        self._seen = self._stamp()
        if self._seen is None:
            read_workers_file(self.path, self.roles)  # raises, saying why it cannot be read
        self._apply(worker_set, parse_workers(self._seen, self.path, self.roles))
        self._thread = threading.Thread(target=self._watch, args=(worker_set,), name="file-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _stamp(self) -> bytes | None:
        """The file's bytes: it is small, and a timestamp can miss a change made within its tick."""
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except OSError:
            return None

    def _watch(self, worker_set: WorkerSet) -> None:
        while not self._stop.wait(self.poll_s):
            stamp = self._stamp()
            if stamp == self._seen:
                continue
            self._seen = stamp
            try:
                if stamp is None:
                    raise ValueError(f"cannot read the workers file {self.path}")
                self._apply(worker_set, parse_workers(stamp, self.path, self.roles))
            except ValueError as exc:
                log.warning("%s; keeping the workers known before", exc)

    def _apply(self, worker_set: WorkerSet, workers: dict[str, list[str]]) -> None:
        for role, addresses in workers.items():
            added, removed = worker_set.replace(role, addresses)
            if added or removed:
                log.info("%s workers from %s: +%s -%s", role, self.path, sorted(added), sorted(removed),
                         extra={"role": role, "added": sorted(added), "removed": sorted(removed), "discovery": "file"})
