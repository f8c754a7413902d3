"""What each `baton` command does. Heavy imports (torch, transformers, the servers) happen inside
the commands, so `baton --help` and argument errors answer at once."""
from __future__ import annotations

import json
import sys

from baton.cli.args import UsageError, connection_kwargs, load_role_settings, sampling_from_args

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
    from baton.launch.local import LocalEngine
    from baton.decode_worker.core import DecodeConfig
    from baton.engine import threads
    from baton.engine.model import ModelLoadError, load_model

    try:
        threads.configure(args.threads, args.cpu_cores)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        loaded = load_model(args.model, dtype=args.dtype, device=args.device, module=args.quantization == "none",
                            quantization=args.quantization, quantized_inputs=args.quantized_inputs)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    engine = LocalEngine(loaded, DecodeConfig(max_rows=args.max_rows), attention_backend=args.attention_backend,
                         executor=args.executor, cuda_graphs=args.cuda_graphs,
                         batch_invariant=args.batch_invariant)
    prompt_ids = [loaded.encode_text(p) if args.raw else loaded.encode_chat([{"role": "user", "content": p}])
                  for p in args.prompts]
    print_results(args.prompts, engine.generate(prompt_ids, params), args.json)
    return 0


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
        from baton.launch.up import LocalCluster, model_env

        print("starting a local cluster (1 prefill, 1 decode)...", file=sys.stderr, flush=True)
        with LocalCluster(model=args.model, max_rows=args.max_rows, extra_env=model_env(args)) as cluster:
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
    from baton.launch.up import run_up

    return run_up(args)
