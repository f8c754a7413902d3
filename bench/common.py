"""What every suite shares: its options, progress and table printing, thread settings, JSON output."""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

DEFAULT_OUT_DIR = "bench-results"
# A cluster's environment where every prompt is prefilled on a prefill worker and its whole KV
# pushed: suites measuring that path (transfers, prefill routing) repeat prompts, which a decode
# worker would otherwise find retained and prefill itself (docs/conversations.md).
NO_LOCAL_PREFILL = {"BATON_DECODE_RETAIN_KV": "false", "BATON_ROUTER_LOCAL_PREFILL_MAX_TOKENS": "0"}


@dataclass
class BenchOptions:
    """Parsed once by `main` and handed to the suite."""

    quick: bool = False
    out_dir: Path = Path(DEFAULT_OUT_DIR)
    threads: int = 1  # torch intra-op threads in this process and in every worker it starts; 0 = torch default
    model: str = "default"
    # Benchmarks check tokens exactly against transformers, which only fp32 makes portable (bf16
    # rounding breaks near-tied logits differently in two implementations); peers run fp32 too.
    dtype: str = "float32"
    # The table and progress go here; with --json stdout carries the JSON document alone.
    out: TextIO = field(default=sys.stdout)
    extra: dict[str, Any] = field(default_factory=dict)  # suite-specific arguments by name

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def progress(self, text: str) -> None:
        print(f"  .. {text}", file=sys.stderr, flush=True)

    def plot_path(self, name: str) -> Path:
        return self.out_dir / name

    def worker_env(self) -> dict[str, str]:
        """Environment for worker processes so they use the same threads and dtype as this one."""
        env = {"BATON_MODEL_DTYPE": self.dtype}
        if self.threads > 0:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        return env


def apply_threads(threads: int) -> int:
    """Set torch's intra-op threads (0 leaves torch's default); returns the count in force."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def environment(threads_in_force: int) -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": threads_in_force, "cuda": torch.cuda.is_available(),
            "machine": platform.machine(), "load_average_at_start": _load_average()}


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class Stopwatch:
    """Seconds since construction, from a monotonic clock."""

    def __init__(self):
        self.started = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.started


def by_clients(items: Sequence[Any], clients: int, handle: Callable[[Any], None]) -> float:
    """`handle(item)` for every item, from `clients` threads each taking the next item until none is
    left (closed-loop clients); the wall seconds from the first start to the last end."""
    pending = iter(items)
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                item = next(pending, _NONE_LEFT)
            if item is _NONE_LEFT:
                return
            handle(item)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(clients, len(items)))]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - started


_NONE_LEFT = object()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Smallest wall time of `repeats` calls: the least disturbed one on a shared machine."""
    return min(timed(fn)[1] for _ in range(repeats))


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    """A plain aligned text table; floats get `digits` decimals, None prints as '-'."""
    cells = [[fmt(v, digits) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM a peer server started in its own session, and its children; SIGKILL after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
