"""The `baton` command line. Bad input exits with status 2 and a message saying what to change.

Heavy imports (torch, transformers, the servers) happen inside the commands, so `baton --help`
and argument errors answer at once."""
from __future__ import annotations

import argparse
import json
import sys

from baton.config import DTYPE_CHOICES, EXECUTOR_CHOICES
from baton.logs import LEVELS, level_name

USAGE_ERROR = 2
# What Baton reads from the environment besides BATON_<SECTION>_<KEY> config overrides.
ENVIRONMENT = """environment:
  BATON_<SECTION>_<KEY>   any config key, e.g. BATON_DECODE_MAX_ROWS=16 (sections: model, router,
                          prefill, decode, tls, cluster, tracing); a flag wins over it, it wins over --config
  BATON_CLUSTER_TOKEN     the token the router and workers present to each other (cluster.token);
                          worker ports refuse calls without it. `baton up` makes one per cluster
  BATON_AUTH_TOKEN        the bearer token clients must send to the router (or router.auth_token_file)
  BATON_CACHE_DIR         where converted models and compiled CPU kernels are kept (~/.cache/baton)
  BATON_CPU_KERNELS=0     use oneDNN/torch instead of Baton's C kernels on CPU
  BATON_VLLM_PYTHON       the vLLM venv's python for `baton bench engine`
  OMP_NUM_THREADS         torch threads when --threads is 0
  CC                      the C compiler that builds Baton's CPU kernels once (default: cc)
  KUBECONFIG              the cluster a router or prefill worker with discovery 'kubernetes' watches
                          from outside a pod (inside one, its service account)"""


class UsageError(Exception):
    """Bad input from the command line; printed without a traceback, exit status 2."""


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable; default none)")


def sampling_from_args(args):
    from baton.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


EXECUTOR_HELP = ("auto (default): Baton's own executor for Llama-family models, else the transformers forward; "
                 "baton; transformers (the reference)")
CUDA_GRAPHS_HELP = "on CUDA, replay each decode step of Baton's executor as a captured graph (default: on)"
THREADS_HELP = "torch threads (default 0: one per core this process may use, or OMP_NUM_THREADS)"
BATCH_INVARIANT_HELP = ("a request's tokens independent of its batch, chunking and cache hits (default on; "
                        "on CPU always; off: cuBLAS and flash prefill on CUDA in bf16/fp16)")
CORES_HELP = "bind the process to these CPU cores, e.g. 0-3 or 0,2 (default: no binding)"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (SmolLM2-135M-Instruct), 'tiny-random', or a Hugging Face model directory")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto (default): bfloat16 where the device computes it fast, else float32")
    parser.add_argument("--device", default="auto", help="auto (default: CUDA where present), cpu, cuda, cuda:N")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="auto (default): Triton kernels on CUDA, torch (and Baton's C kernel) on CPU")
    parser.add_argument("--executor", default="auto", choices=EXECUTOR_CHOICES, help=EXECUTOR_HELP)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help=CUDA_GRAPHS_HELP)
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                        help=BATCH_INVARIANT_HELP)
    parser.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    parser.add_argument("--cpu-cores", default="", metavar="LIST", help=CORES_HELP)


def result_record(prompt: str, output) -> dict:
    return {"prompt": prompt, "prompt_token_ids": output.prompt_token_ids, "token_ids": output.token_ids,
            "text": output.text, "finish_reason": output.finish_reason}


def print_results(prompts: list[str], outputs, as_json: bool) -> None:
    for prompt, out in zip(prompts, outputs):
        if as_json:
            print(json.dumps(result_record(prompt, out)), flush=True)
        else:
            print(f"### {prompt}\n{out.text}\n[{out.finish_reason}, {len(out.token_ids)} tokens]\n", flush=True)


def cmd_generate(args) -> int:
    if not args.prompts or any(not p.strip() for p in args.prompts):
        raise UsageError("every prompt must be non-empty text; pass prompts as arguments")
    params = sampling_from_args(args)
    if args.max_rows < 1:
        raise UsageError(f"--max-rows must be >= 1 (got {args.max_rows})")
    connection = connection_kwargs(args)  # checked before any model loads
    if args.router:
        from baton.client import BatonClient
        from baton.client.cli_support import sampling_kwargs

        with BatonClient(args.router, **connection) as client:
            outputs = client.generate_many(list(args.prompts), max_concurrency=16, raw=args.raw,
                                           **sampling_kwargs(params))
        print_results(args.prompts, outputs, args.json)
        return 0
    from baton.local import LocalEngine
    from baton.decode_worker.core import DecodeConfig
    from baton.engine import threads
    from baton.engine.model import load_model

    try:
        threads.configure(args.threads, args.cpu_cores)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    engine = LocalEngine(loaded, DecodeConfig(max_rows=args.max_rows), attention_backend=args.attention_backend,
                         executor=args.executor, cuda_graphs=args.cuda_graphs,
                         batch_invariant=args.batch_invariant)
    prompt_ids = [loaded.encode_text(p) if args.raw else loaded.encode_chat([{"role": "user", "content": p}])
                  for p in args.prompts]
    print_results(args.prompts, engine.generate(prompt_ids, params), args.json)
    return 0


def _serve_args(parser: argparse.ArgumentParser, role: str, port: int) -> None:
    parser.add_argument("--config", help="YAML config file (sections model, router, prefill, decode, tls, cluster, "
                                          "tracing)")
    parser.add_argument("--host", help="listen address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, help=f"listen port (default {port})")
    parser.add_argument("--model", dest="model_name", help="model to serve (default 'default')")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES,
                        help="auto (default): bfloat16 where the device computes it fast, else float32")
    parser.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton"], help="auto (default), torch or triton")
    parser.add_argument("--executor", choices=EXECUTOR_CHOICES, help=EXECUTOR_HELP)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, help=CUDA_GRAPHS_HELP)
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, help=BATCH_INVARIANT_HELP)
    parser.add_argument("--threads", type=int, help=THREADS_HELP)
    parser.add_argument("--cpu-cores", metavar="LIST", help=CORES_HELP)
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (default 0: off)")
    parser.add_argument("--tls-cert", metavar="FILE",
                        help="this process's certificate (PEM): TLS on its port and to every other component")
    parser.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM)")
    parser.add_argument("--tls-ca", metavar="FILE",
                        help="CA that peers' certificates must be signed by; turns on mutual TLS")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="check peers' certificates for this DNS name instead of the host dialled "
                             "(peers reached by IP)")
    if role != "router":
        parser.add_argument("--insecure", action="store_true", default=None,
                            help="serve with no cluster token on a non-loopback address: the port answers anyone "
                                 "who reaches it (default: refuse to start so)")
    parser.add_argument("--otlp-endpoint", metavar="URL",
                        help="send OpenTelemetry traces of each request's stages to this OTLP/gRPC collector, "
                             "e.g. http://127.0.0.1:4317 (default: tracing off)")
    parser.set_defaults(role=role)


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """How `--router` is reached: TLS material and the bearer token."""
    parser.add_argument("--tls", action="store_true", help="connect to the router over TLS (system roots)")
    parser.add_argument("--ca", metavar="FILE",
                        help="CA certificate (PEM) that signed the router's certificate; implies --tls")
    parser.add_argument("--cert", metavar="FILE", help="client certificate (PEM) for mutual TLS; implies --tls")
    parser.add_argument("--key", metavar="FILE", help="private key (PEM) of --cert")
    parser.add_argument("--server-name", metavar="NAME", help="check the router's certificate for this name "
                        "instead of --router's host; implies --tls")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", help="bearer token the router requires (visible to `ps`; prefer --token-file)")
    token.add_argument("--token-file", metavar="FILE", help="a file holding the bearer token")


def connection_kwargs(args) -> dict:
    """BatonClient keywords from add_connection_args' flags."""
    given = [flag for flag, value in (("--tls", args.tls), ("--ca", args.ca), ("--cert", args.cert),
                                      ("--key", args.key), ("--server-name", args.server_name), ("--token", args.token),
                                      ("--token-file", args.token_file)) if value]
    if given and not args.router:
        raise UsageError(f"{', '.join(given)} configure the connection to --router HOST:PORT; add --router")
    if (args.cert is None) != (args.key is None):
        raise UsageError("--cert and --key go together (mutual TLS needs both)")
    token = args.token
    if args.token_file:
        try:
            token = open(args.token_file, encoding="utf-8").read().strip()
        except OSError as exc:
            raise UsageError(f"cannot read --token-file {args.token_file}: {exc.strerror}") from None
    tls = args.tls or any(v is not None for v in (args.ca, args.cert, args.server_name))
    kwargs = {"tls": tls, "token": token or None, "timeout": getattr(args, "timeout", None)}
    if args.ca:
        kwargs["root_certificates"] = args.ca
    if args.cert:
        kwargs.update(client_cert=args.cert, client_key=args.key)
    if args.server_name:
        kwargs["tls_server_name"] = args.server_name
    return kwargs


def load_role_settings(args):
    from baton.config import load_settings

    section = {k: getattr(args, k, None) for k in ("host", "port", "metrics_port")}
    for key in ("max_rows", "kv_budget_bytes", "page_size", "staging_bytes", "max_queue", "max_batch_tokens", "chunk_tokens", "prefix_cache_bytes",
                "block_size", "prefill_workers", "decode_workers", "discovery", "workers_file", "prefix_index", "redis_url",
                "index_namespace", "max_inflight", "decode_queue_per_worker", "auth_token_file", "require_client_cert", "drain_move_after_s",
                "http_port", "served_model_name", "chat_template", "kv_transport", "kv_memory_bytes"):
        if getattr(args, key, None) is not None:
            section[key] = getattr(args, key)
    model = {"name": args.model_name, "dtype": args.dtype, "device": args.device,
             "attention_backend": args.attention_backend, "executor": args.executor,
             "cuda_graphs": args.cuda_graphs, "batch_invariant": args.batch_invariant, "threads": args.threads,
             "cpu_cores": args.cpu_cores, "generation_config": getattr(args, "generation_config", None),
             "override_generation_config": getattr(args, "override_generation_config", None)}
    tls = {"cert_file": args.tls_cert, "key_file": args.tls_key, "ca_file": args.tls_ca,
           "server_name": args.tls_server_name}
    return load_settings(args.config, overrides={"model": model, args.role: section, "tls": tls,
                                                 "tracing": {"otlp_endpoint": args.otlp_endpoint},
                                                 "cluster": {"insecure": getattr(args, "insecure", None)}})


def cmd_serve(args) -> int:
    settings = load_role_settings(args)
    from baton import tracing

    tracing.configure(settings.tracing, args.role)
    if args.role == "router":
        from baton.router.service import serve
    elif args.role == "prefill":
        from baton.prefill_worker.service import serve
    else:
        from baton.decode_worker.service import serve
    serve(settings.model, getattr(settings, args.role), settings.tls, cluster=settings.cluster)
    from baton.lifeline import bound_exit

    bound_exit(0)  # drained and stopped: a stray thread must not hold the process (and its port)
    return 0


BATCH_KEYS = {"prompt", "messages", "token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
              "priority", "stop_token_ids", "ignore_eos"}


def read_batch_file(path: str) -> list[dict]:
    """One request a line: {"prompt": ...} (a user message), {"messages": [...]} or {"token_ids": [...]}.

    Every line is checked as the SDK would send it (types and ranges included), so a bad line
    is reported before any connection is made or local cluster started."""
    from baton.client.convert import build_request

    requests = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise UsageError(f"{path}:{number}: each line must be a JSON object")
        unknown = sorted(set(item) - BATCH_KEYS)
        if unknown:
            raise UsageError(f"{path}:{number}: unknown key(s) {unknown}; allowed: {sorted(BATCH_KEYS)}")
        kinds = [k for k in ("prompt", "messages", "token_ids") if k in item]
        if len(kinds) != 1:
            raise UsageError(f"{path}:{number}: give exactly one of prompt, messages or token_ids")
        try:
            build_request(**item)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"{path}:{number}: {exc}") from None
        requests.append(item)
    if not requests:
        raise UsageError(f"{path} has no requests; write one JSON object per line")
    return requests


def cmd_batch(args) -> int:
    from baton.client import BatonClient, BatonError

    # Everything that can be wrong with the input is found here, before a cluster starts.
    requests = read_batch_file(args.file)
    connection = connection_kwargs(args)
    if args.max_concurrency < 0:
        raise UsageError(f"--max-concurrency must be >= 0 (0: the router's choice; got {args.max_concurrency})")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds (got {args.timeout})")
    if not args.router and args.max_rows < 1:
        raise UsageError(f"--max-rows must be >= 1 (got {args.max_rows})")
    prompts = [r.get("prompt") or r.get("messages") or r.get("token_ids") for r in requests]
    done = [0]

    def show(index, outcome) -> None:
        done[0] += 1
        if args.json:
            if isinstance(outcome, BatonError):
                print(json.dumps({"index": index, "error": outcome.code, "message": outcome.message}), flush=True)
            else:
                print(json.dumps({"index": index, **result_record(prompts[index], outcome)}), flush=True)
        else:
            print(f"\r{done[0]}/{len(requests)} done", end="", file=sys.stderr, flush=True)

    def run(address: str) -> dict:
        with BatonClient(address, **connection) as client:
            return client.generate_batch(requests, on_result=show, max_concurrency=args.max_concurrency).summary

    if args.router:
        summary = run(args.router)
    else:
        from baton.up import LocalCluster

        print("starting a local cluster (1 prefill, 1 decode)...", file=sys.stderr, flush=True)
        with LocalCluster(model=args.model, max_rows=args.max_rows) as cluster:
            summary = run(cluster.router_address)
    if args.json:
        print(json.dumps({"summary": summary}), flush=True)
    else:
        print(file=sys.stderr)
        print(f"{summary.get('requests')} requests, {summary.get('failed')} failed, {summary.get('groups')} "
              f"prefix groups, {summary.get('seconds', 0):.1f}s\n"
              f"prefill tokens saved: {100 * summary.get('actual_saving_ratio', 0):.1f}% actual, "
              f"{100 * summary.get('planned_saving_ratio', 0):.1f}% planned, "
              f"{100 * summary.get('optimum_saving_ratio', 0):.1f}% optimum; "
              f"routing accuracy {100 * summary.get('routing_accuracy', 0):.1f}%")
    return 0


def cmd_bench(args) -> int:
    from baton.bench import main as bench_main

    return bench_main(args.bench_args)


def cmd_planner(args) -> int:
    from baton.planner.service import run_kubernetes

    if args.router is None:
        raise UsageError("baton planner needs --router HOST:PORT")
    return run_kubernetes(args, connection_kwargs(args))


def cmd_up(args) -> int:
    from baton.up import run_up

    return run_up(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated prefill/decode LLM serving.",
                                     epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="warning", type=level_name, metavar="{" + ",".join(LEVELS) + "}",
                        help="JSON log lines on stderr at this level and above (default warning)")
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
    _serve_args(router, "router", 50051)
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
    _serve_args(prefill, "prefill", 50061)
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
    _serve_args(decode, "decode", 50071)
    decode.add_argument("--max-rows", type=int, help="decode batch rows at most (default 8)")
    decode.add_argument("--kv-budget-bytes", type=int,
                        help="the paged decode KV, allocated once: rows join while what they hold fits, and all "
                             "of it bounds the context served (default 0: a share of the device's free memory)")
    decode.add_argument("--page-size", type=int, help="tokens a KV page holds (default 8)")
    decode.add_argument("--staging-bytes", type=int,
                        help="the host KV pool: landed KV and parked rows (default 512 MiB)")
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
    up.add_argument("--max-rows", type=int, default=8, help="decode batch rows per decode worker (default 8)")
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
    configure(args.log_level)
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


if __name__ == "__main__":
    sys.exit(main())
