"""The SLO planner's decisions (planner/policy.py) and the cluster model it is tried on
(planner/simulator.py): plain Python, milliseconds."""
from __future__ import annotations

import math

import pytest

from baton.planner.policy import Objectives, Observation, Planner, PlannerConfig, Profile
from baton.planner.simulator import Simulation, diurnal_trace

PROFILE = Profile(prefill=((1, 0.02), (1000, 2.0)), step=((1, 0.03), (8, 0.06)), max_rows=8,
                  transfer_bytes_per_s=1e9, kv_bytes_per_token=46080)
OBJECTIVES = Objectives(ttft_s=2.0, itl_s=0.06)


def test_a_profile_interpolates_its_measured_points_and_says_how_many_rows_fit_an_itl():
    assert PROFILE.prefill_seconds(500) == pytest.approx(0.02 + 1.98 * 499 / 999)
    assert PROFILE.prefill_seconds(2000) == pytest.approx(0.02 + 1.98 * 1999 / 999)  # extrapolated
    assert PROFILE.step_seconds(4) == pytest.approx(0.03 + 0.03 * 3 / 7)
    assert PROFILE.rows_within(0.06) == 8 and PROFILE.rows_within(0.045) == 4 and PROFILE.rows_within(0.01) == 1
    assert PROFILE.transfer_seconds(1000) == pytest.approx(0.04608)
    with pytest.raises(ValueError, match="increasing order"):
        Profile(prefill=((10, 1.0), (5, 2.0)), step=PROFILE.step, max_rows=8)
    with pytest.raises(ValueError, match="replica bounds"):
        PlannerConfig(OBJECTIVES, min_decode=3, max_decode=2)


def seen(rps: float, prefill: int, decode: int, **extra) -> Observation:
    interval = 60.0
    return Observation(seconds=interval, requests=round(rps * interval), prompt_tokens=round(rps * interval * 100),
                       output_tokens=round(rps * interval * 60), prefill_workers=prefill, decode_workers=decode,
                       **extra)


def test_each_pool_is_sized_against_its_own_objective():
    planner = Planner(PlannerConfig(OBJECTIVES, utilisation=0.8), PROFILE)
    prefill, decode, why = planner.size(rate=10, prompt_tokens=100, output_tokens=60)
    # prefill: 10 req/s x 0.218 s of prefill = 2.18 worker-s/s at 80%; decode: 600 tokens/s over
    # 8 rows / 0.06 s = 133 tokens/s a worker, at 80%
    assert (prefill, decode) == (3, 6)
    assert "prefill-s/s" in why["prefill"] and "(8 rows;" in why["decode"]
    # A tighter ITL leaves fewer rows a worker: more decode workers for the same load.
    tight = Planner(PlannerConfig(Objectives(ttft_s=2.0, itl_s=0.045), utilisation=0.8), PROFILE)
    assert tight.size(10, 100, 60)[:2] == (3, 9)  # 4 rows at 0.043 s: 93 tokens/s a worker


def test_pools_grow_at_once_and_shrink_one_at_a_time_after_hysteresis_and_cooldown():
    config = PlannerConfig(OBJECTIVES, utilisation=0.8, scale_down_after=3, cooldown_s=200, smoothing=1.0,
                           trend_smoothing=0.0, max_prefill=8, max_decode=8, startup_s=0)
    planner = Planner(config, PROFILE)
    decision = planner.decide(seen(10, 1, 1), now=0)
    assert (decision.prefill, decision.decode) == (3, 6)  # up at once, by as many as needed
    counts, reasons = [], []
    prefill, decode = decision.prefill, decision.decode
    for t in range(60, 1260, 60):  # the load drops to a tenth; each decision is applied
        decision = planner.decide(seen(1, prefill, decode), now=t)
        prefill, decode = decision.prefill, decision.decode
        counts.append((prefill, decode))
        reasons.append(decision.reasons["decode"])
    # 3 intervals asking for fewer (t=60..180), but the cooldown runs to t=200: the first goes at
    # t=240; then 3 more intervals (to t=420) for the next, and so on, one worker at a time.
    assert counts[:4] == [(3, 6)] * 3 + [(2, 5)]
    assert "intervals" in reasons[0] and "cooldown" in reasons[2]
    assert counts[4:7] == [(2, 5)] * 3 and counts[7] == (1, 4)
    assert counts[-1] == (1, 1)  # what the tenth of the load needs, reached one worker at a time
    assert all(a[1] - b[1] in (0, 1) for a, b in zip(counts, counts[1:]))


def test_a_pool_behind_sizes_for_catching_up_not_only_for_keeping_up():
    config = PlannerConfig(OBJECTIVES, utilisation=0.8, interval_s=30, startup_s=60, smoothing=1.0,
                           trend_smoothing=0.0, max_prefill=32, max_decode=32)
    planner = Planner(config, PROFILE)
    keeping_up = planner.size(10, 100, 60)[:2]
    assert keeping_up == (3, 6)  # 2.16 prefill-s/s and 600 tokens/s, at 80%
    # One prefill worker for 2.16 prefill-s/s: 1.16 s of prompts queue each second until a worker
    # asked for now serves (60 s), to be cleared within the interval (30 s): 2.16 + 69.6 / 30.
    assert planner.size(10, 100, 60, prefill_workers=1)[0] == 6
    assert planner.size(10, 100, 60, prefill_workers=3)[0] == 3  # keeping up: no more
    # 2,000 tokens queued are 20 prompts of 100 (20 x 0.218 s), not one prompt of 2,000 (3.98 s)
    assert planner.size(10, 100, 60, backlog_tokens=2000, prefill_workers=3)[0] == math.ceil((2.158 + 4.316 / 30) / 0.8)
    # 100 streams decoding or waiting for a row need 100 / (8 rows at 80%) workers, whatever the rate
    assert planner.size(1, 100, 60, streams=100)[1] == 16


def test_decode_is_sized_by_the_tokens_requests_ask_for_not_by_what_a_saturated_pool_decodes():
    config = PlannerConfig(OBJECTIVES, utilisation=0.8, smoothing=1.0, trend_smoothing=0.0, max_decode=32)
    planner = Planner(config, PROFILE)
    # 10 req/s of 60 tokens (600 tokens/s) on 2 workers that decode 266 tokens/s between them: what
    # finished says 60 tokens a request, so 6 workers, not the 2 the decoded count alone would keep
    saturated = Observation(seconds=60, requests=600, prompt_tokens=60000, output_tokens=16000, finished=266,
                            prefill_workers=3, decode_workers=2)
    assert planner.decide(saturated, now=0).decode == 6


def test_a_missed_objective_adds_a_worker_and_bounds_hold():
    config = PlannerConfig(OBJECTIVES, max_prefill=4, max_decode=2, smoothing=1.0, trend_smoothing=0.0)
    planner = Planner(config, PROFILE)
    alone = planner.decide(seen(1, 1, 1, ttft_s=5.0), now=0)  # a long prompt, nothing waiting: no help
    assert alone.prefill == 1
    calm = planner.decide(seen(1, 1, 1, ttft_s=5.0, itl_s=0.2, prefill_backlog_tokens=300), now=60)
    assert (calm.prefill, calm.decode) == (2, 2)  # the load alone asks for 1 and 1
    assert "TTFT 5.00s over" in calm.reasons["prefill"] and "ITL" in calm.reasons["decode"]
    flood = planner.decide(seen(100, 2, 2), now=120)
    assert (flood.prefill, flood.decode) == (4, 2)
    with pytest.raises(ValueError, match="positive time"):
        planner.decide(Observation(0, 0, 0, 0, 1, 1), now=0)


def test_a_day_of_load_on_the_model_runs_the_planner_s_decisions():
    """A day compressed into an hour (the rate from 0.4 to 4 requests a second and back): the
    planner follows it with fewer worker-hours than static pools sized for the peak, moves the
    streams of the decode workers it removes, and every request finishes."""
    trace = diurnal_trace(hours=1, peak_rps=4, trough_rps=0.4, prompt_tokens=100, output_tokens=60, seed=1,
                          day_s=3600)
    config = PlannerConfig(OBJECTIVES, utilisation=0.7, interval_s=30, cooldown_s=60, scale_down_after=2)
    planner = Planner(config, PROFILE)
    followed = Simulation(PROFILE, OBJECTIVES, planner=planner, startup_s=20).run(trace)
    peak = planner.size(4, 100, 60)
    static = Simulation(PROFILE, OBJECTIVES, static=peak[:2]).run(trace)
    assert followed.requests == static.requests == len(trace) > 5000
    assert followed.unfinished == static.unfinished == 0
    assert sum(followed.worker_seconds.values()) < 0.8 * sum(static.worker_seconds.values())
    assert followed.moved > 0  # scale-downs moved streams with their KV
    assert static.met > 0.95 and followed.met > 0.8
    rates = [rate for _, rate, _, _ in followed.timeline]
    busiest = rates.index(max(rates))
    assert followed.timeline[busiest][3] > followed.timeline[0][3]  # more decode workers at the peak


def test_a_trace_has_the_shape_asked_for():
    trace = diurnal_trace(hours=1, peak_rps=5, trough_rps=1, prompt_tokens=200, output_tokens=50, seed=3, day_s=3600)
    first, middle = [a for a in trace if a.at < 300], [a for a in trace if 1650 <= a.at < 1950]
    assert len(middle) > 3 * len(first)
    assert 150 < sum(a.prompt_tokens for a in trace) / len(trace) < 250
    bursty = diurnal_trace(hours=1, peak_rps=5, trough_rps=1, prompt_tokens=200, output_tokens=50, seed=3,
                           day_s=3600, bursts=2)
    assert len(bursty) > len(trace)
    with pytest.raises(ValueError):
        diurnal_trace(hours=1, peak_rps=1, trough_rps=2, prompt_tokens=10, output_tokens=10)


def test_the_worker_removed_is_the_one_whose_loss_costs_least():
    from baton.planner.policy import WorkerLoad, choose_removals

    workers = [WorkerLoad("a:1", rows=3), WorkerLoad("b:1", rows=1, cached_bytes=900),
               WorkerLoad("c:1", rows=1, cached_bytes=100), WorkerLoad("d:1", rows=0, pinned_groups=1),
               WorkerLoad("e:1", rows=5, draining=True)]
    assert choose_removals(workers, 1) == ["e:1"]  # already draining
    assert choose_removals(workers, 3) == ["e:1", "c:1", "b:1"]  # then fewest rows, then least cache
    assert choose_removals(workers, 9) == ["e:1", "c:1", "b:1", "a:1"]  # never one with a pinned group
    assert choose_removals(workers, 0) == []


def test_an_interval_is_read_from_two_load_reports():
    from baton.planner.observe import Reading, observe, worker_loads

    before = Reading(100.0, {"p:1": {"requests_done": 10, "prompt_tokens_forwarded": 1000}},
                     {"d:1": {"decode_tokens_forwarded": 500, "rows_in_use": 2, "requests_finished": 4}})
    now = Reading(110.0, {"p:1": {"requests_done": 30, "prompt_tokens_forwarded": 3000, "queued_tokens": 40,
                                  "queued": 2, "prefix_cache_bytes": 7},
                          "p:2": {"requests_done": 5, "prompt_tokens_forwarded": 400, "draining": True}},
                  {"d:1": {"decode_tokens_forwarded": 900, "rows_in_use": 4, "kv_bytes_allocated": 30,
                           "kv_budget_bytes": 100, "staged": 1, "waiting_for_kv": 2, "requests_finished": 9},
                   "d:2": {"decode_tokens_forwarded": 100, "rows_in_use": 0, "kv_bytes_allocated": 60,
                           "kv_budget_bytes": 100}})
    seen = observe(before, now)
    # arrived: prefilled plus what the queue grew by (2 prompts, 40 tokens)
    assert (seen.seconds, seen.requests, seen.prompt_tokens, seen.output_tokens) == (10.0, 27, 2440, 500)
    assert (seen.finished, seen.decode_streams) == (5, 5)  # rows and staged; not those waiting for their KV
    assert (seen.prefill_workers, seen.decode_workers, seen.prefill_backlog_tokens) == (1, 2, 40)
    assert seen.itl_s == pytest.approx(10 * 4 / 400) and seen.kv_usage == pytest.approx(0.6)
    restarted = Reading(120.0, {"p:1": {"requests_done": 3}}, {})  # its counters began again
    assert observe(now, restarted).requests == 3
    loads = worker_loads(now)
    assert [(w.address, w.cached_bytes, w.draining) for w in loads["prefill"]] == [("p:1", 7, False), ("p:2", 0, True)]
    assert [(w.address, w.rows) for w in loads["decode"]] == [("d:1", 7), ("d:2", 0)]  # rows, staged, landing


def test_ttft_is_the_interval_s_percentile_of_the_router_s_histogram():
    from baton.planner.observe import Reading, interval_quantile, observe

    inf = float("inf")
    before = ((1.0, 10), (2.5, 20), (5.0, 20), (inf, 20))
    now = ((1.0, 10), (2.5, 30), (5.0, 110), (inf, 120))  # 100 more: 10 under 2.5 s, 80 to 5 s, 10 beyond
    assert interval_quantile(before, now, 0.9) == pytest.approx(2.5 + 2.5 * (90 - 10) / 80)
    assert interval_quantile(before, now, 0.05) == pytest.approx(1.0 + 1.5 * 5 / 10)
    assert interval_quantile(before, now, 0.99) == 5.0  # past the last bound: that bound
    assert interval_quantile(now, now, 0.9) is None  # nothing in the interval
    assert interval_quantile(now, ((1.0, 1), (2.5, 1), (5.0, 2), (inf, 2)), 0.9) == pytest.approx(2.5 + 2.5 * 0.8)
    seen = observe(Reading(0.0, {}, {}, before), Reading(10.0, {}, {}, now))
    assert seen.ttft_s == pytest.approx(5.0)
    assert observe(Reading(0.0, {}, {}), Reading(10.0, {}, {})).ttft_s is None


def test_a_large_pool_shrinks_by_a_quarter_at_a_time():
    config = PlannerConfig(OBJECTIVES, scale_down_after=1, cooldown_s=0, smoothing=1.0, trend_smoothing=0.0,
                           max_prefill=32, max_decode=32)
    planner = Planner(config, PROFILE)
    counts, decode = [], 20
    for t in range(6):
        decode = planner.decide(seen(0.1, 1, decode), now=60.0 * (t + 1)).decode
        counts.append(decode)
    assert counts == [15, 12, 9, 7, 6, 5]  # a quarter of what is left each time, each leaving worker drains


class CountingScaler:
    """A scaler that only counts (the real ones are tested against processes and the Kubernetes API)."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.counts = {"prefill": prefill, "decode": decode}
        self.calls: list[tuple[str, int, list[str]]] = []

    def replicas(self, pool: str) -> int:
        return self.counts[pool]

    def scale(self, pool: str, replicas: int, remove=()) -> None:
        self.calls.append((pool, replicas, list(remove)))
        self.counts[pool] = replicas


def busy_readings():
    """Two load reports 10 s apart: 40 prompts of 100 tokens prefilled and 2,400 tokens decoded."""
    from baton.planner.observe import Reading

    yield Reading(0.0, {"p:1": {"requests_done": 0}}, {"d:1": {"decode_tokens_forwarded": 0}})
    yield Reading(10.0, {"p:1": {"requests_done": 40, "prompt_tokens_forwarded": 4000}},
                  {"d:1": {"decode_tokens_forwarded": 2400, "requests_finished": 40, "rows_in_use": 8}})


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_loop_applies_each_change_logs_and_tells_it_and_a_dry_run_changes_nothing(dry_run):
    from baton.planner.service import PlannerLoop

    scaler, said, readings = CountingScaler(1, 1), [], busy_readings()
    loop = PlannerLoop(Planner(PlannerConfig(OBJECTIVES, startup_s=0), PROFILE), lambda: next(readings), scaler,
                       dry_run=dry_run, say=said.append)
    assert loop.step() is None  # the first reading only sets the start
    decision = loop.step()
    # 4 prompts/s of 0.22 s = 0.87 prefill-s/s; 240 tokens/s over 133 a worker; both at 80%
    assert (decision.prefill, decision.decode) == (2, 3)
    assert said == [line for line in said if line.startswith("planner: ")] and len(said) == 2
    assert all(("(dry run)" in line) == dry_run for line in said)
    assert scaler.calls == ([] if dry_run else [("prefill", 2, []), ("decode", 3, [])])
    assert loop.registry.get_sample_value("baton_planner_desired_workers", {"pool": "decode"}) == 3
    assert loop.registry.get_sample_value("baton_planner_changes_total", {"pool": "prefill", "direction": "up"}) == 1
