"""Tool calling for the OpenAI API, as plain Python: reading `tools` / `tool_choice`, showing the
tools to the model, holding `required` and named calls with a grammar, and reading the calls
back out of the text (whole, or as a stream goes).

The format is Hermes' (vLLM's `hermes` tool parser reads the same): the tools are listed in the
system prompt inside <tools></tools>, the model answers a call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and a tool's result comes back
in a `tool` message inside <tool_response></tool_response>. It works with any chat template, the
default model's included, which knows no tools of its own. `required` and a named function are
enforced by a Lark grammar over that format with each tool's parameters as a JSON schema, so the
call always parses and its `arguments` always match; `auto` leaves the model free and reads
whatever calls it wrote.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from baton.guides import JSON_DEFAULTS
from baton.sampling import Guide

MAX_TOOLS = 128
OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function name rule


class ToolError(ValueError):
    """A bad tools field: `param` names it for the 400."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"} each
    choice: str  # "none", "auto", "required", or a function's name
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    @property
    def shown(self) -> bool:
        """Whether the model sees the tools and its text is read for calls."""
        return self.choice != "none"


def read(body: dict) -> Tools | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` of a chat body; None when no tool is given."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"must be true or false (got {parallel!r})")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "needs tools: give the functions in `tools`")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"must be a list of at most {MAX_TOOLS} {{\"type\": \"function\", \"function\": "
                                 "{...}} objects")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolError(where, "must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": "
                                   "{...}}}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"{where}.function.name", f"must be 1-64 letters, digits, _ . or - (got {name!r})")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters", "must be a JSON Schema object")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description", "must be a string")
        functions.append({"name": name, "description": description, "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools", "two tools have the same name")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        picked = choice.get("function", {}).get("name") if choice.get("type") == "function" else None
        if picked not in names:
            raise ToolError("tool_choice", f"names no function in tools (got {choice!r}; tools: {', '.join(names)})")
        choice = picked
    elif choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice", f"must be none, auto, required or {{\"type\": \"function\", \"function\": "
                                       f"{{\"name\": ...}}}} (got {choice!r})")
    return Tools(tuple(functions), choice, True if parallel is None else parallel)


def preamble(tools: Tools) -> str:
    """What the system prompt says of the tools (Hermes' wording of the format)."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in _offered(tools))
    return ("You are a function calling AI model. You may call one or more functions to assist with the user "
            "query. The function signatures are within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "For each function call, return a JSON object with the function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _offered(tools: Tools) -> list[dict[str, Any]]:
    return [f for f in tools.functions if tools.choice in ("auto", "required", f["name"])]


def render(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict[str, str]]:
    """Chat messages as the template reads them: assistant tool calls and tool results written
    in the Hermes format, the tools' preamble added to the system prompt."""
    out = []
    for message in messages:
        content = message["content"]
        if message.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps({'name': c['name'], 'arguments': c['arguments']})}\n{CLOSE}"
                              for c in message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif message["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": message["role"], "content": content})
    if tools is not None and tools.shown:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{preamble(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": preamble(tools)})
    return out


def guide(tools: Tools | None) -> Guide | None:
    """`required` or a named function: a grammar that admits only well-formed calls (one, or
    several with parallel_tool_calls) whose arguments match their function's parameters."""
    if tools is None or tools.choice in ("none", "auto"):
        return None
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in _offered(tools)]
    schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_DEFAULTS  # compact JSON, as for response_format
    repeat = "+" if tools.parallel else ""
    grammar = (f"start: call{repeat}\n"
               f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
               f"body: %json {json.dumps(schema)}\n")
    return Guide("grammar", grammar)


def call_entry(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One call as OpenAI answers it: `arguments` is JSON text."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse_call(block: str, names: list[str]) -> dict[str, Any] | None:
    """The text between <tool_call> and </tool_call> as a call, or None if it is not one."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return call_entry(value["name"], arguments) if isinstance(arguments, dict) else None


def extract(text: str, tools: Tools) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole answer: the text outside well-formed calls, and the calls."""
    splitter = Splitter(tools)
    content, calls = splitter.feed(text)
    content += splitter.finish()
    return (content.strip() or None) if calls else content, calls


class Splitter:
    """A streamed answer split as it arrives: text goes out as content, except what may be the
    start of a call, held until it is one (sent as a whole call) or is not (sent as content)."""

    def __init__(self, tools: Tools):
        self.names = tools.names
        self.buffer = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                # keep a tail that could still grow into "<tool_call>"
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                             if OPEN.startswith(self.buffer[-k:])), 0)
                cut = len(self.buffer) - keep
                content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                return content, calls
            end = self.buffer.find(CLOSE, start)
            if end < 0:  # a call under way: hold it
                content, self.buffer = content + self.buffer[:start], self.buffer[start:]
                return content, calls
            call = parse_call(self.buffer[start + len(OPEN):end].strip(), self.names)
            if call is None:  # not a call after all: it was text
                content += self.buffer[:end + len(CLOSE)]
            else:
                content += self.buffer[:start]
                calls.append(call)
                self.calls += 1
            self.buffer = self.buffer[end + len(CLOSE):]

    def finish(self) -> str:
        """The end of the answer: whatever is held is text (an unfinished call never parses)."""
        rest, self.buffer = self.buffer, ""
        return rest
