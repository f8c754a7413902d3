"""local: how long a rest the decode worker should prefill itself (router.local_prefill_max_tokens).

A conversation's next turn whose earlier turns a decode worker holds can be prefilled there
(conditional disaggregation: no prefill worker, no transfer) or on the prefill worker (which
computes the whole prompt from its own cache and pushes the KV after what the decode worker
holds). Locally the rest runs a chunk per decode step, so it shares the decode worker's core
with the rows decoding there and stalls each of them by one chunk per step; on the prefill
worker it runs at once on that worker's own core, plus a hop and a push. The longer the new
message, the more the local path costs the turn and the rows beside it.

The shape, the local path's worst case: `baton up`'s cluster (1 prefill, 1 decode worker, each
on its own core) with ROWS - 1 streams decoding (ignore_eos) when a conversation's second turn
arrives: turn 1 a short question (answered, up to 16 tokens), turn 2 that conversation, its answer
and a new user message of N words' tokens (N = 64 .. 2048). Once with every such turn prefilled
locally if the router's cost model agrees (router.local_prefill_max_tokens above N: the model
weighs the rest, twice while rows decode there, against the prompt's uncached part on the prefill
worker), once with none (0). Per N (median of REPEATS conversations): turn 2's TTFT, how many of
them were prefilled on the decode worker, the prompt tokens found cached, and the longest gap the
decoding streams saw while it was prefilled.
"""
from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any

from baton.bench.common import BenchOptions, fmt, table

RESTS = (64, 128, 256, 512, 1024, 2048)
QUICK_RESTS = (32, 128)
ROWS = 8
REPEATS = 3
WORDS = ("river stone lantern quiet harbor engine violet market thunder paper garden orbit copper silent "
         "meadow signal winter candle forest bridge planet whisper mirror shadow").split()


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.engine.model_files import load_tokenizer_view

    rests = QUICK_RESTS if opts.quick else RESTS
    repeats = 1 if opts.quick else REPEATS
    text = load_tokenizer_view(opts.model)
    messages = {n: _message(text, n, random.Random(n)) for n in rests}
    opts.say(f"local: a second turn with a new message of {', '.join(map(str, rests))} tokens while {ROWS - 1} "
             f"streams decode; {repeats} conversation(s) each; model {opts.model}, dtype {opts.dtype}")
    results = {}
    for mode, limit in (("allowed", 1 << 20), ("prefill worker", 0)):
        results[mode] = _measure(opts, mode, limit, rests, messages, repeats)
    rows, default = [], 0
    for n in rests:
        here, there = results["allowed"][n], results["prefill worker"][n]
        routed = sum(not r["prefill_worker"] for r in here["runs"])
        rows.append([n, f"{routed}/{len(here['runs'])}", 1e3 * here["ttft_s"], 1e3 * there["ttft_s"],
                     there["ttft_s"] / here["ttft_s"], here["cached"], there["cached"], 1e3 * here["longest_gap_s"],
                     1e3 * there["longest_gap_s"]])
        if here["ttft_s"] <= there["ttft_s"]:
            default = n
    opts.say(table(["new tokens", "prefilled there", "allowed TTFT ms", "prefill-worker TTFT ms", "ratio",
                    "allowed cached", "prefill-worker cached", "allowed longest gap ms",
                    "prefill-worker longest gap ms"], rows, digits=1))
    opts.say(f"allowing the decode worker to prefill is no worse for TTFT up to a new message of {default} tokens "
             "here (router.local_prefill_max_tokens: 512 by default)")
    return {"rests": list(rests), "rows": ROWS, "repeats": repeats, "results": results,
            "local_no_worse_up_to": default, "plots": []}


def _message(text, tokens: int, rng: random.Random) -> str:
    """Words whose tokens number about `tokens`."""
    words: list[str] = []
    while len(text.encode_text(" ".join(words))) < tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def _measure(opts: BenchOptions, mode: str, limit: int, rests, messages: dict[int, str], repeats: int) -> dict:
    from baton.client import BatonClient
    from baton.launch.up import LocalCluster

    opts.progress(f"local: {mode}: starting a cluster (router.local_prefill_max_tokens {limit})")
    env = {**opts.worker_env(), "BATON_ROUTER_LOCAL_PREFILL_MAX_TOKENS": str(limit)}
    out = {}
    with LocalCluster(prefill=1, decode=1, model=opts.model, max_rows=ROWS, extra_env=env) as cluster, \
            BatonClient(cluster.router_address, timeout=600) as client:
        stop = threading.Event()
        ticks: list[float] = []
        lock = threading.Lock()

        def background(k: int) -> None:
            rng = random.Random(1000 + k)
            while not stop.is_set():
                prompt = [rng.randrange(100, 20000) for _ in range(rng.randint(20, 60))]
                with client.stream(token_ids=prompt, max_tokens=400, ignore_eos=True) as stream:
                    for chunk in stream:
                        with lock:
                            ticks.append(time.monotonic())
                        if stop.is_set():
                            break

        threads = [threading.Thread(target=background, args=(k,), daemon=True) for k in range(ROWS - 1)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # every stream decoding
        for n in rests:
            seen = []
            for r in range(repeats):
                chat = [{"role": "system", "content": f"Conversation {mode} {n}.{r}. You are a helpful assistant."},
                        {"role": "user", "content": "Name a river."}]
                first = client.generate(messages=chat, max_tokens=16, temperature=0)
                chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": messages[n]}]
                time.sleep(0.3)  # its KV events reach the router
                sent = time.monotonic()
                with client.stream(messages=chat, max_tokens=4, temperature=0) as stream:
                    first_token = None
                    for chunk in stream:
                        if first_token is None and chunk.token_ids:
                            first_token = time.monotonic()
                    result = stream.result()
                with lock:
                    window = sorted(t for t in ticks if sent <= t <= first_token + 0.05)
                gaps = [b - a for a, b in zip(window, window[1:])]
                seen.append({"ttft_s": first_token - sent, "cached": result.usage.cached_tokens,
                             "prompt": result.usage.prompt_tokens, "longest_gap_s": max(gaps, default=0.0),
                             "route": result.trace.route, "prefill_worker": result.trace.prefill_worker})
            out[n] = {key: statistics.median(s[key] for s in seen) for key in ("ttft_s", "cached", "longest_gap_s")}
            out[n]["runs"] = seen
            opts.progress(f"local: {mode}: {n} new tokens: TTFT {fmt(1e3 * out[n]['ttft_s'], 1)} ms, "
                          f"{fmt(out[n]['cached'], 0)} cached, longest gap {fmt(1e3 * out[n]['longest_gap_s'], 1)} ms")
        stop.set()
        for t in threads:
            t.join(timeout=60)
    return out
