"""hosts (issue 34): the router, the prefill and the decode worker each on a host of its own
(network namespaces, `baton.launch.netns`), their links held to 1, 10 and 25 Gbit/s (tbf), against
the same three processes on one host, where the KV goes through shared memory.

For long prompts (1k, 4k and 8k tokens, the last capped at the model's context), one request at
a time with 2 output tokens: the time to the first token (sampled by the prefill worker), to the
second (the decode worker's first step, after the KV landed), and the transfer stage of the
request's trace, with the KV pushed after the prefill (`prefill.kv_stream: false`) over gRPC and
through NIXL over UCX's TCP (`kv_transport: nixl`, where the nixl extra is installed: the
library's push against gRPC's on the same link), and streamed over gRPC chunk by chunk while the
prefill runs (the default). Every request's tokens are checked against
`LocalEngine.generate` of the same prompt in this process. The prefill worker's prefix cache is
off, so each cell prefills its whole prompt. Issue 34's bound: with streaming, the second token of
a 2k-4k-token prompt across 1 Gbit/s within 1.1x of one host (fp32).

--quick: the tiny random model, a 600-token prompt, 1 Gbit/s only. --prompts, --rates and --setups
measure a part of the grid.
"""
from __future__ import annotations

import time
from typing import Any

from baton.bench.common import NO_LOCAL_PREFILL, BenchOptions, table

PROMPTS = (1024, 4096, 8192)
RATES_GBIT = (1, 10, 25)
OUTPUT_TOKENS = 2
# name -> (what the table calls it, worker environment beyond the common one); None: one host.
SETUPS = {
    "one-host": ("one host, shared memory", None),
    "after": ("three hosts, after prefill", {"BATON_PREFILL_KV_STREAM": "false"}),
    "nixl": ("three hosts, after prefill, NIXL", {"BATON_PREFILL_KV_STREAM": "false",
                                                  "BATON_PREFILL_KV_TRANSPORT": "nixl", "UCX_TLS": "tcp"}),
    "streamed": ("three hosts, streamed", {"BATON_PREFILL_KV_STREAM": "true"}),
    "push": ("the push alone, gRPC and NIXL", None),  # no cluster: baton.bench.kv_pushes between two hosts
}


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", default=None, help="prompt lengths, comma-separated (default 1024,4096,8192)")
    parser.add_argument("--rates", default=None, help="link rates in Gbit/s, comma-separated (default 1,10,25)")
    parser.add_argument("--setups", default=None,
                        help=f"comma-separated, of {', '.join(SETUPS)} (default all; nixl where installed)")


def _listed(value: str | None, default, kind=int) -> list:
    return list(default) if value is None else [kind(v) for v in value.split(",") if v.strip()]


def run(opts: BenchOptions) -> dict[str, Any]:
    import torch

    from baton.launch import netns
    from baton.decode_worker.core import DecodeConfig
    from baton.kvtransfer.nixl import nixl_installed
    from baton.engine.model import load_model
    from baton.launch.local import LocalEngine
    from baton.sampling import SamplingParams

    ok, why = netns.available()
    if not ok:
        opts.say(f"hosts: skipped: {why}")
        return {"skipped": why, "plots": []}
    model = opts.model
    loaded = load_model(model, dtype=opts.dtype)
    longest = loaded.max_context - OUTPUT_TOKENS
    lengths = [600] if opts.quick else [min(n, longest) for n in _listed(opts.extra.get("prompts"), PROMPTS)]
    rates = RATES_GBIT[:1] if opts.quick else _listed(opts.extra.get("rates"), RATES_GBIT, float)
    setups = _listed(opts.extra.get("setups"), SETUPS, str)
    unknown = [name for name in setups if name not in SETUPS]
    if unknown:
        raise ValueError(f"hosts: unknown setups {unknown}; choose from {', '.join(SETUPS)}")
    if not nixl_installed():
        for name in ("nixl", "push"):
            if name in setups:
                opts.say(f"hosts: the {name} setup is skipped: the nixl extra is not installed "
                         "(pip install 'baton-serve[nixl]')")
                setups.remove(name)
    generator = torch.Generator().manual_seed(34)
    prompts = {n: torch.randint(10, loaded.config.vocab_size, (n,), generator=generator).tolist() for n in lengths}
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    expected = {}
    if any(name != "push" for name in setups):
        engine = LocalEngine(loaded, DecodeConfig(max_rows=1))
        for n, ids in prompts.items():
            opts.progress(f"hosts: the expected tokens of the {n}-token prompt (LocalEngine.generate)")
            expected[n] = engine.generate([ids], params)[0].token_ids
        del engine
    per_token = loaded.kv_shape.bytes_per_token()
    opts.say(f"hosts: {model} ({opts.dtype}), KV {per_token:,} bytes a token; prompts of {', '.join(map(str, lengths))} "
             f"tokens, {OUTPUT_TOKENS} output tokens, one request at a time; links at "
             f"{', '.join(f'{r} Gbit/s' for r in rates)}")

    cells: list[dict[str, Any]] = []
    env = {**opts.worker_env(), "BATON_PREFILL_PREFIX_CACHE_BYTES": "0", **NO_LOCAL_PREFILL}  # every KV crosses
    for name in [name for name in setups if name != "push"]:
        label, extra_env = SETUPS[name]
        opts.progress(f"hosts: {label}")
        if extra_env is None:
            cells += _measure(opts, model, env, None, [None], prompts, expected, label)
        else:
            cells += _measure(opts, model, {**env, **extra_env}, netns, rates, prompts, expected, label)
    pushes = []
    if "push" in setups:
        opts.progress("hosts: the push alone between two hosts, gRPC and NIXL")
        pushes = _pushes(netns, rates, [n * per_token for n in lengths])
    if cells:
        _report(opts, cells, lengths, rates)
    _report_pushes(opts, pushes)
    return {"model": model, "dtype": opts.dtype, "kv_bytes_per_token": per_token, "cells": cells,
            "bound": _bound(cells), "pushes": pushes, "plots": []}


def _pushes(netns, rates, sizes: list[int], repeats: int = 2) -> list[dict[str, Any]]:
    """The push alone, the same bytes over the same link: a receiver in one host, the sender in the
    other (baton.bench.kv_pushes), best of `repeats` after a warm-up, gRPC then NIXL over UCX's TCP."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "UCX_TLS": "tcp"}
    bench = [sys.executable, "-m", "baton.bench.kv_pushes"]
    rows = []
    with netns.Hosts(["prefill", "decode"]) as hosts:
        receiver = subprocess.Popen(hosts.command("decode", [*bench, "--serve", hosts.address("decode")]),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            target = receiver.stdout.readline().strip()
            if not target:
                raise RuntimeError("the push benchmark's receiver did not start")
            for rate in rates:
                hosts.set_rate(rate * 1000)
                sent = subprocess.run(hosts.command("prefill", [*bench, "--push", target, "--repeats", str(repeats),
                                                                "--mbytes", ",".join(str(n / 1e6) for n in sizes)]),
                                      capture_output=True, text=True, env=env, timeout=1800)
                if sent.returncode:
                    raise RuntimeError(f"the push benchmark failed: {sent.stderr[-2000:]}")
                rows += [{"gbit": rate, "bytes": int(n), **best} for n, best in json.loads(sent.stdout).items()]
        finally:
            receiver.stdin.close()
            try:
                receiver.wait(10)
            except subprocess.TimeoutExpired:
                receiver.kill()
                receiver.wait()
    return rows


def _measure(opts: BenchOptions, model: str, env: dict[str, str], netns, rates, prompts, expected,
             setup: str) -> list[dict[str, Any]]:
    from baton.client import BatonClient
    from baton.launch.up import LocalCluster

    hosts = None
    if netns is not None:
        hosts = netns.Hosts(LocalCluster.host_names()).start()
    try:
        with LocalCluster(model=model, max_rows=1, share_cores=True, extra_env=env, hosts=hosts) as cluster, \
                BatonClient(cluster.router_address, timeout=900) as client:
            client.generate(token_ids=list(prompts.values())[0][:16], max_tokens=1)  # warm: the first forward's setup
            cells = []
            for rate in rates:
                if hosts is not None:
                    hosts.set_rate(rate * 1000)
                for n, ids in prompts.items():
                    opts.progress(f"hosts: {setup}, {f'{rate} Gbit/s, ' if rate else ''}{n} tokens")
                    cells.append({"setup": setup, "gbit": rate, "tokens": n,
                                  **_one(client, ids, expected[n])})
            return cells
    finally:
        if hosts is not None:
            hosts.close()


def _one(client, ids: list[int], expected: list[int]) -> dict[str, Any]:
    """One request: seconds to its first and second token, its trace's transfer stage, exactness."""
    started = time.perf_counter()
    arrivals, tokens, trace = [], [], None
    for chunk in client.stream(token_ids=ids, max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0):
        now = time.perf_counter() - started
        for token in chunk.token_ids:
            arrivals.append(now)
            tokens.append(token)
        trace = chunk.trace or trace
    stages = trace.stage_seconds if trace else {}
    return {"first_s": arrivals[0], "second_s": arrivals[1], "prefill_s": stages.get("prefill", 0.0),
            "transfer_s": stages.get("transfer", 0.0), "exact": tokens == expected}


def _bound(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed across 1 Gbit/s over one host, by prompt: the second token's time."""
    one = {c["tokens"]: c["second_s"] for c in cells if c["gbit"] is None}
    return [{"tokens": c["tokens"], "ratio": c["second_s"] / one[c["tokens"]]} for c in cells
            if c["setup"].endswith("streamed") and c["gbit"] == 1 and c["tokens"] in one]


def _report(opts: BenchOptions, cells: list[dict[str, Any]], lengths, rates) -> None:
    rows = [[c["setup"], f"{c['gbit']} Gbit/s" if c["gbit"] else "-", c["tokens"], c["first_s"], c["second_s"],
             c["prefill_s"], c["transfer_s"], "yes" if c["exact"] else "NO"] for c in cells]
    opts.say(table(["setup", "link", "prompt", "1st token s", "2nd token s", "prefill s", "transfer s", "exact"],
                   rows))
    for b in _bound(cells):
        opts.say(f"  {b['tokens']} tokens, streamed across 1 Gbit/s: second token at {b['ratio']:.2f}x one host's")
    wrong = [c for c in cells if not c["exact"]]
    opts.say(f"  tokens equal to LocalEngine.generate in {len(cells) - len(wrong)} of {len(cells)} cells")


def _report_pushes(opts: BenchOptions, pushes: list[dict[str, Any]]) -> None:
    if not pushes:
        return
    opts.say("\nthe push alone between two hosts (best of 2 after a warm-up; UCX over TCP):")
    rows = [[f"{p['gbit']} Gbit/s", f"{p['bytes'] / 1e6:.1f} MB", p["grpc"], p["nixl"], p["nixl"] / p["grpc"],
             p["bytes"] * 8 / (p["gbit"] * 1e9)] for p in pushes]
    opts.say(table(["link", "KV", "gRPC s", "NIXL s", "NIXL / gRPC", "line rate s"], rows))
