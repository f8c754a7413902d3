"""What the residency suite makes of its streams: the client-side counts per second (a stream
decodes in a window if it received a chunk other than its first in it), the table of streams
decoding at once beside what each server said of itself, and the plot of both over time."""
from __future__ import annotations

import math
from typing import Any

from baton.bench.common import BenchOptions, median, table

WINDOW_S = 1.0


def summarize(streams: list[dict], seconds: float) -> dict[str, Any]:
    """Client-side counts from each stream's chunk arrival times (seconds since they were sent).

    decoding[k]: streams that received a chunk other than their first in window k, (k-1, k] s;
    receiving[k]: streams that received any chunk in it (first tokens included)."""
    windows = max(1, math.ceil(seconds / WINDOW_S - 1e-9))
    edges = [(k * WINDOW_S, min((k + 1) * WINDOW_S, seconds)) for k in range(windows)]

    def within(times: list[float], lo: float, hi: float) -> bool:
        return any(lo < t <= hi for t in times)

    decoding = [sum(within(st["chunk_s"][1:], lo, hi) for st in streams) for lo, hi in edges]
    receiving = [sum(within(st["chunk_s"], lo, hi) for st in streams) for lo, hi in edges]
    at_sample = sum(within(st["chunk_s"][1:], seconds - WINDOW_S, seconds) for st in streams)
    first = [st["chunk_s"][0] for st in streams if st["chunk_s"]]
    chunks = [len(st["chunk_s"]) for st in streams]
    tokens = [st.get("tokens") for st in streams]
    counted = tokens if all(t is not None for t in tokens) else chunks
    return {"window_s": WINDOW_S, "window_end_s": [hi for _, hi in edges], "decoding_per_window": decoding,
            "receiving_per_window": receiving, "decoding_at_sample": at_sample,
            "peak_decoding": max(decoding) if decoding else 0, "first_token_s": [st["chunk_s"][0] if st["chunk_s"]
                                                                               else None for st in streams],
            "ttft_median_s": median(first) if first else None, "streams_with_a_token": len(first),
            "chunks_per_stream": chunks, "tokens_per_stream": tokens,
            "tokens_per_s": sum(counted) / seconds, "tokens_counted_as": "tokens" if counted is tokens else "chunks",
            "finished": sum(1 for st in streams if st["finish_reason"])}


def _server_at(result: dict[str, Any], seconds: float) -> str:
    """What the server said of itself at the last sample at or before the count."""
    samples = [x for x in result.get("server_samples", []) if x["t"] <= seconds + 0.5 and "error" not in x]
    if not samples:
        return "-"
    last = samples[-1]
    if "rows_in_use" in last:
        said = f"{last.get('rows_in_use')} rows, {last.get('waiting_for_kv', 0) + last.get('staged', 0)} waiting"
        if "kv_pages_used" in last:
            said += (f", pages {last['kv_pages_used']:.0f}/{last.get('kv_pages_total', 0):.0f}, parked "
                     f"{last.get('parked_for_memory', 0):.0f}, resumed {last.get('resumes', 0):.0f}")
        return said
    if "running" in last:
        return f"{last['running']:.0f} running, {last.get('waiting', 0):.0f} waiting"
    return "-"


def report(opts: BenchOptions, results: dict[str, Any], s: dict[str, Any], shape: dict[str, Any]) -> None:
    if not results:
        return
    rows = [[server, f"{s['kv_gib']:g} GiB", r["decoding_at_sample"], r["peak_decoding"], r["ttft_median_s"],
             r["tokens_per_s"], _server_at(r, s["seconds"])] for server, r in results.items()]
    opts.say(f"\nStreams decoding at once ({s['streams']} streams, max_tokens {s['max_tokens']}, {s['rows']} rows; "
             f"decoding: a token after the first in the last {WINDOW_S:g} s)")
    opts.say(table(["server", "KV memory", f"decoding at {s['seconds']:g} s", "peak", "TTFT p50 s", "tokens/s",
                    "server says"], rows))
    opts.say("\nStreams decoding in each second")
    width = max(len(r["decoding_per_window"]) for r in results.values())
    opts.say(table(["server", *(f"{k + 1}" for k in range(width))],
                   [[server, *r["decoding_per_window"]] for server, r in results.items()]))
    if "bytes_per_token" in shape:
        opts.say(f"\nKV: {shape['bytes_per_token']} bytes per token; {s['kv_gib']:g} GiB holds "
                 f"{shape['tokens_in_budget']} tokens, or {shape['rows_at_their_longest_in_budget']} rows each "
                 f"reserved at its longest (prompt {max(shape['prompt_tokens'])} + max_tokens {s['max_tokens']})")


def plot(opts: BenchOptions, results: dict[str, Any], s: dict[str, Any]):
    if not results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"baton": "tab:blue", "vllm": "tab:orange"}
    for server, r in results.items():
        ax.step([0.0, *r["window_end_s"]], [0, *r["decoding_per_window"]], where="pre", color=colors.get(server),
                label=f"{server}: decoding (client)")
        running = [(x["t"], x.get("rows_in_use", x.get("running"))) for x in r["server_samples"]
                   if x.get("rows_in_use", x.get("running")) is not None]
        if running:
            ax.plot(*zip(*running), ":", marker=".", color=colors.get(server), label=f"{server}: running (server)")
    ax.axhline(s["streams"], color="black", linewidth=0.6, linestyle="--", label=f"{s['streams']} streams sent")
    ax.axvline(s["seconds"], color="gray", linewidth=0.6)
    ax.set_xlabel("seconds since the streams were sent")
    ax.set_ylabel(f"streams decoding (a token after\nthe first in that {WINDOW_S:g} s)")
    ax.set_ylim(0, s["streams"] + 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{s['streams']} streams x {s['max_tokens']} tokens, KV {s['kv_gib']:g} GiB, {s['rows']} rows",
                 fontsize=10)
    fig.tight_layout()
    path = opts.plot_path("residency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
