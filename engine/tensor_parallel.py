"""A tensor-parallel worker: one process per rank, each holding its part of the model
(`engine.shard`), run as one unit.

Rank 0 is the worker itself: its scheduler, servicers and KV plumbing see one runner
(`TensorParallelRunner`) and one page pool (`ShardedKV`) with the whole model's KV shape, exactly
as at TP=1. Each call on them is broadcast to the other ranks (this module's `__main__`, started
by `start`), which run the same forward on their parts; ranks gather between ops. KV leaves and
enters the worker whole (every KV head), so transfers, prefix caches, parking and drains work on
whole KV whatever the TP degree at either end, and a worker at TP a hands KV to one at TP b.

A rank that dies takes the worker down with it (`os._exit`): the router sees a worker gone, as
when one is killed, and fails its requests over; a rank whose worker died ends itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import torch

from baton.engine.collectives import SHM_SLOT_BYTES, Group, host_store, join_store
from baton.engine.kv import KVShape, SequenceKV
from baton.engine.paged_kv import PagedKV, pages_within

log = logging.getLogger(__name__)

RESUME = "resume"  # rank 0 is done with what it ran between two layers of a forward
STOP = "stop"
SETTINGS_ENV = "BATON_TP_MODEL_SETTINGS"  # a rank's model settings, as JSON
LOG_LEVEL_ENV = "BATON_TP_LOG_LEVEL"  # rank 0's
# On CPU, the bytes of a rank's part that a collective passes through shared memory (larger ones
# through gloo); 0: gloo only
SHM_BYTES_ENV = "BATON_TP_SHM_BYTES"
SUPERVISE_S = 0.2
RANK_LOST_EXIT = 70  # the worker's exit status when one of its ranks died


def _compact(kv: SequenceKV | None) -> SequenceKV | None:
    """kv without the rest of a larger buffer it may view (pickling a view sends its storage)."""
    if kv is None or kv.data.untyped_storage().nbytes() == kv.nbytes:
        return kv
    return SequenceKV(kv.data.clone())


class KeptChunks:
    """A rank's own KV heads of the prompts being prefilled a chunk at a time: each chunk continues
    what its rank kept of the chunks before, so no chunk sends the prompt's KV so far to the ranks
    again (that moved O(n^2) bytes between them for an n-token prompt). Every rank runs the same
    calls on it in the same order, so rank 0's tells what all of them hold. At most LIMIT prompts;
    a prompt evicted (or never told to end) is sent whole again at its next chunk."""

    LIMIT = 8

    def __init__(self):
        self.prompts: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()  # key -> (buffer, tokens)

    def holds(self, key: str, tokens: int) -> bool:
        return key in self.prompts and self.prompts[key][1] == tokens

    def prefix(self, key: str) -> SequenceKV:
        buffer, tokens = self.prompts[key]
        return SequenceKV(buffer[:, :, :, :tokens])

    def extend(self, key: str, runner, prefix: SequenceKV | None, own_prefix: bool, new: SequenceKV,
               total: int) -> None:
        """The prompt's KV so far is `prefix` (whole, or this rank's heads if `own_prefix`) and then
        `new` (whole): keep this rank's heads of both, in a buffer sized for all `total` tokens."""
        held, mine = self.prompts.pop(key, None), runner._own_heads(new.data)
        start = prefix.num_tokens if prefix is not None else 0
        if held is None or held[1] != start:
            buffer = torch.empty(*mine.shape[:3], total, mine.shape[4], dtype=mine.dtype, device=mine.device)
            if start:
                buffer[:, :, :, :start] = prefix.data if own_prefix else runner._own_heads(prefix.data)
            held = (buffer, start)
        buffer = held[0]
        end = start + new.num_tokens
        buffer[:, :, :, start:end] = mine
        self.prompts[key] = (buffer, end)
        while len(self.prompts) > self.LIMIT:
            self.prompts.popitem(last=False)

    def drop(self, key: str) -> None:
        self.prompts.pop(key, None)

    @property
    def nbytes(self) -> int:
        """What the buffers take on this rank (each sized for its whole prompt)."""
        return sum(buffer.nbytes for buffer, _ in self.prompts.values())


KEPT = "kept"  # a prefill_chunk's prefix: what each rank kept of the prompt's chunks before


def execute(runner, pools: dict[int, PagedKV], kept: KeptChunks, op: str, args: tuple):
    """Run one broadcast call on this rank (rank 0 included, so every rank runs the same code)."""
    if op == "prefill_chunk":
        key, tokens, prefix, total = args
        own = isinstance(prefix, str)  # KEPT
        if own:
            prefix = kept.prefix(key)
        out = runner.prefill(tokens, prefix, own_heads=own)
        if len(tokens) < total:
            kept.extend(key, runner, prefix, own, out.own, total)
        else:  # the last chunk
            kept.drop(key)
        return out
    if op == "kept_drop":
        kept.drop(args[0])
        return None
    if op == "kv_alloc":
        pool_id, num_pages, page_size = args
        shape = dataclasses.replace(runner.loaded.kv_shape, num_kv_heads=runner.num_kv_heads)
        pools[pool_id] = PagedKV(shape, num_pages, page_size, runner.device)
        return pools[pool_id]
    if op == "kv_write":
        pool_id, table, kv, start = args
        return pools[pool_id].write(table, SequenceKV(runner._own_heads(kv.data)), start)
    if op == "kv_read":
        pool_id, table, num_tokens, start = args
        part = pools[pool_id].read(table, num_tokens, start).data
        return SequenceKV(runner.tp.all_gather(part, 2, runner.widths["kv_heads"]))
    if op == "decode":
        pool_id, step, input_ids = args
        return runner.decode(pools[pool_id], step, input_ids)
    if op in ("prefill", "prefill_batch", "prompt_logits"):
        return getattr(runner, op)(*args)
    raise ValueError(f"unknown tensor-parallel call {op!r}")


class TensorParallelRunner:
    """Rank 0's runner: each call runs on every rank at once. Everything else (the counters,
    `loaded`, the device) is rank 0's own runner's."""

    def __init__(self, runner, ranks: list[subprocess.Popen] | None = None, stopping: threading.Event | None = None):
        self.runner = runner
        self.group = runner.tp
        self.ranks = ranks or []
        self.stopping = stopping or threading.Event()  # set: the ranks' exits are expected
        self.pools: dict[int, PagedKV] = {}
        self.kept = KeptChunks()
        self._ids = itertools.count()
        self._lock = threading.RLock()  # one call at a time across ranks; a nested one from between_layers
        self._between: object = None

    def __getattr__(self, name):
        return getattr(self.runner, name)

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.size

    @property
    def between_layers(self):
        return self._between

    @between_layers.setter
    def between_layers(self, hook) -> None:
        """Called between two layers of a forward, where rank 0 may run nested calls (a prefill
        worker's urgent prompts); the other ranks wait there for them, then for RESUME."""
        self._between = hook
        self.runner.between_layers = self._boundary if hook is not None else None

    def _boundary(self) -> None:
        self._between()
        self.group.broadcast(RESUME)

    def _call(self, op: str, *args):
        with self._lock:
            try:
                self.group.broadcast((op, args, self._between is not None))
                return execute(self.runner, self.pools, self.kept, op, args)
            except ValueError:  # a refused input: every rank refused it alike, before any collective
                raise
            except Exception as exc:  # a rank gone mid-call: the ranks can no longer agree on anything
                if self.stopping.is_set():
                    raise
                first = str(exc).splitlines()[0] if str(exc) else repr(exc)
                _end_worker(f"tensor-parallel call {op} failed ({first})", self.ranks)

    def prefill(self, token_ids: list[int], prefix: SequenceKV | None = None):
        return self._call("prefill", token_ids, _compact(prefix))

    def prefill_batch(self, prompts: list[list[int]], prefix: SequenceKV | None = None):
        return self._call("prefill_batch", prompts, _compact(prefix))

    def prompt_logits(self, token_ids: list[int]):
        return self._call("prompt_logits", token_ids)

    def prefill_chunk(self, key: str, token_ids: list[int], prefix: SequenceKV | None, total: int):
        """One chunk of a long prompt (`key`: the prompt's, `total`: its length): `prefill` of
        token_ids on the KV so far, `prefix`, which is sent to the ranks only when they do not
        keep it from the chunks before (`KeptChunks`). As `prefill`'s output, its prefix whole."""
        with self._lock:
            kept = prefix is not None and self.kept.holds(key, prefix.num_tokens)
            out = self._call("prefill_chunk", key, token_ids, KEPT if kept else _compact(prefix), total)
        return dataclasses.replace(out, prefix=prefix) if kept else out

    def end_chunks(self, key: str) -> None:
        """The ranks forget what they keep of a chunked prompt that ended before its last chunk."""
        self._call("kept_drop", key)

    @property
    def kept_chunk_bytes(self) -> int:
        """What rank 0 keeps of chunked prompts' KV (its heads), beside the prompts' own buffers;
        every other rank keeps as much."""
        with self._lock:
            return self.kept.nbytes

    def decode(self, kv: "ShardedKV", step, input_ids: list[int]):
        return self._call("decode", kv.pool_id, step, input_ids)

    def paged_kv(self, shape: KVShape, budget_bytes: int, page_size: int) -> "ShardedKV":
        """The decode batch's pages: as many as `budget_bytes` buys for the whole KV (so a worker
        holds the same tokens at any TP degree), each rank holding its heads of every page."""
        return ShardedKV(self, shape, pages_within(shape, budget_bytes, page_size), page_size)

    def close(self) -> None:
        """End the other ranks and leave the group (the worker is stopping)."""
        self.stopping.set()
        with self._lock:
            try:
                self.group.broadcast(STOP)
            except Exception:  # a rank already gone
                pass
        for rank in self.ranks:
            try:
                rank.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rank.kill()
        self.group.close()


class ShardedKV:
    """Rank 0's face of a page pool every rank holds its KV heads of: the same calls as
    `engine.paged_kv.PagedKV`, on whole KV."""

    def __init__(self, runner: TensorParallelRunner, shape: KVShape, num_pages: int, page_size: int):
        self.runner, self.shape, self.num_pages, self.page_size = runner, shape, num_pages, page_size
        self.device = runner.device
        self.pool_id = next(runner._ids)
        self.local: PagedKV = runner._call("kv_alloc", self.pool_id, num_pages, page_size)

    @property
    def pages(self) -> torch.Tensor:
        return self.local.pages  # rank 0's heads

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.shape.bytes_per_token()

    def write(self, table: list[int], kv: SequenceKV, start: int = 0) -> None:
        if kv.shape != self.shape:
            raise ValueError(f"KV shape {kv.shape} does not match the batch {self.shape}")
        self.runner._call("kv_write", self.pool_id, table, _compact(kv), start)

    def read(self, table: list[int], num_tokens: int, start: int = 0) -> SequenceKV:
        return self.runner._call("kv_read", self.pool_id, table, num_tokens, start)


# -- the processes ---------------------------------------------------------------------------


def _rank_device(device: str, rank: int) -> str:
    """Rank r's device: its own GPU of the pod's (cuda:r), or the CPU."""
    from baton.engine.model import resolve_device

    return f"cuda:{rank}" if resolve_device(device).type == "cuda" else "cpu"


def _core_shares(settings, size: int) -> list[str]:
    from baton.engine import threads

    cores = threads.parse_cores(settings.cpu_cores) if settings.cpu_cores else threads.usable_cores()
    return threads.split_cores(size, cores)


def _load_rank(settings, rank: int, size: int, store):
    """Rank `rank`'s threads, part of the model and runner; joins the group at `store` once loaded."""
    from baton.engine import threads
    from baton.engine.llama import LlamaRunner
    from baton.engine.model import load_model

    share = _core_shares(settings, size)[rank]
    threads.configure(max(1, settings.threads // size) if settings.threads else (0 if share else 1), share)
    device = _rank_device(settings.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    loaded = load_model(settings.name, dtype=settings.dtype, device=device, module=False,
                        quantization=settings.quantization, quantized_inputs=settings.quantized_inputs,
                        rank=(rank, size))
    group = Group(rank, size, store, loaded.device, int(os.environ.get(SHM_BYTES_ENV, SHM_SLOT_BYTES)))
    runner = LlamaRunner(loaded, settings.attention_backend, settings.cuda_graphs, settings.batch_invariant, tp=group)
    loaded.hand_over()
    return runner


def start(settings) -> TensorParallelRunner:
    """Rank 0 of a worker of `settings.tensor_parallel_size` ranks: starts the others, loads its
    own part beside them, and supervises them for the worker's life."""
    size = settings.tensor_parallel_size
    if settings.executor == "transformers":
        raise ValueError("tensor parallelism runs on Baton's executor; model.executor 'transformers' cannot")
    store = host_store(size)
    env = {**os.environ, SETTINGS_ENV: json.dumps(dataclasses.asdict(settings)),
           LOG_LEVEL_ENV: logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()}
    ranks = [subprocess.Popen([sys.executable, "-m", "baton.engine.tensor_parallel", "--rank", str(rank),
                               "--size", str(size), "--port", str(store.port)], env=env)
             for rank in range(1, size)]
    stopping = threading.Event()
    threading.Thread(target=_supervise, args=(ranks, stopping), name="tp-ranks", daemon=True).start()
    try:
        runner = _load_rank(settings, 0, size, store)
    except BaseException:  # a worker that failed to start leaves no rank behind, waiting for it
        stopping.set()
        for process in ranks:
            process.kill()
            process.wait()
        raise
    if runner.loaded.tokenizer is not None:  # structured outputs' grammar tokenizer, off the serving path
        runner.loaded.grammars.warm_up()
    log.info("tensor-parallel worker of %d ranks ready", size, extra={"tensor_parallel_size": size})
    return TensorParallelRunner(runner, ranks, stopping)


def _supervise(ranks: list[subprocess.Popen], stopping: threading.Event) -> None:
    """A rank that exits takes the worker down."""
    while not stopping.wait(SUPERVISE_S):
        for rank, process in enumerate(ranks, start=1):
            code = process.poll()
            if code is not None and not stopping.is_set():
                _end_worker(f"tensor-parallel rank {rank} exited (code {code})", ranks)


def _end_worker(why: str, ranks: list[subprocess.Popen] = ()) -> None:
    """End the worker at once, as if it had been killed: no request is answered with an error
    (the router fails them over to other workers), and its other ranks end with it."""
    log.error("%s: this worker stops", why, extra={"exit_code": RANK_LOST_EXIT})
    for other in ranks:
        if other.poll() is None:
            other.kill()
    logging.shutdown()
    os._exit(RANK_LOST_EXIT)


def _end_with_parent() -> None:
    """This rank ends when its worker does, however the worker ended (SIGKILL included)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(SUPERVISE_S)
        os._exit(0)

    threading.Thread(target=watch, name="tp-parent", daemon=True).start()


def follow(runner, group: Group) -> None:
    """Ranks 1.. : run rank 0's calls until it says STOP."""
    pools: dict[int, PagedKV] = {}
    kept = KeptChunks()

    def serve(message) -> None:
        op, args, pausable = message
        saved = runner.between_layers
        runner.between_layers = boundary if pausable else None
        try:
            execute(runner, pools, kept, op, args)
        except ValueError as exc:  # rank 0 raised the same on the same input and told its caller
            log.debug("tensor-parallel call %s refused: %s", op, exc)
        finally:
            runner.between_layers = saved

    def boundary() -> None:
        while (message := group.broadcast()) != RESUME:
            serve(message)

    while (message := group.broadcast()) != STOP:
        serve(message)


def main(argv: list[str] | None = None) -> None:
    from baton import logs
    from baton.config import ModelSettings

    parser = argparse.ArgumentParser(description="one rank (not 0) of a tensor-parallel Baton worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logs.configure(os.environ.get(LOG_LEVEL_ENV, "warning"), start_lines=False)
    _end_with_parent()
    settings = ModelSettings(**json.loads(os.environ[SETTINGS_ENV]))
    runner = _load_rank(settings, args.rank, args.size, join_store(args.port, args.size))
    follow(runner, runner.tp)
    runner.tp.close()


if __name__ == "__main__":
    main()
