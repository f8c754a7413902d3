"""mixed: BATON Table 1's workload shapes scaled to a CPU — long-input/short-output,
short-input/long-output and short/short queries in a 1:1:2 ratio, interleaved in arrival order,
on the same four engines as relay. Static batching pads every row of a batch to its longest
prompt and runs it until its longest answer ends, so the mix hurts it twice.
"""
from __future__ import annotations

import argparse
from typing import Any

from baton.bench.common import BenchOptions
from baton.bench.relay import ENGINES, parse_engines, parse_ints, race
from baton.bench.workloads import mixed_queries

DESCRIPTION = "BATON Table 1 scaled to CPU: long-in/short-out, short-in/long-out, short/short (1:1:2)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", help="comma-separated (default 4,8; quick 2)")
    parser.add_argument("--engines", help=f"comma-separated subset of {','.join(ENGINES)} (default all)")
    parser.add_argument("--queries", type=int, help="a multiple of 4 (default 24; quick 4)")
    parser.add_argument("--long-input-sentences", type=int,
                        help="sentences in a long-input document (default 64, about 1,000 tokens; quick 12)")
    parser.add_argument("--short-max", type=int, help="max new tokens of short outputs (default 32; quick 8)")
    parser.add_argument("--long-max", type=int, help="max new tokens of long outputs (default 256; quick 24)")


def run(opts: BenchOptions) -> dict[str, Any]:
    quick = opts.quick
    count = opts.extra.get("queries") or (4 if quick else 24)
    sentences = opts.extra.get("long_input_sentences") or (12 if quick else 64)
    short_max = opts.extra.get("short_max") or (8 if quick else 32)
    long_max = opts.extra.get("long_max") or (24 if quick else 256)
    sizes = parse_ints(opts.extra.get("batch_sizes"), [2] if quick else [4, 8])
    engines = parse_engines(opts.extra.get("engines"))
    try:
        queries = mixed_queries(count, sentences, short_max, long_max)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    opts.say(f"mixed: {count} queries (long-in/short-out : short-in/long-out : short/short = 1:1:2), "
             f"short outputs <= {short_max} tokens, long outputs <= {long_max}, batch sizes "
             f"{', '.join(map(str, sizes))}")
    result = race(opts, "mixed", queries, sizes, engines, paper=None)
    by_kind: dict[str, list[int]] = {}
    for q in result["queries"]:
        by_kind.setdefault(q["kind"], []).append(q["prompt_tokens"])
    opts.say("prompt tokens by kind: " + ", ".join(f"{k} {min(v)}..{max(v)}" for k, v in by_kind.items()))
    return result
