"""Draws docs/img/architecture.png (1200 x 660 px): one request's path through Baton, and the side paths.

Run: .venv/bin/python docs/img/make_architecture.py
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch  # noqa: E402
from PIL import Image  # noqa: E402 - matplotlib's own dependency

MAIN = "#1f4e96"  # one request's path, steps 1-7
SIDE = "#777777"  # side paths
BOX, EDGE, INNER = "#eef3fb", "#2b4c7e", "#fdf6e3"

# name: (x, y, w, h, title, lines, fill); 1 unit = 50 px
BOXES = {
    "client": (0.3, 8.5, 3.6, 3.0, "client SDK", ["BatonClient,", "AsyncBatonClient,", "baton generate / batch"], BOX),
    "redis": (0.3, 3.4, 3.6, 1.8, "Redis", ["one index for all", "router replicas"], BOX),
    "k8s": (0.3, 0.5, 3.6, 1.8, "Kubernetes API", ["EndpointSlices", "per role"], BOX),
    "router": (5.2, 6.0, 5.6, 6.4, "router", ["RouterServicer: validate, tokenize,", "in-flight limit (max_inflight)",
                                              "Dispatcher + Picker: prefix", "match vs load, relay, recover"], BOX),
    "planner": (5.5, 6.3, 5.0, 1.5, "BatchLLM planner", ["GenerateBatch: groups, pins"], INNER),
    "index": (5.2, 3.3, 4.8, 1.9, "prefix index", ["InMemory | Redis backend"], BOX),
    "discovery": (5.2, 0.5, 4.8, 1.8, "discovery", ["static | Kubernetes"], BOX),
    "prefill": (13.0, 8.6, 5.4, 3.8, "prefill worker", ["PrefillQueue: priority, length", "PrefixCache: chained blocks",
                                                        "forward, first token sampled", "KV push, retried"], BOX),
    "decode": (13.0, 0.2, 7.0, 6.4, "decode worker", [""], BOX),
    "staging": (13.3, 3.7, 3.3, 1.8, "StagingPool", ["CPU, bounded bytes", "KV from a push"], INNER),
    "parked": (17.0, 3.7, 2.7, 1.8, "parked rows", ["KV on the host", "(preempted)"], INNER),
    "sched": (13.3, 2.3, 5.6, 0.8, "DecodeScheduler: staged, by priority", [], INNER),
    "batch": (13.3, 0.5, 6.4, 1.0, "BATON batch (BatchKV): one step, all rows", [], INNER),
    "peer": (21.0, 0.5, 2.7, 2.4, "decode", ["worker B", "(drain target)"], BOX),
}


def box(ax, x, y, w, h, title, lines, fill):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04,rounding_size=0.15", fc=fill, ec=EDGE, lw=1.4))
    if not lines:  # a one-line bar
        ax.text(x + w / 2, y + h / 2, title, ha="center", va="center", fontsize=10, weight="bold")
        return
    ax.text(x + w / 2, y + h - 0.38, title, ha="center", va="center", fontsize=12, weight="bold")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.95 - 0.52 * i, line, ha="center", va="center", fontsize=10)


def arrow(ax, start, end, color=MAIN, dashed=False, both=False, style="arc3"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="<|-|>" if both else "-|>", mutation_scale=15,
                                 lw=1.3 if dashed else 2.0, color=color, linestyle=(0, (4, 3)) if dashed else "-",
                                 connectionstyle=style, shrinkA=0, shrinkB=0))


def label(ax, x, y, text, color=MAIN, ha="center", size=9.5):
    ax.text(x, y, text, ha=ha, va="center", fontsize=size, color=color, linespacing=1.15)


def step(ax, x, y, n):
    """The numbered step, a filled circle on its arrow."""
    ax.add_patch(Circle((x, y), 0.27, fc=MAIN, ec="white", lw=1.2, zorder=3))
    ax.text(x, y, str(n), ha="center", va="center", fontsize=9, color="white", weight="bold", zorder=4)


def main() -> None:
    fig = plt.figure(figsize=(12, 6.6), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 24)
    ax.set_ylim(0, 13.2)
    ax.axis("off")
    for spec in BOXES.values():
        box(ax, *spec)
    ax.text(0.3, 12.75, "One request through Baton (every arrow is gRPC)", fontsize=14, weight="bold", va="center")

    # One request, steps 1-7.
    arrow(ax, (3.9, 10.9), (5.2, 10.9))
    step(ax, 4.55, 10.9, 1)
    label(ax, 4.55, 11.55, "Generate")
    arrow(ax, (10.8, 7.9), (13.0, 6.3))
    step(ax, 11.9, 7.1, 2)
    label(ax, 12.2, 7.75, "Decode +\npush token", ha="left")
    arrow(ax, (10.8, 11.6), (13.0, 11.6))
    step(ax, 11.9, 11.6, 3)
    label(ax, 11.9, 12.1, "Prefill")
    arrow(ax, (14.9, 8.6), (14.9, 5.5))
    step(ax, 14.9, 7.4, 4)
    label(ax, 15.35, 7.45, "KV push: header,\nCRC32 chunks, end\n(KVTransfer.Push)", ha="left")
    arrow(ax, (14.9, 3.7), (14.9, 3.1))
    arrow(ax, (14.9, 2.3), (14.9, 1.5))
    step(ax, 14.9, 1.9, 5)
    label(ax, 15.35, 1.9, "embedded at the next iteration", ha="left")
    arrow(ax, (13.0, 5.2), (10.8, 6.6))
    step(ax, 11.9, 5.9, 6)
    label(ax, 11.5, 5.4, "tokens", ha="right")
    arrow(ax, (5.2, 9.6), (3.9, 9.6))
    step(ax, 4.55, 9.6, 7)
    label(ax, 4.55, 9.0, "tokens,\nusage,\ntrace", size=9)

    # Side paths.
    arrow(ax, (18.35, 3.7), (18.35, 3.1), SIDE)
    arrow(ax, (19.35, 1.5), (19.35, 3.7), SIDE)
    label(ax, 19.68, 2.6, "park", SIDE, size=8.5)
    arrow(ax, (13.0, 9.6), (10.8, 9.6), SIDE, dashed=True)
    label(ax, 11.9, 9.95, "reply: KV events", SIDE)
    arrow(ax, (10.8, 10.6), (13.0, 10.6), SIDE, dashed=True)
    label(ax, 11.9, 10.95, "PinPrefix", SIDE)
    arrow(ax, (2.1, 8.5), (5.5, 7.0), SIDE, dashed=True, style="angle,angleA=-90,angleB=180,rad=0")
    label(ax, 2.3, 7.65, "GenerateBatch", SIDE, ha="left")
    arrow(ax, (7.6, 5.2), (7.6, 6.0), SIDE, dashed=True, both=True)
    label(ax, 8.9, 5.6, "match / events", SIDE)
    arrow(ax, (3.9, 4.25), (5.2, 4.25), SIDE, dashed=True, both=True)
    arrow(ax, (3.9, 1.4), (5.2, 1.4), SIDE, dashed=True)
    label(ax, 4.55, 1.8, "watch", SIDE)
    arrow(ax, (10.0, 1.4), (10.5, 6.0), SIDE, dashed=True, style="angle,angleA=0,angleB=90,rad=0")
    label(ax, 11.6, 3.0, "worker\naddresses", SIDE)
    arrow(ax, (20.0, 1.0), (21.0, 1.0), SIDE, dashed=True)
    label(ax, 22.35, 3.7, "drain: Handoff\npushes the KV", SIDE)

    # Legend, top right.
    ax.plot([19.2, 20.2], [12.1, 12.1], color=MAIN, lw=2.0)
    ax.text(20.4, 12.1, "one request, steps 1-7", fontsize=10, va="center")
    ax.plot([19.2, 20.2], [11.4, 11.4], color=SIDE, lw=1.3, linestyle=(0, (4, 3)))
    ax.text(20.4, 11.4, "side paths", fontsize=10, va="center")
    ax.text(19.2, 10.4, "KV crosses as raw tensor\nbytes; decoding never\nwaits on a prefill",
            fontsize=9.5, va="center", color="#333333", linespacing=1.2)

    out = Path(__file__).with_name("architecture.png")
    fig.savefig(out, dpi=100)
    # A 64-colour palette keeps the file small (about a third) with no visible loss on flat shapes.
    Image.open(out).convert("RGB").quantize(colors=64).save(out, optimize=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
