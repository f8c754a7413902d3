"""PNG figures for the suites (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ENGINE_STYLE = {"static": ("tab:gray", "HF static batching"), "continuous": ("tab:orange", "HF continuous batching"),
                "local": ("tab:blue", "Baton local"), "cluster": ("tab:green", "Baton cluster")}


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _steps(finished: Sequence[float], weights: Sequence[int]) -> tuple[list[float], list[int]]:
    """Cumulative weight over time, as a step curve starting at (0, 0)."""
    xs, ys, total = [0.0], [0], 0
    for t, w in sorted(zip(finished, weights)):
        total += w
        xs.append(t)
        ys.append(total)
    return xs, ys


def completion_timelines(path: Path, title: str, per_batch: dict[int, dict[str, tuple[list[float], list[int]]]]) -> Path:
    """One row per batch size: completed queries over time, and output tokens of completed queries.

    per_batch[B][engine] = (finish second of each query, output length of each query)."""
    sizes = sorted(per_batch)
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 2.8 * len(sizes)), squeeze=False)
    for row, b in enumerate(sizes):
        for engine, (finished, lengths) in per_batch[b].items():
            color, label = ENGINE_STYLE.get(engine, (None, engine))
            axes[row][0].step(*_steps(finished, [1] * len(finished)), where="post", color=color, label=label)
            axes[row][1].step(*_steps(finished, lengths), where="post", color=color, label=label)
        axes[row][0].set_ylabel(f"B={b}\ncompleted queries")
        axes[row][1].set_ylabel("output tokens (completed)")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds")
    axes[-1][1].set_xlabel("seconds")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    return _save(fig, path)


def kv_bytes(path: Path, title: str, per_batch: dict[int, list[dict[str, float]]]) -> Path:
    """Batch KV bytes after every decode step: allocated buffer, padded window attention reads, useful."""
    sizes = sorted(per_batch)
    fig, axes = plt.subplots(len(sizes), 1, figsize=(9, 2.4 * len(sizes)), squeeze=False)
    for ax, b in zip((a[0] for a in axes), sizes):
        samples = per_batch[b]
        t = [s["t"] for s in samples]
        for key, color in (("allocated", "tab:red"), ("window", "tab:orange"), ("useful", "tab:blue")):
            ax.plot(t, [s[key] / 2**20 for s in samples], color=color, label=key, linewidth=1)
        ax.set_ylabel(f"B={b}\nMiB")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper right")
    axes[-1][0].set_xlabel("seconds")
    fig.suptitle(title)
    return _save(fig, path)


def speedups(path: Path, title: str, sizes: list[int], series: dict[str, list[float | None]],
             targets: dict[int, float] | None = None, ideal: list[float] | None = None) -> Path:
    """Each engine's speedup over static batching by batch size, with the paper's figures and the
    bound the workload's output lengths allow."""
    fig, ax = plt.subplots(figsize=(7, 4))
    if ideal:
        ax.plot(sizes, ideal, ":", color="tab:purple", label="ideal (step-count bound of these lengths)")
    for engine, values in series.items():
        pts = [(b, v) for b, v in zip(sizes, values) if v is not None]
        if pts:
            color, label = ENGINE_STYLE.get(engine, (None, engine))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label)
    if targets:
        tb = [b for b in sizes if b in targets]
        if tb:
            ax.plot(tb, [targets[b] for b in tb], "k*--", label="BATON paper (vs static)")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over static batching (completion time)")
    ax.set_xticks(sizes)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def bars(path: Path, title: str, labels: list[str], groups: dict[str, list[float]], ylabel: str,
         log: bool = False) -> Path:
    """Grouped bars: one group per label, one bar per series."""
    fig, ax = plt.subplots(figsize=(7, 4))
    n = max(1, len(groups))
    width = 0.8 / n
    for i, (name, values) in enumerate(groups.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (n - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def token_batch_timeline(path: Path, title: str, series: dict[str, list[int]], budget: int) -> Path:
    """Tokens per prefill iteration: the dips are BatchLLM's "valleys"."""
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for name, sizes in series.items():
        ax.step(range(len(sizes)), sizes, where="post", label=name, linewidth=1)
    ax.axhline(budget, color="black", linestyle="--", linewidth=0.8, label="token budget per iteration")
    ax.set_xlabel("prefill iteration")
    ax.set_ylabel("tokens in the iteration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def replicas_and_load(path: Path, title: str, hours: list[float], rate: list[float],
                      pools: dict[str, list[int]], static: dict[str, int]) -> Path:
    """Arrival rate (left axis) and each pool's workers (right axis) against the hour of the day."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.plot(hours, rate, color="tab:gray", linewidth=0.8, label="arrivals per second")
    ax.set_xlabel("hour")
    ax.set_ylabel("requests per second")
    workers = ax.twinx()
    for (name, counts), color in zip(pools.items(), ("tab:blue", "tab:green")):
        workers.step(hours, counts, where="post", color=color, linewidth=1.2, label=f"{name} workers (planner)")
        workers.axhline(static[name], color=color, linestyle="--", linewidth=0.8, label=f"{name} workers (static)")
    return _finish_twin(fig, ax, workers, title, path)


def replicas_measured_and_modelled(path: Path, title: str, measured: tuple[list[float], dict[str, list[int]]],
                                   modelled: tuple[list[float], dict[str, list[int]]],
                                   rate: tuple[list[float], list[float]]) -> Path:
    """Each pool's workers over a run (minutes): the real cluster's (solid) and the simulator's (dashed),
    with the arrival rate."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.plot(*rate, color="tab:gray", linewidth=0.8, label="arrivals per second")
    ax.set_xlabel("minute")
    ax.set_ylabel("requests per second")
    workers = ax.twinx()
    for (name, counts), color in zip(measured[1].items(), ("tab:blue", "tab:green")):
        workers.step(measured[0], counts, where="post", color=color, linewidth=1.4, label=f"{name} workers (real)")
        workers.step(modelled[0], modelled[1][name], where="post", color=color, linestyle="--", linewidth=1.0,
                     label=f"{name} workers (simulated)")
    return _finish_twin(fig, ax, workers, title, path)


def _finish_twin(fig, ax, workers, title: str, path: Path) -> Path:
    """One legend for both axes, a grid and the title; saved."""
    workers.set_ylabel("workers")
    lines = ax.get_legend_handles_labels()
    more = workers.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    return _save(fig, path)
