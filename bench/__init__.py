"""`baton bench SUITE [--quick] [--json] [--out DIR]`: measured figures against the papers' results.

Every suite prints a table of figures measured in that run, writes DIR/SUITE.json and PNG plots
into DIR (default bench-results/). `--quick` shrinks a suite to a CI smoke test (the tiny random model unless --model says otherwise); `--list`
names the suites. Ratios are from one run on whatever machine this is: no timing is asserted.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from baton.bench.common import DEFAULT_OUT_DIR, BenchOptions, apply_threads, environment, write_json


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    module: str  # imported only when the suite runs, so --list stays instant

    def load(self):
        return importlib.import_module(self.module)


SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("relay", "BATON Table 2 / Figs 5-7: 30 short chat queries, B=2..10; static vs continuous batching "
                   "vs Baton local vs cluster", "baton.bench.relay"),
    Suite("engine", "Baton's executor vs vLLM's CPU build vs transformers: relay shape at 4 and 8 rows, decode "
                    "step at 1-16 rows vs the weight-read floor", "baton.bench.engine"),
    Suite("mixed", "BATON Table 1 scaled to CPU: long-in/short-out, short-in/long-out, short/short (1:1:2), "
                   "same engines", "baton.bench.mixed"),
    Suite("prefix", "BatchLLM: prefill tokens saved by the planner vs optimum vs LRU cache; token-batch valleys",
          "baton.bench.prefix"),
    Suite("transfer", "KV transfer over gRPC loopback vs memcpy (1/16/64 MB) and as a share of prefill time",
          "baton.bench.transfer"),
    Suite("roofline", "decode step at batch 1 vs reading the weights once at measured memory bandwidth",
          "baton.bench.roofline"),
    Suite("kernels", "Triton decode attention bandwidth vs peak and SDPA (needs a CUDA GPU)", "baton.bench.kernels"),
    Suite("chaos", "sustained streams, batches and cancels while workers are killed, stopped, restarted and "
                   "slow-pushed: requests exact, wrong, refused, lost, hung; memory over time", "baton.bench.chaos"),
    Suite("serve", "AIPerf drives Baton's and vLLM's OpenAI servers at request rates up to saturation: TTFT and "
                   "ITL p50/p99, output tokens/s, goodput, Baton over vLLM", "baton.bench.serve"),
    Suite("chunks", "chunked prefill: a long prompt's prefill whole vs in chunks of 128-1024 tokens, and the "
                    "longest a short prompt queued behind it waits", "baton.bench.chunks"),
    Suite("route", "issue 16: 200 requests over 12 shared prefixes, 2 prefill workers (one restarted half way): "
                   "prediction precision, tokens reused vs optimum, router time per request; memory, Redis, a "
                   "bounded index, round-robin", "baton.bench.route"),
    Suite("shared", "issue 18: 8 rows sharing a 512-token prefix, decoded with its KV held once vs per row: KV "
                    "bytes and step time side by side", "baton.bench.shared"),
    Suite("fairness", "interactive TTFT p50/p99 idle vs during an 84-request batch (low priority) vs the same load "
                      "at equal priority", "baton.bench.fairness"),
    Suite("residency", "issue 31: 16 streams x 4096 tokens (ignore_eos) under 1 GiB of KV: how many decode at once "
                       "after 20 s, Baton vs vLLM's CPU build; streams decoding over time, TTFT, tokens/s",
          "baton.bench.residency"),
    Suite("goodput", "issue 31: relay chat queries from 3 clients per decode row (overload): requests within TTFT "
                     "and ITL objectives per second for each router admission rule, Baton vs vLLM's CPU build",
          "baton.bench.goodput"),
    Suite("served", "issue 32: `baton up` as a new user gets it (dtype auto) vs vLLM's CPU build at its dtype and "
                    "rows: the 30 relay chat queries at 1, 8 and 30 concurrent streams; wall, TTFT, TPOT, tokens/s, "
                    "answers identical at every concurrency", "baton.bench.served"),
    Suite("chat", "issue 49: multi-turn conversations (3-8 turns, each answer sent back with the next question) at "
                  "1 and 8 concurrent conversations, Baton vs vLLM with prefix caching: TTFT p50/p99, prompt, cached "
                  "and recomputed tokens per turn, KV bytes pushed", "baton.bench.chat"),
    Suite("local", "issue 49: a conversation's second turn with a new message of 64-2048 tokens while 7 streams "
                   "decode, prefilled on its decode worker vs the prefill worker: TTFT and the decoding streams' "
                   "longest gap (router.local_prefill_max_tokens)", "baton.bench.local_prefill"),
    Suite("quant", "issue 50: quantized weights on one core, the default model's GGUF Q4_1 and Q8_0 made at load "
                   "(16-bit and 8-bit GEMM inputs) vs bf16 and llama.cpp on the same file: the relay race, a 4-row "
                   "decode, accuracy against the float model", "baton.bench.quant"),
    Suite("tp", "issue 48: tensor parallelism, TP=1 on two cores vs TP=2 (gloo) one rank per core, on a "
                "Llama-3.2-1B-shaped model and the default one: prefill, decode step at 1 and 4 rows, same bits",
          "baton.bench.tp"),
    Suite("structured", "issue 33: JSON schemas and tool calls through the openai client, Baton vs vLLM's CPU build "
                        "on the same grammar engine (valid answers, same text at temperature 0); the grammar mask's "
                        "cost per decode step at 1-16 rows", "baton.bench.structured"),
    Suite("hosts", "issue 34: router, prefill and decode on three hosts (network namespaces) linked at 1, 10 and "
                   "25 Gbit/s vs one host: long prompts' first and second token and transfer stage, KV pushed "
                   "after the prefill vs streamed while it runs (needs root)", "baton.bench.hosts"),
    Suite("planner", "issue 35: the SLO planner over a simulated day (diurnal, bursty) with the profile measured "
                     "here, against static pools for the peak: objectives met and worker-hours; then a compressed "
                     "day on real processes beside what the simulator predicts for it", "baton.bench.planner"),
    Suite("gpu", "issue 46: Llama-3-8B and Llama-3.2-1B shapes (random weights) on the GPU against the copy and "
                 "matmul rates measured in the same run: decode at 1-256 rows x 512-16k contexts, prefill at "
                 "512-16k tokens beside transformers' forward, prefill attention beside torch SDPA; both modes "
                 "(without CUDA: a small model on this CPU, a check of the suite)", "baton.bench.gpu"),
    Suite("long", "issues 46 and 47: new prompts of 1,024-8,000 tokens through `baton up` on one host: TTFT, the "
                  "prefill and transfer stages, how the KV travelled, TTFT growth against the tokens' (with "
                  "--host-transport: the same tokens when KV goes through host memory)", "baton.bench.long_prompts"),
    Suite("isa", "Baton's CPU kernels built for each instruction set this CPU runs (AVX-512, AVX2, SSE2), one "
                 "core: GEMM fp32/bf16 at 1-64 rows against MKL held to the same set, prefill and decode "
                 "attention; whether each build computes the native build's bits", "baton.bench.cpu_isa"),
    Suite("invariance", "issue 32 on CUDA: decode step (1-64 rows) and prefill with batch invariance on and off, "
                        "and whether a row keeps its bits beside 15 others (needs a CUDA GPU)",
          "baton.bench.invariance"),
]}


def suite_parser(suite: Suite) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"baton bench {suite.name}", description=suite.description)
    parser.add_argument("--quick", action="store_true", help="small enough for CI: a smoke test, not a result")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON document on stdout (the table goes to stderr)")
    parser.add_argument("--out", default=DEFAULT_OUT_DIR,
                        help=f"directory for {suite.name}.json and the plots (default {DEFAULT_OUT_DIR}/)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in this process and in every worker it starts (default 1: steadiest "
                             "on a small shared machine; 0 = torch's default)")
    parser.add_argument("--model", help="'default' (SmolLM2-135M-Instruct, the default), 'tiny-random' (the default "
                                         "with --quick: a smoke test's seconds) or a model directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                        help="model dtype here and in every worker (default %(default)s; float32 is the only one "
                             "whose tokens can be checked exactly against transformers on every CPU)")
    add = getattr(suite.load(), "add_arguments", None)
    if add:
        add(parser)
    return parser


def list_suites(out=None) -> None:
    out = out or sys.stdout
    width = max(map(len, SUITES))
    for suite in SUITES.values():
        print(f"{suite.name:<{width}}  {suite.description}", file=out)


USAGE = "usage: baton bench SUITE [--quick] [--json] [--out DIR] [--threads N]   |   baton bench --list"
_COMMON = {"quick", "json", "out", "threads", "model", "dtype"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--list" in argv:
        list_suites()
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        print(__doc__, file=sys.stdout if argv else sys.stderr)
        list_suites(sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        print(f"unknown suite {name!r}; choose one of: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    suite = SUITES[name]
    parser = suite_parser(suite)
    args = parser.parse_args(rest)
    if args.threads < 0:
        parser.error(f"--threads must be >= 0 (got {args.threads})")
    model = args.model or ("tiny-random" if args.quick else "default")
    opts = BenchOptions(quick=args.quick, out_dir=Path(args.out), threads=args.threads, model=model,
                        dtype=args.dtype,
                        out=sys.stderr if args.json else sys.stdout,
                        extra={k: v for k, v in vars(args).items() if k not in _COMMON})
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    threads = apply_threads(args.threads)
    started = time.time()
    result = suite.load().run(opts)
    document = {"suite": suite.name, "description": suite.description, "quick": args.quick,
                "started_unix": started, "elapsed_s": time.time() - started, "environment": environment(threads),
                **result}
    path = opts.out_dir / f"{suite.name}.json"
    write_json(path, document)
    opts.say(f"\nwrote {path}" + "".join(f", {p}" for p in result.get("plots", [])))
    if args.json:
        print(json.dumps(document, indent=2, default=str))
    return 1 if any(str(v).startswith("failed") for v in result.get("problems", {}).values()) else 0
