"""The local engine and `baton generate --local`: bad input, bounded memory, sampling, the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baton.launch.local import LocalEngine
from baton.decode_worker.core import DecodeConfig
from baton.engine.request import RequestError
from baton.sampling import SamplingParams


def test_thousand_requests_give_every_kv_page_back(tiny_model):
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=6))
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(1 + i % 40)] for i in range(1000)]
    params = [SamplingParams(max_tokens=1 + i % 5, ignore_eos=True) for i in range(1000)]
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert engine.decode.scheduler.kv_usage().used == 0
    assert engine.decode.scheduler.num_running == 0 and not engine.decode.scheduler.requests


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    (list(range(3000)), SamplingParams(), "context served is 113"),  # one row's KV pages, not the model's 2048
    (list(range(113)), SamplingParams(), "shorten it to at most 112 tokens"),
    ([10**6], SamplingParams(), "outside the model's vocabulary"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(tiny_model, prompt, params, message):
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=2, kv_budget_bytes=512 * 16 * 8, page_size=16))  # 7 pages and the null page
    good = engine.submit([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RequestError, match=message):
        engine.submit(prompt, params)
    finals = {}
    while engine.has_work():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(finals[good].token_ids) == 4


def test_max_tokens_past_the_served_context_is_cut_to_it(tiny_model, tiny_reference):
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=2, kv_budget_bytes=512 * 16 * 8, page_size=16))  # 7 pages and the null page
    (out,) = engine.generate([[5, 6]], SamplingParams(max_tokens=500, ignore_eos=True))
    assert engine.decode.max_context == 113
    assert len(out.token_ids) == 111 and out.finish_reason == "length"
    assert out.token_ids == tiny_reference.greedy([5, 6], 111)


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens"), ("temperature", -0.5, "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"),
])
def test_bad_sampling_settings_say_what_to_change(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = LocalEngine(tiny_model, DecodeConfig(max_rows=1)).generate([[5, 6, 7]], params)[0]
    crowd = LocalEngine(tiny_model, DecodeConfig(max_rows=3)).generate(
        [[9, 9], [5, 6, 7], [1, 2, 3, 4]], [SamplingParams(max_tokens=8, temperature=1.0), params,
                                            SamplingParams(max_tokens=20)])[1]
    assert alone.token_ids == crowd.token_ids


def test_abort_frees_the_row(tiny_model):
    engine = LocalEngine(tiny_model, DecodeConfig(max_rows=2))
    rid = engine.submit([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.decode.scheduler.num_running == 1
    assert engine.abort(rid).finish_reason == "abort"
    assert engine.decode.scheduler.num_running == 0 and not engine.has_work()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["generate", "--top-p", "2", "hi"], "top_p"),
    (["generate", ""], "non-empty"),
    (["generate", "--model", "/no/such/model", "hi"], "config.json"),
])
def test_cli_bad_input_exits_2_with_a_message(args, message, capsys):
    from baton import cli

    assert cli.main(args) == cli.USAGE_ERROR  # in-process: no interpreter started per case
    assert message in capsys.readouterr().err


def test_cli_generate_json(tiny_model):
    done = run_cli("generate", "--local", "--model", "tiny-random", "--max-rows", "2", "--max-tokens", "5",
                   "--json", "Hello there", "What is 2+2?", "Tell me a story")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in lines] == ["Hello there", "What is 2+2?", "Tell me a story"]
    for record in lines:
        assert set(record) == {"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}
        assert 1 <= len(record["token_ids"]) <= 5 and record["finish_reason"] in ("stop", "length")
        assert record["prompt_token_ids"][:1] == [1]  # the chat template's <|im_start|>
