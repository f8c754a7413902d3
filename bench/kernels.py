"""kernels: the Triton decode attention benchmark (bench/decode_attention.py) as a suite.

Needs a CUDA GPU; elsewhere it says so and records {"skipped": reason}.
"""
from __future__ import annotations

import contextlib
from typing import Any

from baton.bench import plots
from baton.bench.common import BenchOptions


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.bench import decode_attention

    with contextlib.redirect_stdout(opts.out):  # its table joins ours (stderr under --json)
        result = decode_attention.run(opts.quick)
    if "skipped" in result:
        return {"kernels": result, "skipped": result["skipped"], "plots": []}
    rows = result["decode"]
    files = [plots.bars(opts.plot_path("kernels.png"), f"decode attention bandwidth, {result['device']}",
                        [r["shape"] for r in rows],
                        {"Triton": [r["triton_gbps"] for r in rows], "SDPA": [r["sdpa_gbps"] for r in rows]},
                        "GB/s of useful KV")]
    return {"kernels": result, "plots": [str(f) for f in files]}
