"""The command line's shared flags and how they are read: sampling, the model, a server's role,
the connection to a router. Bad input raises UsageError (exit status 2) with what to change."""
from __future__ import annotations

import argparse

from baton.config import DTYPE_CHOICES, EXECUTOR_CHOICES, QUANTIZATIONS, QUANTIZED_INPUT_BITS, TP_SIZES

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
QUANTIZATION_HELP = ("none (default): float weights in --dtype; gguf: the model's GGUF blocks as stored (Q8_0, "
                     "Q4_0, Q4_1, Q4_K; the default model's Q4_1 file); int8: Q8_0 blocks made from the floats at load "
                     "(both on the CPU); fp8: e4m3 weights with a scale per output feature made at load, for GPUs "
                     "with fp8 tensor cores. Activations and KV in --dtype")
QUANTIZED_INPUTS_HELP = ("bits each block of 32 inputs of a quantized weight's GEMM is quantized to: 16 (default; "
                         "the float model's answers) or 8 (llama.cpp's arithmetic: half the dot products, less exact)")
CUDA_GRAPHS_HELP = "on CUDA, replay each decode step of Baton's executor as a captured graph (default: on)"
THREADS_HELP = "torch threads (default 0: one per core this process may use, or OMP_NUM_THREADS)"
BATCH_INVARIANT_HELP = ("a request's tokens independent of its batch, chunking and cache hits (default on; "
                        "on CPU always; off: cuBLAS and flash prefill on CUDA in bf16/fp16)")
CORES_HELP = "bind the process to these CPU cores, e.g. 0-3 or 0,2 (default: no binding)"
TP_HELP = ("split the model over this many ranks inside the worker, one process (and on CUDA one GPU) each: "
           "1 (default), 2, 4 or 8, at most the model's KV heads; any degree computes the same tokens")


def add_quantization_args(parser: argparse.ArgumentParser, defaults: bool = False) -> None:
    """--quantization and --quantized-inputs: with their defaults where the command loads the model
    itself; without, where they are config overrides (a server) or reach workers it starts."""
    parser.add_argument("--quantization", default="none" if defaults else None, choices=QUANTIZATIONS,
                        help=QUANTIZATION_HELP)
    parser.add_argument("--quantized-inputs", type=int, default=QUANTIZED_INPUT_BITS[0] if defaults else None,
                        choices=QUANTIZED_INPUT_BITS, help=QUANTIZED_INPUTS_HELP)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (SmolLM2-135M-Instruct), 'tiny-random', or a Hugging Face model directory")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto (default): bfloat16 where the device computes it fast, else float32")
    parser.add_argument("--device", default="auto", help="auto (default: CUDA where present), cpu, cuda, cuda:N")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="auto (default): Triton kernels on CUDA, torch (and Baton's C kernel) on CPU")
    parser.add_argument("--executor", default="auto", choices=EXECUTOR_CHOICES, help=EXECUTOR_HELP)
    add_quantization_args(parser, defaults=True)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help=CUDA_GRAPHS_HELP)
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                        help=BATCH_INVARIANT_HELP)
    parser.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    parser.add_argument("--cpu-cores", default="", metavar="LIST", help=CORES_HELP)


def add_serve_args(parser: argparse.ArgumentParser, role: str, port: int) -> None:
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
    add_quantization_args(parser)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, help=CUDA_GRAPHS_HELP)
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, help=BATCH_INVARIANT_HELP)
    parser.add_argument("--threads", type=int, help=THREADS_HELP)
    parser.add_argument("--cpu-cores", metavar="LIST", help=CORES_HELP)
    if role in ("prefill", "decode"):
        parser.add_argument("--tensor-parallel-size", "--tp", type=int, choices=TP_SIZES, help=TP_HELP)
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
                "http_port", "served_model_name", "chat_template", "kv_transport", "kv_memory_bytes",
                "local_prefill_max_tokens"):
        if getattr(args, key, None) is not None:
            section[key] = getattr(args, key)
    model = {"name": args.model_name, "dtype": args.dtype, "device": args.device,
             "attention_backend": args.attention_backend, "executor": args.executor, "quantization": args.quantization,
             "quantized_inputs": args.quantized_inputs,
             "tensor_parallel_size": getattr(args, "tensor_parallel_size", None),
             "cuda_graphs": args.cuda_graphs, "batch_invariant": args.batch_invariant, "threads": args.threads,
             "cpu_cores": args.cpu_cores, "generation_config": getattr(args, "generation_config", None),
             "override_generation_config": getattr(args, "override_generation_config", None)}
    tls = {"cert_file": args.tls_cert, "key_file": args.tls_key, "ca_file": args.tls_ca,
           "server_name": args.tls_server_name}
    return load_settings(args.config, overrides={"model": model, args.role: section, "tls": tls,
                                                 "tracing": {"otlp_endpoint": args.otlp_endpoint},
                                                 "cluster": {"insecure": getattr(args, "insecure", None)}})
