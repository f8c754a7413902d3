"""roofline: how close a batch-1 decode step comes to the memory-bound floor.

A decode step at batch 1 must read every weight once, so its floor is weight bytes divided by
memory bandwidth. Bandwidth is measured in the same run with a large tensor copy (read +
write bytes / time, best of several) using the same thread count the decode runs with. The
step is timed three ways: the bare transformers forward with its own cache, the executor's decode
on the BATON batch, and a whole LocalEngine.step (decode + sampling + bookkeeping).
"""
from __future__ import annotations

from typing import Any

from baton.bench import plots
from baton.bench.common import BenchOptions, Stopwatch, median, table


def measure_bandwidth(nbytes: int, repeats: int) -> tuple[float, float]:
    """(bytes/s, seconds) of the best copy of nbytes: each copy reads and writes nbytes."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    best = min(_time(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best, best


def _time(fn) -> float:
    clock = Stopwatch()
    fn()
    return clock()


def run(opts: BenchOptions) -> dict[str, Any]:
    import torch

    from baton.launch.local import LocalEngine
    from baton.decode_worker.core import DecodeConfig
    from baton.decode_worker.paged_rows import PagedRows
    from baton.engine.model import load_model
    from baton.engine.executors import make_runner
    from baton.sampling import SamplingParams

    steps = 8 if opts.quick else 40
    copy_mib = 128 if opts.quick else 512
    bandwidth, copy_s = measure_bandwidth(copy_mib << 20, repeats=3 if opts.quick else 8)
    loaded = load_model(opts.model, dtype=opts.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    floor_s = weight_bytes / bandwidth
    prompt = loaded.encode_chat([{"role": "user", "content": "Tell me a long story about the sea."}])

    # Bare transformers forward with its own cache, batch 1 (a separate copy keeps stock attention).
    hf = load_model(opts.model, dtype=opts.dtype)
    hf.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = hf.model(torch.tensor([prompt]), use_cache=True)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        hf_times = []
        for _ in range(steps):
            clock = Stopwatch()
            out = hf.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            hf_times.append(clock())

    # Baton: the executor's decode on a one-row BATON batch holding the prompt's KV.
    runner = make_runner(loaded)
    prefilled = runner.prefill(prompt)
    rows = PagedRows(loaded.kv_shape, num_pages=2 + (len(prompt) + steps) // 8, device=loaded.device)
    rows.add(prefilled.kv)
    token, runner_times = int(prefilled.logits.argmax()), []
    for _ in range(steps):
        clock = Stopwatch()
        token = int(runner.decode(rows.kv, rows.step(), [token])[0].argmax())
        runner_times.append(clock())

    # And a whole LocalEngine.step (decode + sampling + stop checks + scheduling), one row.
    engine = LocalEngine(loaded, DecodeConfig(max_rows=1))
    engine.submit(prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # prefill + admission + first decode
    step_times = []
    while engine.has_work() and len(step_times) < steps:
        clock = Stopwatch()
        engine.step()
        step_times.append(clock())

    rows = []
    for name, times in (("transformers forward (own cache)", hf_times), ("the executor's decode (paged KV)",
                        runner_times), ("LocalEngine.step (decode+sample)", step_times)):
        m = median(times)
        rows.append([name, 1e3 * m, 1e3 * min(times), m / floor_s, 100 * floor_s / m])
    opts.say(f"roofline: {loaded.name}, {loaded.dtype}, batch 1, {torch.get_num_threads()} torch thread(s)")
    opts.say(f"memory bandwidth (copy of {copy_mib} MiB, read+write): {bandwidth / 1e9:.2f} GB/s; weights "
             f"{weight_bytes / 2**20:.0f} MiB -> floor {1e3 * floor_s:.1f} ms per step")
    opts.say(table(["decode step", "median ms", "best ms", "x floor", "% of roofline"], rows, digits=1))
    files = [plots.bars(opts.plot_path("roofline.png"), "batch-1 decode step vs weight-read floor",
                        ["floor (weights / bandwidth)"] + [r[0].split(" (")[0] for r in rows],
                        {"median ms": [1e3 * floor_s] + [r[1] for r in rows]}, "milliseconds")]
    return {"bandwidth_bytes_per_s": bandwidth, "copy_bytes": copy_mib << 20, "copy_s": copy_s,
            "weight_bytes": weight_bytes, "floor_s": floor_s, "threads": torch.get_num_threads(),
            "steps": {"hf_forward_s": hf_times, "runner_decode_s": runner_times, "engine_step_s": step_times},
            "median_s": {"hf_forward": median(hf_times), "runner_decode": median(runner_times),
                         "engine_step": median(step_times)},
            "plots": [str(f) for f in files]}
