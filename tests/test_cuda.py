"""The engine on a CUDA GPU: the same executor and BATON batch as on CPU, with the Triton
attention kernels compiled for real, token-exact against transformers generate in the same dtype
and device. Skipped without a GPU (CI has none); run on one as docs/deploy.md says."""
from __future__ import annotations

import copy
import zlib

import pytest
import torch

from baton.decode_worker.core import DecodeConfig
from baton.decode_worker.scheduler import Status
from baton.engine.model import load_model
from baton.launch.local import LocalEngine
from baton.sampling import SamplingParams
from test_engine_exact import mixed_prompts, run_with_random_arrivals

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def greedy_on(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids], device=model.device), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


# bf16 keeps 8 bits of mantissa: two implementations (or two batch shapes, which pick different
# GPU GEMM kernels) round a logit differently by up to a few 2^-8 of its size. Where the top two
# logits are that close, greedy may go either way; past that point the sequences differ.
BF16_TIE = 4 * 2 ** -8


def near_tie(reference, prompt: list[int], got: list[int], expected: list[int]) -> tuple[int, float, float]:
    """(step, gap, top logit) at the first step where `got` left `expected`: by how much the
    reference's logit for its own choice beat ours there."""
    step = next(k for k, (a, b) in enumerate(zip(got, expected)) if a != b)
    with torch.no_grad():
        ids = torch.tensor([prompt + expected[:step]], device=reference.device)
        logits = reference(ids).logits[0, -1].float()
    return step, float(logits[expected[step]] - logits[got[step]]), float(logits[expected[step]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_engine_on_cuda_matches_generate_in_the_same_dtype(dtype, backend):
    """Random arrivals into a 4-row batch on paged KV: rows reused, the batch emptied and refilled. fp32: every prompt's greedy tokens equal generate's on the same GPU.
    bf16: equal up to the first step whose top two logits are within bf16 rounding of each other."""
    loaded = load_model("tiny-random", dtype=dtype, device="cuda")
    reference = copy.deepcopy(loaded.model).eval()
    reference.set_attn_implementation("sdpa")
    engine = LocalEngine(loaded, DecodeConfig(max_rows=4, kv_budget_bytes=256 << 20), attention_backend=backend)
    assert engine.runner.backend == backend
    prompts = mixed_prompts(loaded, 24, seed=7)
    finals = run_with_random_arrivals(engine, prompts, SamplingParams(max_tokens=24), seed=11)
    gaps = []
    for i, prompt in enumerate(prompts):
        expected = greedy_on(reference, prompt, 24)
        if finals[i] != expected:
            gaps.append((i, *near_tie(reference, prompt, finals[i], expected)))
    print(f"\n{dtype} {backend}: {len(gaps)} of {len(prompts)} differ; (prompt, step, gap, top logit): {gaps}")
    if dtype == "float32":
        assert not gaps, f"{len(gaps)} of {len(prompts)} prompts differ from generate: {gaps[:5]}"
    else:
        assert all(gap <= BF16_TIE * max(1.0, abs(top)) for _, _, gap, top in gaps), gaps
    assert engine.decode.scheduler.kv_usage().used == 0 and engine.decode.kv.pages.device.type == "cuda"
    assert engine.runner.backend == backend, "the Triton kernels fell back to torch"
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.replays > 0, "decode steps should replay CUDA graphs"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_replayed_cuda_graphs_give_the_eager_steps_tokens(backend):
    """Graphs captured per row bucket (the paged KV never moves) give the same tokens as launching
    every step op by op."""
    loaded = load_model("tiny-random", dtype="float32", device="cuda")
    prompts = mixed_prompts(loaded, 12, seed=3)

    def run(graphs: bool):
        engine = LocalEngine(loaded, DecodeConfig(max_rows=4, kv_budget_bytes=256 << 20), attention_backend=backend)
        if not graphs:
            engine.runner.graphs = None
        return run_with_random_arrivals(engine, prompts, SamplingParams(max_tokens=24), seed=5), engine.runner

    (replayed, runner), (eager, _) = run(True), run(False)
    assert replayed == eager
    assert runner.graphs.captures >= 2, "each row bucket needs its capture"
    assert runner.graphs.replays > runner.graphs.captures


def test_preemption_and_prefix_reuse_on_cuda_stay_exact():
    """A high-priority arrival parks a row on the host and it resumes; a cached prefix is reused."""
    loaded = load_model("tiny-random", dtype="float32", device="cuda")
    reference = copy.deepcopy(loaded.model).eval()
    engine = LocalEngine(loaded, DecodeConfig(max_rows=2), prefix_cache_bytes=64 << 20)
    shared = list(range(500, 570))
    low = [shared + [7, 8, 9], shared + [10, 11]]
    ids = {engine.submit(p, SamplingParams(max_tokens=30, ignore_eos=True, priority=0)): p for p in low}
    finals = {}
    for _ in range(6):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    urgent, later = [40, 41, 42, 43], shared + [12]  # `later` finds the shared prefix cached
    ids[engine.submit(urgent, SamplingParams(max_tokens=10, ignore_eos=True, priority=5))] = urgent
    ids[engine.submit(later, SamplingParams(max_tokens=10, ignore_eos=True, priority=0))] = later
    parked_pinned = []
    while engine.has_work():
        parked_pinned += [seq.engine.kv.data.is_pinned() for seq in engine.decode.scheduler.requests.values()
                          if seq.status == Status.PARKED]
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.decode.scheduler.parked_total >= 1, "the urgent request should have parked a row"
    assert parked_pinned and all(parked_pinned), "a parked row's KV waits in pinned host memory"
    for rid, prompt in ids.items():
        assert finals[rid].token_ids == greedy_on(reference, prompt, len(finals[rid].token_ids)), rid
    assert engine.prefill.cached_tokens_total > 0


def test_kv_landing_on_a_cuda_worker_waits_in_pinned_memory():
    """Both transports land pinned KV when the receiver is a CUDA worker's; it embeds unchanged."""
    from baton.engine.kv import KVShape, SequenceKV, to_host
    from baton.engine.paged_kv import PagedKV
    from baton.kvtransfer import Receiver, ReceiverConfig, StagingConfig, StagingPool
    from inprocess_push import push_in_process
    from baton.kvtransfer.sender import kv_header

    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    kv = SequenceKV(torch.randn(2, 2, 2, 33, 64).to(torch.bfloat16))
    pool = StagingPool(StagingConfig(capacity_bytes=1 << 20))
    receiver = Receiver(pool, ReceiverConfig("m", shape, pin_memory=True))
    push_in_process(receiver, "chunks", "m", kv)  # gRPC's path: chunks
    raw = kv.data.view(torch.uint8).reshape(-1).numpy().tobytes()
    receiver.receive_whole(kv_header("whole", "m", kv), raw, zlib.crc32(raw))
    for rid in ("chunks", "whole"):
        landed = pool.take(rid).kv.data
        assert landed.is_pinned() and torch.equal(landed, kv.data)
    assert to_host(kv.data.cuda()).is_pinned()
    paged = PagedKV(shape, num_pages=8, page_size=16, device="cuda")
    paged.write([5, 2, 7], SequenceKV(to_host(kv.data.cuda())))
    assert torch.equal(paged.read([5, 2, 7], 33).data, kv.data)


_IPC_RECEIVER = """
import sys, torch
from baton.engine.kv import KVShape
from baton.kvtransfer import Receiver, ReceiverConfig, StagingConfig, StagingPool
from baton.kvtransfer.shm import ShmKVServer
pool = StagingPool(StagingConfig(capacity_bytes=1 << 30))
shape = KVShape(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
receiver = Receiver(pool, ReceiverConfig("m", shape, pin_memory=torch.cuda.is_available()))
with ShmKVServer(receiver, int(sys.argv[1])):
    print("ready", flush=True)
    for rid in sys.stdin.read().split():
        staged = pool.take(rid).kv.data
        want = torch.randn(4, 2, 8, 3000, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        print(rid, staged.is_pinned() == torch.cuda.is_available() and torch.equal(staged, want), flush=True)
"""


@pytest.mark.parametrize("receiver_sees_the_gpu", [True, False])
def test_kv_in_cuda_memory_reaches_a_decode_process_on_this_gpu_by_handle(receiver_sees_the_gpu):
    """A CUDA IPC push (kvtransfer.cuda_ipc) to another process: the receiver checks the digest on
    the device and stages the KV's exact bits in pinned memory; one that cannot see the GPU gets
    the bytes through shared memory. Either way no copy stays behind on the sender's GPU."""
    import os
    import subprocess
    import sys

    from baton.engine.kv import SequenceKV
    from baton.kvtransfer.push import KVPusher
    from baton.launch.up import free_port

    port = free_port()
    env = {**os.environ, **({} if receiver_sees_the_gpu else {"CUDA_VISIBLE_DEVICES": ""})}
    receiver = subprocess.Popen([sys.executable, "-c", _IPC_RECEIVER, str(port)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert receiver.stdout.readline().strip() == "ready"
        kv = torch.randn(4, 2, 8, 3000, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        pusher = KVPusher()
        went = [pusher.push(f"127.0.0.1:{port}", lambda: None, rid, "m", SequenceKV(kv), timeout_s=60)
                for rid in ("r1", "r2")]
        assert went == ["cuda_ipc" if receiver_sees_the_gpu else "shm"] * 2
        out, _ = receiver.communicate("r1 r2\n", timeout=60)
        assert out.split() == ["r1", "True", "r2", "True"]
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() == before, "a pushed copy stayed on the sender's GPU"
    finally:
        receiver.kill()
        receiver.wait()


def test_kv_work_after_its_ready_event_does_not_wait_for_later_work_on_the_default_stream():
    """A prefill worker's sender threads copy a prompt's KV on a stream of their own, from the
    point the compute thread made it: not behind the next forward it launched since."""
    from baton.engine.kv import after, ready_event

    data = torch.randn(1 << 20, device="cuda")
    expected = data.cpu()
    ready = ready_event(data)
    torch.cuda._sleep(int(2e9))  # the compute thread's next forward, say: about a second of the GPU
    with after(ready, data.device):
        host = data.to("cpu")
    assert not torch.cuda.current_stream().query(), "the copy waited for the default stream's later work"
    torch.cuda.synchronize()
    assert torch.equal(host, expected)


def test_the_invariant_kernels_compiled_keep_a_rows_bits():
    """The bit tests of the batch-invariant path, compiled on the GPU (in the interpreter on CPU:
    test_triton_backend.py): a row's tokens beside other rows, chunked prefill = whole, and the KV
    decode wrote = the KV a prefill of the same tokens computes."""
    import json
    import os
    import subprocess
    import sys

    from test_triton_backend import INVARIANT_SCRIPT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", INVARIANT_SCRIPT], capture_output=True, text=True,
                          env={**env, "BATON_TEST_DEVICE": "cuda"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for weights in ("bf16", "fp8"):  # fp8: e4m3 codes on Hopper's fp8 tensor cores
        run = result[weights]
        assert run["layout"] == "triton" and run["invariant"]
        assert len(run["alone"]) == 3 and run["mixed"] == run["alone"], weights
        assert run["chunked"] and run["reprefilled"], weights
