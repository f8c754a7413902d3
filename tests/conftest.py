"""Shared fixtures (the real default model, a tiny random model, transformers' own generate) and
the test tiers: every test is marked unit, engine, cluster or deploy by what it needs (README.md
in this folder; `make test-fast` runs the unit tier)."""
from __future__ import annotations

import os
import platform

# The Triton kernels' tests run them under the interpreter, whose dot is numpy's matmul. OpenBLAS's
# AVX2 (Haswell, Zen) sgemm rounds a row by its place in the tile (60 of 64 places differed for one
# row here, an AMD EPYC without AVX-512), which a GPU's MMA does not: the batch-invariance tests
# would measure numpy. Its AVX kernel gives every row its own bits; set before torch loads numpy.
if platform.machine() == "x86_64":
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

# Under pytest-xdist (`make test` runs a worker per core) each worker and the processes its tests
# start keep to a share of the cores: their torch/OpenMP threads spin-wait, and two workers' threads
# on the same cores slowed the suite 2x. Set before torch starts its thread pool.
ALL_CORES = sorted(os.sched_getaffinity(0))  # what the runner was given: `all_cores` tests get it back
_worker, _workers = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _worker.startswith("gw") and _workers > 1:
    os.sched_setaffinity(0, ALL_CORES[int(_worker[2:]) % len(ALL_CORES)::_workers] or ALL_CORES)

from concurrent import futures

import grpc
import pytest
import torch

from baton.engine.model import LoadedModel, load_model

# The suite checks tokens exactly, which only fp32 makes portable: under `dtype: auto` a CPU with
# fast bf16 (AVX-512/AMX) would run bf16, whose rounding breaks near-tied logits differently in
# two implementations. Worker processes read it too (BATON_<SECTION>_<KEY>); bf16 has its own tests.
TEST_DTYPE = os.environ.setdefault("BATON_MODEL_DTYPE", "float32")


class Reference:
    """`transformers` generate on a separate copy of the same weights: the ground truth."""

    def __init__(self, name: str):
        self.loaded = load_model(name, dtype=TEST_DTYPE)
        self.loaded.model.set_attn_implementation("sdpa")

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
        """generate_kwargs: transformers' own processors, e.g. repetition_penalty=1.3."""
        model = self.loaded.model
        out = model.generate(torch.tensor([prompt_ids], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.generation_config.pad_token_id, **generate_kwargs)
        return out[0, len(prompt_ids):].tolist()

    def logprobs(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """[len(output_ids), vocab]: the log-softmax of the logits each output token was drawn from."""
        with torch.no_grad():
            ids = torch.tensor([prompt_ids + output_ids[:-1]], device=self.loaded.model.device)
            logits = self.loaded.model(ids).logits[0, len(prompt_ids) - 1:]
        return torch.log_softmax(logits.float(), dim=-1).cpu()


@pytest.fixture(autouse=True)
def _cores_and_threads_as_they_were(request):
    """A test that loads a worker's runner in this process (a tensor-parallel rank 0 binds itself to
    its share of the cores) leaves the cores and torch threads it found: the tests after it, and the
    worker processes they start, which inherit the binding, would otherwise run on one core. A test
    marked `all_cores` (it needs more than a pinned worker's share) runs on every core."""
    from baton.engine import threads

    cores, count, chosen = os.sched_getaffinity(0), torch.get_num_threads(), threads._chosen
    if request.node.get_closest_marker("all_cores"):
        os.sched_setaffinity(0, ALL_CORES)
    yield
    if os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    threads._chosen = chosen


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return load_model("default", dtype=TEST_DTYPE)


@pytest.fixture(scope="session")
def default_reference() -> Reference:
    return Reference("default")


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return load_model("tiny-random", dtype=TEST_DTYPE)


@pytest.fixture(scope="session")
def tiny_reference() -> Reference:
    return Reference("tiny-random")


@pytest.fixture
def grpc_server():
    """start(add, servicer, options) -> the loopback address of a gRPC server serving the test's
    servicer (`add` is the generated add_..._to_server); every one is stopped after the test."""
    servers = []

    def start(add, servicer, options=()) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=list(options))
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


# --- tiers ----------------------------------------------------------------------------------------

# Each file's tier: what its tests need. A test in a unit file that loads a model is engine, one
# that needs redis-server or is marked slow is cluster. A new file must be placed here.
TIERS = {
    "unit": {  # plain Python and small tensors, milliseconds to a second; loopback at most
        "test_batch_planner.py", "test_block_hash.py", "test_decode_scheduler.py", "test_discovery.py",
        "test_imports.py", "test_prefill_batching.py", "test_prefix_cache.py", "test_prefix_index.py",
        "test_protogen.py", "test_sampling.py", "test_stopping.py", "test_cli.py",
        "test_openai_protocol.py", "test_cache_events.py", "test_routing_policy.py", "test_tracing.py",
        "test_kv_pages.py", "test_admission.py", "test_shard.py", "test_openai_tools.py", "test_planner.py",
        "test_planner_kubernetes.py", "test_prefill_delivery.py", "test_resources.py", "test_sizing.py",
        "test_progress.py",
    },
    "engine": {  # loads a model and runs forwards in this process
        "test_engine_exact.py", "test_executor.py", "test_fp8.py", "test_kernels.py", "test_local_engine.py",
        "test_prefill_core.py", "test_triton_backend.py", "test_cuda.py", "test_batch_invariance.py",
        "test_cpu_prefill_attention.py", "test_huge_pages.py", "test_checkpoint.py", "test_quantized.py", "test_tensor_parallel.py",
    },
    "cluster": {  # real gRPC servers, worker processes, redis-server, network namespaces
        "test_bench.py", "test_bench_chaos.py", "test_cli_batch.py", "test_client.py", "test_cluster.py",
        "test_faults.py", "test_fuzz.py", "test_kvtransfer.py", "test_lifecycle.py", "test_migration.py",
        "test_prefill_push.py", "test_prefix_cluster.py", "test_router_dispatch.py", "test_security.py",
        "test_openai_api.py", "test_cache_sync.py", "test_kv_shm.py", "test_hosts.py", "test_kv_nixl.py",
        "test_planner_local.py", "test_forkserver.py", "test_conversations.py", "test_quantized_cluster.py",
        "test_tensor_parallel_cluster.py", "test_kv_pull.py",
    },
    "deploy": {"test_deploy.py", "test_packaging.py"},  # the chart, compose, the image, wheels and venvs
}
_TIER_OF_FILE = {name: tier for tier, names in TIERS.items() for name in names}
_MODEL_FIXTURES = {"tiny_model", "tiny_reference", "default_model", "default_reference"}


def tier_of(item) -> str:
    name = item.path.name
    if name not in _TIER_OF_FILE:
        raise pytest.UsageError(f"{name} has no test tier: add it to TIERS in tests/conftest.py")
    tier = _TIER_OF_FILE[name]
    if tier == "unit":
        if "redis_server" in item.fixturenames or "redis" in getattr(getattr(item, "callspec", None), "id", ""):
            return "cluster"
        if _MODEL_FIXTURES & set(item.fixturenames):
            return "engine"
        if item.get_closest_marker("slow"):
            return "cluster"
    return tier


# The files that take longest (seconds on 2 cores, `make test`'s --durations summed per file), run
# first: `make test` hands each pytest-xdist worker a file at a time in this order, so the workers
# end together. Last, planner_local and triton_backend (200 s between them) once kept one worker
# busy 90 s after the other had finished.
LONGEST_FIRST = (
    "test_bench.py",  # 330
    "test_faults.py",  # 210
    "test_migration.py",  # 125
    "test_cpu_prefill_attention.py",  # 115
    "test_planner_local.py",  # 110
    "test_engine_exact.py",  # 100
    "test_lifecycle.py",  # 95
    "test_triton_backend.py",  # 90
    "test_tensor_parallel_cluster.py",  # 70
    "test_conversations.py",  # 70
    "test_prefix_cluster.py",  # 65
    "test_tensor_parallel.py",  # 65
    "test_hosts.py",  # 60
    "test_cluster.py",  # 60
    "test_quantized.py",  # 55
    "test_fuzz.py",  # 50
    "test_deploy.py",  # 50
    "test_security.py",  # 40
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
