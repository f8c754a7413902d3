"""Draws docs/img/architecture.png: one request's path through Baton.
Run: .venv/bin/python docs/img/make_architecture.py"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {  # name: (x, y, w, h, title, lines)
    "client": (0.2, 3.2, 2.2, 1.6, "client SDK", ["BatonClient", "stream / generate / batch"]),
    "router": (3.2, 2.6, 3.0, 2.8, "router", ["validate, admit, drain", "prefix index (memory | Redis)",
                                             "Picker: prefill + decode", "BatchLLM planner", "relay, recover"]),
    "prefill": (7.2, 4.2, 3.0, 2.2, "prefill worker", ["queue: priority, length", "prefix KV cache + pins",
                                                      "forward → first token"]),
    "decode": (7.2, 0.6, 3.0, 2.6, "decode worker", ["staging pool (CPU)", "BATON batch: admit,",
                                                    "park, release, move", "one step, all rows"]),
    "peer": (11.0, 0.6, 2.2, 1.6, "decode worker", ["(Handoff target)"]),
    "k8s": (3.2, 0.4, 3.0, 1.2, "discovery", ["static | EndpointSlices"]),
}
ARROWS = [  # (from, to, label, from side, to side)
    ("client", "router", "Generate", (2.4, 4.4), (3.2, 4.4)),
    ("router", "client", "tokens", (3.2, 3.6), (2.4, 3.6)),
    ("router", "prefill", "Prefill + push token", (6.2, 5.0), (7.2, 5.4)),
    ("router", "decode", "Decode + push token", (6.2, 3.0), (7.2, 2.4)),
    ("prefill", "decode", "KV push (raw chunks, CRC)", (8.7, 4.2), (8.7, 3.2)),
    ("decode", "router", "tokens", (7.2, 1.2), (6.2, 2.8)),
    ("decode", "peer", "Handoff: KV moves", (10.2, 1.4), (11.0, 1.4)),
    ("prefill", "router", "KV events", (7.2, 6.0), (6.2, 5.2)),
    ("k8s", "router", "workers", (4.7, 1.6), (4.7, 2.6)),
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 6.4), dpi=100)
    for x, y, w, h, title, lines in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc="#eef3fb", ec="#2b4c7e", lw=1.5))
        ax.text(x + w / 2, y + h - 0.3, title, ha="center", va="center", fontsize=12, weight="bold")
        for i, line in enumerate(lines):
            ax.text(x + w / 2, y + h - 0.75 - 0.4 * i, line, ha="center", va="center", fontsize=9.5)
    for _, _, label, start, end in ARROWS:
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#444"))
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.15, label, ha="center", fontsize=8.5,
                color="#7a2e2e")
    ax.set_xlim(0, 13.4)
    ax.set_ylim(0, 6.7)
    ax.axis("off")
    ax.set_title("One request through Baton: route, prefill, push KV, decode in the BATON batch", fontsize=13)
    out = Path(__file__).with_name("architecture.png")
    fig.savefig(out, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
