"""What this process may use: memory and CPUs within its container's limits, not only the machine's.

A pod's memory limit and CPU quota live in its cgroup; `/proc/meminfo` and the affinity mask show
the whole node. Defaults sized from the node get a pod OOM-killed (a KV budget of a quarter of the
node's memory) or oversubscribed (a thread per node core under a one-CPU quota), so, as the JVM
and Go runtimes do, Baton reads the cgroup: v2 (`memory.max`, `memory.current`, `cpu.max`) or v1
(`memory.limit_in_bytes`, `memory.usage_in_bytes`, `cpu.cfs_quota_us` / `cpu.cfs_period_us`),
the tightest limit from the process's own cgroup up to the root. Standard library only.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 writes "no limit" as a huge number (page-rounded LONG_MAX)


@dataclass(frozen=True)
class Amount:
    """A quantity and how it was found, for the start-up log."""

    value: int
    source: str


def _cgroup_dirs(controller: str, root: Path, proc_cgroup: Path) -> list[Path]:
    """The controller's cgroup folders for this process, its own first, then each parent up to the
    hierarchy's root (a limit set on any of them binds). Inside a container the path in
    /proc/self/cgroup may name the host's hierarchy while the container's own is mounted at the
    root: folders that do not exist are skipped."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):  # v1: the controller's own hierarchy
            base = next((root / name for name in (controllers, controller) if (root / name).is_dir()), None)
            break
    else:  # v2: one unified hierarchy, "0::/path"
        path = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
        base = root if path is not None and (root / "cgroup.controllers").exists() else None
    if base is None:
        return []
    parts = [p for p in path.strip("/").split("/") if p]
    candidates = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in candidates if d.is_dir()]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().split()[0]
    except (OSError, IndexError):
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value < 0 or value >= UNLIMITED else value


def memory_available(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                     meminfo: Path = Path("/proc/meminfo")) -> Amount:
    """Bytes this process may still take: the host's MemAvailable, or less where a cgroup's limit
    minus what the cgroup already uses is tighter."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        best = Amount(int(fields["MemAvailable"].split()[0]) * 1024, "the host's MemAvailable")
    except (OSError, KeyError, ValueError):
        best = Amount(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the host's free pages")
    for folder in _cgroup_dirs("memory", root, proc_cgroup):
        limit = _read_int(folder / "memory.max") or _read_int(folder / "memory.limit_in_bytes")
        if limit is None:
            continue
        used = _read_int(folder / "memory.current") or _read_int(folder / "memory.usage_in_bytes") or 0
        left = max(0, limit - used)
        if left < best.value:
            best = Amount(left, f"the cgroup memory limit {limit} bytes less {used} in use ({folder})")
    return best


def cpus_usable(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> Amount:
    """CPUs this process may keep busy: the cores its affinity mask allows, or fewer where a cgroup's
    CPU quota is lower (a quota of 1.5 CPUs gives 2: a thread per started CPU)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    best = Amount(cores, f"{cores} cores in the affinity mask")
    for folder in _cgroup_dirs("cpu", root, proc_cgroup):
        quota = period = None
        try:
            v2 = (folder / "cpu.max").read_text().split()
            quota, period = (None if v2[0] == "max" else int(v2[0])), int(v2[1])
        except (OSError, IndexError, ValueError):
            quota, period = _read_int(folder / "cpu.cfs_quota_us"), _read_int(folder / "cpu.cfs_period_us")
        if quota is None or not period:
            continue
        allowed = max(1, math.ceil(quota / period))
        if allowed < best.value:
            best = Amount(allowed, f"the cgroup CPU quota {quota / period:g} CPUs ({folder}) of {cores} cores")
    return best
