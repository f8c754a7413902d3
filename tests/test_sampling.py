import dataclasses
import json
import math

import pytest
import torch

from baton.engine.sampling import INVALID_TOKEN, RequestSampler, SamplingParams, sample, token_logprobs
from baton.v1 import common_pb2


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(params: SamplingParams, logits_row: torch.Tensor, count: int) -> list[int]:
    """`count` independent draws from one logits row: one seeded request per draw, one batch."""
    samplers = [RequestSampler(dataclasses.replace(params, seed=s)) for s in range(count)]
    return sample(logits_row.expand(count, -1).contiguous(), samplers)


# --- greedy -----------------------------------------------------------------------------------

def test_greedy_is_argmax_with_first_index_on_ties():
    logits = _logits(5, 50, seed=0)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # a tie: argmax takes the first
    samplers = [RequestSampler(SamplingParams()) for _ in range(5)]
    assert sample(logits, samplers) == torch.argmax(logits, dim=-1).tolist()
    assert sample(logits, [RequestSampler(SamplingParams()) for _ in range(5)])[2] == 7


def test_greedy_rows_in_a_mixed_batch_are_still_argmax():
    logits = _logits(4, 50, seed=1)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=4)]
    tokens = sample(logits, [RequestSampler(p) for p in params])
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]


def test_greedy_matches_transformers_generate():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[1, 17, 42, 99, 5]])
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
        sampler, ids = RequestSampler(SamplingParams(max_tokens=12)), prompt
        for _ in range(12):
            token = sample(model(ids).logits[:, -1, :], [sampler])[0]
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert ids[0, prompt.shape[1]:].tolist() == expected


# --- seeded reproducibility -------------------------------------------------------------------

def _run_steps(target: SamplingParams, companions: list[SamplingParams], row: int, steps: int) -> list[int]:
    """Tokens of `target` over `steps` steps while it sits at `row` among `companions`."""
    target_sampler = RequestSampler(target)
    others = [RequestSampler(p) for p in companions]
    out = []
    for step in range(steps):
        batch = others[:row] + [target_sampler] + others[row:]
        logits = _logits(len(batch), 200, seed=1000 + step)
        logits[row] = _logits(1, 200, seed=step)[0]  # the target's logits depend only on the step
        out.append(sample(logits, batch)[row])
    return out


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=99),
])
def test_seeded_request_is_independent_of_batch_and_row(target):
    alone = _run_steps(target, [], row=0, steps=20)
    crowd = [SamplingParams(), SamplingParams(temperature=1.3, seed=5),
             SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(temperature=2.0, top_k=3, seed=8)]
    assert _run_steps(target, crowd, row=0, steps=20) == alone
    assert _run_steps(target, crowd[::-1], row=3, steps=20) == alone
    assert _run_steps(target, crowd[:1], row=1, steps=20) == alone


def test_different_seeds_give_different_tokens():
    a = _run_steps(SamplingParams(temperature=1.0, seed=1), [], row=0, steps=20)
    b = _run_steps(SamplingParams(temperature=1.0, seed=2), [], row=0, steps=20)
    assert a != b


def test_each_step_draws_fresh_randomness():
    sampler, row = RequestSampler(SamplingParams(temperature=1.0, seed=5)), torch.zeros(1, 50)
    assert len({sample(row, [sampler])[0] for _ in range(30)}) > 10


def test_a_worker_taking_over_continues_the_same_random_stream():
    params = SamplingParams(temperature=1.0, seed=77)
    logits = [_logits(1, 200, seed=step) for step in range(10)]
    one_process = RequestSampler(params)
    expected = [sample(row, [one_process])[0] for row in logits]
    first = sample(logits[0], [RequestSampler(params)])[0]  # e.g. the prefill worker's token
    taken_over = RequestSampler(params, tokens_generated=1)
    assert [first] + [sample(row, [taken_over])[0] for row in logits[1:]] == expected


def test_unseeded_requests_draw_their_own_seed():
    a, b = RequestSampler(SamplingParams(temperature=1.0)), RequestSampler(SamplingParams(temperature=1.0))
    assert a.seed != b.seed and 0 <= a.seed < 2**63


# --- temperature, top-k, top-p -----------------------------------------------------------------

def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _logits(6, 300, seed=3)
    logits[4, 10] = logits[4, 250] = logits[4].max() + 1  # a tie: the filtered path must pick 10
    greedy = torch.argmax(logits, dim=-1).tolist()
    for params in (SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)):
        samplers = [RequestSampler(dataclasses.replace(params, seed=i)) for i in range(6)]
        assert sample(logits, samplers) == greedy


def test_top_k_restricts_support_to_the_k_best():
    row = _logits(1, 30, seed=4)[0]
    tokens = _draws(SamplingParams(temperature=3.0, top_k=3), row, 2000)
    assert set(tokens) == set(torch.topk(row, 3).indices.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    row = torch.log(torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05]))
    # sorted: 0.5, 0.3, 0.1, ... -> mass before token 3 is 0.5 < 0.6 (kept), before token 0 is 0.8
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.6), row, 2000)) == {1, 3}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.85), row, 2000)) == {0, 1, 3}


def test_top_p_applies_after_top_k_renormalises():
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # top_k=2 renormalises to 4/7, 3/7, so top_p=0.5 keeps token 0 alone
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, top_p=0.5), row, 500)) == {0}


def test_temperature_reshapes_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    n = 4000
    tokens = _draws(SamplingParams(temperature=2.0), torch.log(probs), n)
    expected = probs.sqrt() / probs.sqrt().sum()  # p^(1/T), renormalised
    for token in range(3):
        assert abs(tokens.count(token) / n - expected[token].item()) < 0.03


def test_sample_refuses_mismatched_rows():
    with pytest.raises(ValueError, match="one row per sampler"):
        sample(torch.zeros(2, 10), [RequestSampler(SamplingParams())])


# --- log probabilities ---------------------------------------------------------------------------

def test_logprobs_are_the_raw_log_softmax_whatever_the_sampling():
    logits = _logits(4, 50, 11)
    params = [SamplingParams(logprobs=3), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1, logprobs=0), SamplingParams(logprobs=2)]
    tokens = sample(logits, [RequestSampler(p) for p in params])
    tokens[3] = INVALID_TOKEN  # a row whose logits went bad gets none
    out = token_logprobs(logits, tokens, params)
    reference = torch.log_softmax(logits, dim=-1)
    assert out[1] is None and out[3] is None
    for row in (0, 2):
        assert out[row].token_id == tokens[row]
        assert out[row].logprob == pytest.approx(reference[row, tokens[row]].item(), abs=1e-6)
    best = reference[0].topk(3)
    assert [t for t, _ in out[0].top] == best.indices.tolist() == [tokens[0]] + best.indices.tolist()[1:]
    assert [v for _, v in out[0].top] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert out[2].top == ()  # logprobs=0: the token's own only
    assert token_logprobs(logits, tokens, [SamplingParams()] * 4) == [None] * 4


# --- validation and transport ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, r"max_tokens must be an integer >= 1 \(got 0\); ask for at least one"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"seed": -1}, "seed must be an integer in 0..2\\*\\*63-1"),
    ({"seed": 2**63}, "seed"),
    ({"stop": ("",)}, "non-empty string"),
    ({"stop": tuple(f"s{i}" for i in range(17))}, "at most 16 stop strings"),
    ({"stop": ("x" * 257,)}, "at most 256 characters"),
    ({"stop": (3,)}, "non-empty string"),
    ({"stop_token_ids": (5, -2)}, "stop_token_ids must be integers >= 0"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"priority": 1.5}, "priority"),
    ({"logprobs": 21}, r"logprobs must be an integer in 0..20"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
])
def test_validation_says_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_keyword_input_is_normalised_and_unknown_names_refused():
    params = SamplingParams.from_kwargs(json.loads('{"stop": "END", "temperature": 1, "stop_token_ids": [7], '
                                                   '"max_tokens": null}'))
    assert (params.stop, params.temperature, params.stop_token_ids, params.max_tokens) == (("END",), 1.0, (7,), 256)
    assert SamplingParams.from_kwargs({}) == SamplingParams()
    with pytest.raises(TypeError, match="unknown sampling option.*topk"):
        SamplingParams.from_kwargs({"topk": 3})


def test_one_sampling_params_for_the_sdk_the_router_and_the_engine():
    """Validated once, in one torch-free place (baton/sampling.py)."""
    import baton.engine.sampling as engine_sampling
    import baton.sampling as shared
    from baton.client import SamplingOptions
    from baton.messages import sampling_from_proto

    assert SamplingOptions is shared.SamplingParams is engine_sampling.SamplingParams
    assert type(sampling_from_proto(common_pb2.SamplingParams(max_tokens=3))) is shared.SamplingParams
    assert "torch" not in shared.__dict__


def test_sampling_and_logprobs_cross_the_wire_unchanged():
    from baton.messages import logprob_from_proto, logprob_to_proto, sampling_from_proto, sampling_to_proto
    from baton.sampling import TokenLogprob

    params = SamplingParams(max_tokens=9, temperature=0.5, top_k=4, top_p=0.75, seed=3, stop=("x",),
                            stop_token_ids=(2,), ignore_eos=True, priority=-2, logprobs=5)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).logprobs is None
    assert sampling_from_proto(sampling_to_proto(SamplingParams(logprobs=0))).logprobs == 0
    entry = TokenLogprob(7, -0.5, ((7, -0.5), (3, -1.25)))
    assert logprob_from_proto(logprob_to_proto(entry)) == entry


def test_default_sampling_from_a_generation_config_is_checked_and_fills_only_unset_fields():
    from baton.sampling import fill_unset, sampling_defaults

    hf = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 512,
          "repetition_penalty": 1.1, "eos_token_id": 2}
    assert sampling_defaults(hf, "gen.json", strict=False) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                               "max_tokens": 512, "repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="override: 'typical_p' is not a sampling default"):
        sampling_defaults({"typical_p": 0.9}, "override")
    with pytest.raises(ValueError, match="override: top_p must be in"):
        sampling_defaults({"top_p": 0}, "override")
    with pytest.raises(ValueError, match="expected a JSON object"):
        sampling_defaults([0.5], "override")
    assert fill_unset({"temperature": None, "top_p": 0.5}, {"temperature": 0.2, "top_p": 0.9}) == {
        "temperature": 0.2, "top_p": 0.5}


def test_each_model_says_its_default_sampling(tmp_path):
    from baton.config import load_settings
    from baton.engine.model import DEFAULT_MODEL_SAMPLING, ModelLoadError, model_sampling_defaults

    assert model_sampling_defaults("default") == DEFAULT_MODEL_SAMPLING == {"temperature": 0.2, "top_p": 0.9}
    assert model_sampling_defaults("default", "none") == {} == model_sampling_defaults("tiny-random")
    assert model_sampling_defaults("default", override={"temperature": 0.7}) == {"temperature": 0.7, "top_p": 0.9}
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "do_sample": True}))
    assert model_sampling_defaults(str(folder)) == {"temperature": 0.6, "top_p": 0.95}
    assert model_sampling_defaults("tiny-random", str(folder), {"max_new_tokens": 9}) == {
        "temperature": 0.6, "top_p": 0.95, "max_tokens": 9}
    with pytest.raises(ModelLoadError, match="no generation_config.json"):
        model_sampling_defaults("default", str(tmp_path))
    # The settings: a flag or an environment variable carries the override as JSON, checked at start.
    assert load_settings(env={"BATON_MODEL_OVERRIDE_GENERATION_CONFIG": '{"temperature": 0.5}'}).model \
        .override_generation_config == {"temperature": 0.5}
    with pytest.raises(ValueError, match="'seed' is not a sampling default"):
        load_settings(env={"BATON_MODEL_OVERRIDE_GENERATION_CONFIG": '{"seed": 1}'})
    with pytest.raises(ValueError, match="cannot read"):
        load_settings(env={"BATON_MODEL_OVERRIDE_GENERATION_CONFIG": "temperature=0.5"})


# -- penalties, biases, min-p, min_tokens ----------------------------------------------------------


def test_logit_adjustments_follow_their_definitions():
    """Repetition as transformers' RepetitionPenaltyLogitsProcessor (prompt and output); presence
    and frequency as OpenAI defines them (output only); the bias added; min_tokens holds back the
    ids that would end the request until that many tokens are out."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from baton.engine.sampling import RequestSampler

    torch.manual_seed(0)
    raw = torch.randn(50) * 3
    prompt, outputs = [1, 2, 3, 3], [4, 4, 4, 9]
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias={7: 5.0, 8: -100}, min_tokens=2, max_tokens=10)
    # Taken over after 4 tokens, its min_tokens 6 came lowered by as much (the router's _left).
    sampler = RequestSampler.for_request(params, prompt + outputs, resume_step=len(outputs), suppress_ids={2, 9})
    row = raw.clone()
    sampler.adjust(row)
    expected = raw.clone()
    expected[7] += 5.0
    expected[8] -= 100
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + outputs]), expected[None])[0]
    expected[4] -= 0.25 * 3 + 0.5
    expected[9] -= 0.25 * 1 + 0.5
    expected[[2, 9]] = float("-inf")  # 0 of 2 tokens out here: EOS and stop ids held back
    assert torch.equal(row, expected)
    sampler.record(11)
    sampler.record(12)  # 2 out now: they may end it
    row = raw.clone()
    sampler.adjust(row)
    assert torch.isfinite(row[[2, 9]]).all() and row[11] == (raw[11] / 1.5 if raw[11] > 0 else raw[11] * 1.5) - 0.75


def test_min_p_keeps_tokens_within_its_share_of_the_likeliest():
    from transformers import MinPLogitsWarper

    from baton.engine.sampling import RequestSampler, _filtered_sorted_probs

    torch.manual_seed(1)
    logits = torch.randn(2, 40) * 2
    params = [SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.7, min_p=0.05, top_k=10)]
    probs, ids = _filtered_sorted_probs(logits, params)
    for i, p in enumerate(params):
        scores = logits[i:i + 1] / p.temperature
        if p.top_k:
            scores = scores.masked_fill(scores < scores.topk(p.top_k).values[:, -1:], float("-inf"))
        kept = torch.isfinite(MinPLogitsWarper(p.min_p)(None, scores))[0]
        assert set(ids[i][probs[i] > 0].tolist()) == set(kept.nonzero().flatten().tolist()), i
    # A seeded draw never leaves the kept set, batched or alone.
    samplers = [RequestSampler(replace_seed(p, 3)) for p in params]
    tokens = sample(logits, samplers)
    for i, token in enumerate(tokens):
        assert probs[i][(ids[i] == token).nonzero()[0, 0]] > 0


def replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def test_penalised_greedy_decoding_equals_transformers_in_any_batch(tiny_model, tiny_reference):
    """fp32 exactness with penalties: repetition_penalty as transformers' generate applies it, and
    presence, frequency and a logit bias against a plain decoding loop over the same model; each
    row alone or beside other rows (plain and penalised) gives the same tokens."""
    from baton.decode_worker.core import DecodeConfig
    from baton.launch.local import LocalEngine

    prompts = [[300 + 11 * i + j for j in range(4 + 3 * i)] for i in range(4)]
    steps = 20
    repeat = SamplingParams(max_tokens=steps, ignore_eos=True, repetition_penalty=1.3)
    openai_style = SamplingParams(max_tokens=steps, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7,
                                  logit_bias={prompts[1][0]: 3.0})
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=4), attention_backend="torch")
    mixed = engine.generate(prompts, [SamplingParams(max_tokens=steps, ignore_eos=True), openai_style, repeat, repeat])
    alone = engine.generate([prompts[1]], openai_style)[0]
    assert mixed[0].token_ids == tiny_reference.greedy(prompts[0], steps)
    assert mixed[2].token_ids == tiny_reference.greedy(prompts[2], steps, repetition_penalty=1.3)
    assert mixed[3].token_ids == tiny_reference.greedy(prompts[3], steps, repetition_penalty=1.3)
    assert mixed[1].token_ids == alone.token_ids == _penalised_greedy(tiny_reference, prompts[1], openai_style)
    for i in (1, 2):  # the penalties did something
        assert mixed[i].token_ids != tiny_reference.greedy(prompts[i], steps), i


def _penalised_greedy(reference, prompt: list[int], params: SamplingParams) -> list[int]:
    """The definition, one token at a time over transformers' forward."""
    model, ids, out = reference.loaded.model, list(prompt), []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        for token, bias in params.logit_bias:
            logits[token] += bias
        for token in set(out):
            logits[token] -= params.frequency_penalty * out.count(token) + params.presence_penalty
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def test_min_tokens_holds_eos_and_stop_strings_back(tiny_model):
    from baton.decode_worker.core import DecodeConfig
    from baton.launch.local import LocalEngine

    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=2), attention_backend="torch")
    prompt = [500, 501, 502]
    free = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    first = free.token_ids[0]
    # The first token made an EOS: without min_tokens it ends at once, with min_tokens=5 it cannot.
    ended = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(first,)))[0]
    held = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(first,), min_tokens=5))[0]
    assert ended.token_ids == [first] and ended.finish_reason == "stop"
    assert first not in held.token_ids[:5] and len(held.token_ids) >= 6


def test_a_guide_masks_exactly_what_its_grammar_allows_and_fails_its_request_alone(tiny_model):
    """The mask a row gets (computed on the mask thread while the step runs) is llguidance's own
    mask, bit for bit, at every token; a token the grammar refuses ends that request only."""
    import llguidance

    from baton.guides import grammar_of
    from baton.sampling import Guide

    guide = Guide("regex", "[0-9]{2}-[a-c]{2}")
    params = SamplingParams(max_tokens=8, guide=guide)
    vocab = tiny_model.config.vocab_size
    reference = llguidance.LLMatcher(tiny_model.grammars.lltokenizer, grammar_of(guide))
    sampler, free = RequestSampler(params, grammars=tiny_model.grammars), RequestSampler(SamplingParams(max_tokens=8))
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(2, vocab, generator=generator)
        adjusted = logits[0].clone()
        sampler.adjust(adjusted)
        bits = reference.compute_bitmask()
        allowed = [t for t in range(vocab) if bits[t // 8] >> (t % 8) & 1]
        assert torch.isfinite(adjusted).nonzero().flatten().tolist() == allowed
        assert torch.equal(adjusted[allowed], logits[0][allowed])  # untouched where allowed
        token, other = sample(logits, [sampler, free])
        assert token in allowed and other == logits[1].argmax().item()
        assert reference.consume_token(token)
    refused = RequestSampler(params, grammars=tiny_model.grammars)
    refused.record(tiny_model.encode_text("x")[0])  # not a digit: the guide is broken for this request
    logits = torch.randn(2, vocab, generator=generator)
    assert sample(logits, [refused, RequestSampler(SamplingParams(max_tokens=8))]) == [INVALID_TOKEN,
                                                                                        logits[1].argmax().item()]
    assert "does not continue the regex guide" in refused.guide.error
