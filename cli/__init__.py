"""The `baton` command line: one parser for every command (`args` holds the shared flags,
`commands` what each does). Bad input exits with status 2 and a message saying what to change."""
from __future__ import annotations

import argparse
import sys

from baton.cli.args import (ENVIRONMENT, USAGE_ERROR, UsageError, add_connection_args, add_model_args,
                            add_quantization_args, add_sampling_args, add_serve_args, load_role_settings)
from baton.cli.commands import cmd_batch, cmd_bench, cmd_generate, cmd_planner, cmd_serve, cmd_up
from baton.logs import LEVELS, level_name
from baton.config import TP_SIZES

__all__ = ["build_parser", "load_role_settings", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated prefill/decode LLM serving.",
                                     epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="warning", type=level_name, metavar="{" + ",".join(LEVELS) + "}",
                        help="JSON log lines on stderr at this level and above (default warning; a process's few "
                             "start-up lines, what it loads and the sizes it chooses, show at info unless this is error)")
    parser.add_argument("--quiet-start", action="store_true",
                        help="leave out the start-up lines (what is loaded, the sizes chosen) below --log-level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts, locally or through a router")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run prefill and decode in this process (default)")
    where.add_argument("--router", metavar="HOST:PORT", help="send the prompts to a running Baton router")
    gen.add_argument("--max-rows", type=int, default=8, help="decode batch rows (default 8)")
    gen.add_argument("--raw", action="store_true", help="send prompts as raw text, without the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt")
    add_connection_args(gen)
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="the prompts, each as a chat message unless --raw")
    gen.set_defaults(func=cmd_generate)

    router = sub.add_parser("router", help="run the router (the public API)")
    add_serve_args(router, "router", 50051)
    router.add_argument("--prefill-workers", type=lambda s: s.split(","), metavar="HOST:PORT,...",
                        help="static discovery: the prefill workers (router.prefill_workers)")
    router.add_argument("--decode-workers", type=lambda s: s.split(","), metavar="HOST:PORT,...",
                        help="static discovery: the decode workers (router.decode_workers)")
    router.add_argument("--discovery", choices=["static", "kubernetes", "file"],
                        help="static (default): the lists above; kubernetes: the workers' EndpointSlices; file: "
                             "--workers-file, read again when it changes")
    router.add_argument("--workers-file", help="file discovery: JSON {\"prefill\": [...], \"decode\": [...]}")
    router.add_argument("--prefix-index", choices=["memory", "redis"],
                        help="memory (default): this router's own; redis: shared by every router replica")
    router.add_argument("--redis-url", help="with --prefix-index redis (default redis://127.0.0.1:6379/0)")
    router.add_argument("--max-inflight", type=int, help="requests in flight before RESOURCE_EXHAUSTED (default 1024)")
    router.add_argument("--decode-queue-per-worker", type=int,
                        help="requests wait before their prefill while the decode workers hold their rows' worth plus "
                             "this many each (default 2; -1: prefill every request at once)")
    router.add_argument("--index-namespace", help="Redis key prefix of this deployment's prefix index (default baton)")
    router.add_argument("--block-size", type=int, help="prefix block tokens, equal to the prefill workers' (default 16)")
    router.add_argument("--local-prefill-max-tokens", type=int, metavar="N",
                        help="a decode worker holding a prompt's prefix (a conversation's earlier turns) prefills a "
                             "rest of at most N tokens itself, no prefill worker, no transfer (default 512; 0: never)")
    router.add_argument("--auth-token-file", metavar="FILE",
                        help="a file holding the bearer token every API call must send (default: no token)")
    router.add_argument("--require-client-cert", action=argparse.BooleanOptionalAction, default=None,
                        help="with --tls-ca: API clients must present a certificate (default: yes)")
    router.add_argument("--http-port", type=int,
                        help="the OpenAI-compatible HTTP API on this port (default 8000; 0 = off)")
    router.add_argument("--served-model-name", metavar="NAME",
                        help="the model name OpenAI clients send (default: the model's own, SmolLM2-135M-Instruct)")
    router.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template (or a file holding one) instead of the tokenizer's")
    router.add_argument("--generation-config", metavar="auto|none|FOLDER",
                        help="default sampling for requests that leave it unset: auto (default), the model's own "
                             "generation_config.json (the default model: temperature 0.2, top_p 0.9); none, each "
                             "API's own (gRPC greedy, OpenAI temperature 1); or a folder holding one")
    router.add_argument("--override-generation-config", metavar="JSON",
                        help='wins over --generation-config key by key, e.g. \'{"temperature": 0.7, "top_p": 0.95}\' '
                             "(max_tokens or max_new_tokens, temperature, top_k, top_p, repetition_penalty, min_p)")
    router.set_defaults(func=cmd_serve)

    prefill = sub.add_parser("prefill", help="run a prefill worker")
    add_serve_args(prefill, "prefill", 50061)
    prefill.add_argument("--max-queue", type=int,
                         help="prompts queued or being prefilled before RESOURCE_EXHAUSTED (default 256)")
    prefill.add_argument("--max-batch-tokens", type=int, help="prompt tokens per prefill batch (default 4096)")
    prefill.add_argument("--chunk-tokens", type=int,
                         help="prefill a prompt with more uncached tokens than this in chunks of this many, one per "
                              "iteration, so other prompts need not wait for all of it (default 256; 0 = off)")
    prefill.add_argument("--kv-memory-bytes", type=int,
                         help="KV prefilled and not yet pushed stays under this; past it new prompts wait for pushes "
                              "(BatchLLM's M_threshold; default 1073741824; 0 = no limit)")
    prefill.add_argument("--prefix-cache-bytes", type=int,
                         help="prefix KV cache size, pins included (default 268435456; 0 turns it off)")
    prefill.add_argument("--block-size", type=int, help="prefix block tokens (default 16)")
    prefill.add_argument("--kv-transport", choices=("auto", "nixl", "grpc"),
                         help="auto: KV to a decode worker on this host goes through shared memory, to others over "
                              "gRPC (default); nixl: to others through NIXL where they take it; grpc: always gRPC")
    prefill.set_defaults(func=cmd_serve)

    decode = sub.add_parser("decode", help="run a decode worker")
    add_serve_args(decode, "decode", 50071)
    decode.add_argument("--max-rows", type=int, help="decode batch rows at most (default 0: 256 on a GPU, 4 per "
                                                     "thread on a CPU, fewer where the KV budget holds fewer)")
    decode.add_argument("--kv-budget-bytes", type=int,
                        help="the paged decode KV, allocated once: rows join while what they hold fits, and all "
                             "of it bounds the context served (default 0: a share of the device's free memory)")
    decode.add_argument("--page-size", type=int, help="tokens a KV page holds (default 8)")
    decode.add_argument("--staging-bytes", type=int,
                        help="the host KV pool: landed KV and parked rows (default 0: two longest prompts' KV, at "
                             "least 512 MiB, within a quarter of the memory left)")
    decode.add_argument("--drain-move-after-s", type=float,
                        help="on SIGTERM, seconds before running requests move with their KV to another decode worker "
                             "(default 5)")
    decode.add_argument("--kv-transport", choices=("auto", "nixl", "grpc"),
                        help="auto: also take KV through shared memory from workers on this host, and NIXL writes "
                             "where nixl is installed (default); nixl: also push through NIXL when draining; "
                             "grpc: gRPC only")
    decode.set_defaults(func=cmd_serve)

    batch = sub.add_parser("batch", help="a large offline batch with shared prefixes (BatchLLM)")
    batch.add_argument("file", metavar="FILE.jsonl", help="one JSON request a line")
    batch.add_argument("--router", metavar="HOST:PORT", help="a running router (default: start a local cluster)")
    batch.add_argument("--json", action="store_true", help="one JSON line per request, then a summary line")
    batch.add_argument("--model", default="default", help="model of the local cluster, without --router (default 'default')")
    batch.add_argument("--max-rows", type=int, default=8, help="decode rows of the local cluster (default 8)")
    add_quantization_args(batch)
    batch.add_argument("--max-concurrency", type=int, default=0, help="requests in flight (default: the router's)")
    batch.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole batch (default 3600)")
    add_connection_args(batch)
    batch.set_defaults(func=cmd_batch)

    bench = sub.add_parser("bench", help="the papers' experiments: relay, mixed, prefix, transfer, roofline, kernels",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="SUITE [--quick] [--json] [--out DIR], or --list")
    bench.set_defaults(func=cmd_bench)

    plan = sub.add_parser("planner", help="the SLO planner: scale a Kubernetes release's prefill and decode "
                                           "Deployments apart, against TTFT and ITL targets")
    plan.add_argument("--router", required=True, metavar="HOST:PORT", help="the release's router (its load reports)")
    add_connection_args(plan)
    plan.add_argument("--namespace", default="", help="the Deployments' namespace (default: the pod's own)")
    plan.add_argument("--prefill-deployment", required=True, help="the prefill workers' Deployment")
    plan.add_argument("--decode-deployment", required=True, help="the decode workers' Deployment")
    plan.add_argument("--prefill-selector", required=True, help="label selector of the prefill pods")
    plan.add_argument("--decode-selector", required=True, help="label selector of the decode pods")
    plan.add_argument("--ttft-target", type=float, default=2.0, help="time to first token to meet, s (default 2)")
    plan.add_argument("--itl-target", type=float, default=0.1, help="time between tokens to meet, s (default 0.1)")
    plan.add_argument("--min-prefill", type=int, default=1, help="fewest prefill workers (default 1)")
    plan.add_argument("--max-prefill", type=int, default=8, help="most prefill workers (default 8)")
    plan.add_argument("--min-decode", type=int, default=1, help="fewest decode workers (default 1)")
    plan.add_argument("--max-decode", type=int, default=8, help="most decode workers (default 8)")
    plan.add_argument("--interval", type=float, default=30.0, help="seconds between decisions (default 30)")
    plan.add_argument("--cooldown", type=float, default=120.0, help="seconds after a pool changed before it may "
                                                                    "shrink (default 120)")
    plan.add_argument("--worker-startup", type=float, default=60.0, help="seconds from asking for a worker to its "
                      "serving: image pull, model load (default 60); prompts queue meanwhile")
    plan.add_argument("--profile", help="a JSON profile of one worker's costs on the cluster's hardware")
    plan.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics of its decisions (0 = off)")
    plan.add_argument("--dry-run", action="store_true", help="log the decisions, change nothing")
    plan.set_defaults(func=cmd_planner)

    up = sub.add_parser("up", help="a local cluster as processes on loopback")
    up.add_argument("--port", type=int, default=50051, help="router port (default 50051)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="the router's OpenAI-compatible HTTP API (default 8000; 0 = off)")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    up.add_argument("--model", default="default",
                    help="'default' (SmolLM2-135M-Instruct), 'tiny-random', or a Hugging Face model directory")
    up.add_argument("--max-rows", type=int, default=0,
                    help="decode batch rows per decode worker (default 0: sized from the device, as a worker does)")
    add_quantization_args(up)
    up.add_argument("--tp", type=int, choices=TP_SIZES, default=1,
                    help="ranks each worker splits the model over (tensor parallelism; default 1)")
    up.add_argument("--prefill-tp", type=int, choices=TP_SIZES, help="the prefill workers' (default: --tp)")
    up.add_argument("--decode-tp", type=int, choices=TP_SIZES, help="the decode workers' (default: --tp)")
    up.add_argument("--demo", action="store_true", help="send a short demo workload through the SDK, then stop")
    planner = up.add_argument_group("planner", "with --planner, workers are added and drained as the load asks "
                                               "(--prefill and --decode are then the least of each)")
    planner.add_argument("--planner", action="store_true", help="run the SLO planner over the workers")
    planner.add_argument("--ttft-target", type=float, default=2.0, help="time to first token to meet, s (default 2)")
    planner.add_argument("--itl-target", type=float, default=0.1, help="time between tokens to meet, s (default 0.1)")
    planner.add_argument("--max-prefill", type=int, default=2, help="most prefill workers (default 2)")
    planner.add_argument("--max-decode", type=int, default=2, help="most decode workers (default 2)")
    planner.add_argument("--planner-interval", type=float, default=30.0, help="seconds between decisions (default 30)")
    planner.add_argument("--worker-startup", type=float, default=15.0, help="seconds a worker takes to start "
                         "serving here (default 15); prompts queue meanwhile")
    planner.add_argument("--planner-profile", help="a JSON profile of one worker's costs (default: the default "
                                                   "model on the CPU Baton is developed on)")
    planner.add_argument("--dry-run", action="store_true", help="log the planner's decisions, change nothing")
    up.set_defaults(func=cmd_up)
    for name, command in sub.choices.items():  # `baton router --log-level info` works as well
        if name != "bench":
            command.add_argument("--log-level", default=argparse.SUPPRESS, type=level_name,
                                 metavar="{" + ",".join(LEVELS) + "}", help="as before the command (default warning)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the bench has its own parser (suites, --list, --quick, ...)
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    from baton.logs import configure
    from baton.lifeline import die_with_parent

    die_with_parent()
    configure(args.log_level, start_lines=not args.quiet_start)
    try:
        return args.func(args)
    except (UsageError, ValueError) as exc:  # engine.request.RequestError is a ValueError
        print(f"baton {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except Exception as exc:  # a refusal from a running cluster: say what it said, no traceback
        if type(exc).__module__ != "baton.client.errors":
            raise
        print(f"baton {args.command}: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

