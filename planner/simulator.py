"""A discrete-event model of a Baton cluster under a day of load, for what one machine cannot show:
pools of workers whose costs come from a measured Profile, driven by an arrival trace, sized every
interval by the planner's own decision code (policy.Planner) or held static.

The model: a prompt waits for the first free prefill worker (one prompt at a time), its KV then
travels (the profile's transfer rate) to the decode worker with the fewest streams, which admits it
at its next step if it has a row free; every step gives each row a token and takes the profile's
step time for that many rows. TTFT is arrival to the first token the decode worker sends, ITL a
request's mean time between its tokens. A worker the planner adds serves after `startup_s`; one it
removes takes no new work, and a decode worker's rows move to the others with their KV (the drain
handoff) rather than being prefilled again. Worker-seconds count from a worker's start to its end.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from baton.planner.policy import Objectives, Observation, Planner, Profile


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt_tokens: int
    output_tokens: int


def diurnal_trace(hours: float, peak_rps: float, trough_rps: float, prompt_tokens: int, output_tokens: int,
                  seed: int = 0, bursts: int = 0, burst_factor: float = 3.0, burst_s: float = 300.0,
                  day_s: float = 86400.0) -> list[Arrival]:
    """Poisson arrivals whose rate follows a day of day_s seconds (trough at its start, peak at
    its middle: a raised cosine), with `bursts` windows of burst_s at burst_factor times the rate;
    prompt and output lengths drawn around their means (exponential spread, at least 1)."""
    if hours <= 0 or peak_rps <= 0 or not 0 <= trough_rps <= peak_rps:
        raise ValueError("a trace needs hours > 0 and 0 <= trough_rps <= peak_rps, peak_rps > 0")
    rng = random.Random(seed)
    end = hours * 3600
    burst_starts = sorted(rng.uniform(0, max(end - burst_s, 0)) for _ in range(bursts))
    top = peak_rps * (burst_factor if bursts else 1)

    def rate(t: float) -> float:
        base = trough_rps + (peak_rps - trough_rps) * (1 - math.cos(2 * math.pi * t / day_s)) / 2
        return base * (burst_factor if any(s <= t < s + burst_s for s in burst_starts) else 1)

    arrivals, t = [], 0.0
    while True:  # thinning: candidates at the top rate, each kept with rate(t) / top
        t += rng.expovariate(top)
        if t >= end:
            return arrivals
        if rng.random() * top <= rate(t):
            arrivals.append(Arrival(t, max(1, round(rng.expovariate(1 / prompt_tokens))),
                                    max(1, round(rng.expovariate(1 / output_tokens)))))


@dataclass
class _Request:
    arrival: Arrival
    first_token_at: float | None = None
    tokens_left: int = 0
    last_token_at: float = 0.0
    done_at: float | None = None


@dataclass
class _Worker:
    started: float
    serving_from: float
    stopped: float | None = None
    busy_until: float = 0.0  # prefill
    rows: list = field(default_factory=list)  # decode: requests holding a row
    waiting: list = field(default_factory=list)  # decode: landed, not yet in a row
    stepping: bool = False

    def serving(self, now: float) -> bool:
        return self.stopped is None and now >= self.serving_from


@dataclass
class SimResult:
    requests: int
    met: float  # share of requests meeting both objectives
    ttft_met: float
    itl_met: float
    worker_seconds: dict[str, float]
    timeline: list[tuple[float, float, int, int]]  # (time, arrivals per second, prefill, decode)
    moved: int  # decode streams moved with their KV by a scale-down
    unfinished: int
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    itl_p50: float = 0.0


class Simulation:
    """`Simulation(profile, objectives, planner=Planner(...))` or with `static=(prefill, decode)`."""

    def __init__(self, profile: Profile, objectives: Objectives, planner: Planner | None = None,
                 static: tuple[int, int] | None = None, startup_s: float = 60.0, interval_s: float | None = None):
        if (planner is None) == (static is None):
            raise ValueError("give a planner or static replica counts, not both")
        self.profile, self.objectives, self.planner, self.static = profile, objectives, planner, static
        self.startup_s = startup_s
        self.interval_s = interval_s or (planner.config.interval_s if planner else 60.0)

    def run(self, trace: list[Arrival]) -> SimResult:
        self._events: list = []
        self._order = itertools.count()
        self._queue: list[_Request] = []
        first = self.static or (self.planner.config.min_prefill, self.planner.config.min_decode)
        self._pools = {"prefill": [_Worker(0.0, 0.0) for _ in range(first[0])],
                       "decode": [_Worker(0.0, 0.0) for _ in range(first[1])]}
        self._requests = [_Request(a, tokens_left=a.output_tokens) for a in trace]
        self._window: list[_Request] = []  # finished their first token in this interval
        self._arrived = self._prompt = self._output = self._finished = 0
        self.moved, timeline = 0, []
        for request in self._requests:
            self._at(request.arrival.at, self._arrive, request)
        end = (trace[-1].at if trace else 0.0) + self.interval_s
        self._at(self.interval_s, self._tick, end, timeline)
        while self._events:
            now, _, action, args = heapq.heappop(self._events)
            action(now, *args)
        finish = max([end] + [r.done_at or 0.0 for r in self._requests])
        seconds = {pool: sum((w.stopped if w.stopped is not None else finish) - w.started for w in workers)
                   for pool, workers in self._pools.items()}
        done = [r for r in self._requests if r.done_at is not None]
        ttft_ok = [r.first_token_at - r.arrival.at <= self.objectives.ttft_s for r in done]
        itl_ok = [self._itl(r) <= self.objectives.itl_s for r in done]
        total = max(len(self._requests), 1)
        ttfts = sorted(r.first_token_at - r.arrival.at for r in done)
        return SimResult(len(self._requests), sum(a and b for a, b in zip(ttft_ok, itl_ok)) / total,
                         sum(ttft_ok) / total, sum(itl_ok) / total, seconds, timeline, self.moved,
                         len(self._requests) - len(done), ttft_p50=quantile(ttfts, 0.5), ttft_p90=quantile(ttfts, 0.9),
                         itl_p50=quantile(sorted(self._itl(r) for r in done), 0.5))

    # -- events ---------------------------------------------------------------------------------

    def _at(self, when: float, action, *args) -> None:
        heapq.heappush(self._events, (when, next(self._order), action, args))

    def _arrive(self, now: float, request: _Request) -> None:
        self._arrived += 1
        self._prompt += request.arrival.prompt_tokens
        self._queue.append(request)
        self._start_prefills(now)

    def _start_prefills(self, now: float) -> None:
        for worker in self._pools["prefill"]:
            if not self._queue:
                return
            if worker.serving(now) and worker.busy_until <= now:
                request = self._queue.pop(0)
                worker.busy_until = now + self.profile.prefill_seconds(request.arrival.prompt_tokens)
                landed = worker.busy_until + self.profile.transfer_seconds(request.arrival.prompt_tokens)
                self._at(worker.busy_until, lambda t: self._start_prefills(t))
                self._at(landed, self._land, request)

    def _land(self, now: float, request: _Request) -> None:
        live = [w for w in self._pools["decode"] if w.serving(now)] or [
            w for w in self._pools["decode"] if w.stopped is None]
        worker = min(live, key=lambda w: len(w.rows) + len(w.waiting))
        worker.waiting.append(request)
        self._wake(now, worker)

    def _wake(self, now: float, worker: _Worker) -> None:
        if not worker.stepping:
            worker.stepping = True
            self._at(max(now, worker.serving_from), self._step, worker)

    def _step(self, now: float, worker: _Worker) -> None:
        while worker.waiting and len(worker.rows) < self.profile.max_rows:
            request = worker.waiting.pop(0)
            if request.first_token_at is None:  # its first token (the prefill's) goes out on joining
                request.first_token_at = request.last_token_at = now
                self._window.append(request)
            worker.rows.append(request)
        if not worker.rows:
            worker.stepping = False
            return
        end = now + self.profile.step_seconds(len(worker.rows))
        self._at(end, self._stepped, worker)

    def _stepped(self, now: float, worker: _Worker) -> None:
        for request in list(worker.rows):
            request.tokens_left -= 1
            request.last_token_at = now
            self._output += 1
            if request.tokens_left <= 0:
                request.done_at = now
                worker.rows.remove(request)
                self._finished += 1
        if worker.stopped is not None:  # removed while stepping: what it holds moves on
            self._move_rows(now, worker)
            worker.stepping = False
            return
        self._step(now, worker)

    def _tick(self, now: float, end: float, timeline: list) -> None:
        prefill, decode = self._pools["prefill"], self._pools["decode"]
        live_p = [w for w in prefill if w.stopped is None]
        live_d = [w for w in decode if w.stopped is None]
        finished = self._window
        seen = Observation(
            seconds=self.interval_s, requests=self._arrived, prompt_tokens=self._prompt, output_tokens=self._output,
            prefill_workers=len(live_p), decode_workers=len(live_d),
            prefill_backlog_tokens=sum(r.arrival.prompt_tokens for r in self._queue), finished=self._finished,
            decode_streams=sum(len(w.rows) + len(w.waiting) for w in live_d),
            ttft_s=_p90([r.first_token_at - r.arrival.at for r in finished]),
            itl_s=_p90([self._itl(r) for r in finished if r.done_at is not None] or
                       [self.profile.step_seconds(len(w.rows)) for w in live_d if w.rows]),
            kv_usage=max((len(w.rows) + len(w.waiting)) / self.profile.max_rows for w in live_d) if live_d else 0.0)
        timeline.append((now, self._arrived / self.interval_s, len(live_p), len(live_d)))
        self._window, self._arrived, self._prompt, self._output, self._finished = [], 0, 0, 0, 0
        if self.planner is not None:
            decision = self.planner.decide(seen, now)
            self._resize("prefill", live_p, decision.prefill, now)
            self._resize("decode", live_d, decision.decode, now)
        if now < end or self._queue or any(w.rows or w.waiting for w in decode):
            self._at(now + self.interval_s, self._tick, end, timeline)

    def _resize(self, pool: str, live: list[_Worker], want: int, now: float) -> None:
        for _ in range(want - len(live)):
            worker = _Worker(now, now + self.startup_s)
            self._pools[pool].append(worker)
            if pool == "prefill":
                self._at(worker.serving_from, lambda t: self._start_prefills(t))
        for worker in sorted(live, key=lambda w: len(w.rows) + len(w.waiting))[:max(len(live) - want, 0)]:
            worker.stopped = max(now, worker.busy_until)  # the least loaded goes; a prompt under way ends
            if pool == "decode" and not worker.stepping:
                self._move_rows(now, worker)

    def _move_rows(self, now: float, worker: _Worker) -> None:
        """The drain handoff: a removed decode worker's streams go to the others with their KV."""
        moving, worker.rows, worker.waiting = worker.rows + worker.waiting, [], []
        for request in moving:
            self.moved += 1
            tokens = request.arrival.prompt_tokens + request.arrival.output_tokens - request.tokens_left
            self._at(now + self.profile.transfer_seconds(tokens), self._land, request)

    def _itl(self, request: _Request) -> float:
        steps = request.arrival.output_tokens - 1
        return (request.done_at - request.first_token_at) / steps if steps > 0 and request.done_at else 0.0


def _p90(values: list[float]) -> float | None:
    return quantile(sorted(values), 0.9) if values else None


def quantile(ordered: list[float], q: float, empty: float = 0.0) -> float:
    """The q-quantile of sorted values (the value at rank q * n), `empty` for none."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else empty
