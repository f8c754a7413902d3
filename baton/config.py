"""One configuration schema for every process, read once at start: file, then environment, then flags.

A YAML file holds sections `model`, `router`, `prefill`, `decode`, `tls`, `cluster`, `tracing`; each key of a section
can also come from the environment as BATON_<SECTION>_<KEY> (e.g. BATON_DECODE_MAX_ROWS=16) and
from a command-line flag (--max-rows 16). The Helm chart and docker-compose set exactly these keys.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from baton.transport import MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES, max_chunk_bytes_within


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
EXECUTOR_CHOICES = ("auto", "baton", "transformers")
# how a model's weights are held: floats in the dtype; the GGUF file's own blocks; Q8_0 blocks
# made at load (engine.quantized; CPU, Baton's executor); e4m3 made at load (engine.fp8; GPU)
QUANTIZATIONS = ("none", "gguf", "int8", "fp8")
TP_SIZES = (1, 2, 4, 8)  # model.tensor_parallel_size
QUANTIZED_INPUT_BITS = (16, 8)  # what a quantized GEMM quantizes its inputs to (model.quantized_inputs)


@dataclass
class ModelSettings:
    name: str = "default"  # 'default', 'tiny-random', or a Hugging Face model directory
    dtype: str = "auto"  # bfloat16 where the device computes it fast, else float32
    device: str = "auto"
    attention_backend: str = "auto"
    executor: str = "auto"  # 'baton' (Llama family), 'transformers' (any model); auto: baton where it applies
    # 'none': float weights in `dtype`; 'gguf': the model's GGUF blocks as stored (Q8_0, Q4_0,
    # Q4_1, Q4_K); 'int8': Q8_0 blocks made from the floats at load (those two: CPU, Baton's executor);
    # 'fp8': e4m3 with a scale per output feature, made at load, for GPUs with fp8 tensor cores.
    quantization: str = "none"
    # Quantized weights' GEMM quantizes its inputs per block of 32 to 16-bit codes (the float model's
    # answers: KL 0.0001 on the default model) or 8-bit ones (llama.cpp's arithmetic: half the dot
    # products, KL 0.024, a tenth of the relay queries' first tokens changed; docs/quantization.md)
    quantized_inputs: int = 16
    # Ranks the model is split over inside each worker (one process and, on CUDA, one GPU each;
    # engine.shard): 1, 2, 4 or 8, at most the model's KV heads. Baton's executor. Any TP degree
    # computes the same bits, so KV moves between pools of different degrees.
    tensor_parallel_size: int = 1
    cuda_graphs: bool = True  # CUDA, Baton's executor: decode steps replay captured graphs (false: op by op)
    # A request's tokens independent of the rows sharing its step, of chunking and of prefix-cache
    # hits. CPU: always (Baton's C kernels). CUDA, bf16/fp16: Baton's fixed-order Triton GEMM, norm
    # and attention instead of cuBLAS and flash prefill (false: those; docs/bench.md has the cost)
    batch_invariant: bool = True
    threads: int = 0  # torch intra-op threads; 0: one per core this process may use
    cpu_cores: str = ""  # bind the process to these cores, e.g. '0-3' (empty: no binding)
    # The router's default sampling for requests that leave max_tokens, temperature, top_k or top_p
    # unset (vLLM's --generation-config): 'auto', the model's generation_config.json (the default
    # model: its card's temperature 0.2, top_p 0.9); 'none', each API's own (gRPC greedy, OpenAI
    # temperature 1); or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Wins over it key by key (vLLM's --override-generation-config), e.g. {"temperature": 0.7};
    # from the environment or a flag as JSON.
    override_generation_config: dict = field(default_factory=dict)

    def validate(self) -> None:
        from baton.sampling import sampling_defaults

        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"model.quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.quantized_inputs not in QUANTIZED_INPUT_BITS:
            raise ValueError(f"model.quantized_inputs must be 8 or 16 (bits), not {self.quantized_inputs!r}")
        if self.quantization != "none" and self.executor == "transformers":
            raise ValueError(f"model.quantization {self.quantization!r} runs on Baton's executor; "
                             "model.executor 'transformers' cannot serve it")

        if self.tensor_parallel_size not in TP_SIZES:
            raise ValueError(f"model.tensor_parallel_size must be one of {', '.join(map(str, TP_SIZES))}, "
                             f"not {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.executor == "transformers":
            raise ValueError("model.tensor_parallel_size > 1 runs on Baton's executor; model.executor 'transformers' "
                             "cannot split a model")
        if not self.generation_config.strip():
            raise ValueError("model.generation_config is empty; use 'auto' (the model's own defaults), 'none', "
                             "or a folder holding a generation_config.json")
        sampling_defaults(self.override_generation_config, "model.override_generation_config")


@dataclass
class TLSSettings:
    """One certificate per process, used both ways: served on its own port and presented as the
    client certificate on every channel it opens to another component (router -> workers,
    prefill -> decode KV push). TLS is on when cert_file is set, for every server and channel."""

    cert_file: str = ""  # this process's certificate chain (PEM); empty means plaintext everywhere
    key_file: str = ""  # its private key (PEM)
    ca_file: str = ""  # CA that peers' certificates are checked against (empty: the system roots);
    # with it, worker ports demand a client certificate signed by it (mutual TLS), and so does the
    # router's public port unless router.require_client_cert is false
    server_name: str = ""  # the name peers' certificates are checked against instead of the host in
    # their address (gRPC's ssl_target_name_override): set it when peers are reached by IP (Kubernetes
    # discovery uses pod IPs) and their certificate names a DNS name; empty: the address's host

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def validate(self) -> None:
        """Refuse half a TLS setup, which would otherwise fail only at the first connection."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls.cert_file and tls.key_file go together: set both (TLS) or neither (plaintext)")
        if self.ca_file and not self.cert_file:
            raise ValueError("tls.ca_file needs tls.cert_file and tls.key_file: with a CA every process also "
                             "serves TLS with its own certificate; set them, or clear tls.ca_file for plaintext")
        if self.server_name and not self.cert_file:
            raise ValueError("tls.server_name applies to TLS channels only: set tls.cert_file and tls.key_file, "
                             "or clear tls.server_name")
        if self.server_name != self.server_name.strip() or any(c in self.server_name for c in " /:,"):
            raise ValueError(f"tls.server_name must be a bare host name such as baton.serving.svc "
                             f"(got {self.server_name!r})")


@dataclass
class ClusterSettings:
    """The credential the router and the workers present to each other, distinct from any client's:
    with it set, worker ports refuse every call that lacks it (see baton/auth.py). `baton up`, the
    compose file and the Helm chart set one. A worker with none starts only on a loopback address
    (one machine, development) or when told `insecure`: its port would answer whoever reaches it."""

    token: str = ""  # the token itself; usually from the environment as BATON_CLUSTER_TOKEN (a Secret)
    token_file: str = ""  # or a file holding it
    insecure: bool = False  # a worker without a token serves on any address (`--insecure`)


@dataclass
class TracingSettings:
    """OpenTelemetry tracing (baton/tracing.py): each request's stages as spans of one trace across
    router, prefill and decode, exported over OTLP/gRPC. Off while otlp_endpoint is empty."""

    otlp_endpoint: str = ""  # an OTLP/gRPC collector, e.g. http://otel-collector:4317 (https:// for TLS)
    sample_ratio: float = 1.0  # share of requests traced (the router decides; workers follow)
    service_name: str = ""  # the service.name of this process's spans; empty: baton-<role>

    def validate(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"tracing.sample_ratio must be in [0, 1] (got {self.sample_ratio})")
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"tracing.otlp_endpoint must be an http:// or https:// URL of an OTLP/gRPC collector, "
                             f"e.g. http://otel-collector:4317 (got {self.otlp_endpoint!r})")


@dataclass
class RouterSettings:
    host: str = "0.0.0.0"
    port: int = 50051
    prefill_workers: list[str] = field(default_factory=list)  # static discovery: host:port each
    decode_workers: list[str] = field(default_factory=list)
    discovery: str = "static"  # 'static', 'kubernetes' or 'file' (workers_file, rewritten as workers come and go)
    workers_file: str = ""  # file discovery: JSON {"prefill": [host:port, ...], "decode": [...]}
    namespace: str = ""  # kubernetes discovery: namespace of the worker EndpointSlices
    # Kubernetes discovery: label selector terms ANDed with each role's, e.g.
    # app.kubernetes.io/instance=prod; the chart sets its release's, so two releases in one
    # namespace never see each other's workers.
    discovery_labels: str = ""
    prefix_index: str = "memory"  # 'memory' or 'redis'
    redis_url: str = ""
    # Redis's password, kept out of the URL and the ConfigMap: BATON_ROUTER_REDIS_PASSWORD from a Secret
    redis_password: str = field(default="", repr=False)
    block_size: int = 16  # prefix-cache block tokens; must equal the prefill workers'
    index_namespace: str = "baton"  # Redis key prefix, so deployments sharing a Redis do not collide
    index_max_blocks: int = 262_144  # prefix index entries kept (least recently touched dropped)
    # An index entry no worker re-announced for this long is dropped (0 = never): the backstop for a
    # worker that vanished without discovery noticing. The router re-reads every prefill worker's
    # whole cache every third of it, so entries a live worker holds never expire.
    index_ttl_s: float = 900.0
    # Prefixes just sent to a prefill worker, before its cache events arrive: a request with the
    # same prefix meanwhile is steered there. At most this many (worker, block) entries are kept.
    pending_max_blocks: int = 65_536
    load_weight: float = 1.0  # routing cost per queued prompt token on a prefill worker
    cache_weight: float = 1.0  # routing credit per prompt token a worker already holds
    # Conditional disaggregation: a decode worker that holds a prompt's prefix (a conversation's
    # earlier turns) prefills the rest itself, with no prefill worker and no KV transfer, when
    # that rest is at most this many tokens; 0 = never (docs/conversations.md: how it was measured).
    local_prefill_max_tokens: int = 512
    max_inflight: int = 1024  # requests in flight before RESOURCE_EXHAUSTED (also sizes the server's threads)
    # Requests wait here, before their prefill, while the decode workers hold their rows' worth of
    # requests plus this many each (router/admission.py): they queue before their first token
    # instead of stalling after it. -1: every request is prefilled at once.
    decode_queue_per_worker: int = 2
    load_poll_seconds: float = 0.2
    # A request that has not moved (no row, no KV, no token, no chunk of its prompt prefilled) for
    # this long is logged once, where it waits and on which workers (router/progress.py), and
    # counted in baton_router_stalled_requests.
    stall_log_s: float = 30.0
    metrics_port: int = 0  # 0 = no metrics endpoint
    # A file holding the bearer token every public API call must send (`authorization: Bearer
    # <token>`); empty = no token (the BATON_AUTH_TOKEN environment variable may hold it instead).
    auth_token_file: str = ""
    # With tls.ca_file set: clients of the public API must present a certificate signed by that
    # CA (mutual TLS). false: server-side TLS only, e.g. for SDK users holding just a token.
    require_client_cert: bool = True
    # On SIGTERM: refuse new requests and let those in flight finish for up to this many seconds
    # before the worker channels close (Kubernetes sends SIGTERM on every rollout).
    drain_timeout_s: float = 20.0
    # The OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) on this
    # port, with the same token, TLS and admission as the gRPC one; 0 = off.
    http_port: int = 8000
    served_model_name: str = ""  # the `model` clients send; empty: the model's own name
    chat_template: str = ""  # a Jinja chat template or a file holding one; empty: the tokenizer's
    http_request_timeout_s: float = 600.0  # an HTTP request still running after this is ended (504); 0 = never

    def validate(self) -> None:
        check_labels(self.discovery_labels, "router.discovery_labels")
        if self.decode_queue_per_worker < -1:
            raise ValueError(f"router.decode_queue_per_worker must be >= 0, or -1 to prefill every request at once "
                             f"(got {self.decode_queue_per_worker})")
        if self.pending_max_blocks < 1:
            raise ValueError(f"router.pending_max_blocks must be >= 1 (got {self.pending_max_blocks})")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"router.local_prefill_max_tokens must be >= 0 (got {self.local_prefill_max_tokens}; "
                             "0 never prefills on a decode worker)")
        if not self.stall_log_s > 0:
            raise ValueError(f"router.stall_log_s must be > 0 seconds (got {self.stall_log_s})")
        if not self.index_ttl_s >= 0:
            raise ValueError(f"router.index_ttl_s must be >= 0 seconds (0 = never; got {self.index_ttl_s})")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"router.http_port must be a port in [0, 65535] (0 = off; got {self.http_port})")
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ValueError(f"router.http_port {self.http_port} is already router.port or router.metrics_port")
        if not self.http_request_timeout_s >= 0:
            raise ValueError(f"router.http_request_timeout_s must be >= 0 seconds (0 = never; "
                             f"got {self.http_request_timeout_s})")


@dataclass
class PrefillSettings:
    host: str = "0.0.0.0"
    port: int = 50061
    max_queue: int = 256  # prompts queued or being prefilled/pushed before RESOURCE_EXHAUSTED
    max_batch_tokens: int = 4096  # prompt tokens per prefill batch
    max_batch_size: int = 8
    # A prompt with more uncached tokens than this is prefilled in chunks of this many, one per
    # iteration, so prompts arriving meanwhile wait for a chunk rather than the whole prompt (0 = off).
    # 256 on a CPU core: a chunk takes ~0.5 s, and a long prompt 5-10% longer (`baton bench chunks`).
    chunk_tokens: int = 256
    # BatchLLM's M_threshold: KV prefilled here and not yet pushed (plus long prompts' KV so far)
    # stays under this; past it no new prompt is prefilled until pushes free memory (a slow
    # decode side cannot make this worker hold unbounded KV). A lone prompt always goes. 0 = no limit.
    kv_memory_bytes: int = 1 << 30
    prefix_cache_bytes: int = 256 << 20
    max_pins: int = 256  # batch groups' pinned prefixes held at once (their KV counts in prefix_cache_bytes)
    pin_ttl_s: float = 3600.0  # a pin not released by then is dropped (its router may have died)
    drain_timeout_s: float = 20.0  # on SIGTERM: queued prompts get this long to be prefilled and pushed
    # The decode workers this worker may push KV to (host:port each, as the router discovered them);
    # a Prefill naming any other is refused. Empty: any target a caller holding the cluster token names.
    decode_workers: list[str] = field(default_factory=list)
    # 'static' (decode_workers above), 'kubernetes': the decode workers this worker's own
    # EndpointSlice watch sees in `namespace` (empty: the pod's own), as the router's discovery, or
    # 'file': the decode workers of `workers_file` (the router's file discovery).
    discovery: str = "static"
    workers_file: str = ""
    namespace: str = ""
    # Kubernetes discovery: label selector terms ANDed with each role's, e.g.
    # app.kubernetes.io/instance=prod; the chart sets its release's, so two releases in one
    # namespace never see each other's workers.
    discovery_labels: str = ""
    block_size: int = 16
    kv_chunk_bytes: int = 2 << 20  # KV payload bytes per message of a push (validate() says how many fit)
    # 'auto': KV to a decode worker on this host (same network namespace) goes through shared
    # memory, to any other over gRPC; 'nixl': as auto, but to other hosts through NIXL (UCX) where
    # the decode worker takes it (the nixl extra installed on both), else gRPC; 'grpc': always gRPC.
    kv_transport: str = "auto"
    # A prompt prefilled in chunks streams its KV to a decode worker reached over gRPC chunk by
    # chunk, as each is computed, so the transfer overlaps the prefill; off: pushed after it.
    kv_stream: bool = True
    # A prompt whose leading tokens' KV its decode worker holds (a conversation's earlier turns,
    # answers included) reads that KV from it (DecodeWorker.ReadKV) rather than computing it, when
    # reading is measured to be faster; off: such tokens are computed here unless cached here.
    pull_kv: bool = True
    advertise: str = ""  # host:port others use to reach this worker (default: host:port)
    metrics_port: int = 0

    def validate(self) -> None:
        """Refuse values that would otherwise fail only at the first KV push or pin."""
        check_labels(self.discovery_labels, "prefill.discovery_labels")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"prefill.drain_timeout_s must be >= 0 seconds (got {self.drain_timeout_s})")
        check_kv_transport(self.kv_transport, "prefill.kv_transport")
        if self.kv_memory_bytes < 0:
            raise ValueError(f"prefill.kv_memory_bytes must be >= 0 (got {self.kv_memory_bytes}); 0 = no limit")
        if self.chunk_tokens < 0:
            raise ValueError(f"prefill.chunk_tokens must be >= 0 (got {self.chunk_tokens}); 0 turns chunking off")
        if self.discovery not in ("static", "kubernetes", "file"):
            raise ValueError(f"prefill.discovery is {self.discovery!r}; set it to 'static' (decode targets from "
                             "prefill.decode_workers), 'kubernetes' (the decode workers' EndpointSlices) or 'file' "
                             "(prefill.workers_file)")
        if self.discovery == "file" and not self.workers_file:
            raise ValueError("prefill.discovery is 'file': set prefill.workers_file to the workers file's path")
        if self.max_pins < 0 or not self.pin_ttl_s > 0:
            raise ValueError(f"prefill.max_pins must be >= 0 and prefill.pin_ttl_s > 0 "
                             f"(got {self.max_pins} and {self.pin_ttl_s})")
        # A decode worker refuses chunks above MAX_CHUNK_BYTES, and a chunk plus its framing must
        # fit one gRPC message of the decode worker's server.
        limit = max_chunk_bytes_within(MAX_MESSAGE_BYTES)
        if not 0 < self.kv_chunk_bytes <= limit:
            raise ValueError(f"prefill.kv_chunk_bytes is {self.kv_chunk_bytes}; it must be in (0, {limit}]: a KV "
                             f"chunk plus its framing must fit one {MAX_MESSAGE_BYTES >> 20} MiB gRPC message "
                             f"(and the wire allows at most {MAX_CHUNK_BYTES}); the default is 2097152 (2 MiB)")


@dataclass
class DecodeSettings:
    host: str = "0.0.0.0"
    port: int = 50071
    max_rows: int = 0  # decode batch rows at most; 0: sized at start (baton/sizing.py)
    # The decode KV in pages, allocated once: rows join while what they hold (plus a growth
    # reserve) fits, never by max_tokens, so max_rows is a cap; when pages run out the latest
    # lowest-priority row is parked in the host pool. 0: a share of the device's free memory.
    kv_budget_bytes: int = 0
    page_size: int = 8  # tokens a KV page holds
    growth_reserve_tokens: int = 32  # free room a joining row must find beyond its own KV
    # The host KV pool: landed KV waiting for a row and parked rows' KV; 0: sized at start from the
    # longest prompt served and the memory the host (or container) has left (baton/sizing.py).
    staging_bytes: int = 0
    # Requests waiting for KV before RESOURCE_EXHAUSTED; with max_rows it also bounds every request
    # held here (waiting for KV or a row, or decoding), each holding a server thread.
    max_pending: int = 256
    kv_high_watermark_bytes: int = 0  # KV pages in use above this park rows on the host (0 = off)
    kv_low_watermark_bytes: int = 0  # and rows are admitted only while they stay at or below this
    # Rows whose prompts begin with at least this many equal tokens share those full pages (a
    # system prompt, a batch group's document); 0 turns sharing off.
    share_min_tokens: int = 64
    # A finished request's KV pages stay until pages are needed, so a conversation's next turn
    # finds its prompt and answer here (the router sends it here: conditional disaggregation).
    retain_kv: bool = True
    # Prompt tokens a decode step's time admits of a prompt prefilled here (the rows decoding
    # meanwhile wait at most this chunk).
    local_prefill_chunk_tokens: int = 128
    block_size: int = 16  # the KV events' blocks; must equal the router's and prefill workers'
    # On SIGTERM (drain): seconds to let running requests finish before their KV moves to another
    # decode worker that has room (the router re-prefills a request when none takes it). At or past
    # drain_timeout_s, nothing moves and what is left is re-prefilled.
    drain_move_after_s: float = 5.0
    drain_timeout_s: float = 20.0  # on SIGTERM: how long the drain may take in all
    # 'auto' and 'nixl': also take KV through shared memory from workers on this host, and NIXL
    # writes where the nixl extra is installed ('nixl' also pushes through it when draining);
    # 'grpc': gRPC only.
    kv_transport: str = "auto"
    advertise: str = ""
    metrics_port: int = 0

    def validate(self) -> None:
        check_kv_transport(self.kv_transport, "decode.kv_transport")
        if self.share_min_tokens < 0:
            raise ValueError(f"decode.share_min_tokens must be >= 0 (got {self.share_min_tokens}; 0 turns sharing off)")
        if not 1 <= self.page_size <= 4096:
            raise ValueError(f"decode.page_size must be 1..4096 tokens (got {self.page_size}; the default is 8)")
        for key in ("max_rows", "staging_bytes"):
            if getattr(self, key) < 0:
                raise ValueError(f"decode.{key} must be >= 0 (got {getattr(self, key)}; 0 sizes it at start)")
        if self.growth_reserve_tokens < 0:
            raise ValueError(f"decode.growth_reserve_tokens must be >= 0 (got {self.growth_reserve_tokens})")
        if self.local_prefill_chunk_tokens < 1:
            raise ValueError(f"decode.local_prefill_chunk_tokens must be >= 1 (got {self.local_prefill_chunk_tokens})")
        if not 1 <= self.block_size <= 4096:
            raise ValueError(f"decode.block_size must be 1..4096 tokens (got {self.block_size}; the default is 16)")
        if not self.drain_move_after_s >= 0:
            raise ValueError(f"decode.drain_move_after_s must be >= 0 seconds (got {self.drain_move_after_s})")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"decode.drain_timeout_s must be >= 0 seconds (got {self.drain_timeout_s})")


def check_kv_transport(value: str, key: str) -> None:
    if value not in ("auto", "nixl", "grpc"):
        raise ValueError(f"{key} is {value!r}; set it to 'auto' (shared memory between workers on one host, gRPC "
                         "otherwise), 'nixl' (as auto, NIXL between hosts) or 'grpc'")
    if value == "nixl":
        import importlib.util

        if not any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12", "nixl_cu13")):
            raise ValueError(f"{key} is 'nixl' but the nixl package is not installed here: "
                             "pip install 'baton-serve[nixl]' (or nixl-cu13 on CUDA 13), or set it to 'auto'")


def check_labels(selector: str, key: str) -> None:
    """A Kubernetes equality label selector: `key=value` terms joined by commas, or empty."""
    for term in filter(None, selector.split(",")):
        name, eq, value = term.partition("=")
        if not eq or not name or any(c.isspace() for c in term) or "=" in value.lstrip("="):
            raise ValueError(f"{key} must be label terms such as app.kubernetes.io/instance=prod, joined by "
                             f"commas (got {selector!r})")


SECTIONS = {"model": ModelSettings, "router": RouterSettings, "prefill": PrefillSettings,
            "decode": DecodeSettings, "tls": TLSSettings, "cluster": ClusterSettings, "tracing": TracingSettings}


@dataclass
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    prefill: PrefillSettings = field(default_factory=PrefillSettings)
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    tls: TLSSettings = field(default_factory=TLSSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)


def known_keys() -> dict[str, set[str]]:
    """Every key a process accepts, per section: what the chart and compose files may set."""
    return {section: {f.name for f in fields(cls)} for section, cls in SECTIONS.items()}


def load_settings(path: str | None = None, env: dict[str, str] | None = None,
                  overrides: dict[str, dict[str, Any]] | None = None) -> Settings:
    """File, then BATON_<SECTION>_<KEY> environment variables, then explicit overrides."""
    settings = Settings()
    env = os.environ if env is None else env
    if path:
        import yaml  # only config files need it: the SDK-only install has no PyYAML

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must be a mapping of sections {sorted(SECTIONS)}")
        for section, values in data.items():
            _apply(settings, section, values or {}, source=f"config file {path}")
    for name, raw in env.items():
        if not name.startswith("BATON_") or name.count("_") < 2:
            continue
        section, _, key = name[len("BATON_"):].lower().partition("_")
        if section in SECTIONS:
            _apply(settings, section, {key: raw}, source=f"environment variable {name}")
    for section, values in (overrides or {}).items():
        _apply(settings, section, {k: v for k, v in values.items() if v is not None}, source="command line")
    settings.model.validate()
    settings.tls.validate()
    settings.router.validate()
    settings.prefill.validate()
    settings.decode.validate()
    settings.tracing.validate()
    return settings


def _apply(settings: Settings, section: str, values: dict, source: str) -> None:
    if section not in SECTIONS:
        raise ValueError(f"{source}: unknown section {section!r}; known sections: {sorted(SECTIONS)}")
    target = getattr(settings, section)
    hints = get_type_hints(type(target))
    for key, raw in values.items():
        if key not in hints:
            raise ValueError(f"{source}: unknown key {section}.{key}; known keys: {sorted(hints)}")
        setattr(target, key, _coerce(raw, hints[key], f"{source}: {section}.{key}"))


def _coerce(raw: Any, kind, where: str) -> Any:
    try:
        if kind is bool:
            if isinstance(raw, str):
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError
                return raw.lower() in ("1", "true", "yes")
            return bool(raw)
        if kind is int:
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)
        if kind is float:
            return float(raw)
        if kind is dict:
            if isinstance(raw, str):
                import json

                raw = json.loads(raw) if raw.strip() else {}
            if not isinstance(raw, dict):
                raise ValueError
            return raw
        if kind == list[str]:
            if isinstance(raw, str):
                return [item.strip() for item in raw.split(",") if item.strip()]
            return [str(item) for item in raw]
        return str(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: cannot read {raw!r} as {getattr(kind, '__name__', kind)}") from None

