"""Batch invariance in bf16 and fp16: a request's tokens depend on its prompt, its sampling
parameters and the model alone. Each target request is run alone first; then beside 1-15 random
other rows arriving at random steps, with its prefix cached or computed in chunks, parked to the
host and resumed, its KV dropped and computed again, handed off to another core, or prefilled
again after a failover, it must produce the same tokens (and prefill must produce the same KV bits
as the decode steps that wrote them). fp32 keeps its stronger contract, equality with transformers'
`generate` (test_engine_exact.py)."""
from __future__ import annotations

import random

import pytest
import torch

from baton.decode_worker.core import DecodeConfig, DecodeCore
from baton.engine.cpu import kernels as cpu_kernels
from baton.engine.executors import make_runner
from baton.engine.model import load_model
from baton.engine.request import GenerationRequest
from baton.kvtransfer.staging import StagingConfig, StagingPool
from baton.launch.local import LocalEngine
from baton.prefill_worker.core import PrefillCore
from baton.sampling import SamplingParams

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, top_p=0.9, seed=11)


@pytest.fixture(scope="module", params=["bfloat16", "float16", "bfloat16+int8"])
def model(request):
    """bf16 and fp16 weights and KV; and Q8_0 weight blocks (engine.quantized) with bf16 KV."""
    dtype, _, quantization = request.param.partition("+")
    if not cpu_kernels.stores(getattr(torch, dtype)):
        pytest.skip(f"Baton's CPU kernels do not read {dtype} here (no C compiler, or no _Float16)")
    return load_model("tiny-random", dtype=dtype, module=not quantization, quantization=quantization or "none")


def targets(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50, 40000) for _ in range(n)] for n in (1, 9, 40, 130)]


def alone(model, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return LocalEngine(model, DecodeConfig(max_rows=1)).generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("rows", [2, 5, 16])
def test_tokens_do_not_depend_on_the_rows_beside_them(model, rows):
    """Targets (greedy and seeded sampling) among random rows of random lengths, arriving at
    random steps into a batch of `rows` rows."""
    wanted = {i: (prompt, GREEDY if i % 2 else SAMPLED) for i, prompt in enumerate(targets())}
    expected = {i: alone(model, prompt, params) for i, (prompt, params) in wanted.items()}
    rng = random.Random(rows)
    others = [([rng.randrange(50, 40000) for _ in range(rng.randint(1, 200))],
               SamplingParams(max_tokens=rng.randint(1, 30), temperature=rng.choice([0.0, 1.0]),
                              seed=rng.randrange(99)))
              for _ in range(2 * rows)]
    engine = LocalEngine(model, DecodeConfig(max_rows=rows))
    pending = [(f"target-{i}", p, sp) for i, (p, sp) in wanted.items()] + \
              [(f"other-{i}", p, sp) for i, (p, sp) in enumerate(others)]
    rng.shuffle(pending)
    finals = {}
    while pending or engine.has_work():
        if pending and rng.random() < 0.5:
            rid, prompt, params = pending.pop()
            engine.submit(prompt, params, request_id=rid)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    for i in wanted:
        assert finals[f"target-{i}"] == expected[i], f"target {i} changed beside other rows"
    assert engine.decode.scheduler.kv_usage().used == 0


def test_cached_and_chunked_prefixes_change_nothing(model):
    """A prompt whose prefix came from the cache, or whose prefill ran in chunks of any size, has
    the KV bits and first logits of one whole prefill, and the same tokens."""
    runner = make_runner(model)
    prompt = targets()[3]
    whole = runner.prefill(prompt)
    for chunk in (1, 7, 64, 129):
        kv = None
        for end in range(chunk, len(prompt) + chunk, chunk):
            out = runner.prefill_batch([prompt[:min(end, len(prompt))]], kv)[0]
            kv = out.kv
        assert torch.equal(out.logits, whole.logits) and torch.equal(out.kv.data, whole.kv.data), chunk
    # the same through the prefill core: chunked (Sarathi) and from the prefix cache
    prefill = PrefillCore(runner, prefix_cache_bytes=64 << 20)
    chunked = prefill.begin_chunks(GenerationRequest("chunked", prompt, GREEDY))
    done = None
    while done is None:
        done = prefill.advance(chunked, 17)
    prefill.prefill([GenerationRequest("warm", prompt[:100] + [7], GREEDY)])
    cached = prefill.prefill([GenerationRequest("cached", prompt, GREEDY)])[0]
    assert cached.request.trace.cached_tokens >= 64
    for got in (done, cached):
        assert torch.equal(got.whole_kv().data, whole.kv.data)
    expected = alone(model, prompt)
    engine = LocalEngine(model, DecodeConfig(max_rows=4), prefix_cache_bytes=64 << 20)
    engine.generate([prompt[:90] + [5, 6]], GREEDY)  # its first blocks are cached now
    out = engine.generate([prompt], GREEDY)[0]
    assert out.trace.cached_tokens >= 64 and out.token_ids == expected


def test_decode_writes_the_kv_prefill_would_compute(model):
    """The KV a decode step stores for a generated token is the KV a prefill of the prompt and the
    tokens so far computes: a failover's re-prefill or a dropped row's recompute continues from
    the very same bits."""
    runner = make_runner(model)
    prompt = targets()[2]
    core = DecodeCore(runner, DecodeConfig(max_rows=3, page_size=8))
    prefill = PrefillCore(runner, prefix_cache_bytes=0)
    for rid, p in (("a", prompt), ("b", targets()[1]), ("c", targets()[3])):
        core.add(prefill.prefill([GenerationRequest(rid, p, GREEDY)])[0])
    for _ in range(9):
        core.step()
    ev = core.evict("a")
    # (an evicted row's KV waits in host memory, wherever the runner computes)
    assert torch.equal(ev.kv.data.cpu(), runner.prefill(prompt + ev.token_ids[:-1]).kv.data.cpu())
    core.scheduler.take_moving("a")
    while core.has_work():
        core.step()


def test_parked_recomputed_and_handed_off_rows_go_on_unchanged(model):
    """Rows outgrow the pages: some are parked in the host pool and resumed; with no host room
    their KV is dropped and recomputed. One row is handed off to another core mid-generation.
    Every request's tokens equal its tokens alone."""
    from test_migration import resumed  # here: it pulls in the whole server stack

    rng = random.Random(29)
    prompts = [[rng.randrange(50, 40000) for _ in range(rng.randint(10, 40))] for _ in range(8)]
    expected = [alone(model, p) for p in prompts]
    per_token = model.kv_shape.bytes_per_token()
    for host_tokens, counter in ((4000, "resumed_total"), (1, "recomputed_total")):
        engine = LocalEngine(model, DecodeConfig(max_rows=8, kv_budget_bytes=24 * 16 * per_token, page_size=16,
                                                 growth_reserve_tokens=8))
        pool = StagingPool(StagingConfig(capacity_bytes=host_tokens * per_token))
        engine.decode.hold_parked, engine.decode.release_parked = pool.hold, pool.release
        assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected
        moved = engine.decode.scheduler if counter == "resumed_total" else engine.decode
        assert getattr(moved, counter) >= 1, counter

    runner = make_runner(model)
    source, target = DecodeCore(runner, DecodeConfig(max_rows=4)), DecodeCore(runner, DecodeConfig(max_rows=2))
    prefill = PrefillCore(runner, prefix_cache_bytes=0)
    for i, p in enumerate(prompts[:4]):
        source.add(prefill.prefill([GenerationRequest(f"r{i}", p, GREEDY)])[0])
    for _ in range(6):
        source.step()
    ev = source.evict("r2")
    source.scheduler.take_moving("r2")
    first = target.add(resumed(ev, GREEDY))
    tokens = {}
    for core in (source, target):
        while core.has_work():
            for out in core.step():
                tokens[out.request_id] = out.token_ids
    assert first.token_ids == ev.token_ids[-1:] and ev.token_ids + tokens["r2"][1:] == expected[2]
    for i in (0, 1, 3):
        assert tokens[f"r{i}"] == expected[i]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_turn_prefilled_on_the_decode_worker_answers_as_it_would_alone(model, params):
    """Conditional disaggregation: a conversation's next turn prefilled on the decode worker, on
    top of the previous turn's retained pages (and the partly filled last one, copied), in chunks
    between the steps of other rows, gives the tokens it gives alone."""
    rng = random.Random(4)
    first = targets()[2]
    runner = make_runner(model)
    decode = DecodeCore(runner, DecodeConfig(max_rows=4, page_size=8, share_min_tokens=8, local_chunk_tokens=8))
    prefill = PrefillCore(runner, prefix_cache_bytes=0)
    finals = {}

    def drain() -> None:
        while decode.has_work():
            for out in decode.advance_local() + decode.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids

    turn = GenerationRequest("turn-1", first, params)
    decode.register(turn)
    decode.add(prefill.prefill([turn])[0])
    drain()
    second = first + finals["turn-1"] + [rng.randrange(50, 40000) for _ in range(27)]
    for n in range(3):  # rows decoding beside it
        other = GenerationRequest(f"other-{n}", [rng.randrange(50, 40000) for _ in range(rng.randint(5, 90))],
                                  SamplingParams(max_tokens=rng.randint(5, 30), ignore_eos=True))
        decode.register(other)
        decode.add(prefill.prefill([other])[0])
    decode.step()
    turn = GenerationRequest("turn-2", second, params)
    decode.register(turn, local=True)
    decode.compute("turn-2")
    drain()
    assert turn.trace.cached_tokens == len(first) + MAX_TOKENS - 1
    assert finals["turn-2"] == alone(model, second, params)
