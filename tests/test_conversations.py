"""Conversations end to end: a finished turn's KV stays on its decode worker, which publishes it
to the router's prefix index, and the next turn is prefilled there on top of it (conditional
disaggregation): no token of earlier turns is computed again, nothing is transferred, and every
turn's tokens equal `generate`'s (fp32)."""
from __future__ import annotations

import json
import urllib.request

import pytest

from baton.block_hash import common_prefix
from baton.client import BatonClient
from baton.launch.up import LocalCluster

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two cities is larger?"]


def chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = json.dumps({"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(url + "/chat/completions", body.encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def test_a_three_turn_chat_computes_only_each_new_message(default_model, default_reference):
    """Through the OpenAI API: turns 2 and 3 find every token of the earlier prompts and answers
    cached (all but the answer's end-of-turn token, whose KV no step computed), their answers equal
    generate's on the prompt the template renders, and the router sent them to the decode worker
    with no prefill worker (the trace says why)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    with LocalCluster(prefill=1, decode=1, model="default", max_rows=4, http_port=-1) as cluster:
        said = 0  # tokens of everything said before this turn, as the model saw them
        for turn, question in enumerate(QUESTIONS, start=1):
            messages.append({"role": "user", "content": question})
            reply = chat(cluster.http_url, messages, max_tokens=40)
            answer = reply["choices"][0]["message"]["content"]
            prompt = default_model.encode_chat(messages)
            usage = reply["usage"]
            assert usage["prompt_tokens"] == len(prompt)
            expected = default_reference.greedy(prompt, 40)
            if expected[-1] in default_model.eos_token_ids:
                expected = expected[:-1]
            assert answer == default_model.decode(expected), turn
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if turn > 1:
                assert cached == said, f"turn {turn}: {cached} of the {said} earlier tokens found cached"
            said = len(prompt) + usage["completion_tokens"] - 1  # its answer but the end-of-turn token
            messages.append({"role": "assistant", "content": answer})
        with BatonClient(cluster.router_address) as client:
            status = client.cluster_status()
            assert all(w.cache_synced for w in status.workers)
            follow_up = messages + [{"role": "user", "content": "Thanks!"}]
            result = client.generate(messages=follow_up, max_tokens=8, temperature=0)
            assert result.trace.prefill_worker == "" and "prefills the other" in result.trace.route
            assert result.usage.cached_tokens == said
            assert result.token_ids == default_reference.greedy(result.prompt_token_ids, 8)


def test_an_answer_that_tokenizes_differently_is_matched_as_far_as_it_agrees(tiny_model, tiny_reference):
    """tiny-random's answers are random tokens, whose text rarely tokenizes back to the same ids:
    the next turn finds the KV only as far as its tokens agree with what was generated, never
    beyond, and its answer is still exact."""
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4) as cluster, \
            BatonClient(cluster.router_address) as client:
        messages = [{"role": "user", "content": "Tell me a long story about a river and a stone."}]
        first = client.generate(messages=messages, max_tokens=24, temperature=0, ignore_eos=True)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
        second = client.generate(messages=messages, max_tokens=12, temperature=0, ignore_eos=True)
        held = first.prompt_token_ids + first.token_ids[:-1]  # the KV the first turn left
        agree = common_prefix(second.prompt_token_ids, held)
        assert second.usage.cached_tokens <= agree
        assert second.token_ids == tiny_reference.greedy(second.prompt_token_ids, 12)
        if agree >= 16 + 8:  # a block for the router to see, a page for the worker to share
            assert second.usage.cached_tokens >= agree // 8 * 8
