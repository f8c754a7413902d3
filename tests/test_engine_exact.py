"""The BATON contract: greedy tokens through the re-batching engine equal transformers' generate.

Prompts of mixed lengths (a few tokens to over 500) arrive at random iterations into a batch
with fewer rows than prompts; the run must grow the batch KV on the left, release leading
columns, reuse rows many times and let the batch empty and refill.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from baton.launch.local import LocalEngine
from baton.decode_worker.core import DecodeConfig, DecodeCore
from baton.sampling import SamplingParams

WORDS = ("river stone lantern quiet harbor engine violet market thunder paper garden orbit copper "
         "silent meadow signal winter candle forest bridge planet whisper mirror shadow").split()
TOPICS = ["Hi", "What is 2+2?", "Name three colors.", "Why is the sky blue?", "Write a haiku about rain.",
          "Explain gravity to a child.", "List two fruits.", "What is the capital of Italy?"]


def mixed_prompts(model, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 3 == 0:
            prompts.append(model.encode_chat([{"role": "user", "content": rng.choice(TOPICS)}]))
        else:
            words = (2 if i == 1 else rng.randint(1, 40)) if i % 3 == 1 else rng.randint(420, 520)
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            prompts.append(model.encode_text(text))
    rng.shuffle(prompts)
    # A long prompt right after short ones makes the batch KV grow on the left.
    short = min(range(count), key=lambda i: len(prompts[i]))
    prompts.insert(0, prompts.pop(short))
    longest = max(range(count), key=lambda i: len(prompts[i]))
    prompts.insert(2, prompts.pop(longest))
    return prompts


def run_with_random_arrivals(engine: LocalEngine, prompts, params, seed: int) -> dict[int, list[int]]:
    """Submit prompts at random iterations, with one pause that lets the batch empty."""
    rng = random.Random(seed)
    pending = list(enumerate(prompts))
    ids: dict[str, int] = {}
    finals: dict[int, list[int]] = {}
    empties = 0
    half = len(prompts) // 2
    while pending or engine.has_work():
        hold = empties == 0 and len(ids) >= half  # the second half waits until the batch is empty
        if pending and not (hold and engine.has_work()) and (not engine.has_work() or rng.random() < 0.3):
            for _ in range(min(len(pending), rng.randint(1, 3))):
                index, prompt = pending.pop(0)
                ids[engine.submit(prompt, params)] = index
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out.token_ids
        if not engine.has_work() and pending:
            empties += 1
    assert empties >= 1, "the batch never emptied and refilled"
    return finals


def check_engine_matches_generate(model, reference, count: int, max_tokens: int, max_rows: int,
                                  executor: str = "auto"):
    prompts = mixed_prompts(model, count, seed=7)
    assert min(map(len, prompts)) <= 8 and max(map(len, prompts)) > 500
    engine = LocalEngine(model, DecodeConfig(max_rows=max_rows), executor=executor)
    finals = run_with_random_arrivals(engine, prompts, SamplingParams(max_tokens=max_tokens), seed=11)
    mismatches = []
    for index, prompt in enumerate(prompts):
        expected = reference.greedy(prompt, max_tokens)
        if finals[index] != expected:
            mismatches.append((index, len(prompt), finals[index], expected))
    assert not mismatches, f"{len(mismatches)} prompts differ from generate: {mismatches[:3]}"

    runner, scheduler = engine.runner, engine.decode.scheduler
    # One token per occupied row per step: every generated token but the prefill's first was fed once.
    assert runner.decode_tokens_forwarded == sum(len(t) - 1 for t in finals.values())
    assert scheduler.num_running == 0 and scheduler.kv_usage().used == 0, "pages were not all given back"


@pytest.mark.parametrize("executor", ["baton", "transformers"])
def test_tiny_model_matches_generate(tiny_model, tiny_reference, executor):
    check_engine_matches_generate(tiny_model, tiny_reference, count=32, max_tokens=24, max_rows=4,
                                  executor=executor)


@pytest.mark.slow
def test_default_model_matches_generate(default_model, default_reference):
    check_engine_matches_generate(default_model, default_reference, count=16, max_tokens=20, max_rows=5)


def test_prefix_reuse_is_token_identical(tiny_model, tiny_reference):
    """Prompts sharing long prefixes, served with the prefix cache on, match generate exactly."""
    rng = random.Random(3)
    shared = [rng.randrange(50, 40000) for _ in range(70)]
    prompts = [shared + [rng.randrange(50, 40000) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    prompts.append(shared[:48])  # whole prompt cached but its last token: computed anyway
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=3), prefix_cache_bytes=64 << 20)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == tiny_reference.greedy(prompt, 12)
    # The first max_rows prompts prefill together, before anything is cached; the rest reuse 4 blocks.
    assert engine.prefill.cached_tokens_total >= 5 * 64


def test_pinned_group_prefix_is_reused_to_the_token(tiny_model, tiny_reference):
    """A pinned prefix (BatchLLM group) covers its partial last block too; outputs stay exact."""
    rng = random.Random(5)
    prefix = [rng.randrange(50, 40000) for _ in range(70)]  # 4 full blocks + 6 tokens
    prompts = [prefix + [rng.randrange(50, 40000) for _ in range(rng.randint(2, 9))] for _ in range(5)]
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=2), prefix_cache_bytes=64 << 20)
    assert engine.prefill.pin("group-1", prefix) == (70, 70)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.trace.cached_tokens for o in outs] == [70] * 5
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == tiny_reference.greedy(prompt, 10)
    assert engine.prefill.unpin("group-1") and not engine.prefill.partials


def run_steps(engine: LocalEngine, steps: int, finals: dict) -> None:
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out


def test_preempted_and_resumed_requests_are_token_identical(tiny_model, tiny_reference):
    """A higher-priority arrival parks the lowest-priority row on the host; it resumes exactly."""
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=2))
    low = [list(range(200, 230)), list(range(300, 311))]
    finals: dict = {}
    ids = {engine.submit(p, SamplingParams(max_tokens=30, ignore_eos=True, priority=0)): p for p in low}
    run_steps(engine, 6, finals)
    urgent = list(range(500, 520))
    ids[engine.submit(urgent, SamplingParams(max_tokens=8, ignore_eos=True, priority=5))] = urgent
    run_steps(engine, 2, finals)
    assert engine.decode.scheduler.parked_total == 1 and engine.decode.parked_bytes() > 0
    # What a load report (another thread) sees while the loop parks a row: PARKED, its KV not out yet.
    parked = next(s for s in engine.decode.scheduler.staged if s.status.name == "PARKED")
    kv, parked.engine.kv = parked.engine.kv, None
    assert engine.decode.parked_bytes() == 0
    parked.engine.kv = kv
    while engine.has_work():
        run_steps(engine, 1, finals)
    for rid, prompt in ids.items():
        max_tokens = 8 if prompt is urgent else 30
        assert finals[rid].token_ids == tiny_reference.greedy(prompt, max_tokens)
    assert engine.decode.parked_bytes() == 0 and engine.decode.scheduler.kv_usage().used == 0


def test_a_priority_storm_parks_rows_only_while_the_host_pool_has_room(tiny_model, tiny_reference):
    """Parked rows live in the worker's one host pool (kvtransfer.staging): its bound holds under
    wave after wave of higher-priority arrivals, rows the host has no room for keep their rows
    (a priority park never drops KV), and every request is exact."""
    from baton.kvtransfer.staging import StagingConfig, StagingPool

    per_token = tiny_model.kv_shape.bytes_per_token()
    pool = StagingPool(StagingConfig(capacity_bytes=45 * per_token))  # one parked row of ~40 tokens
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=2))
    engine.decode.hold_parked, engine.decode.release_parked = pool.hold, pool.release
    rng = random.Random(11)
    finals: dict = {}
    ids = {}
    for wave in range(4):  # each wave outranks everything before it
        for _ in range(2):
            prompt = [rng.randrange(50, 40000) for _ in range(rng.randint(20, 30))]
            ids[engine.submit(prompt, SamplingParams(max_tokens=12, ignore_eos=True, priority=wave))] = prompt
        for _ in range(3):
            run_steps(engine, 1, finals)
            used = pool.stats().used_bytes
            assert used == engine.decode.parked_bytes() <= pool.config.capacity_bytes
    while engine.has_work():
        run_steps(engine, 1, finals)
    scheduler = engine.decode.scheduler
    assert scheduler.parked_total >= 1 and scheduler.park_refused_total >= 1
    for rid, prompt in ids.items():
        assert finals[rid].token_ids == tiny_reference.greedy(prompt, 12)
    assert pool.stats().used_bytes == 0 and engine.decode.parked_bytes() == 0


def test_kv_high_watermark_parks_rows_and_low_watermark_readmits(tiny_model, tiny_reference):
    per_token = tiny_model.kv_shape.bytes_per_token()
    # pages of 16 tokens: at most 11 in use before parking, 7 to admit; rows reach 5 pages each
    config = DecodeConfig(max_rows=4, high_watermark_bytes=3 * 60 * per_token, low_watermark_bytes=2 * 60 * per_token,
                          growth_reserve_tokens=0, page_size=16)
    engine = LocalEngine(tiny_model, config)
    prompts = [list(range(100 + 50 * i, 130 + 50 * i)) for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert engine.decode.scheduler.parked_total > 0, "the high watermark never parked a row"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == tiny_reference.greedy(prompt, 40)


def test_rows_sharing_a_prefix_decode_exactly_as_without_sharing(tiny_model, tiny_reference):
    """Eight rows continuing one 300-token document hold its KV once; tokens equal generate's with
    and without sharing, through parking (a higher-priority arrival) and rows leaving and joining."""
    rng = random.Random(17)
    document = [rng.randrange(50, 40000) for _ in range(300)]
    prompts = [document + [rng.randrange(50, 40000) for _ in range(rng.randint(3, 20))] for _ in range(10)]
    urgent = [rng.randrange(50, 40000) for _ in range(40)]

    def serve(share_min_tokens: int):
        engine = LocalEngine(tiny_model, DecodeConfig(max_rows=8, share_min_tokens=share_min_tokens))
        finals, peak = {}, 0
        ids = {engine.submit(p, SamplingParams(max_tokens=16 + i, ignore_eos=True)): i for i, p in enumerate(prompts)}
        for step in itertools.count():
            if step == 6:
                ids[engine.submit(urgent, SamplingParams(max_tokens=6, ignore_eos=True, priority=9))] = -1
            for out in engine.step():
                if out.finished:
                    finals[ids[out.request_id]] = out.token_ids
            peak = max(peak, engine.decode.scheduler.kv_usage().used)
            if not engine.has_work():
                return engine, finals, peak

    shared_engine, shared, shared_peak = serve(share_min_tokens=64)
    plain_engine, plain, plain_peak = serve(share_min_tokens=0)
    assert shared == plain
    for index, prompt in enumerate(prompts):
        assert shared[index] == tiny_reference.greedy(prompt, 16 + index)
    assert shared[-1] == tiny_reference.greedy(urgent, 6)
    assert shared_engine.decode.scheduler.parked_total >= 1, "no row was parked"
    assert shared_engine.decode.scheduler.kv_usage().used == 0, "shared pages outlived their rows"
    # Eight rows of the same 300 tokens: the shared run held several times fewer pages at its peak.
    assert plain_peak > 4 * shared_peak


def test_a_request_registered_after_its_shared_prefix_takes_only_its_own_kv(tiny_model, tiny_reference):
    """The decode worker tells a request's registration how much of its prompt it holds in shared
    pages; the prefill then sends only the rest. The pages stay while any such request waits (even
    once every row using them has gone), a whole KV is taken as well, and they go once no one
    needs them."""
    import dataclasses

    from baton.decode_worker.core import DecodeCore
    from baton.engine.executors import make_runner
    from baton.engine.kv import SequenceKV
    from baton.engine.request import GenerationRequest
    from baton.prefill_worker.core import PrefillCore

    rng = random.Random(23)
    document = [rng.randrange(50, 40000) for _ in range(100)]
    prompts = {name: document + [rng.randrange(50, 40000) for _ in range(rng.randint(2, 9))] for name in "ABCDEF"}
    runner = make_runner(tiny_model)
    decode, prefill = DecodeCore(runner, DecodeConfig(max_rows=4, page_size=16)), PrefillCore(runner, prefix_cache_bytes=0)
    requests = {n: GenerationRequest(n, p, SamplingParams(max_tokens=10, ignore_eos=True)) for n, p in prompts.items()}
    finals: dict[str, list[int]] = {}

    def send(name: str, own_only: bool) -> None:
        done = prefill.prefill([requests[name]])[0]
        held = decode.held_tokens(name)
        if own_only:
            assert held == 96  # the document's full 16-token pages
            done = dataclasses.replace(done, kv=SequenceKV(done.kv.data[:, :, :, held:].contiguous()))
        decode.add(done)

    def run_until(names) -> None:
        while any(n not in finals for n in names):
            for out in decode.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids

    for name in "AB":
        decode.register(requests[name])
        assert decode.held_tokens(name) == 0  # nothing shared yet: whole KVs
        send(name, own_only=False)
    decode.step()  # B shares A's pages of the document
    assert decode.scheduler.kv_usage().shared == 6
    for name in "CDEF":
        decode.register(requests[name])
    send("C", own_only=True)
    send("D", own_only=False)  # a whole KV for a held prefix is fine too
    run_until("ABCD")
    assert decode.scheduler.num_running == 0 and decode.scheduler.kv_usage().used == 6, "E and F hold the pages"
    send("E", own_only=True)
    decode.abort("F")
    run_until("E")
    assert decode.scheduler.kv_usage().used == 0
    for name in "ABCDE":
        assert finals[name] == tiny_reference.greedy(prompts[name], 10), name


def test_rows_outgrowing_the_kv_pages_park_and_resume_exactly(tiny_model, tiny_reference):
    """Admission counts what rows hold, not max_tokens: eight rows join a KV that cannot hold them
    all at their longest. When pages run out mid-decode the latest row leaves for the host pool and
    comes back; with the host pool too small, its KV is dropped and computed again. Every token
    equals generate's and every page is given back."""
    from baton.kvtransfer.staging import StagingConfig, StagingPool

    per_token = tiny_model.kv_shape.bytes_per_token()
    rng = random.Random(29)
    prompts = [[rng.randrange(50, 40000) for _ in range(rng.randint(10, 40))] for _ in range(8)]

    def serve(host_tokens: int):
        # 39 pages of 16 tokens (and the null page): the eight rows join with at most 3 each and reach
        # up to 6 each
        engine = LocalEngine(tiny_model, DecodeConfig(max_rows=8, kv_budget_bytes=40 * 16 * per_token, page_size=16,
                                                      growth_reserve_tokens=8))
        pool = StagingPool(StagingConfig(capacity_bytes=host_tokens * per_token))
        engine.decode.hold_parked, engine.decode.release_parked = pool.hold, pool.release
        ids = {engine.submit(p, SamplingParams(max_tokens=48, ignore_eos=True)): p for p in prompts}
        finals, most_running = {}, 0
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
            most_running = max(most_running, engine.decode.scheduler.num_running)
            assert pool.stats().used_bytes <= pool.config.capacity_bytes
        for rid, prompt in ids.items():
            assert finals[rid] == tiny_reference.greedy(prompt, 48)
        scheduler = engine.decode.scheduler
        assert scheduler.kv_usage().used == 0 and pool.stats().used_bytes == 0
        return engine, most_running

    roomy, most_running = serve(host_tokens=4000)
    assert most_running == 8, "admission reserved max_tokens instead of what rows hold"
    assert roomy.decode.scheduler.parked_for_memory_total >= 1 and roomy.decode.scheduler.resumed_total >= 1
    assert roomy.decode.recomputed_total == 0
    tight, _ = serve(host_tokens=1)  # no parked row fits
    assert tight.decode.scheduler.park_refused_total >= 1 and tight.decode.recomputed_total >= 1


def test_a_conversations_next_turn_prefilled_where_its_kv_is_answers_exactly(tiny_model, tiny_reference):
    """Conditional disaggregation: a finished turn's pages stay on the decode worker (prompt and
    answer), and the next turn, prompt = everything said so far + a new message, is prefilled there
    on top of them, in chunks between decode steps, while another row decodes. No token of earlier
    turns is computed again, and every turn's tokens equal generate's."""
    from baton.engine.executors import make_runner
    from baton.engine.request import GenerationRequest
    from baton.prefill_worker.core import PrefillCore

    rng = random.Random(5)
    runner = make_runner(tiny_model)
    decode = DecodeCore(runner, DecodeConfig(max_rows=2, page_size=8, share_min_tokens=8, local_chunk_tokens=16))
    prefill = PrefillCore(runner, prefix_cache_bytes=0)
    finals: dict[str, list[int]] = {}

    def run_until(name: str, local: bool) -> None:
        while name not in finals:
            for out in (decode.advance_local() if local else []) + decode.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    said = [rng.randrange(50, 40000) for _ in range(70)]
    first = GenerationRequest("turn-1", said, params)
    decode.register(first)
    decode.add(prefill.prefill([first])[0])  # turn 1 the usual way: prefilled elsewhere, KV pushed
    run_until("turn-1", local=False)
    assert finals["turn-1"] == tiny_reference.greedy(said, 12)
    for turn in (2, 3):
        said = said + finals[f"turn-{turn - 1}"] + [rng.randrange(50, 40000) for _ in range(30)]
        other = GenerationRequest(f"other-{turn}", [rng.randrange(50, 40000) for _ in range(20)], params)
        decode.register(other)
        decode.add(prefill.prefill([other])[0])  # decoding beside the prefill done here
        name = f"turn-{turn}"
        request = GenerationRequest(name, said, params)
        decode.register(request, local=True)
        seq = decode.scheduler.find(name)
        kv_before = len(said) - 30 - 1  # the earlier prompt and answer, but the answer's last token
        assert seq.held_tokens == kv_before // 8 * 8 and seq.tail == (seq.tail[0], kv_before % 8)
        decode.compute(name)
        run_until(name, local=True)
        run_until(f"other-{turn}", local=False)
        assert request.trace.cached_tokens == kv_before
        assert finals[name] == tiny_reference.greedy(said, 12), name
        assert finals[f"other-{turn}"] == tiny_reference.greedy(other.prompt_token_ids, 12)
    assert decode.local_prefills_total == 2 and decode.local_tokens_total == 2 * 31
    usage = decode.scheduler.kv_usage()
    assert usage.used == 0 and usage.retained > 0  # what is left is retained, free for the taking
    # turn 3's entry continues turn 2's, which continued turn 1's: one entry per conversation left
    assert decode.scheduler.pages.num_retained == 3  # the conversation, other-2 and other-3


def test_a_conversation_whose_pages_were_needed_goes_on_from_host_memory(tiny_model, tiny_reference):
    """A retained turn whose pages another row needs moves to the host KV pool (as room the pool
    lends and takes back); the next turn, prefilled here, copies its start from there: exact, and
    nothing of the earlier turn computed again. When the pool needs that room, the entry goes."""
    from baton.engine.executors import make_runner
    from baton.engine.request import GenerationRequest
    from baton.kvtransfer.staging import StagingConfig, StagingPool
    from baton.prefill_worker.core import PrefillCore

    rng = random.Random(9)
    runner = make_runner(tiny_model)
    per_token = tiny_model.kv_shape.bytes_per_token()
    decode = DecodeCore(runner, DecodeConfig(max_rows=2, page_size=8, share_min_tokens=8, local_chunk_tokens=16,
                                             growth_reserve_tokens=0, kv_budget_bytes=25 * 8 * per_token))
    pool = StagingPool(StagingConfig(capacity_bytes=400 * per_token), on_yield=decode.host_taken_back)
    decode.on_kv_consumed, decode.hold_parked, decode.release_parked = pool.release, pool.hold, pool.release
    decode.hold_retained = lambda key, nbytes: pool.hold(key, nbytes, yields=True)
    prefill = PrefillCore(runner, prefix_cache_bytes=0)
    finals: dict[str, list[int]] = {}

    def run(request: GenerationRequest, local: bool = False) -> None:
        decode.register(request, local=local)
        if local:
            decode.compute(request.request_id)
        else:
            decode.add(prefill.prefill([request])[0])
        while request.request_id not in finals:
            for out in decode.advance_local() + decode.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    said = [rng.randrange(50, 40000) for _ in range(70)]
    run(GenerationRequest("turn-1", said, params))  # 81 tokens of KV retained: 11 pages
    assert decode.scheduler.pages.num_retained == 1
    run(GenerationRequest("long", [rng.randrange(50, 40000) for _ in range(150)], params))  # needs 21 of 24
    assert [key for key, _ in decode.scheduler.pages.retained_entries()] == ["retained:long"]
    assert decode.host.keys() == ["retained:turn-1"]
    assert pool.stats().yielding_bytes == 81 * per_token and pool.stats().needed_bytes == 0
    said = said + finals["turn-1"] + [rng.randrange(50, 40000) for _ in range(20)]
    second = GenerationRequest("turn-2", said, params)
    run(second, local=True)
    assert second.trace.cached_tokens == 81 and finals["turn-2"] == tiny_reference.greedy(said, 12)
    # staged KV needing the room takes it back, and the worker forgets the entry
    reservation = pool.reserve("pushed", 390 * per_token, timeout_s=1)
    assert "retained:turn-1" not in decode.host.keys()
    pool.abort(reservation)


def test_a_turn_prefilled_from_the_decode_workers_kv_answers_exactly(tiny_model, tiny_reference):
    """The prefill worker's side of a conversation (prefill.pull_kv): the decode worker holds turn 1's
    prompt and answer for turn 2's registration; the prefill worker reads that KV (`held_kv`),
    adopts it into its prefix cache, computes only the new message and pushes only that. Turn 2's
    tokens equal generate's. A read the registration does not cover is refused."""
    from baton.engine.executors import make_runner
    from baton.engine.kv import SequenceKV
    from baton.engine.request import GenerationRequest
    from baton.prefill_worker.core import PrefillCore

    rng = random.Random(31)
    runner = make_runner(tiny_model)
    decode = DecodeCore(runner, DecodeConfig(max_rows=2, page_size=16, share_min_tokens=16))
    prefill = PrefillCore(runner, prefix_cache_bytes=64 << 20)
    finals: dict[str, list[int]] = {}

    def run(request: GenerationRequest, held: int = 0) -> None:  # as the prefill worker would
        done = prefill.prefill([request])[0]
        # what the push sends: the prompt's KV after the tokens the decode worker holds
        decode.add(dataclasses.replace(done, kv=SequenceKV(done.whole_kv(held).data.contiguous()), shared_prefix=None))
        while request.request_id not in finals:
            for out in decode.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    said = [rng.randrange(50, 40000) for _ in range(70)]
    first = GenerationRequest("turn-1", said, params)
    decode.register(first)
    run(first)
    said = said + finals["turn-1"] + [rng.randrange(50, 40000) for _ in range(30)]
    second = GenerationRequest("turn-2", said, params)
    decode.register(second)
    held = decode.held_tokens("turn-2")
    assert held == (70 + 11) // 16 * 16 == 80  # turn 1's prompt and answer but its last token, in whole pages
    assert prefill.cached_tokens(said) == 64  # the prefill worker computed turn 1's prompt, not its answer
    with pytest.raises(ValueError, match="holds the KV of 80"):
        decode.held_kv("turn-2", 96)
    with pytest.raises(LookupError):
        decode.held_kv("turn-1", 16)  # finished: nothing waits for KV under that id
    assert prefill.adopt(said, decode.held_kv("turn-2", held)) == 16  # the answer's block: the rest it had
    run(second, held=held)
    assert second.trace.cached_tokens == 80
    assert finals["turn-2"] == tiny_reference.greedy(said, 12)


class SmallDecode:
    """A decode core with `pages` pages of 16 tokens, shared prompt pages (16 tokens and up) and no
    growth reserve, fed by a prefill core with no cache of its own: `land` prefills a registered
    request and hands its KV over past the pages held for it; `run_until` steps until the named
    requests finish (their tokens in `finals`), failing with the scheduler's standstill report."""

    def __init__(self, tiny_model, pages: int):
        from baton.engine.executors import make_runner
        from baton.prefill_worker.core import PrefillCore

        runner = make_runner(tiny_model)
        per_token = tiny_model.kv_shape.bytes_per_token()
        self.decode = DecodeCore(runner, DecodeConfig(max_rows=2, page_size=16, share_min_tokens=16,
                                                      growth_reserve_tokens=0, kv_budget_bytes=pages * 16 * per_token))
        self.prefill = PrefillCore(runner, prefix_cache_bytes=0)
        self.finals: dict[str, list[int]] = {}

    def land(self, request) -> None:
        from baton.engine.kv import SequenceKV

        done = self.prefill.prefill([request])[0]
        held = self.decode.held_tokens(request.request_id)
        self.decode.add(dataclasses.replace(done, kv=SequenceKV(done.whole_kv(held).data.contiguous()),
                                            shared_prefix=None))

    def run_until(self, *names: str, steps: int = 100) -> None:
        for _ in range(steps):
            if all(n in self.finals for n in names):
                return
            for out in self.decode.step():
                if out.finished:
                    self.finals[out.request_id] = out.token_ids
        raise AssertionError(f"{[n for n in names if n not in self.finals]} did not finish in {steps} steps: "
                             f"{self.decode.scheduler.standstill()}")


def test_a_standstill_of_waiting_rows_names_who_holds_the_pages(tiny_model, tiny_reference):
    """A request registered for a conversation's next turn holds the earlier turn's pages until its
    KV lands; a request landing meanwhile that needs more pages than are left waits with no row
    decoding. The scheduler says so, naming the holder (the decode loop logs it after
    STANDSTILL_LOG_S), and once the holder's KV lands both run and end exactly."""
    from baton.engine.request import GenerationRequest

    rng = random.Random(37)
    small = SmallDecode(tiny_model, pages=11)
    decode, land, run_until, finals = small.decode, small.land, small.run_until, small.finals
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    said = [rng.randrange(50, 40000) for _ in range(100)]
    first = GenerationRequest("turn-1", said, params)
    decode.register(first)
    land(first)
    run_until("turn-1")  # 107 tokens of KV retained: 6 whole pages and a partial one
    assert decode.scheduler.standstill() is None
    second = GenerationRequest("turn-2", said + finals["turn-1"] + [rng.randrange(50, 40000) for _ in range(20)], params)
    decode.register(second)  # holds the 6 whole pages until its KV lands
    other = GenerationRequest("other", [rng.randrange(50, 40000) for _ in range(70)], params)  # 5 pages
    decode.register(other)
    land(other)
    decode.step()
    why = decode.scheduler.standstill()
    assert why is not None and "turn-2 (6 pages, waiting)" in why, why
    land(second)
    run_until("turn-2", "other")
    assert decode.scheduler.standstill() is None
    assert finals["turn-2"] == tiny_reference.greedy(second.prompt_token_ids, 8)
    assert finals["other"] == tiny_reference.greedy(other.prompt_token_ids, 8)


def test_requests_holding_each_others_pages_do_not_wait_for_each_other(tiny_model, tiny_reference):
    """Two conversations' next turns each hold their earlier turn's pages, and each needs more pages
    than the other's hold leaves: with no row decoding, neither could start. The one behind gives its
    held pages' KV to the host (as a parked row does) so the first runs; then it runs; both exact."""
    from baton.engine.request import GenerationRequest

    rng = random.Random(41)
    small = SmallDecode(tiny_model, pages=16)
    decode, land, run_until, finals = small.decode, small.land, small.run_until, small.finals
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    said = {c: [rng.randrange(50, 40000) for _ in range(100)] for c in "ab"}
    for c in "ab":  # 107 tokens of KV retained each: 6 whole pages and a partial one
        decode.register(GenerationRequest(f"{c}-1", said[c], params))
        land(decode.scheduler.find(f"{c}-1").engine.request)
        run_until(f"{c}-1")
    turns = {c: GenerationRequest(f"{c}-2", said[c] + finals[f"{c}-1"] + [rng.randrange(50, 40000) for _ in range(60)],
                                  params) for c in "ab"}  # 168 tokens: 11 pages, 6 of them held
    for c in "ab":
        decode.register(turns[c])
        assert decode.held_tokens(f"{c}-2") == 96
    for c in "ab":
        land(turns[c])
    run_until("a-2", "b-2")
    assert decode.scheduler.standstill() is None
    for c in "ab":
        assert finals[f"{c}-2"] == tiny_reference.greedy(turns[c].prompt_token_ids, 8)
    assert decode.scheduler.pages.num_available_pages() == decode.scheduler.pages.total_pages
