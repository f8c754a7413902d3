"""chunks: what chunked prefill costs a long prompt and buys the prompts queued behind it.

A prefill forward cannot be interrupted, so a short prompt that arrives behind a long one waits
for the forward under way. The prefill worker prefills a prompt with more uncached tokens than
`prefill.chunk_tokens` a chunk per iteration and runs the queued prompts between chunks
(Sarathi): the wait shrinks to one chunk, while the long prompt pays for re-reading its growing
KV at every chunk. This suite times both on the model, on the prefill core the worker runs:
each long prompt whole, then in chunks of each budget (best of several runs), and reports the
long prompt's slowdown and the longest chunk (the most a prompt queued behind it waits) next to
a short prompt's own prefill. Prompt lengths are the `serve` suite's long prompt (1,000
tokens) and BatchLLM's longest distinct part scaled to this CPU (2,000).
"""
from __future__ import annotations

from typing import Any

from baton.bench import plots
from baton.bench.common import BenchOptions, Stopwatch, table

LENGTHS = (1000, 2000)
BUDGETS = (0, 128, 256, 512, 1024)  # 0: one forward (chunking off)
SHORT = 100  # the `serve` suite's chat prompt


def run(opts: BenchOptions) -> dict[str, Any]:
    import torch

    from baton.engine.executors import make_runner
    from baton.engine.model import load_model
    from baton.engine.request import GenerationRequest
    from baton.prefill_worker.core import PrefillCore
    from baton.sampling import SamplingParams

    lengths, budgets, repeats = ((300,), (0, 128), 1) if opts.quick else (LENGTHS, BUDGETS, 3)
    loaded = load_model(opts.model, dtype=opts.dtype)
    runner = make_runner(loaded)
    core = PrefillCore(runner, prefix_cache_bytes=0)  # nothing cached: every token is computed
    params = SamplingParams(max_tokens=1)
    vocab = loaded.config.vocab_size

    def prompt(n: int, salt: int) -> list[int]:
        return [(97 * i + 31 * salt) % (vocab - 10) + 5 for i in range(n)]

    def one(n: int, budget: int, salt: int) -> tuple[float, list[float], int]:
        """(total s, per-chunk s, first token) of one prompt prefilled whole or in chunks."""
        request = GenerationRequest(f"p{salt}", prompt(n, salt), params)
        if not budget:
            clock = Stopwatch()
            done = core.prefill([request])[0]
            total = clock()
            return total, [total], done.first_token
        chunked, times = core.begin_chunks(request), []
        done = None
        while done is None:
            clock = Stopwatch()
            done = core.advance(chunked, budget)
            times.append(clock())
        return sum(times), times, done.first_token

    one(64, 0, 0)  # warm-up: first-call allocations
    short_s = min(one(SHORT, 0, 1)[0] for _ in range(repeats))
    rows, results = [], []
    for n in lengths:
        whole_s, tokens = None, set()
        for budget in budgets:
            runs = [one(n, budget, 2) for _ in range(repeats)]
            total, chunk_times, first = min(runs, key=lambda r: r[0])
            tokens.add(first)
            if not budget:
                whole_s = total
            worst = max(chunk_times)
            results.append({"prompt_tokens": n, "budget": budget, "chunks": len(chunk_times), "total_s": total,
                            "longest_chunk_s": worst, "slowdown": total / whole_s})
            rows.append([n, budget or "whole", len(chunk_times), 1e3 * total, total / whole_s, 1e3 * worst,
                         1e3 * (worst + short_s)])
        results.append({"prompt_tokens": n, "first_tokens_agree": len(tokens) == 1})
        if len(tokens) != 1:
            opts.say(f"chunks: WARNING the {n}-token prompt's first token differs between budgets: {sorted(tokens)}")
    opts.say(f"chunks: {loaded.name}, {loaded.dtype}, {torch.get_num_threads()} torch thread(s), best of {repeats}; "
             f"a {SHORT}-token prompt prefills in {1e3 * short_s:.0f} ms")
    opts.say(table(["prompt tokens", "chunk tokens", "chunks", "long prompt ms", "x whole",
                    "longest chunk ms", f"{SHORT}-token prompt behind it: TTFT bound ms"], rows, digits=2))
    timed = [r for r in results if "budget" in r]
    files = [plots.bars(opts.plot_path("chunks.png"), "chunked prefill: long prompt total vs longest chunk",
                        [f"{r['prompt_tokens']}/{r['budget'] or 'whole'}" for r in timed],
                        {"long prompt ms": [1e3 * r["total_s"] for r in timed],
                         "longest chunk ms": [1e3 * r["longest_chunk_s"] for r in timed]}, "milliseconds")]
    return {"short_prompt_tokens": SHORT, "short_prefill_s": short_s, "repeats": repeats, "results": results,
            "threads": torch.get_num_threads(), "plots": [str(f) for f in files]}
