"""Prefill over cached prefixes: a group sharing one prefix runs as one batch, and gives what
prefilling each whole prompt alone gives."""
import time

import pytest
import torch

from baton.engine.request import GenerationRequest
from baton.engine.executors import make_runner
from baton.sampling import SamplingParams
from baton.prefill_worker.core import PrefillCore

PREFIX = list(range(200, 240))  # 2 full blocks of 16 and a partial one of 8
SUFFIXES = [[7, 8, 9], list(range(500, 521)), [11], list(range(600, 606))]


def test_prefill_batch_over_a_shared_prefix_matches_each_whole_prompt(tiny_model):
    runner = make_runner(tiny_model)
    prefix_kv = runner.prefill(PREFIX).kv  # causal: the same KV as the prompts' first tokens
    prompts = [PREFIX + s for s in SUFFIXES]
    before = runner.prompt_tokens_forwarded
    batched = runner.prefill_batch(prompts, prefix_kv)
    assert runner.prompt_tokens_forwarded - before == sum(map(len, SUFFIXES))  # the prefix is not recomputed
    for prompt, out in zip(prompts, batched):
        alone = runner.prefill(prompt)
        assert out.kv.num_tokens == len(prompt)
        assert out.computed_tokens == len(prompt) - len(PREFIX)
        torch.testing.assert_close(out.kv.data, alone.kv.data, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.logits, alone.logits, rtol=1e-4, atol=1e-4)


def test_a_pinned_group_prefills_in_one_forward_with_the_first_tokens_of_a_cold_prefill(tiny_model):
    cold = PrefillCore(make_runner(tiny_model), prefix_cache_bytes=0)
    prompts = [PREFIX + s for s in SUFFIXES]
    params = SamplingParams(max_tokens=4)
    cold_done = cold.prefill([GenerationRequest(f"c{i}", p, params) for i, p in enumerate(prompts)])
    expected = [p.first_token for p in cold_done]

    core = PrefillCore(make_runner(tiny_model))
    held, computed = core.pin("group", PREFIX)
    assert (held, computed) == (len(PREFIX), len(PREFIX))
    calls = []
    original = core.runner.prefill_batch
    core.runner.prefill_batch = lambda batch, prefix=None: calls.append(len(batch)) or original(batch, prefix)
    before = core.runner.prompt_tokens_forwarded
    got = core.prefill([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert calls == [len(prompts)]  # one forward for the whole group
    assert core.runner.prompt_tokens_forwarded - before == sum(map(len, SUFFIXES))
    assert [p.cached_tokens for p in got] == [len(PREFIX)] * len(prompts)
    assert [p.first_token for p in got] == expected
    # The members reference one prefix tensor and hold only their own tokens' KV: none copies it
    assert len({p.shared_prefix.data.data_ptr() for p in got}) == 1
    assert [p.kv.num_tokens for p in got] == list(map(len, SUFFIXES))
    for p, c, prompt in zip(got, cold_done, prompts):
        assert p.whole_kv().num_tokens == len(prompt)
        torch.testing.assert_close(p.whole_kv().data, c.kv.data, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(p.whole_kv(len(PREFIX)).data, p.kv.data, rtol=0, atol=0)
    assert core.unpin("group")


def test_prompts_with_different_cached_prefixes_run_as_separate_batches(tiny_model):
    core = PrefillCore(make_runner(tiny_model))
    other = list(range(900, 932))
    core.pin("a", PREFIX)
    core.pin("b", other)
    calls = []
    original = core.runner.prefill_batch
    core.runner.prefill_batch = lambda batch, prefix=None: calls.append(
        (len(batch), prefix.num_tokens if prefix is not None else 0)) or original(batch, prefix)
    prompts = [PREFIX + [1, 2], other + [3], PREFIX + [4], [5, 6, 7]]
    requests = [GenerationRequest(str(i), p, SamplingParams()) for i, p in enumerate(prompts)]
    got = core.prefill(requests)
    assert sorted(calls) == sorted([(2, len(PREFIX)), (1, len(other)), (1, 0)])
    assert [p.cached_tokens for p in got] == [len(PREFIX), len(other), len(PREFIX), 0]


def test_pins_are_bounded_in_count_charged_to_the_cache_budget_and_expire(tiny_model):
    """1,000 pins once added 600 MB to a worker: their partial blocks lived outside every budget."""
    runner = make_runner(tiny_model)
    block_bytes = tiny_model.kv_shape.bytes_per_token() * 16
    core = PrefillCore(runner, prefix_cache_bytes=8 * block_bytes, max_pins=6, pin_ttl_s=60)
    prefixes = [[1000 + 100 * g + t for t in range(20)] for g in range(8)]  # one full block and 4 tokens each
    held = [core.pin(f"g{g}", prefixes[g])[0] for g in range(4)]
    assert held == [20] * 4  # each: its full block locked, its partial block reserved
    assert (core.cache.num_blocks, core.cache.reserved_blocks) == (4, 4)
    assert core.cache.used_bytes <= core.cache.capacity_bytes
    # The budget is now all locked or reserved: a fifth pin keeps nothing outside it.
    assert core.pin("g4", prefixes[4])[0] == 0
    assert core.cache.used_bytes <= core.cache.capacity_bytes
    core.pin("g5", prefixes[5])
    try:
        core.pin("g6", prefixes[6])
        raise AssertionError("a seventh pin went past max_pins=6")
    except OverflowError as exc:
        assert "prefill.max_pins" in str(exc)
    assert core.unpin("g0") and core.cache.reserved_blocks == 3
    assert core.pin("g6", prefixes[6])[0] > 0  # room again
    # A router that died never unpins: the pins go at their time, with their locks and room.
    assert sorted(core.expire_pins(now=time.monotonic() + 61)) == ["g1", "g2", "g3", "g4", "g5", "g6"]
    assert not core.pins and not core.partials and core.cache.reserved_blocks == 0
    assert core.cache.num_evictable_blocks == core.cache.num_blocks  # nothing locked any more


@pytest.mark.parametrize("executor", ["baton", "transformers"])
def test_chunked_prefill_gives_the_kv_and_first_token_of_one_forward(tiny_model, executor):
    """Chunks of any size, from scratch or from a cached prefix: the same KV (to float rounding,
    fp32: 1e-5) and the same first token as prefilling the whole prompt in one forward."""
    prompt = [(31 * i) % 900 + 5 for i in range(150)]
    params = SamplingParams(max_tokens=4, logprobs=2)
    whole = PrefillCore(make_runner(tiny_model, executor), prefix_cache_bytes=0).prefill(
        [GenerationRequest("whole", prompt, params)])[0]
    for budget, cached in ((40, 0), (7, 0), (1000, 0), (33, 48)):
        core = PrefillCore(make_runner(tiny_model, executor))
        if cached:  # another prompt leaves the first 48 tokens' blocks in the cache
            core.prefill([GenerationRequest("warm", prompt[:cached] + [1, 2], params)])
        chunked = core.begin_chunks(GenerationRequest(f"c{budget}", prompt, params))
        assert chunked.done == cached
        steps = []
        while (done := core.advance(chunked, budget)) is None:
            steps.append(chunked.done)
        expected_chunks = -(-(len(prompt) - cached) // budget)
        assert chunked.chunks == expected_chunks and len(steps) == expected_chunks - 1  # progress every chunk
        assert done.whole_kv().num_tokens == len(prompt) and done.cached_tokens == cached
        torch.testing.assert_close(done.whole_kv().data, whole.whole_kv().data, rtol=1e-4, atol=1e-5)
        assert done.first_token == whole.first_token
        assert abs(done.first_logprob.logprob - whole.first_logprob.logprob) < 1e-4
        assert core.cache.match(core.hasher.hash_prompt(prompt)) == len(prompt) // core.block_size  # cached after


def test_each_chunk_continues_the_kv_so_far_where_it_lies(tiny_model, monkeypatch):
    """No chunk copies the KV before it: each continues a view of the one buffer the prompt's KV
    is written into (joining it anew each chunk moved O(n^2) bytes for an n-token prompt)."""
    runner = make_runner(tiny_model)
    core = PrefillCore(runner, prefix_cache_bytes=0)
    prompt = [(7 * i) % 500 + 5 for i in range(100)]
    chunked = core.begin_chunks(GenerationRequest("long", prompt, SamplingParams(max_tokens=1)))
    seen, prefill_batch = [], runner.prefill_batch

    def recording(prompts, prefix=None):
        seen.append(None if prefix is None else prefix.data.data_ptr())
        return prefill_batch(prompts, prefix)

    monkeypatch.setattr(runner, "prefill_batch", recording)
    while (done := core.advance(chunked, 30)) is None:
        pass
    assert seen == [None] + [chunked.buffer.data_ptr()] * 3
    assert done.kv.data.data_ptr() == chunked.buffer.data_ptr() and done.shared_prefix is None
    assert chunked.held_bytes == len(prompt) * tiny_model.kv_shape.bytes_per_token()


def test_a_chunked_prompt_s_blocks_are_cached_chunk_by_chunk(tiny_model):
    """Another prompt sharing its first part need not wait for the last chunk: it reuses what the
    chunks so far computed, and its KV is what a forward alone gives."""
    core = PrefillCore(make_runner(tiny_model))
    prompt = [(13 * i) % 700 + 5 for i in range(200)]
    params = SamplingParams(max_tokens=4)
    chunked = core.begin_chunks(GenerationRequest("long", prompt, params))
    assert core.advance(chunked, 70) is None  # 70 tokens: 4 whole blocks
    hashes = core.hasher.hash_prompt(prompt)
    assert core.cache.match(hashes) == 4
    other = prompt[:80] + [9, 9, 9]
    shared = core.prefill([GenerationRequest("other", other, params)])[0]
    alone = PrefillCore(make_runner(tiny_model), prefix_cache_bytes=0).prefill(
        [GenerationRequest("alone", other, params)])[0]
    assert shared.cached_tokens == 64
    torch.testing.assert_close(shared.whole_kv().data, alone.whole_kv().data, rtol=1e-4, atol=1e-5)
    while core.advance(chunked, 70) is None:
        pass
    assert core.cache.match(hashes) == len(prompt) // core.block_size


def test_chunk_budget_must_hold_a_token(tiny_model):
    core = PrefillCore(make_runner(tiny_model))
    chunked = core.begin_chunks(GenerationRequest("r", [5, 6, 7], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="at least one token"):
        core.advance(chunked, 0)


def test_each_prompt_of_a_batch_is_handed_on_as_soon_as_its_first_token_is_sampled(tiny_model):
    """Its KV can leave while the batch's later prompts are still being cached and sampled."""
    core = PrefillCore(make_runner(tiny_model))
    requests = [GenerationRequest(f"r{i}", PREFIX[:10 + i] + s, SamplingParams(max_tokens=1))
                for i, s in enumerate(SUFFIXES)]
    seen = []

    def finished(i, done):
        later_sampled = [r.request_id for r in requests[i + 1:] if "prefill_end" in r.trace.marks]
        seen.append((i, done.request.request_id, later_sampled))

    results = core.prefill(requests, on_finished=finished)
    assert seen == [(i, f"r{i}", []) for i in range(len(requests))]
    assert [r.request.request_id for r in results] == [r.request_id for r in requests]
