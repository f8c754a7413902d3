"""long (issues 46 and 47): new prompts of 1,024-8,000 tokens through `baton up` on one host, as a
user sends them: time to first token, the trace's prefill and transfer stages, and which way the
KV went from the prefill to the decode worker.

A `LocalCluster` (1 router, 1 prefill and 1 decode worker, each on cores of its own; on a GPU
both workers share it) serves `--model`. Each prompt is new (random token ids: nothing cached),
streamed through the SDK with greedy sampling for 8 tokens, one request at a time, the lengths
taken in turn `--repeats` times so drift on the machine falls on all of them alike. Per length,
the medians: TTFT, the prefill stage, the transfer stage (prefill end to the KV staged on the
decode worker) and its share of the prefill stage (issue 47: under 10% on a GPU); then the TTFT
of the longest over the shortest beside their token ratio (issue 46 on this CPU: 8,000 over 1,024
tokens within 16x). Each prompt is then sent again through the OpenAI API (`/v1/completions` with
its token ids, streamed): its TTFT there, and whether its text is the SDK's. The prefill worker's
metrics say how each KV travelled (cuda_ipc, shm, nixl, grpc). With `--host-transport` the same
prompts go again through a cluster whose KV goes over gRPC through host memory, and the tokens
of both are compared (issue 47: identical). With `--against-generate`, once the clusters are
stopped, each prompt goes through transformers' `generate` on the same weights in the same dtype
(greedy, as many tokens): whether the served tokens are its (issue 46: in fp32, equal).
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any

from baton.bench.common import NO_LOCAL_PREFILL, BenchOptions, table

LENGTHS = (1024, 2048, 4000, 8000)
QUICK_LENGTHS = (64, 256)
OUTPUT_TOKENS = 8


def add_arguments(parser) -> None:
    parser.add_argument("--lengths", default=None,
                        help=f"prompt lengths in tokens, comma-separated (default {','.join(map(str, LENGTHS))})")
    parser.add_argument("--repeats", type=int, default=None, help="prompts of each length (default 3; --quick 1)")
    parser.add_argument("--host-transport", action="store_true",
                        help="send the same prompts through a cluster pushing KV over gRPC and compare the tokens")
    parser.add_argument("--against-generate", action="store_true",
                        help="afterwards, compare each prompt's served tokens with transformers' generate")


def run(opts: BenchOptions) -> dict[str, Any]:
    lengths = QUICK_LENGTHS if opts.quick else tuple(
        int(n) for n in (opts.extra.get("lengths") or ",".join(map(str, LENGTHS))).split(",") if n.strip())
    if not lengths or min(lengths) < 2:
        raise ValueError(f"long: prompt lengths must be at least 2 tokens (got {lengths})")
    repeats = opts.extra.get("repeats") or (1 if opts.quick else 3)
    runs = {"default": _serve(opts, lengths, repeats, ())}
    if opts.extra.get("host_transport") or opts.quick:
        runs["grpc"] = _serve(opts, lengths, repeats, ("--kv-transport", "grpc"))
    rows, by_length = [], {}
    for n in lengths:
        sent = [r for r in runs["default"]["requests"] if r["tokens"] == n]
        medians = {key: statistics.median(r[key] for r in sent)
                   for key in ("ttft_s", "prefill_s", "transfer_s", "openai_ttft_s")}
        medians["transfer_share"] = statistics.median(r["transfer_s"] / r["prefill_s"] for r in sent if r["prefill_s"])
        by_length[n] = medians
        rows.append([n, 1e3 * medians["ttft_s"], 1e3 * medians["prefill_s"], 1e3 * medians["transfer_s"],
                     f"{100 * medians['transfer_share']:.1f}%", 1e3 * medians["openai_ttft_s"]])
    opts.say(table(["prompt tokens", "TTFT ms", "prefill ms", "transfer ms", "transfer / prefill",
                    "OpenAI API TTFT ms"], rows, digits=1))
    shortest, longest = min(lengths), max(lengths)
    growth = by_length[longest]["ttft_s"] / by_length[shortest]["ttft_s"]
    opts.say(f"the KV of the SDK's and the API's requests went by {runs['default']['transports']}; TTFT of "
             f"{longest} tokens over {shortest}: {growth:.2f}x for {longest / shortest:.2f}x the tokens")
    served = runs["default"]["requests"]
    opts.say(f"the OpenAI API's text is the SDK's for {sum(r['openai_text'] == r['text'] for r in served)} of "
             f"{len(served)} prompts")
    same = None
    if "grpc" in runs:
        pairs = list(zip(runs["default"]["requests"], runs["grpc"]["requests"]))
        same = sum(a["output"] == b["output"] for a, b in pairs)
        opts.say(f"tokens identical with the KV pushed over gRPC through host memory ({runs['grpc']['transports']}): "
                 f"{same} of {len(pairs)} requests")
    as_generate = None
    if opts.extra.get("against_generate"):
        as_generate = _as_generate(opts, served)
        opts.say(f"the served tokens are transformers' generate's ({opts.dtype}) for {as_generate} of "
                 f"{len(served)} prompts")
    return {"model": opts.model, "dtype": opts.dtype, "lengths": list(lengths), "repeats": repeats,
            "by_length": {str(n): m for n, m in by_length.items()}, "ttft_growth": growth,
            "transports": runs["default"]["transports"], "identical_with_grpc": same,
            "as_generate": as_generate, "runs": runs, "plots": []}


def _as_generate(opts: BenchOptions, requests: list[dict[str, Any]]) -> int:
    """How many requests' served tokens are what transformers' greedy `generate` gives their prompt on
    the same weights and dtype (up to its own end where it meets an end-of-sequence token: the
    requests ignored it)."""
    from baton.bench.engines import hf_greedy
    from baton.engine.model import load_model

    loaded = load_model(opts.model, dtype=opts.dtype)
    loaded.model.set_attn_implementation("sdpa")
    same = 0
    for i, request in enumerate(requests):
        opts.progress(f"long: transformers' generate on prompt {i + 1} of {len(requests)} ({request['tokens']} tokens)")
        expected = hf_greedy(loaded, request["prompt"], len(request["output"]))
        same += request["output"][:len(expected)] == expected
    return same


def _serve(opts: BenchOptions, lengths, repeats: int, transport_args: tuple[str, ...]) -> dict[str, Any]:
    """Each length's prompts through a fresh cluster; what each request saw, and the transports."""
    from baton.bench.goodput import one_request
    from baton.client import BatonClient
    from baton.launch.up import LocalCluster, free_port

    label = " ".join(transport_args) or "the default transport"
    opts.progress(f"long: starting a cluster serving {opts.model} ({label})")
    metrics_port = free_port()
    env = {**opts.worker_env(), "BATON_PREFILL_PREFIX_CACHE_BYTES": "0", **NO_LOCAL_PREFILL}
    requests = []
    with LocalCluster(model=opts.model, max_rows=4, share_cores=True, extra_env=env, http_port=-1,
                      prefill_args=("--metrics-port", str(metrics_port), *transport_args),
                      decode_args=transport_args) as cluster, \
            BatonClient(cluster.router_address, timeout=1800) as client:
        info = client.model_info()
        base = cluster.http_url.removesuffix("/v1")
        if max(lengths) + OUTPUT_TOKENS > info.max_context:
            raise ValueError(f"long: {max(lengths)} prompt tokens and {OUTPUT_TOKENS} more exceed the model's context "
                             f"({info.max_context})")
        client.generate(token_ids=[11, 12, 13], max_tokens=2, temperature=0)  # warm
        before = _transports(metrics_port)
        rng = random.Random(46)  # the same prompts in every cluster
        for repeat in range(repeats):
            for n in lengths:
                prompt = [rng.randrange(10, info.vocab_size) for _ in range(n)]
                opts.progress(f"long: a new {n}-token prompt ({repeat + 1} of {repeats}, {label})")
                started, first, output, text = time.perf_counter(), None, [], []
                with client.stream(token_ids=prompt, max_tokens=OUTPUT_TOKENS, temperature=0,
                                   ignore_eos=True) as stream:
                    for chunk in stream:
                        if first is None and chunk.token_ids:
                            first = time.perf_counter() - started
                        output += chunk.token_ids
                        text.append(chunk.text_delta)
                    stages = stream.result().trace.stage_seconds
                # the same prompt through the OpenAI API (nothing of it is cached: computed again)
                api = one_request(base, {"model": info.name, "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                                         "temperature": 0, "ignore_eos": True, "stream": True}, "/v1/completions")
                if api["error"] or not api["chunks"]:
                    raise RuntimeError(f"long: the OpenAI API failed on a {n}-token prompt: {api['error']}")
                requests.append({"tokens": n, "prompt": prompt, "ttft_s": first, "prefill_s": stages.get("prefill", 0.0),
                                 "transfer_s": stages.get("transfer", 0.0), "output": output, "text": "".join(text),
                                 "openai_ttft_s": api["chunks"][0] - api["sent"], "openai_text": api["text"]})
        after = _transports(metrics_port)
    transports = {name: count - before.get(name, 0) for name, count in after.items() if count > before.get(name, 0)}
    return {"requests": requests, "transports": transports}


def _transports(metrics_port: int) -> dict[str, int]:
    """KV pushes the prefill worker landed so far, by transport (its /metrics)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        scraped = response.read().decode()
    return {s.labels["transport"]: int(s.value) for f in text_string_to_metric_families(scraped)
            for s in f.samples if s.name == "baton_kv_transfer_transports_total"}
