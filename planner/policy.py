"""How many prefill and how many decode workers the next interval needs, from what the last ones
measured: plain Python, no I/O (the planner process and the simulator both call it).

Each pool is sized apart, against its own objective, from a profile of what one worker does on
this hardware (DistServe's and Dynamo's planner's idea):

- prefill: the prompt work predicted to arrive per second, in worker-seconds of prefill (the
  profile's prefill time of the mean prompt), plus the backlog to clear within the next interval
  (what is queued, and what will queue until a worker asked for now serves: `startup_s`), over a
  target utilisation; queueing behind each other is what TTFT loses first.
- decode: the tokens per second predicted to arrive (requests times the tokens a request decodes)
  over what one worker gives while its step stays within the ITL target (the rows it then holds,
  over that step's time), at the same target utilisation; and at least the rows for the streams
  already there.

The load comes from a Holt predictor (level and trend, smoothed) of arrivals and prompt tokens;
the tokens a request decodes from the requests that finished (what a saturated pool decodes is its
capacity, not the demand).
When an objective is missed the pool gains a worker even if the prediction says it has enough (the
profile was optimistic; for TTFT, only while prompts wait: a long prompt alone is not sped up by
more workers); a pool shrinks only after `scale_down_after` intervals in a row asked for
less and `cooldown_s` after its last change, by a quarter of its workers at most (one from a small
pool); it grows at once, by as many as needed. Every decision carries its reasons, for the log line and the metrics.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Profile:
    """One worker's costs on the hardware it runs on: (tokens, seconds) for a prompt's prefill and
    (rows, seconds) for a decode step, measured points interpolated linearly (extrapolated from
    the last two), and the KV transfer's rate."""

    prefill: tuple[tuple[int, float], ...]
    step: tuple[tuple[int, float], ...]
    max_rows: int
    transfer_bytes_per_s: float = 1e9
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        for name, points in (("prefill", self.prefill), ("step", self.step)):
            if len(points) < 2 or any(b[0] <= a[0] for a, b in zip(points, points[1:])):
                raise ValueError(f"profile {name} needs 2 or more points in increasing order, got {points}")
            if any(x < 0 or y <= 0 for x, y in points):
                raise ValueError(f"profile {name} points must be (count >= 0, seconds > 0), got {points}")
        if self.max_rows < 1 or self.transfer_bytes_per_s <= 0 or self.kv_bytes_per_token < 0:
            raise ValueError(f"profile needs max_rows >= 1 and a positive transfer rate, got {self}")

    def prefill_seconds(self, tokens: float) -> float:
        return _interpolate(self.prefill, tokens)

    def step_seconds(self, rows: float) -> float:
        return _interpolate(self.step, max(rows, 1))

    def transfer_seconds(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def rows_within(self, itl_s: float) -> int:
        """The most rows a decode worker holds while its step takes at most itl_s (at least 1)."""
        fitting = [rows for rows in range(1, self.max_rows + 1) if self.step_seconds(rows) <= itl_s]
        return max(fitting, default=1)


def _interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-6)


@dataclass(frozen=True)
class Objectives:
    ttft_s: float  # time to first token each request should meet
    itl_s: float  # time between its tokens

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"objectives must be positive seconds, got {self}")


@dataclass(frozen=True)
class PlannerConfig:
    objectives: Objectives
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    interval_s: float = 30.0
    utilisation: float = 0.8  # of a prefill worker's time, and of a decode worker's rows, the plan fills
    scale_down_after: int = 3  # intervals in a row asking for fewer workers before one goes
    cooldown_s: float = 120.0  # after a pool changed, before it may shrink
    smoothing: float = 0.5  # Holt: weight of the newest interval in the level
    trend_smoothing: float = 0.3  # and in the trend
    startup_s: float = 60.0  # from asking for a worker to its serving (image, model load, warm-up)

    def __post_init__(self) -> None:
        if not 1 <= self.min_prefill <= self.max_prefill or not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(f"replica bounds need 1 <= min <= max, got prefill {self.min_prefill}..{self.max_prefill}, "
                             f"decode {self.min_decode}..{self.max_decode}")
        if not (0 < self.utilisation <= 1 and 0 < self.smoothing <= 1 and 0 <= self.trend_smoothing <= 1):
            raise ValueError("utilisation and smoothing must be in (0, 1]")
        if self.interval_s <= 0 or self.cooldown_s < 0 or self.scale_down_after < 1 or self.startup_s < 0:
            raise ValueError("interval_s > 0, cooldown_s >= 0, startup_s >= 0 and scale_down_after >= 1 are required")


@dataclass(frozen=True)
class Observation:
    """One interval of the cluster, as its metrics tell it."""

    seconds: float
    requests: int  # arrived in the interval
    prompt_tokens: int  # their prompts' tokens (prefix cache hits excluded: work actually done)
    output_tokens: int  # tokens decoded in the interval
    prefill_workers: int
    decode_workers: int
    prefill_backlog_tokens: int = 0  # queued, not yet prefilled, at the interval's end
    finished: int = 0  # requests that finished decoding in the interval
    decode_streams: int = 0  # at its end: streams decoding, plus those landed that wait for a row
    ttft_s: float | None = None  # the interval's high percentile (None: no request finished one)
    itl_s: float | None = None
    kv_usage: float = 0.0  # decode KV pages in use, 0..1, the fullest worker


@dataclass(frozen=True)
class Decision:
    prefill: int
    decode: int
    reasons: dict[str, str] = field(default_factory=dict)


_MEMORY = 0.9  # weight of the past in the tokens-per-request ratio, per interval


class _Holt:
    """Double exponential smoothing of one rate; predicts the next interval's value."""

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def add(self, value: float) -> None:
        if self.level is None:
            self.level = value
            return
        previous = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (self.level + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def next(self) -> float:
        return max(0.0, (self.level or 0.0) + self.trend)


class Planner:
    """Feed it one Observation per interval; it answers the replica counts to set."""

    def __init__(self, config: PlannerConfig, profile: Profile) -> None:
        self.config, self.profile = config, profile
        self._rates = {k: _Holt(config.smoothing, config.trend_smoothing) for k in ("requests", "prompt", "output")}
        # Tokens a request decodes, over the requests that finished: a ratio of totals, not of one
        # interval's rates (a saturated decode pool decodes what it can, not what arrived).
        self._decoded = self._finished = 0.0
        self._lower = {"prefill": 0, "decode": 0}  # intervals in a row that asked for fewer
        self._changed_at = {"prefill": -math.inf, "decode": -math.inf}
        self._backlog = 0  # prompt tokens waiting at the last interval's end

    def decide(self, seen: Observation, now: float) -> Decision:
        if seen.seconds <= 0:
            raise ValueError(f"an observation covers a positive time, got {seen.seconds}")
        for key, count in (("requests", seen.requests), ("prompt", seen.prompt_tokens), ("output", seen.output_tokens)):
            self._rates[key].add(count / seen.seconds)
        self._decoded = self._decoded * _MEMORY + seen.output_tokens
        self._finished = self._finished * _MEMORY + seen.finished
        rate = self._rates["requests"].next()
        prompt = self._rates["prompt"].next() / rate if rate > 0 else 0.0
        if self._finished >= 1:
            output = self._decoded / self._finished
        else:  # nothing finished yet: what was decoded per arrival
            output = self._rates["output"].next() / rate if rate > 0 else 0.0
        objectives = self.config.objectives
        want_prefill, want_decode, reasons = self.size(rate, prompt, output, seen.prefill_backlog_tokens,
                                                       seen.prefill_workers, seen.decode_streams)
        # A missed TTFT with prompts waiting is queueing: the pool does not shrink then, and gains a
        # worker while the queue grows (a long prompt alone missing it is not helped by more workers).
        backlog_grew = seen.prefill_backlog_tokens > self._backlog
        self._backlog = seen.prefill_backlog_tokens
        if seen.ttft_s is not None and seen.ttft_s > objectives.ttft_s and seen.prefill_backlog_tokens \
                and want_prefill <= seen.prefill_workers:
            want_prefill = seen.prefill_workers + (1 if backlog_grew else 0)
            reasons["prefill"] += (f"; TTFT {seen.ttft_s:.2f}s over {objectives.ttft_s:.2f}s with prompts waiting"
                                   f"{' and their queue growing: one more' if backlog_grew else ': holding'}")
        if ((seen.itl_s is not None and seen.itl_s > objectives.itl_s) or seen.kv_usage > 0.9) \
                and want_decode <= seen.decode_workers:
            want_decode = seen.decode_workers + 1
            reasons["decode"] += (f"; ITL {seen.itl_s:.3f}s over target" if seen.itl_s and seen.itl_s > objectives.itl_s
                                  else f"; KV {seen.kv_usage:.0%} used") + ": one more"

        prefill = self._settle("prefill", seen.prefill_workers, want_prefill, self.config.min_prefill,
                               self.config.max_prefill, now, reasons)
        decode = self._settle("decode", seen.decode_workers, want_decode, self.config.min_decode,
                              self.config.max_decode, now, reasons)
        return Decision(prefill, decode, reasons)

    def size(self, rate: float, prompt_tokens: float, output_tokens: float, backlog_tokens: int = 0,
             prefill_workers: int | None = None, streams: int = 0) -> tuple[int, int, dict[str, str]]:
        """The workers a load needs (before bounds and hysteresis): prefill, decode, why. With the
        pools' present state (prompt tokens queued, prefill workers, decode streams in rows or landed)
        it also sizes for catching up, not only for keeping up."""
        objectives, utilisation = self.config.objectives, self.config.utilisation
        # Prefill: worker-seconds of prompt work per second, plus the backlog cleared within the next
        # interval (sized to clear it within the TTFT, a burst's queue asked for workers that came
        # when it was gone). The backlog is what is queued now (at the mean prompt's cost per token:
        # many prompts, not one long one) and what will queue until a worker asked for now serves.
        work = rate * self.profile.prefill_seconds(prompt_tokens) if rate > 0 else 0.0
        per_token = self.profile.prefill_seconds(max(prompt_tokens, 1)) / max(prompt_tokens, 1)
        backlog = backlog_tokens * per_token
        if prefill_workers is not None:
            backlog += max(0.0, work - prefill_workers) * self.config.startup_s
        horizon = max(objectives.ttft_s, self.config.interval_s)
        prefill = math.ceil((work + backlog / horizon) / utilisation - 1e-9)
        # Decode: tokens per second over what one worker gives while its step stays within the ITL
        # target (its rows at that step time).
        rows = self.profile.rows_within(objectives.itl_s)
        per_worker = rows / self.profile.step_seconds(rows)
        tokens = rate * output_tokens
        decode = math.ceil(tokens / (per_worker * utilisation) - 1e-9)
        # and rows for every stream already there (a burst's prompts land faster than they finish)
        decode = max(decode, math.ceil(streams / (rows * utilisation) - 1e-9))
        return prefill, decode, {
            "prefill": f"{rate:.2f} req/s x {prompt_tokens:.0f} prompt tokens = {work:.2f} prefill-s/s, backlog "
                       f"{backlog:.0f} prefill-s ({backlog_tokens} tokens queued), at {utilisation:.0%}: {prefill}",
            "decode": f"{rate:.2f} req/s x {output_tokens:.0f} tokens = {tokens:.0f} tokens/s; a worker gives "
                      f"{per_worker:.0f} within ITL ({rows} rows; {streams} streams now), at {utilisation:.0%}: "
                      f"{decode}"}

    def _settle(self, pool: str, current: int, wanted: int, low: int, high: int, now: float,
                reasons: dict[str, str]) -> int:
        """Bounds, then: grow at once; shrink (a quarter at most) after enough intervals asking and the cooldown."""
        wanted = min(max(wanted, low), high)
        if wanted >= current:
            self._lower[pool] = 0
            if wanted > current:
                self._changed_at[pool] = now
            return wanted
        self._lower[pool] += 1
        if self._lower[pool] < self.config.scale_down_after:
            reasons[pool] += f"; holding {current} ({self._lower[pool]} of {self.config.scale_down_after} intervals)"
            return current
        if now - self._changed_at[pool] < self.config.cooldown_s:
            reasons[pool] += f"; holding {current} (cooldown)"
            return current
        self._lower[pool] = 0
        self._changed_at[pool] = now
        return max(wanted, current - max(1, current // 4))  # a quarter at most: each leaving worker drains


@dataclass(frozen=True)
class WorkerLoad:
    """What removing one worker would cost, from its load report."""

    address: str
    rows: int = 0  # decode: streams it holds (each must move, with its KV)
    cached_bytes: int = 0  # prefill: prefix cache it would take with it
    pinned_groups: int = 0  # prefill: batch groups pinned to it (BatchLLM); such a worker stays
    draining: bool = False  # already going


def choose_removals(workers: list[WorkerLoad], count: int) -> list[str]:
    """The `count` workers whose removal costs least: none with a pinned batch group, then fewest
    rows to move, then least cached prefix; a draining one first of all. Fewer than `count` if
    only pinned workers are left."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    free = [w for w in workers if not w.pinned_groups]
    ranked = sorted(free, key=lambda w: (not w.draining, w.rows, w.cached_bytes, w.address))
    return [w.address for w in ranked[:count]]


# SmolLM2-135M-Instruct in fp32 on one core of the 2-vCPU machine Baton is developed on (docs/bench.md:
# `transfer`'s prefills, the decode steps of `structured` and `engine`): `baton up --planner`'s default.
CPU_SMOLLM2_FP32 = Profile(prefill=((23, 0.078), (365, 0.896), (1457, 5.05), (4096, 36.0)),
                           step=((1, 0.026), (8, 0.056)), max_rows=8, transfer_bytes_per_s=1.2e9,
                           kv_bytes_per_token=46080)


def load_profile(path: str = "") -> Profile:
    """The profile in the JSON file at `path`; CPU_SMOLLM2_FP32 without one."""
    if not path:
        return CPU_SMOLLM2_FP32
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return profile_from_json(json.load(f))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the planner profile {path}: {exc}") from None


def profile_from_json(content: dict) -> Profile:
    """A Profile from {"prefill": [[tokens, seconds], ...], "step": [[rows, seconds], ...],
    "max_rows": N, "transfer_bytes_per_s": x, "kv_bytes_per_token": n} (the last two optional)."""
    try:
        return Profile(prefill=tuple((int(t), float(s)) for t, s in content["prefill"]),
                       step=tuple((int(r), float(s)) for r, s in content["step"]), max_rows=int(content["max_rows"]),
                       transfer_bytes_per_s=float(content.get("transfer_bytes_per_s", 1e9)),
                       kv_bytes_per_token=int(content.get("kv_bytes_per_token", 0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a planner profile needs prefill [[tokens, seconds], ...], step [[rows, seconds], ...] "
                         f"and max_rows: {exc}") from None
