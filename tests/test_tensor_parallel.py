"""Tensor parallelism inside a worker (engine.tensor_parallel, engine.shard), on this CPU over
gloo: a TP=2 runner, its ranks real processes, computes the same bits as TP=1 (logits, KV,
decode steps, KV written and read back through the ranks' pages), for fp32, bf16 with heads that
split unevenly, and quantized weights; a forward paused between layers for nested ones; a refused
input leaves the ranks in step. Each rank reads only its rows of the checkpoint."""
from __future__ import annotations

import pytest
import torch

from baton.config import ModelSettings
from baton.decode_worker.paged_rows import PagedRows
from baton.engine.cpu import kernels as cpu_kernels
from baton.engine.executors import load_runner
from baton.engine.kv import SequenceKV
from baton.engine.model import load_model
from baton.engine.shard import Shard
from baton.engine.tensor_parallel import SHM_BYTES_ENV

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="Baton's CPU kernels did not build here")
PROMPTS = [[1, 4093, 28, 253, 9, 331], list(range(200, 260)), [17, 42, 99]]
PAGE = 4


def forwards(runner, kv=None) -> dict[str, torch.Tensor]:
    """Everything a worker asks of a runner, its results stacked: a batch prefill, a prompt that
    continues a cached prefix, decode steps over pages, and the pages read back."""
    outs = runner.prefill_batch(PROMPTS)
    prefix = outs[1].kv.prefix(40)
    continued = runner.prefill(PROMPTS[1] + [7, 8, 9], prefix)
    rows = PagedRows(runner.loaded.kv_shape, num_pages=64, page_size=PAGE)
    if kv is not None:
        rows.kv = kv
    for out in outs:
        rows.add(out.kv)
    tokens, steps = [int(o.logits.argmax()) for o in outs], []
    for _ in range(6):
        steps.append(runner.decode(rows.kv, rows.step(), tokens))
        tokens = steps[-1].argmax(-1).tolist()
    return {"prefill": torch.stack([o.logits for o in outs]), "kv": torch.cat([o.kv.data for o in outs], dim=3),
            "continued": continued.logits, "continued_kv": continued.own.data, "decode": torch.stack(steps),
            "pages": torch.cat([rows.read(r).data for r in range(len(PROMPTS))], dim=3)}


@pytest.mark.parametrize("settings", [
    dict(name="tiny-random", dtype="float32"),
    dict(name="default", dtype="bfloat16"),  # 9 query and 3 KV heads: ranks hold 2 and 1 KV heads
    dict(name="tiny-random", dtype="bfloat16", quantization="int8"),
], ids=["tiny-fp32", "default-bf16", "tiny-bf16-int8"])
def test_tp2_computes_the_same_bits_as_tp1(settings):
    one = load_runner(ModelSettings(**settings))
    expected = forwards(one)
    two = load_runner(ModelSettings(**settings, tensor_parallel_size=2))
    try:
        shape = two.loaded.kv_shape
        assert shape == one.loaded.kv_shape  # the whole model's KV enters and leaves the worker
        got = forwards(two, two.paged_kv(shape, 64 * PAGE * shape.bytes_per_token(), PAGE))
        for key, want in expected.items():
            assert torch.equal(got[key], want), key
        # a refused input is refused on every rank, and they stay in step
        with pytest.raises(ValueError):
            two.prefill([])
        assert torch.equal(two.prefill(PROMPTS[0]).logits, expected["prefill"][0])
    finally:
        two.close()


def test_collectives_too_large_for_shared_memory_go_through_gloo_with_the_same_bits(monkeypatch):
    """Slots of 4 KiB: a decode step's gathers fit, a prefill's and the KV written into pages do not
    (nor do broadcasts carrying KV), and go through gloo."""
    shm_bytes = 4096
    monkeypatch.setenv(SHM_BYTES_ENV, str(shm_bytes))
    settings = dict(name="tiny-random", dtype="float32")
    expected = forwards(load_runner(ModelSettings(**settings)))
    two = load_runner(ModelSettings(**settings, tensor_parallel_size=2))
    try:
        assert two.group.shm is not None and two.group.shm.slot_bytes == shm_bytes
        shape = two.loaded.kv_shape
        got = forwards(two, two.paged_kv(shape, 64 * PAGE * shape.bytes_per_token(), PAGE))
        for key, want in expected.items():
            assert torch.equal(got[key], want), key
    finally:
        two.close()


def test_prompts_prefilled_in_chunks_send_the_ranks_only_their_new_tokens():
    """Each rank keeps its heads of a chunked prompt's KV so far, so a chunk's call carries its
    tokens and not that KV (it carried all of it before: O(n^2) bytes for an n-token prompt), and
    two prompts' chunks interleaved give the bits of TP=1's whole prefill."""
    import pickle

    from baton.engine.request import GenerationRequest
    from baton.prefill_worker.core import PrefillCore
    from baton.sampling import SamplingParams

    settings = dict(name="tiny-random", dtype="float32")
    prompts = [list(range(100, 400)), list(range(900, 1130))]
    one = load_runner(ModelSettings(**settings))
    want = [one.prefill(p) for p in prompts]
    two = load_runner(ModelSettings(**settings, tensor_parallel_size=2))
    try:
        sent, broadcast = [], two.group.broadcast
        two.group.broadcast = lambda obj=None: (sent.append(len(pickle.dumps(obj))), broadcast(obj))[1]
        core = PrefillCore(two, prefix_cache_bytes=0)
        chunked = [core.begin_chunks(GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=1)))
                   for i, p in enumerate(prompts)]
        done = [None, None]
        while None in done:
            for i, c in enumerate(chunked):
                if done[i] is None:
                    done[i] = core.advance(c, 64)
                    assert done[i] is not None or two.kept.holds(c.key, c.done)
        assert not two.kept.prompts  # each prompt's last chunk let its KV go
        for got, expected in zip(done, want):
            assert torch.equal(got.whole_kv().data, expected.kv.data)
            assert got.first_token == int(expected.logits.argmax())
        assert max(sent) < 64 * two.loaded.kv_shape.bytes_per_token()  # not even one chunk's KV
        # a prompt that ends before its last chunk (cancelled) is forgotten on every rank
        ended = core.begin_chunks(GenerationRequest("r2", prompts[0], SamplingParams(max_tokens=1)))
        assert core.advance(ended, 64) is None and two.kept.holds(ended.key, 64)
        # what rank 0 keeps counts in the worker's KV held (prefill.kv_memory_bytes): its heads,
        # half the prompt's whole KV at TP 2, sized for the whole prompt
        assert core.kept_chunk_bytes == ended.held_bytes // 2 > 0
        core.end_chunks(ended)
        assert not two.kept.prompts and core.kept_chunk_bytes == 0
        assert PrefillCore(one, prefix_cache_bytes=0).kept_chunk_bytes == 0
        assert torch.equal(two.prefill(prompts[1]).logits, want[1].logits)  # the ranks are in step
    finally:
        two.close()


def test_a_forward_paused_between_layers_runs_nested_forwards_on_every_rank():
    """A prefill worker runs urgent prompts between two layers of a long forward: on a TP worker
    the other ranks run them there too, and neither forward changes."""
    settings = dict(name="tiny-random", dtype="float32")
    one = load_runner(ModelSettings(**settings))
    long_want, short_want = one.prefill(PROMPTS[1]).logits, one.prefill(PROMPTS[2]).logits
    two = load_runner(ModelSettings(**settings, tensor_parallel_size=2))
    try:
        nested, running = [], []

        def urgent():  # as the prefill loop's: once, and not from within the nested forward
            if not nested and not running:
                running.append(True)
                nested.append(two.prefill(PROMPTS[2]).logits)

        two.between_layers = urgent
        long_got = two.prefill(PROMPTS[1]).logits
        two.between_layers = None
        assert nested and torch.equal(nested[0], short_want)
        assert torch.equal(long_got, long_want)
        assert torch.equal(two.prefill(PROMPTS[0]).logits, one.prefill(PROMPTS[0]).logits)
    finally:
        two.close()


def test_each_rank_reads_only_its_rows():
    whole = load_model("tiny-random", dtype="float32", module=False)
    parts = [load_model("tiny-random", dtype="float32", module=False, rank=(r, 2)) for r in range(2)]
    shards = Shard.all(whole.config, 2)
    for name, weight in whole.tensors.items():
        span = shards[0].rows(name)
        if span is None:
            assert all(torch.equal(p.tensors[name], weight) for p in parts), name
            continue
        joined = torch.cat([p.tensors[name] for p in parts])
        assert torch.equal(joined, weight), name
    assert sum(p.weight_bytes for p in parts) < 1.1 * whole.weight_bytes
    assert parts[1].kv_shape == whole.kv_shape and str(parts[1].fingerprint) == str(whole.fingerprint)


def test_a_split_the_model_cannot_take_is_refused():
    with pytest.raises(ValueError, match="at least 4 KV heads"):
        load_model("tiny-random", dtype="float32", module=False, rank=(0, 4))  # 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelSettings(tensor_parallel_size=3).validate()
    with pytest.raises(ValueError, match="Baton's executor"):
        ModelSettings(tensor_parallel_size=2, executor="transformers").validate()


def test_a_worker_whose_rank_0_fails_to_load_leaves_no_rank_behind(monkeypatch):
    """Rank 0 starts the other ranks, then loads its own part: if that fails, the ranks it started
    (waiting at its store for up to collectives.TIMEOUT) end too, rather than linger and knock at
    a port that something else may hold next."""
    import subprocess

    from baton.engine import tensor_parallel

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def fails(*args, **kwargs):
        raise RuntimeError("rank 0 could not load its part")

    monkeypatch.setattr(tensor_parallel.subprocess, "Popen", popen)
    monkeypatch.setattr(tensor_parallel, "_load_rank", fails)
    with pytest.raises(RuntimeError, match="could not load its part"):
        tensor_parallel.start(ModelSettings(name="tiny-random", dtype="float32", tensor_parallel_size=2))
    assert len(started) == 1 and started[0].poll() is not None
