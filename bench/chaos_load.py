"""The chaos suite's requests and the one class each ends in: seeded prompts with their greedy
continuations from transformers (the answers the load is checked against), the calls a client
thread makes (streams, streams it leaves midway, generates, GenerateBatches, conversations whose
turns each send everything said before), and the judging of what came back: exact, wrong,
refused, cancelled, lost or hung (bench/chaos.py says what each means)."""
from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("exact", "wrong", "refused", "cancelled", "lost", "hung")
KINDS = ("stream", "stream-cancel", "generate", "batch member", "conversation turn")
REFUSED = {"RESOURCE_EXHAUSTED", "UNAVAILABLE", "ABORTED"}  # a status that says why and invites a retry
HUNG = {"DEADLINE_EXCEEDED"}  # the call ran out its whole deadline
REQUEST_TIMEOUT_S = 60.0  # every call's deadline (a whole GenerateBatch's included)
HUNG_MARGIN_S = 15.0  # a call still open this long after its deadline is hung whatever it returns later
MAX_TOKENS = 24
PROMPTS = 32
CONVERSATIONS, TURNS = 8, 3  # of the prompts, the first ones open conversations of this many turns


@dataclass
class Tally:
    """Every request's outcome, with the details of the ones that were not exact."""

    by_kind: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    reasons: Counter = field(default_factory=Counter)
    spans: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, outcome) of each
    notable: list[dict[str, Any]] = field(default_factory=list)  # wrong, lost and hung, in full

    def totals(self) -> Counter:
        total: Counter = Counter()
        for counts in self.by_kind.values():
            total.update(counts)
        return total


@dataclass(frozen=True)
class Conversation:
    """Turn t's prompt is turn t-1's prompt, its answer and a new message; its greedy answer."""

    prompts: list[list[int]]
    expected: list[list[int]]


def references(model: str, dtype: str, seed: int, context: int | None = None
               ) -> tuple[Any, list[list[int]], list[list[int]], list[Conversation]]:
    """Seeded random prompts and their greedy continuations from transformers generate, and
    conversations opened by the first of them, as many turns as `context` tokens (the decode
    workers' KV, when it is small) hold. A prompt whose greedy run meets EOS early is dropped (the
    load sets ignore_eos; generate stops)."""
    import torch

    from baton.engine.model import load_model

    rng = random.Random(seed)
    loaded = load_model(model, dtype=dtype)
    loaded.model.set_attn_implementation("sdpa")
    vocab = loaded.model.config.vocab_size
    prompts, expected = [], []
    def greedy(prompt: list[int]) -> list[int]:
        out = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    pad_token_id=loaded.model.generation_config.pad_token_id)
        return out[0, len(prompt):].tolist()

    def message() -> list[int]:
        return [rng.randrange(10, min(vocab, 4000)) for _ in range(rng.randrange(4, 40))]

    conversations = []
    with torch.no_grad():
        for _ in range(PROMPTS):
            prompt = [rng.randrange(10, min(vocab, 4000)) for _ in range(rng.randrange(4, 120))]
            tokens = greedy(prompt)
            if len(tokens) == MAX_TOKENS:
                prompts.append(prompt)
                expected.append(tokens)
        for prompt, tokens in zip(prompts[:CONVERSATIONS], expected):
            turns, answers = [prompt], [tokens]
            while len(turns) < TURNS and len(answers[-1]) == MAX_TOKENS:
                turn = turns[-1] + answers[-1] + message()
                if context is not None and len(turn) + MAX_TOKENS >= context:
                    break
                turns.append(turn)
                answers.append(greedy(turns[-1]))
            if len(answers[-1]) == MAX_TOKENS and len(turns) > 1:
                conversations.append(Conversation(turns, answers))
    if not prompts:
        raise RuntimeError("every reference run met EOS early; no prompt to check against")
    return loaded, prompts, expected, conversations


def one_call(client, kind: str, rng: random.Random, prompts: list[list[int]],
             expected: list[list[int]], conversations: list[Conversation] = ()) -> list[tuple[str, str, str, str]]:
    """One call of `kind` on random prompts: (kind, outcome, reason, detail) of each of its requests."""
    from baton.client import BatonError

    sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
    if kind == "conversation":  # its turns one after another, each after the answer before it came
        chat = conversations[rng.randrange(len(conversations))]
        results = []
        for turn, prompt in enumerate(chat.prompts):
            try:
                result = client.generate(token_ids=prompt, **sampling)
            except BatonError as exc:
                return results + [("conversation turn", *judge_error(exc))]
            results.append(("conversation turn",
                            *judge_tokens(chat.expected, turn, result.token_ids, result.finish_reason)))
            if results[-1][1] != "exact":
                break
        return results
    i = rng.randrange(len(prompts))
    if kind == "stream":
        tokens, finish = [], None
        for chunk in client.stream(token_ids=prompts[i], **sampling):
            tokens.extend(chunk.token_ids)
            finish = chunk.finish_reason or finish
        return [(kind, *judge_tokens(expected, i, tokens, finish))]
    if kind == "stream-cancel":  # a client that leaves midway: its row and KV must be freed
        leave_after = rng.randrange(1, 4)
        tokens, finish = [], None
        with client.stream(token_ids=prompts[i], **sampling) as stream:
            for n, chunk in enumerate(stream, start=1):
                tokens.extend(chunk.token_ids)
                finish = chunk.finish_reason or finish
                if n >= leave_after and finish is None:
                    if tokens != expected[i][:len(tokens)]:  # what it saw before leaving must be right
                        return [(kind, *judge_tokens(expected, i, tokens, finish))]
                    return [(kind, "cancelled", "", "")]
        return [(kind, *judge_tokens(expected, i, tokens, finish))]  # finished before it could leave
    if kind == "generate":
        result = client.generate(token_ids=prompts[i], **sampling)
        return [(kind, *judge_tokens(expected, i, result.token_ids, result.finish_reason))]
    picks = [rng.randrange(len(prompts)) for _ in range(rng.randrange(5, 11))]
    outcome = client.generate_batch([{"token_ids": prompts[j], **sampling} for j in picks])
    results = []
    for j, item in zip(picks, outcome.results):
        if item is None:
            results.append(("batch member", "lost", "no answer", f"prompt {j}: the batch ended without it"))
        elif isinstance(item, BatonError):
            results.append(("batch member", *judge_error(item)))
        else:
            results.append(("batch member", *judge_tokens(expected, j, item.token_ids, item.finish_reason)))
    return results


def judge_tokens(expected: list[list[int]], i: int, tokens: list[int],
                 finish_reason: str | None) -> tuple[str, str, str]:
    """(outcome, reason, detail) of prompt i's answer against its greedy continuation."""
    if finish_reason == "abort":
        return "lost", "finish_reason abort", f"prompt {i}: aborted after {len(tokens)} tokens"
    if tokens == expected[i]:
        return "exact", "", ""
    k = next((n for n, (a, b) in enumerate(zip(tokens, expected[i])) if a != b),
             min(len(tokens), len(expected[i])))
    return ("wrong", f"differs at token {k}",
            f"prompt {i}: {len(tokens)} tokens (finish {finish_reason}), first difference at {k}: "
            f"got {tokens[k:k + 4]}, greedy {expected[i][k:k + 4]}")


def judge_error(exc: BaseException) -> tuple[str, str, str]:
    """(outcome, reason, detail) of a call or batch member that ended in an error."""
    code = getattr(exc, "code", None)
    if not isinstance(code, str):
        return "lost", type(exc).__name__, f"{type(exc).__name__}: {exc}"
    message = str(getattr(exc, "message", "") or "")
    if code in REFUSED:
        return "refused", f"{code}: {_short(message)}", ""
    if code in HUNG:
        return "hung", code, str(exc)
    return "lost", f"{code}: {_short(message)}", str(exc)


def _short(text: str, n: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."
