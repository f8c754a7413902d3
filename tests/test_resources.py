"""Defaults within the container's limits: the cgroup's memory limit and CPU quota (v1 and v2,
the tightest from the process's cgroup up), read from cgroup trees written here; then a real
decode worker started inside a real cgroup of 2 GiB and one CPU, whose KV budget, host KV pool and
threads stay within them and whose start-up lines say so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from baton.resources import cpus_usable, memory_available

GIB = 1 << 30


def meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {4 * available_kib} kB\nMemAvailable: {available_kib} kB\n")
    return path


def tree(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "proc-cgroup").write_text(proc)
    return root, tmp_path / "proc-cgroup"


def test_v2_memory_limit_less_usage_and_cpu_quota_bind(tmp_path):
    root, proc = tree(tmp_path, {"cgroup.controllers": "cpu memory", "pod/memory.max": str(2 * GIB),
                                 "pod/memory.current": str(GIB // 2), "pod/cpu.max": "50000 100000"}, "0::/pod\n")
    memory = memory_available(root, proc, meminfo(tmp_path, 16 << 20))  # the host has 16 GiB available
    assert memory.value == 2 * GIB - GIB // 2 and "cgroup memory limit" in memory.source
    cpus = cpus_usable(root, proc)
    # a thread per started CPU: the quota binds where the affinity mask allows more (one core: a tie)
    assert (cpus.value, "0.5 CPUs" in cpus.source) == (1, len(os.sched_getaffinity(0)) > 1)


def test_v1_limits_are_read_from_each_controller_and_a_parent_limit_binds(tmp_path):
    root, proc = tree(tmp_path, {
        "memory/kubepods/memory.limit_in_bytes": str(GIB), "memory/kubepods/memory.usage_in_bytes": "0",
        "memory/kubepods/pod/memory.limit_in_bytes": str(9223372036854771712),  # "unlimited" in v1
        "memory/kubepods/pod/memory.usage_in_bytes": str(GIB // 4),
        "cpu,cpuacct/kubepods/pod/cpu.cfs_quota_us": "100000", "cpu,cpuacct/kubepods/pod/cpu.cfs_period_us": "100000",
    }, "4:memory:/kubepods/pod\n3:cpu,cpuacct:/kubepods/pod\n")
    memory = memory_available(root, proc, meminfo(tmp_path, 16 << 20))
    assert memory.value == GIB and "kubepods" in memory.source  # the parent's limit, its own usage
    assert cpus_usable(root, proc).value == 1


def test_without_limits_the_host_figures_stand(tmp_path):
    root, proc = tree(tmp_path, {"cgroup.controllers": "cpu memory", "memory.max": "max", "cpu.max": "max 100000"},
                      "0::/\n")
    memory = memory_available(root, proc, meminfo(tmp_path, 3 << 20))
    assert (memory.value, memory.source) == (3 * GIB, "the host's MemAvailable")
    cpus = cpus_usable(root, proc)
    assert cpus.value == len(os.sched_getaffinity(0)) and "affinity" in cpus.source


def test_a_cgroup_path_from_the_hosts_view_falls_back_to_what_is_mounted(tmp_path):
    """In a container without its own cgroup namespace, /proc/self/cgroup names the host's path
    while the container's cgroup is what is mounted at the root."""
    root, proc = tree(tmp_path, {"memory/memory.limit_in_bytes": str(GIB), "memory/memory.usage_in_bytes": "0"},
                      "4:memory:/docker/0123abcd\n")
    assert memory_available(root, proc, meminfo(tmp_path, 16 << 20)).value == GIB


V1 = Path("/sys/fs/cgroup")


def real_v1_cgroup() -> tuple[Path, Path] | None:
    """(memory, cpu) cgroup folders made for this test, or None where cgroups v1 cannot be written."""
    name = f"baton-test-{uuid.uuid4().hex[:8]}"
    memory, cpu = V1 / "memory" / name, V1 / "cpu" / name
    try:
        memory.mkdir()
        cpu.mkdir()
        (memory / "memory.limit_in_bytes").write_text(str(2 * GIB))
        (cpu / "cpu.cfs_period_us").write_text("100000")
        (cpu / "cpu.cfs_quota_us").write_text("100000")
    except OSError:
        for folder in (memory, cpu):
            if folder.is_dir():
                folder.rmdir()
        return None
    return memory, cpu


@pytest.mark.slow
@pytest.mark.all_cores  # the quota binds only where the affinity mask allows more than it
def test_a_decode_worker_in_a_2_gib_one_cpu_cgroup_sizes_itself_within_it():
    made = real_v1_cgroup()
    if made is None:
        pytest.skip("needs writable cgroup v1 memory and cpu hierarchies (root)")
    memory, cpu = made
    script = (f"echo $$ > {memory}/cgroup.procs && echo $$ > {cpu}/cgroup.procs && "
              f"exec {sys.executable} -m baton.cli decode --host 127.0.0.1 --port 0 "
              "--model tiny-random")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.Popen(["sh", "-c", script], stderr=subprocess.PIPE, text=True, env=env)
    lines: dict[str, dict] = {}
    try:
        for line in proc.stderr:
            record = json.loads(line) if line.startswith("{") else {}
            message = record.get("message", "")
            for key in ("KV budget", "torch threads", "host KV pool", "decode rows"):
                if message.startswith(key):
                    lines[key] = record
            if len(lines) == 4:
                break
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for folder in (memory, cpu):
            folder.rmdir()
    # at the default log level: a worker's start-up lines show unless --log-level error
    assert set(lines) == {"KV budget", "torch threads", "host KV pool", "decode rows"}, lines
    budget, threads, staging = lines["KV budget"], lines["torch threads"], lines["host KV pool"]
    assert budget["value"] <= 2 * GIB // 4 and "cgroup memory limit" in budget["chosen_by"], budget
    assert threads["value"] == 1 and ("cgroup CPU quota 1 CPUs" in threads["chosen_by"] or len(os.sched_getaffinity(0)) == 1), threads
    # its 512 MiB floor would pass a quarter of what the cgroup leaves
    assert staging["value"] <= 2 * GIB // 4 and "cgroup memory limit" in staging["chosen_by"], staging
    assert lines["decode rows"]["value"] == 8, lines["decode rows"]  # 4 per thread, at least 8
