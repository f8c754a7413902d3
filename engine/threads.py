"""CPU threads and cores for a process that runs a model.

A worker picks its torch/OpenMP threads deliberately: one per core it may use, and, when told
which cores are its own, bound to them (as vLLM's CPU workers are), so that two workers on one
machine split its cores instead of each spinning a thread on all of them.
"""
from __future__ import annotations

import logging
import os

from baton.logs import STARTUP_LOGGER
from baton.resources import Amount, cpus_usable

log = logging.getLogger(STARTUP_LOGGER)
_chosen: Amount | None = None  # torch's threads are the process's: so is what configure chose


def parse_cores(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]; raises ValueError with what was wrong."""
    cores: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"cpu cores must look like '0-3,6' (got {text!r})") from None
        if first < 0 or last < first:
            raise ValueError(f"bad core range {part!r} in {text!r}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return sorted(cores)


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def configure(threads: int = 0, cpu_cores: str = "") -> int:
    """Bind to `cpu_cores` (if given) and run `threads` intra-op threads (0: one per usable core,
    unless OMP_NUM_THREADS says otherwise). Returns the thread count in force."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (got {threads})")
    if cpu_cores:
        cores = parse_cores(cpu_cores)
        missing = sorted(set(cores) - set(range(os.cpu_count() or 1)))
        if missing:
            raise ValueError(f"cpu cores {missing} do not exist on this machine ({os.cpu_count()} cores)")
        os.sched_setaffinity(0, cores)
    how = "as asked"
    if threads == 0:
        omp = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        usable = cpus_usable()  # the container's CPU quota too: a thread per core past it only waits
        threads, how = (omp, "OMP_NUM_THREADS") if omp else (usable.value, usable.source)
    import torch  # here, so that picking cores for other processes does not load torch

    torch.set_num_threads(threads)
    log.info("torch threads %d (%s) on cores %s", threads, how, ",".join(map(str, usable_cores())),
             extra={"setting": "threads", "value": threads, "chosen_by": how})
    global _chosen
    _chosen = Amount(threads, how)
    return threads


def chosen() -> Amount:
    """This process's torch threads and how configure() chose them (torch's own count if it was
    never called)."""
    import torch

    return _chosen if _chosen is not None else Amount(torch.get_num_threads(), "torch's default")


def split_cores(count: int, cores: list[int] | None = None) -> list[str]:
    """Disjoint core lists for `count` processes ('' for each where there are fewer cores than
    processes: they share rather than pile onto one core)."""
    cores = usable_cores() if cores is None else cores
    if count < 1 or len(cores) < count:
        return [""] * max(count, 0)
    share, extra = divmod(len(cores), count)
    out, at = [], 0
    for i in range(count):
        n = share + (1 if i < extra else 0)
        out.append(",".join(map(str, cores[at:at + n])))
        at += n
    return out
