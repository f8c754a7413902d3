"""Structured outputs' grammars: a request's `Guide` as an llguidance grammar, checked without a
tokenizer (the router refuses what no worker could compile, with llguidance's own message).

llguidance is the grammar engine (vLLM's `guidance` backend, also SGLang's and Dynamo's option):
it has no dependencies, compiles JSON Schema, regular expressions and Lark grammars (with JSON
schemas inside them, which tool calls need), and validates a grammar without a tokenizer. On this
machine's CPU its token mask for SmolLM2's 49,152-token vocabulary costs about 21 us a token
(xgrammar: 24 us), next to a 25-40 ms decode step; docs/bench.md has the measurement. JSON is
generated without free whitespace (llguidance's `whitespace_flexible: false`), so a schema answer
cannot spend its tokens on spaces and newlines.
"""
from __future__ import annotations

import functools
import json

from baton.sampling import Guide

# Compact JSON: no free whitespace between its tokens.
JSON_DEFAULTS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=256)
def grammar_of(guide: Guide) -> str:
    """The llguidance grammar (its JSON form) for `guide`; raises ValueError where llguidance
    cannot compile it, naming what is wrong."""
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        if guide.kind == "json_object":
            grammar = matcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_DEFAULTS)
        elif guide.kind == "json_schema":
            grammar = matcher.grammar_from_json_schema(guide.spec, defaults=JSON_DEFAULTS)
        elif guide.kind == "regex":
            grammar = matcher.grammar_from_regex(guide.spec)
        elif guide.kind == "choice":
            # Lark string literals take JSON's escapes, so each choice is matched exactly
            grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(guide.spec)))
        else:
            grammar = matcher.grammar_from_lark(guide.spec)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"the {guide.kind} guide cannot be compiled: {exc}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"the {guide.kind} guide cannot be compiled: {error.strip()}")
    return grammar
