"""planner (issue 35): the SLO planner over a day of load, in the cluster model of planner/simulator.py
fed by the profile measured here (planner.policy.CPU_SMOLLM2_FP32: SmolLM2-135M fp32 on one core),
against static pools sized by the same formulas for the day's peak (and for its bursts' peak).

The day: Poisson arrivals whose rate follows a raised cosine from the trough (midnight) to the
peak (noon), 10:1, with four 5-minute bursts at three times the rate, chat-sized requests (prompt
and output lengths drawn around their means). The planner runs its own decision code every 30 s
(its default interval; starting a worker takes 60 s); the table gives the share of requests
meeting the TTFT and ITL objectives and the worker-hours each way. Issue 35's bound: at least 95%
of requests within both objectives with at most 70% of static provisioning's worker-hours. Static
pools for the peak (sized by the planner's formulas for the day's peak rate, bursts aside) miss
that bar in the bursts, so the table also gives the smallest static pools that meet it (the
formulas at a higher rate, bisected).

Then the model against real processes, at the sizes this machine holds: a dynamic local cluster
of the default model (1 to 2 workers a pool), a compressed day of real requests through the SDK,
`baton up --planner`'s loop and scaler; and the simulator on the same arrivals, with the same
planner settings and the worker start time the run measured: once with the profile (what the
planner believes), once with the costs the run measured (its prefill seconds per prompt token and
its time between tokens, over the profile's: the workers share 2 cores). What it predicted and what
the run measured, side by side.

--quick: two hours compressed into one, no real run.
"""
from __future__ import annotations

from typing import Any

from baton.bench import plots
from baton.bench.common import BenchOptions, table

PEAK_RPS = 2.0  # and 4x that: pools of a few workers and of a dozen; the trough is a tenth
PROMPT_TOKENS, OUTPUT_TOKENS = 200, 100
TTFT_S, ITL_S = 4.0, 0.1  # a 1,200-token prompt prefills in 4 s on this core
STARTUP_S = 60.0  # from asking for a worker to its serving
BAR = 0.95


# The real run: a day compressed into REAL_MINUTES, sized for this machine's 2 cores: by the
# profile its peak needs 2 prefill workers and 1 decode worker, its trough 1 of each.
REAL_MINUTES, REAL_PEAK_RPS, REAL_PROMPT, REAL_OUTPUT = 8.0, 1.2, 300, 30
REAL_CONFIG = {"interval_s": 10.0, "cooldown_s": 30.0, "scale_down_after": 2, "startup_s": 20.0,
               "max_prefill": 2, "max_decode": 2}


def run(opts: BenchOptions) -> dict[str, Any]:
    days = {}
    for peak_rps in ((PEAK_RPS,) if opts.quick else (PEAK_RPS, 4 * PEAK_RPS)):
        days[peak_rps] = _day(opts, peak_rps)
    out = {"days": days, "plots": [p for day in days.values() for p in day["plots"]]}
    if not opts.quick:
        out["real"] = _real(opts)
        out["plots"] += out["real"]["plots"]
    return out


def _day(opts: BenchOptions, peak_rps: float) -> dict[str, Any]:
    from baton.planner.policy import CPU_SMOLLM2_FP32, Objectives, Planner, PlannerConfig
    from baton.planner.simulator import Simulation, diurnal_trace

    profile, objectives = CPU_SMOLLM2_FP32, Objectives(ttft_s=TTFT_S, itl_s=ITL_S)
    hours, day_s = (1, 3600.0) if opts.quick else (24, 86400.0)
    trace = diurnal_trace(hours=hours, peak_rps=peak_rps, trough_rps=peak_rps / 10, prompt_tokens=PROMPT_TOKENS,
                          output_tokens=OUTPUT_TOKENS, seed=35, bursts=4, day_s=day_s)
    config = PlannerConfig(objectives, max_prefill=32, max_decode=32, startup_s=STARTUP_S,
                           **({"cooldown_s": 60.0} if opts.quick else {}))  # otherwise the defaults
    planner = Planner(config, profile)
    peak = planner.size(peak_rps, PROMPT_TOKENS, OUTPUT_TOKENS)[:2]
    burst_peak = planner.size(3 * peak_rps, PROMPT_TOKENS, OUTPUT_TOKENS)[:2]
    beyond = sum(profile.prefill_seconds(a.prompt_tokens) > TTFT_S for a in trace) / len(trace)
    opts.say(f"\nplanner: {len(trace):,} requests over {hours} h ({peak_rps / 10:g}-{peak_rps:g} req/s, 4 bursts at "
             f"3x), ~{PROMPT_TOKENS} prompt and ~{OUTPUT_TOKENS} output tokens; objectives TTFT {TTFT_S} s, ITL "
             f"{ITL_S} s; profile: SmolLM2-135M fp32, one core (measured here)")
    opts.progress("planner: the day with the planner")
    followed = Simulation(profile, objectives, planner=planner, startup_s=STARTUP_S).run(trace)
    opts.progress(f"planner: the day with static pools for the peak ({peak[0]} prefill, {peak[1]} decode)")
    static = Simulation(profile, objectives, static=peak).run(trace)
    opts.progress(f"planner: the day with static pools for the bursts' peak ({burst_peak[0]} + {burst_peak[1]})")
    static_bursts = Simulation(profile, objectives, static=burst_peak).run(trace)
    # The smallest static pools meeting the bar: the formulas at k times the peak, k bisected
    # between 1 (misses it) and 3 (the bursts' peak).
    low, high, meeting, fewest = 1.0, 3.0, static_bursts, burst_peak
    if static.met >= BAR:
        meeting, fewest, high = static, peak, 1.0
    for _ in range(0 if static.met >= BAR or static_bursts.met < BAR else 4):
        k = (low + high) / 2
        pools = planner.size(k * peak_rps, PROMPT_TOKENS, OUTPUT_TOKENS)[:2]
        opts.progress(f"planner: static pools at {k:.2f}x the peak ({pools[0]} + {pools[1]})")
        result = Simulation(profile, objectives, static=pools).run(trace)
        if result.met >= BAR and sum(pools) <= sum(fewest):
            meeting, fewest, high = result, pools, k
        else:
            low = k
    rows, records = [], {}
    for name, result in (("planner", followed), (f"static for the peak, {peak[0]} + {peak[1]}", static),
                         (f"static, fewest meeting {BAR:.0%}, {fewest[0]} + {fewest[1]}", meeting),
                         (f"static for the bursts, {burst_peak[0]} + {burst_peak[1]}", static_bursts)):
        hours_used = {pool: seconds / 3600 for pool, seconds in result.worker_seconds.items()}
        records[name] = {"met": result.met, "ttft_met": result.ttft_met, "itl_met": result.itl_met,
                         "worker_hours": hours_used, "moved": result.moved, "unfinished": result.unfinished}
        rows.append([name, f"{100 * result.met:.1f}%", f"{100 * result.ttft_met:.1f}%", f"{100 * result.itl_met:.1f}%",
                     hours_used["prefill"], hours_used["decode"], sum(hours_used.values()), result.moved])
    opts.say(table(["pools", "both met", "TTFT met", "ITL met", "prefill worker-h", "decode worker-h", "worker-h",
                    "streams moved"], rows, digits=1))
    share = sum(followed.worker_seconds.values()) / sum(static.worker_seconds.values())
    share_bursts = sum(followed.worker_seconds.values()) / sum(static_bursts.worker_seconds.values())
    share_meeting = sum(followed.worker_seconds.values()) / sum(meeting.worker_seconds.values())
    opts.say(f"  the planner met both objectives for {100 * followed.met:.1f}% of requests with {100 * share:.0f}% of "
             f"the worker-hours of static pools for the peak ({100 * share_meeting:.0f}% of the fewest static pools "
             f"meeting {BAR:.0%}, {100 * share_bursts:.0f}% of those for the bursts' peak); issue 35: >= 95% with "
             "<= 70%")
    opts.say(f"  bound the workload allows: {100 * beyond:.1f}% of prompts take longer than the TTFT objective to "
             "prefill on an idle worker, so no provisioning meets it for them")
    timeline = followed.timeline
    path = plots.replicas_and_load(opts.plot_path(f"planner_day_{peak_rps:g}rps.png"),
                                   f"The planner over a simulated day (peak {peak_rps:g} req/s)",
                                   [t / 3600 for t, *_ in timeline], [r for _, r, _, _ in timeline],
                                   {"prefill": [p for *_, p, _ in timeline], "decode": [d for *_, d in timeline]},
                                   {"prefill": peak[0], "decode": peak[1]})
    return {"peak_rps": peak_rps, "requests": len(trace), "static": peak, "static_bursts": burst_peak, "results": records,
            "static_meeting": fewest, "worker_hours_share": share, "worker_hours_share_bursts": share_bursts,
            "worker_hours_share_meeting": share_meeting, "unattainable": beyond,
            "plots": [str(path)]}


def _real(opts: BenchOptions) -> dict[str, Any]:
    """A compressed day on real processes, and what the simulator predicted for it."""
    import math
    import random
    import threading
    import time
    from dataclasses import replace

    from baton.client import BatonClient
    from baton.planner.policy import CPU_SMOLLM2_FP32, Objectives, Planner, PlannerConfig
    from baton.planner.service import LocalScaler, PlannerLoop, reading_from
    from baton.planner.simulator import Arrival, Simulation, diurnal_trace, quantile
    from baton.launch.up import LocalCluster

    objectives = Objectives(ttft_s=TTFT_S, itl_s=ITL_S)
    config = PlannerConfig(objectives, **REAL_CONFIG)
    seconds = REAL_MINUTES * 60
    trace = diurnal_trace(hours=seconds / 3600, peak_rps=REAL_PEAK_RPS, trough_rps=REAL_PEAK_RPS / 10,
                          prompt_tokens=REAL_PROMPT, output_tokens=REAL_OUTPUT, seed=35, day_s=seconds)
    trace = [Arrival(a.at, min(a.prompt_tokens, 2000), min(a.output_tokens, 400)) for a in trace]
    rng = random.Random(35)
    prompts = [[rng.randrange(1000, 40000) for _ in range(a.prompt_tokens)] for a in trace]
    opts.say(f"\nplanner, real processes: {len(trace)} requests over {REAL_MINUTES:g} minutes "
             f"({REAL_PEAK_RPS / 10:g}-{REAL_PEAK_RPS:g} req/s, ~{REAL_PROMPT} prompt and ~{REAL_OUTPUT} output "
             f"tokens), the default model, pools of 1-2 workers, planner every {config.interval_s:g} s")

    class Timed(LocalScaler):  # when each pool changed, and how long a worker took to start
        def __init__(self, cluster, t0):
            super().__init__(cluster)
            self.t0, self.changes, self.starts = t0, [], []

        def scale(self, pool, replicas, remove=()):
            before, began = self.replicas(pool), time.monotonic()
            if replicas > before:
                self.changes.append((began - self.t0, pool, replicas))
            super().scale(pool, replicas, remove)
            if replicas > before:
                self.starts.append((time.monotonic() - began) / (replicas - before))
            else:
                self.changes.append((time.monotonic() - self.t0, pool, self.replicas(pool)))

    records: list[dict | None] = [None] * len(trace)
    with LocalCluster(prefill=1, decode=1, dynamic=True, max_rows=8, model=opts.model,
                      extra_env=opts.worker_env()) as cluster, \
            BatonClient(cluster.router_address, timeout=300) as client:
        client.generate(token_ids=prompts[0][:8], max_tokens=2)  # warm
        t0 = time.monotonic()
        scaler = Timed(cluster, t0)
        loop = PlannerLoop(Planner(config, CPU_SMOLLM2_FP32),
                           lambda: reading_from(client.cluster_status(), time.monotonic()), scaler)

        def one(i: int) -> None:
            arrival, first, last, tokens, prefill = t0 + trace[i].at, None, None, 0, None
            try:
                for chunk in client.stream(token_ids=prompts[i], max_tokens=trace[i].output_tokens, ignore_eos=True):
                    if chunk.token_ids:
                        last = time.monotonic()
                        first = first or last
                        tokens += len(chunk.token_ids)
                    if chunk.trace is not None:
                        prefill = chunk.trace.stage_seconds.get("prefill")
                records[i] = {"ttft": first - arrival, "itl": (last - first) / (tokens - 1) if tokens > 1 else 0.0,
                              "prefill": prefill}
            except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                records[i] = {"error": str(exc)[:200]}

        def send() -> None:
            for i, arrival in enumerate(trace):
                time.sleep(max(0.0, t0 + arrival.at - time.monotonic()))
                threading.Thread(target=one, args=(i,), daemon=True).start()

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        timeline = []
        while sender.is_alive() or any(r is None for r in records):
            began = time.monotonic()
            loop.step()  # in this thread: it started the cluster's processes (lifeline)
            timeline.append((began - t0, len(cluster.prefill_addrs), len(cluster.decode_addrs)))
            opts.progress(f"planner, real: {sum(r is not None for r in records)}/{len(trace)} requests done, "
                          f"{timeline[-1][1]} + {timeline[-1][2]} workers at {timeline[-1][0]:.0f} s")
            time.sleep(max(0.0, config.interval_s - (time.monotonic() - began)))
        end = time.monotonic() - t0
        moved = sum(w.decode.get("migrations_in", 0) for w in client.cluster_status().workers if w.decode)
    measured_seconds = _worker_seconds(scaler.changes, end)
    startup = sum(scaler.starts) / len(scaler.starts) if scaler.starts else config.startup_s
    opts.progress(f"planner: the simulator on the same arrivals (workers start in {startup:.1f} s, as measured)")
    model = Simulation(CPU_SMOLLM2_FP32, objectives, planner=Planner(config, CPU_SMOLLM2_FP32),
                       startup_s=startup).run(trace)
    done = [r for r in records if r and "error" not in r]
    # The costs the run measured, over the profile's: prefill seconds (the trace's prefill stage) and
    # the time between tokens, each as a median ratio; the model again with the profile so scaled.
    prefill_ratio = quantile(sorted(r["prefill"] / CPU_SMOLLM2_FP32.prefill_seconds(trace[i].prompt_tokens)
                                      for i, r in enumerate(records) if r and r.get("prefill")), 0.5) or 1.0
    step_ratio = quantile(sorted(r["itl"] for r in done if r["itl"]), 0.5) / model.itl_p50 if model.itl_p50 else 1.0
    measured_profile = replace(CPU_SMOLLM2_FP32,
                               prefill=tuple((t, s * prefill_ratio) for t, s in CPU_SMOLLM2_FP32.prefill),
                               step=tuple((r, s * step_ratio) for r, s in CPU_SMOLLM2_FP32.step))
    opts.progress(f"planner: the simulator with the costs the run measured (prefill x{prefill_ratio:.2f}, "
                  f"step x{step_ratio:.2f})")
    calibrated = Simulation(measured_profile, objectives, planner=Planner(config, CPU_SMOLLM2_FP32),
                            startup_s=startup).run(trace)
    ttft = sorted(r["ttft"] for r in done)
    ttft_met = sum(t <= TTFT_S for t in ttft) / len(trace)
    itl_met = sum(r["itl"] <= ITL_S for r in done) / len(trace)
    both = sum(r["ttft"] <= TTFT_S and r["itl"] <= ITL_S for r in done) / len(trace)
    rows = [["real", f"{100 * both:.1f}%", f"{100 * ttft_met:.1f}%", f"{100 * itl_met:.1f}%",
             f"{quantile(ttft, 0.5, math.nan):.2f} / {quantile(ttft, 0.9, math.nan):.2f}", measured_seconds["prefill"] / 60,
             measured_seconds["decode"] / 60, len(trace) - len(done), moved],
            *[[name, f"{100 * m.met:.1f}%", f"{100 * m.ttft_met:.1f}%", f"{100 * m.itl_met:.1f}%",
               f"{m.ttft_p50:.2f} / {m.ttft_p90:.2f}", m.worker_seconds["prefill"] / 60, m.worker_seconds["decode"] / 60,
               m.unfinished, m.moved]
              for name, m in (("simulated, profile", model),
                              (f"simulated, measured costs (x{prefill_ratio:.2f}, x{step_ratio:.2f})", calibrated))]]
    opts.say(table(["run", "both met", "TTFT met", "ITL met", "TTFT p50 / p90 s", "prefill worker-min",
                    "decode worker-min", "failed", "streams moved"], rows, digits=1))
    minutes = [t / 60 for t, *_ in timeline]
    path = plots.replicas_measured_and_modelled(
        opts.plot_path("planner_real.png"),
        f"The planner on real processes vs the simulator with their costs ({REAL_MINUTES:g} min)",
        (minutes, {"prefill": [p for _, p, _ in timeline], "decode": [d for *_, d in timeline]}),
        ([t / 60 for t, *_ in calibrated.timeline], {"prefill": [p for *_, p, _ in calibrated.timeline],
                                                      "decode": [d for *_, d in calibrated.timeline]}),
        ([t / 60 for t, *_ in model.timeline], [r for _, r, _, _ in model.timeline]))
    return {"requests": len(trace), "startup_s": startup, "errors": [r["error"] for r in records if r and "error" in r],
            "measured": {"met": both, "ttft_met": ttft_met, "itl_met": itl_met, "worker_seconds": measured_seconds,
                         "ttft_p50": quantile(ttft, 0.5, math.nan), "ttft_p90": quantile(ttft, 0.9, math.nan), "moved": moved,
                         "timeline": timeline},
            "simulated": _summary(model), "simulated_measured_costs": _summary(calibrated),
            "measured_cost_ratios": {"prefill": prefill_ratio, "step": step_ratio},
            "plots": [str(path)]}


def _worker_seconds(changes: list[tuple[float, str, int]], end: float) -> dict[str, float]:
    """Worker-seconds per pool from its changes (time, pool, workers after), each pool at 1 from 0."""
    seconds = {}
    for pool in ("prefill", "decode"):
        at, count, total = 0.0, 1, 0.0
        for t, changed, workers in sorted(changes):
            if changed == pool:
                total += count * (t - at)
                at, count = t, workers
        seconds[pool] = total + count * (end - at)
    return seconds


def _summary(result) -> dict[str, Any]:
    return {"met": result.met, "ttft_met": result.ttft_met, "itl_met": result.itl_met,
            "worker_seconds": result.worker_seconds, "ttft_p50": result.ttft_p50, "ttft_p90": result.ttft_p90,
            "moved": result.moved, "timeline": result.timeline}
