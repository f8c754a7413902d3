"""shared: rows that continue one prompt prefix, decoded with that prefix's KV held once vs per row.

Issue 18's shape: 8 rows sharing a 512-token prefix (a system prompt or a batch group's
document), each with its own question, decoded together on the decode core the worker runs,
once with `decode.share_min_tokens` on and once off, side by side in one run. Reported: the
batch KV bytes (allocated and useful) once every row has joined, the median decode step, and
whether the tokens agree. The bound the shape allows: KV bytes fall by at most
(rows x (prefix + own)) / (prefix + rows x own), the share degree when own parts are short.
"""
from __future__ import annotations

import statistics
from typing import Any

from baton.bench import plots
from baton.bench.common import BenchOptions, Stopwatch, table

ROWS, PREFIX, OWN, STEPS = 8, 512, 32, 64


def add_arguments(parser) -> None:
    parser.add_argument("--rows", type=int, default=ROWS, help=f"rows sharing the prefix (default {ROWS})")
    parser.add_argument("--prefix", type=int, default=PREFIX, help=f"shared prefix tokens (default {PREFIX})")


def run(opts: BenchOptions) -> dict[str, Any]:
    import torch

    from baton.decode_worker.core import DecodeConfig
    from baton.engine.model import load_model
    from baton.launch.local import LocalEngine
    from baton.sampling import SamplingParams

    rows, prefix_len = opts.extra.get("rows", ROWS), opts.extra.get("prefix", PREFIX)
    steps = 8 if opts.quick else STEPS
    loaded = load_model(opts.model, dtype=opts.dtype)
    vocab = loaded.config.vocab_size
    prefix = [(97 * i + 13) % (vocab - 10) + 5 for i in range(prefix_len)]
    prompts = [prefix + [(31 * i + 7 * r + 3) % (vocab - 10) + 5 for i in range(OWN)] for r in range(rows)]
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    per_token = loaded.kv_shape.bytes_per_token()

    def serve(share_min_tokens: int) -> dict[str, Any]:
        engine = LocalEngine(loaded, DecodeConfig(max_rows=rows, share_min_tokens=share_min_tokens))
        ids = [engine.submit(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {}
        times, kv, sharing = [], None, 0
        while engine.has_work():
            joined = engine.decode.scheduler.num_running == rows
            clock = Stopwatch()
            outs = engine.step()
            if joined:  # a step of the full batch, no prefill or embedding in it
                times.append(clock())
            if kv is None and engine.decode.scheduler.num_running == rows:
                usage = engine.decode.scheduler.kv_usage()
                kv = {"allocated": usage.used * engine.decode.kv.page_bytes, "useful": usage.tokens * per_token,
                      "pages_shared": usage.shared}
                sharing = engine.decode.scheduler.rows_sharing_total
            for out in outs:
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        return {"tokens": [tokens[i] for i in ids], "step_s": statistics.median(times), "steps": len(times), **kv,
                "rows_sharing": sharing}

    serve(0)  # warm-up: first-call allocations, the CPU kernels' build
    plain, shared = serve(0), serve(64)
    agree = plain["tokens"] == shared["tokens"]
    bound = rows * (prefix_len + OWN) / (prefix_len + rows * OWN)
    result = {
        "rows": rows, "prefix_tokens": prefix_len, "own_tokens": OWN, "decode_steps": steps,
        "threads": torch.get_num_threads(), "tokens_agree": agree, "bound_kv_ratio": bound,
        "without": {k: v for k, v in plain.items() if k != "tokens"},
        "with": {k: v for k, v in shared.items() if k != "tokens"},
        "kv_useful_ratio": plain["useful"] / shared["useful"],
        "kv_allocated_ratio": plain["allocated"] / shared["allocated"],
        "step_speedup": plain["step_s"] / shared["step_s"],
    }
    opts.say(f"shared: {loaded.name}, {loaded.dtype}, {torch.get_num_threads()} torch thread(s); {rows} rows of a "
             f"{prefix_len}-token prefix + {OWN} own tokens, {steps} decode steps; KV per token {per_token} bytes")
    opts.say(table(["", "KV allocated MiB", "KV useful MiB", "median step ms", "pages shared"], [
        ["without sharing", plain["allocated"] / 2**20, plain["useful"] / 2**20, 1e3 * plain["step_s"],
         plain["pages_shared"]],
        ["with sharing", shared["allocated"] / 2**20, shared["useful"] / 2**20, 1e3 * shared["step_s"],
         shared["pages_shared"]],
    ], digits=2))
    opts.say(f"shared: useful KV {result['kv_useful_ratio']:.2f}x less (the shape allows {bound:.2f}x), allocated "
             f"{result['kv_allocated_ratio']:.2f}x less; step {result['step_speedup']:.2f}x as fast; "
             f"tokens {'agree' if agree else 'DIFFER'}")
    files = [plots.bars(opts.plot_path("shared.png"), f"{rows} rows sharing a {prefix_len}-token prefix",
                        ["KV useful MiB", "KV allocated MiB", "step ms"],
                        {"without": [plain["useful"] / 2**20, plain["allocated"] / 2**20, 1e3 * plain["step_s"]],
                         "with": [shared["useful"] / 2**20, shared["allocated"] / 2**20, 1e3 * shared["step_s"]]},
                        "MiB / ms")]
    result["plots"] = [str(f) for f in files]
    return result
