"""Tool calling's plain-Python half (router/openai_api/tools.py): reading tools and tool_choice,
showing them to the model, the grammar that holds required and named calls, and reading calls
back out of whole and streamed answers."""
from __future__ import annotations

import json

import llguidance
import pytest

from baton.guides import grammar_of
from baton.router.openai_api import tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tools_are_read_with_openai_defaults():
    assert tools.read({}) is None and tools.read({"tools": [], "tool_choice": "none"}) is None
    spec = tools.read({"tools": [WEATHER, TIME]})
    assert spec.names == ["get_weather", "get_time"] and spec.choice == "auto" and spec.parallel
    named = tools.read({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                        "parallel_tool_calls": False})
    assert named.choice == "get_time" and not named.parallel
    with pytest.raises(tools.ToolError) as err:
        tools.read({"tools": [WEATHER, WEATHER]})
    assert err.value.param == "tools"


def test_the_model_sees_the_tools_and_the_history_in_hermes_format():
    spec = tools.read({"tools": [WEATHER], "tool_choice": "auto"})
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather",
                                                                    "arguments": {"city": "Oslo"}}]},
               {"role": "tool", "content": "-3 C"}]
    rendered = tools.render(history, spec)
    assert rendered[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\n-3 C\n</tool_response>"}
    assert tools.render(history[1:2], spec)[0]["role"] == "system"  # a system prompt is added for the tools
    assert tools.render(history[1:2], tools.read({"tools": [WEATHER], "tool_choice": "none"})) == history[1:2]


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_required_and_named_calls_get_a_grammar_that_compiles(choice, parallel):
    guide = tools.guide(tools.read({"tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": parallel}))
    assert guide.kind == "grammar" and llguidance.LLMatcher.validate_grammar(grammar_of(guide)) == ""
    assert ("start: call+" in guide.spec) == parallel
    assert ("get_time" in guide.spec) == (choice == "required")
    assert tools.guide(tools.read({"tools": [WEATHER], "tool_choice": "auto"})) is None


def test_calls_are_read_out_of_a_whole_answer():
    spec = tools.read({"tools": [WEATHER, TIME]})
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>')
    content, calls = tools.extract(text, spec)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for not_a_call in ("<tool_call>\n{broken\n</tool_call>",
                       '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                       "<tool_call>\n{\"name\": \"get_time\"", "plain text"):
        assert tools.extract(not_a_call, spec) == (not_a_call, [])


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_a_streamed_answer_splits_as_the_whole_one_does(size):
    spec = tools.read({"tools": [WEATHER, TIME]})
    text = ('Sure <tool_ <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
            ' then <tool_call>{"name": "get_time", "arguments": {}}</tool_call> done <tool')
    splitter = tools.Splitter(spec)
    content, calls = "", []
    for at in range(0, len(text), size):
        piece, found = splitter.feed(text[at:at + size])
        content, calls = content + piece, calls + found
        assert "<tool_call>" not in piece
    content += splitter.finish()
    assert content == "Sure <tool_  then  done <tool"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"] and splitter.calls == 2
