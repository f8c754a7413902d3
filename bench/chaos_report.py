"""The chaos suite's report: the table of outcomes by kind of request, what was in flight during
each kind of fault, the fault log, memory per role and per process life (RSS once warmed up, at
the end and at most, and its slope), what the workers still held once the load stopped, the
notable requests in full, and the plot of every process's memory with the faults marked."""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from baton.bench.chaos_faults import FAULTS
from baton.bench.chaos_load import KINDS, OUTCOMES
from baton.bench.common import BenchOptions, table

WARM_UP_S = 60.0  # a process's memory is compared from this long after its first sample (start-up churn settles)
LONG_LIFE_S = 120.0  # a slope is fitted only over lives at least this long


def report(opts: BenchOptions, chaos, **run_facts: Any) -> dict[str, Any]:
    """Prints the run's tables and returns its JSON document. chaos: the run's record (bench/chaos.py's
    Chaos), its tally, faults, problems and memory samples; run_facts go into the document as they are."""
    tally = chaos.tally
    totals = tally.totals()
    total = sum(totals.values())
    applied = Counter(f.kind for f in chaos.faults if f.applied)
    opts.say(f"\nchaos: {run_facts['duration']:.0f} s of load, {run_facts['clients']} clients, seed "
             f"{run_facts['seed']}, model {run_facts['model']}; {total} requests, faults "
             + ", ".join(f"{applied[k]} {k}" for k in FAULTS))
    if run_facts.get("decode_kv_tokens"):
        opts.say(f"decode KV: {run_facts['decode_kv_tokens']} tokens a worker; rows that left their pages (priority "
                 f"or memory) since each decode worker's last start: {run_facts['decode_preemptions']}")
    routing = run_facts.get("routing") or {}
    if routing:
        opts.say(f"the router's prefix index: {routing.get('requests', 0)} requests routed to a prefill worker, "
                 f"prediction accuracy {routing.get('accuracy', 0):.3f}; {routing.get('local_requests', 0)} prefilled "
                 f"on the decode worker holding their prefix, accuracy {routing.get('local_accuracy', 0):.3f}; "
                 f"{routing.get('pulled_requests', 0)} prefills read {routing.get('pulled_tokens', 0)} tokens of KV "
                 "from the decode worker holding them")
    kinds = [k for k in KINDS if k in tally.by_kind]
    rows = [[o, *[tally.by_kind[k].get(o, 0) for k in kinds], totals.get(o, 0),
             f"{100 * totals.get(o, 0) / max(total, 1):.1f}%"] for o in OUTCOMES]
    opts.say(table(["outcome", *kinds, "all", "share"], rows))
    if tally.reasons:
        opts.say("\nreasons:")
        for reason, n in sorted(tally.reasons.items(), key=lambda kv: -kv[1]):
            opts.say(f"  {n:6d}  {reason}")

    fault_rows = []
    per_fault: dict[str, Counter] = {}
    for kind in FAULTS:
        windows = [(f.start, f.end + 1.0) for f in chaos.faults if f.kind == kind and f.applied]
        seen: Counter = Counter()
        for start, end, outcome in tally.spans:
            if any(s <= end and start <= e for s, e in windows):
                seen[outcome] += 1
        per_fault[kind] = seen
        fault_rows.append([kind, applied[kind], sum(seen.values()), seen["exact"], seen["refused"],
                           seen["cancelled"], seen["wrong"], seen["lost"], seen["hung"]])
    opts.say()
    opts.say(table(["fault", "applied", "requests in flight", "exact", "refused", "cancelled", "wrong", "lost",
                    "hung"], fault_rows))
    for f in chaos.faults:
        opts.say(f"  {f.start:6.1f}s  {f.kind:<9} {f.role:<7} {f.target:<16} {f.detail}")

    memory = memory_summary(chaos.memory)
    opts.say()
    opts.say(table(["role (its processes)", "RSS start MiB", "RSS end MiB", "RSS max MiB",
                    "slopes of its processes MiB/min"],
                   [[role, m["start_mib"], m["end_mib"], m["max_mib"], _slopes(m["process_slopes_mib_per_min"])]
                    for role, m in memory.items()], digits=1))
    lives = process_lives(chaos.memory)
    if any(x["slope_mib_per_min"] is not None for x in lives):
        opts.say()
        opts.say(table([f"process (lives of {LONG_LIFE_S:.0f} s or more)", "alive s", f"RSS at +{WARM_UP_S:.0f}s MiB",
                        "RSS end MiB", "RSS max MiB", f"slope after +{WARM_UP_S:.0f}s MiB/min"],
                       [[f"{x['role']} {x['address']}", f"{x['from_s']:.0f}-{x['to_s']:.0f}", x["warm_mib"],
                         x["end_mib"], x["max_mib"], f"{x['slope_mib_per_min']:+.2f}"]
                        for x in lives if x["slope_mib_per_min"] is not None], digits=1))
    left = run_facts["left_behind"]
    opts.say("\nonce the load stopped: " + ("; ".join(f"{a} still holds {v}" for a, v in left.items()) if left else
                                          "every worker idle (no rows, queued prompts, staged or parked KV)"))
    for problem in chaos.problems:
        opts.say(f"  problem: {problem}")
    for n in tally.notable[:20]:
        opts.say(f"  {n['outcome']}: {n['kind']} at {n['start_s']:.1f}-{n['end_s']:.1f}s: {n['reason']}; "
                 f"{n['detail']} (faults meanwhile: {'; '.join(n['faults_meanwhile']) or 'none'})")
    if len(tally.notable) > 20:
        opts.say(f"  ... {len(tally.notable) - 20} more in the JSON")

    bad = {o: totals.get(o, 0) for o in ("wrong", "lost", "hung")}
    problems = {str(i): p for i, p in enumerate(chaos.problems)}
    if any(bad.values()):
        problems["goal"] = "failed: " + ", ".join(f"{n} {o}" for o, n in bad.items())
    files = plot_memory(opts, chaos)
    series: dict[str, list[list[float]]] = defaultdict(list)
    for t, role, _, _, rss in chaos.memory:
        if series[role] and series[role][-1][0] == round(t, 2):
            series[role][-1][1] += rss
        else:
            series[role].append([round(t, 2), rss])
    return {**run_facts, "requests": total, "outcomes": {o: totals.get(o, 0) for o in OUTCOMES},
            "by_kind": {k: dict(v) for k, v in tally.by_kind.items()}, "reasons": dict(tally.reasons),
            "faults": dict(applied), "fault_log": [f.as_dict() for f in chaos.faults],
            "outcomes_during_faults": {k: dict(v) for k, v in per_fault.items()},
            "notable": tally.notable, "memory_summary": memory, "memory": dict(series),
            "memory_processes": _per_process(chaos.memory), "memory_lives": lives, "problems": problems,
            "plots": files}


def _per_process(samples) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = defaultdict(list)
    for t, role, address, pid, rss in samples:
        out[f"{role} {address} pid {pid}"].append([round(t, 2), round(rss / (1 << 20), 1)])
    return dict(out)


def process_lives(samples) -> list[dict[str, Any]]:
    """Each process's own life (a worker started again is a new life): its span, its RSS once
    warmed up, at its end and at most, and the least-squares slope after the warm-up."""
    lives = []
    for name, life in _per_process(samples).items():
        role, address, _, pid = name.split()
        span = life[-1][0] - life[0][0]
        warm = [(t, v) for t, v in life if t - life[0][0] >= WARM_UP_S]
        lives.append({"role": role, "address": address, "pid": int(pid), "from_s": life[0][0], "to_s": life[-1][0],
                      "warm_mib": warm[0][1] if warm else None, "end_mib": life[-1][1],
                      "max_mib": max(v for _, v in life),
                      "slope_mib_per_min": slope_per_minute(warm) if span >= LONG_LIFE_S else None})
    return sorted(lives, key=lambda x: (x["role"], x["address"], x["from_s"]))


def slope_per_minute(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) samples, per minute; None under three samples."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (v - mv) for t, v in samples) / var


def memory_summary(samples) -> dict[str, dict[str, Any]]:
    """Per role: RSS of its processes together at the first and last sample and the most; and the
    slopes of its long-lived processes over their own lives, after their warm-up (a worker killed
    and started again begins small, so the slope of the sum says little)."""
    by_time: dict[str, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    for t, role, _, _, rss in samples:
        by_time[role][t] += rss
    lives = process_lives(samples)
    out = {}
    for role in sorted(by_time):
        mib = [(t, v / (1 << 20)) for t, v in sorted(by_time[role].items())]
        slopes = sorted(x["slope_mib_per_min"] for x in lives
                        if x["role"] == role and x["slope_mib_per_min"] is not None)
        out[role] = {"start_mib": mib[0][1], "end_mib": mib[-1][1], "max_mib": max(v for _, v in mib),
                     "process_slopes_mib_per_min": slopes, "samples": len(mib)}
    return out


def _slopes(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:+.2f}" if len(values) == 1 else f"{lo:+.2f}..{hi:+.2f}"


def plot_memory(opts: BenchOptions, chaos) -> list[str]:
    if not chaos.memory:
        return []
    try:
        from baton.bench import plots
    except ImportError:  # matplotlib missing: the table and JSON still say it all
        return []
    plt = plots.plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = {"router": "tab:gray", "prefill": "tab:blue", "decode": "tab:green"}
    for name, life in sorted(_per_process(chaos.memory).items()):
        role = name.split()[0]
        ax.plot([t for t, _ in life], [v for _, v in life], color=colors.get(role), linewidth=1,
                label=role if not any(line.get_label() == role for line in ax.get_lines()) else None)
    marks = {"kill": "tab:red", "stop": "tab:orange", "cut": "tab:purple", "slow-push": "tab:brown", "drain": "tab:green"}
    for kind, color in marks.items():
        for n, f in enumerate(f for f in chaos.faults if f.kind == kind and f.applied):
            ax.axvspan(f.start, max(f.end, f.start + 0.5), color=color, alpha=0.15, label=kind if n == 0 else None)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("RSS per process (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    ax.set_title("chaos: memory of every Baton process under load and faults")
    return [str(plots._save(fig, opts.plot_path("chaos_memory.png")))]
