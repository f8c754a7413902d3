"""Conversations end to end: a finished turn's KV stays on its decode worker, which publishes it
to the router's prefix index, and the next turn is prefilled there on top of it (conditional
disaggregation): no token of earlier turns is computed again, nothing is transferred, and every
turn's tokens equal `generate`'s (fp32)."""
from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.block_hash import common_prefix
from baton.client import BatonClient
from baton.launch.up import LocalCluster, free_port

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two cities is larger?"]
LONGER_ANSWERS = ["Tell me about the history of Paris.", "And what about Rome?",
                  "Which of the two would you visit first, and why?"]


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


def test_a_turn_prefilled_on_the_prefill_worker_reads_the_earlier_turns_kv(default_model, default_reference):
    """Every turn on the prefill worker (router.local_prefill_max_tokens 0): it reads the KV the
    decode worker holds of the earlier turns (answers included, which it never computed) instead of
    computing them, computes only the new message, and pushes back only that: turns 2 and 3 find
    every earlier token cached, the trace says how many were read, and the answers equal generate's.
    With prefill.pull_kv off the same turns compute the earlier answers again."""
    # long enough that the decode worker holds the earlier turns for a pushed prompt (decode.share_min_tokens)
    system = ("You are a helpful assistant. Answer every question in one short sentence, name the facts you "
              "rely on, and say plainly when you do not know the answer.")
    messages = [{"role": "system", "content": system}]
    router = ("--local-prefill-max-tokens", "0")
    metrics_port = free_port()
    with LocalCluster(prefill=1, decode=1, model="default", max_rows=4, router_args=router,
                      prefill_args=("--metrics-port", str(metrics_port))) as cluster, \
            BatonClient(cluster.router_address) as client:
        said = 0
        for turn, question in enumerate(LONGER_ANSWERS, start=1):
            messages.append({"role": "user", "content": question})
            result = client.generate(messages=messages, max_tokens=40, temperature=0)
            assert result.trace.prefill_worker, "every turn goes to the prefill worker"
            expected = default_reference.greedy(result.prompt_token_ids, 40)
            assert result.token_ids == expected[:len(result.token_ids)], turn
            if turn > 1:  # every whole page of the earlier prompts and answers, which the decode worker held
                assert result.usage.cached_tokens >= said // 16 * 16, (turn, result.usage.cached_tokens, said)
                assert "read the KV of" in result.trace.route, result.trace.route
            if turn == 2:
                cached_on = result.usage.cached_tokens
            said = len(result.prompt_token_ids) + len(result.token_ids) - 1
            messages.append({"role": "assistant", "content": result.text})
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        routing = client.cluster_status().routing
    # The index predicts what the prefill worker holds itself (its earlier prompts), and the reads
    # count only what they added: tokens it had and read again are not taken for a misprediction.
    print(f"\nrouting: {dict(routing)}")
    assert routing["pulled_tokens"] > 0 and routing["accuracy"] > 0.5, dict(routing)
    pulled = sum(s.value for f in text_string_to_metric_families(scraped) for s in f.samples
                 if s.name == "baton_prefill_kv_pulled_tokens_total")
    assert pulled >= 2 * 16
    messages = messages[:3]  # the first two turns again, on a fresh cluster that never reads
    with LocalCluster(prefill=1, decode=1, model="default", max_rows=4, router_args=router,
                      extra_env={"BATON_PREFILL_PULL_KV": "false"}) as cluster, \
            BatonClient(cluster.router_address) as client:
        first = client.generate(messages=messages[:2], max_tokens=40, temperature=0)
        second = client.generate(messages=messages, max_tokens=40, temperature=0)
        assert "read the KV" not in second.trace.route
        # only its own cache: the first prompt's blocks, none of the answer it never computed
        assert second.usage.cached_tokens <= len(first.prompt_token_ids) < cached_on
