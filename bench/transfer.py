"""transfer: shipping KV from prefill to decode over gRPC loopback and through shared memory (the
same-host path `baton up` takes), against a memory copy of the same bytes, and against the
prefill that produced it.

For each KV size a push covers everything a worker's does (encoding or the sealed memory file,
checksums, the socket, assembly, landing in the receiver's staging pool; baton.bench.kv_pushes,
receiver in its own process). The prefill side times the executor's prefill of a prompt whose
KV has that size (the model's KV bytes per token give the token count, capped at its context).
Issue 18's goal: same-host transfer under 5% of prefill time.

Then what a served response's trace says: short chat prompts (the relay questions) through a
`baton up` cluster on this host, the transfer stage (prefill end to KV staged on the decode
worker) against the prefill stage, median over the responses, sent one at a time and all at once.
Issue 34's goal: under 5%.
"""
from __future__ import annotations

from typing import Any

from baton.bench import plots
from baton.bench.common import NO_LOCAL_PREFILL, BenchOptions, best_of, table

MIB = 1 << 20


def run(opts: BenchOptions) -> dict[str, Any]:
    import torch

    from baton.engine.model import load_model
    from baton.engine.executors import make_runner
    from baton.bench.kv_pushes import measure_transports

    sizes_mib = [1, 4] if opts.quick else [1, 16, 64]
    repeats = 2 if opts.quick else 5
    loaded = load_model(opts.model, dtype=opts.dtype)
    runner = make_runner(loaded)
    per_token = loaded.kv_shape.bytes_per_token()
    max_prompt = loaded.max_context - 1
    opts.say(f"transfer: KV of {', '.join(f'{s} MiB' for s in sizes_mib)}; {loaded.name} KV is {per_token:,} bytes "
             f"per token ({loaded.kv_shape.dtype}), context {loaded.max_context}; best of {repeats}")
    gen = torch.Generator().manual_seed(0)
    rows, records = [], []
    for mib in sizes_mib:
        nbytes = mib * MIB
        opts.progress(f"transfer: {mib} MiB over gRPC loopback and shared memory")
        times = measure_transports(nbytes, repeats=repeats)
        transfer_s, shm_s, memcpy_s = times["grpc"], times["shm"], times["memcpy"]
        tokens = -(-nbytes // per_token)
        capped = tokens > max_prompt
        tokens = min(tokens, max_prompt)
        prompt = torch.randint(0, loaded.config.vocab_size, (tokens,), generator=gen).tolist()
        runner.prefill(prompt[: min(8, tokens)])  # warm-up
        opts.progress(f"transfer: prefill of {tokens} tokens")
        prefill_s = best_of(lambda: runner.prefill(prompt), max(1, repeats // 2))
        # The prompt's own KV may be a little more than nbytes (whole tokens): scale transfer to it.
        kv_bytes = tokens * per_token
        scale = kv_bytes / nbytes
        record = {"mib": mib, "bytes": nbytes, "transfer_s": transfer_s, "shm_s": shm_s, "memcpy_s": memcpy_s,
                  "transfer_mib_s": mib / transfer_s, "shm_mib_s": mib / shm_s, "memcpy_mib_s": mib / memcpy_s,
                  "memcpy_speedup": transfer_s / memcpy_s, "shm_speedup": transfer_s / shm_s,
                  "prompt_tokens": tokens, "capped_at_context": capped, "prefill_s": prefill_s,
                  "prompt_kv_bytes": kv_bytes, "transfer_share_of_prefill": transfer_s * scale / prefill_s,
                  "shm_share_of_prefill": shm_s * scale / prefill_s}
        records.append(record)
        rows.append([f"{mib} MiB", 1e3 * transfer_s, mib / transfer_s, 1e3 * shm_s, mib / shm_s, 1e3 * memcpy_s,
                     mib / memcpy_s, f"{tokens}{' (cap)' if capped else ''}", 1e3 * prefill_s,
                     100 * record["transfer_share_of_prefill"], 100 * record["shm_share_of_prefill"]])
    opts.say(table(["KV", "gRPC ms", "MiB/s", "shm ms", "MiB/s", "memcpy ms", "MiB/s", "tokens", "prefill ms",
                    "gRPC % prefill", "shm % prefill"], rows, digits=1))
    worst = max(r["shm_share_of_prefill"] for r in records)
    opts.say(f"same-host (shared memory) transfer is at most {100 * worst:.1f}% of prefill time (goal < 5%); "
             f"shared memory is {min(r['shm_speedup'] for r in records):.1f}-"
             f"{max(r['shm_speedup'] for r in records):.1f}x faster than gRPC loopback")
    if any(r["capped_at_context"] for r in records):
        opts.say(f"(cap) the KV size needs more tokens than the model's context; the prompt is cut at {max_prompt}")
    files = [plots.bars(opts.plot_path("transfer.png"), "KV transfer vs memcpy vs prefill",
                        [f"{r['mib']} MiB" for r in records],
                        {"gRPC loopback": [1e3 * r["transfer_s"] for r in records],
                         "shared memory": [1e3 * r["shm_s"] for r in records],
                         "memcpy": [1e3 * r["memcpy_s"] for r in records],
                         "prefill of that KV": [1e3 * r["prefill_s"] for r in records]},
                        "milliseconds (log)", log=True)]
    served = _served_share(opts)
    return {"kv_bytes_per_token": per_token, "repeats": repeats, "sizes": records, "served": served,
            "plots": [str(f) for f in files]}


def _served_share(opts: BenchOptions) -> dict[str, Any]:
    """The transfer stage over the prefill stage of served short chat responses (median)."""
    import statistics

    from baton.bench.workloads import relay_queries
    from baton.client import BatonClient
    from baton.launch.up import LocalCluster

    queries = relay_queries(4 if opts.quick else 12, 16)
    rounds = 1 if opts.quick else 2
    # each prompt prefilled whole, on the prefill worker, and its whole KV pushed (nothing kept on
    # the decode worker for a repeat to find)
    env = {**opts.worker_env(), "BATON_PREFILL_PREFIX_CACHE_BYTES": "0", **NO_LOCAL_PREFILL}
    opts.progress(f"transfer: {len(queries)} short chat prompts through a cluster on this host")
    measured = {}
    with LocalCluster(model=opts.model, max_rows=8, share_cores=True, http_port=-1, extra_env=env) as cluster, \
            BatonClient(cluster.router_address, timeout=600) as client:
        client.generate(messages=[{"role": "user", "content": "Hello"}], max_tokens=2)  # warm
        for mode in ("one at a time", "all at once"):
            stages = []
            for _ in range(rounds):
                if mode == "one at a time":
                    results = [client.generate(messages=q.chat(), max_tokens=q.max_tokens) for q in queries]
                else:
                    results = client.generate_many([{"messages": q.chat(), "max_tokens": q.max_tokens}
                                                    for q in queries])
                stages += [r.trace.stage_seconds for r in results]
            measured[mode] = {
                "responses": len(stages),
                "prefill_s": statistics.median(s.get("prefill", 0.0) for s in stages),
                "transfer_s": statistics.median(s.get("transfer", 0.0) for s in stages),
                "share": statistics.median(s.get("transfer", 0.0) / s["prefill"] for s in stages if s.get("prefill")),
            }
    opts.say(f"\nserved short chat prompts on this host ({len(queries)} relay questions, x{rounds}; medians of "
             "each response's trace):")
    opts.say(table(["sent", "responses", "prefill ms", "transfer ms", "transfer / prefill"],
                   [[mode, m["responses"], 1e3 * m["prefill_s"], 1e3 * m["transfer_s"], f"{100 * m['share']:.1f}%"]
                    for mode, m in measured.items()], digits=1))
    opts.say(f"  the transfer stage is at most {100 * max(m['share'] for m in measured.values()):.1f}% of the "
             "prefill stage (median; issue 34's goal < 5%)")
    return measured
