"""Large offline batches, BatchLLM style, on top of the per-request dispatcher.

The batch planner finds the shared prefixes of the whole batch ahead of time and orders the
prefix-sharing groups (largest R = 1/(L_prefix + sum L_distinct) first). For each group the
router pins its prefix on one prefill worker (computed once, held in that worker's prefix
cache), sends every member there, and unpins when the last member is done. The levels around a
group are pinned too (`batch_planner.levels`): a prefix it shares with other groups (an
instruction template; pinned first, on the same worker, until the batch ends) and the
sub-prefixes some of its members share, so the worker reuses every shared level to the token,
not only to its last whole block. At most `max_concurrency` requests are in flight, so groups
are pinned as their turn comes, and at most MAX_PINS_PER_BATCH pins at once: one caller's batch
cannot hold every prefill worker's pins (the groups past it run unpinned, routed by the prefix
index).
"""
from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from baton import tracing
from baton.v1 import router_pb2, workers_pb2
from baton.router.batch_planner import GroupLevels, group_levels, plan_batch
from baton.router.dispatch import DispatchError, Dispatcher, RoutingStats

_DONE = object()
MAX_PINS_PER_BATCH = 16
# Batch members run this far below the priority they asked for, so interactive requests (0 unless
# set) take prefill turns and decode rows first; within a batch the members keep their order.
BATCH_PRIORITY_OFFSET = 1 << 16
INT32_MIN = -(1 << 31)


def batch_priority(sampling):
    """A member's sampling parameters at batch priority (a copy)."""
    lowered = type(sampling).FromString(sampling.SerializeToString())
    lowered.priority = max(INT32_MIN, sampling.priority - BATCH_PRIORITY_OFFSET)
    return lowered


@dataclass
class _Pin:
    id: str
    address: str  # the prefill worker holding it
    tokens: tuple[int, ...]
    computed_tokens: int  # what pinning it cost


@dataclass
class _Group:
    id: str
    members: list[int]
    prefix: list[int]
    levels: GroupLevels = GroupLevels((), ())
    prefill_address: str | None = None
    pins: list[_Pin] = field(default_factory=list)  # its prefix and sub-prefixes, held until its last member is done
    remaining: int = 0

    @property
    def computed_tokens(self) -> int:
        return sum(p.computed_tokens for p in self.pins)

    def pinned_tokens(self, prompt: list[int]) -> int:
        """The longest of its pinned levels that `prompt` continues."""
        return max((len(p.tokens) for p in self.pins if tuple(prompt[:len(p.tokens)]) == p.tokens), default=0)


class BatchRunner:
    def __init__(self, dispatcher: Dispatcher, max_concurrency: int, kv_token_budget: int = 1 << 20):
        self.dispatcher = dispatcher
        self.max_concurrency = max_concurrency
        self.kv_token_budget = kv_token_budget

    def run(self, prompts: list[list[int]], samplings: list, timeout: float | None, on_done=lambda cancel: None,
            carrier=None):
        """Yield (index, GenerateResponse | DispatchError) as requests finish, then the summary.

        `on_done(cancel)` registers what to call when the client's call ends (the servicer passes
        context.add_callback): a batch whose client left stops submitting members and cancels
        those running on every worker. The generator returns only once no member runs, so the
        caller releases its slots when their work has really stopped. Each member's trace (baton.tracing)
        is a child of the trace context in `carrier`, the batch call's metadata."""
        started = time.monotonic()
        samplings = [batch_priority(s) for s in samplings]
        longest = max(map(len, prompts))
        plan = plan_batch(prompts, kv_token_budget=max(self.kv_token_budget, 2 * longest),
                          max_tokens_per_iteration=max(4096, longest))
        groups = self._groups(plan, prompts)
        results: "queue.Queue" = queue.Queue()
        stats = RoutingStats()
        slots = threading.Semaphore(self.max_concurrency)
        lock = threading.Lock()
        batch_id = uuid.uuid4().hex[:8]
        cancelled = threading.Event()
        member_cancels: list = []
        pins_held = [0]
        ancestors: dict[tuple[int, ...], _Pin | None] = {}  # levels above groups: pinned once, until the batch ends

        def register(cancel) -> None:  # a member's dispatch registers how to cancel it
            with lock:
                member_cancels.append(cancel)
                late = cancelled.is_set()
            if late:
                cancel()

        def cancel_all() -> None:
            with lock:
                cancelled.set()
                cancels = list(member_cancels)
            for cancel in cancels:
                cancel()

        on_done(cancel_all)

        def member_done(group: _Group) -> None:
            with lock:
                group.remaining -= 1
                last = group.remaining == 0
            if last and group.pins:
                for pin in group.pins:
                    self._unpin(pin)
                with lock:
                    pins_held[0] -= len(group.pins)

        def run_one(index: int, group: _Group) -> None:
            try:
                if cancelled.is_set():
                    raise DispatchError(grpc.StatusCode.CANCELLED, "the batch was cancelled")
                results.put((index, self._collect(f"{batch_id}-{index}", prompts[index], samplings[index],
                                                  timeout, group, stats, register, carrier)))
            except DispatchError as err:
                results.put((index, err))
            finally:
                member_done(group)
                slots.release()

        def submit_all(pool: ThreadPoolExecutor) -> None:
            for group in groups:
                for index in group.members:
                    slots.acquire()
                    if cancelled.is_set():  # the client left: what has not started never will
                        slots.release()
                        member_done(group)
                        continue
                    if index == group.members[0]:
                        with lock:
                            room = MAX_PINS_PER_BATCH - pins_held[0]
                        pinned = self._pin_group(group, ancestors, room)
                        with lock:
                            pins_held[0] += pinned
                    try:
                        pool.submit(run_one, index, group)
                    except RuntimeError:  # cancelled between the check and here: the pool is shut
                        slots.release()
                        member_done(group)
            pool.shutdown(wait=True)
            for pin in ancestors.values():
                if pin is not None:
                    self._unpin(pin)
            results.put(_DONE)

        pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix=f"batch-{batch_id}")
        threading.Thread(target=submit_all, args=(pool,), daemon=True).start()
        failed = cached = 0
        item = None
        try:
            while (item := results.get()) is not _DONE:
                index, outcome = item
                if isinstance(outcome, DispatchError):
                    failed += 1
                else:
                    cached += outcome.usage.cached_tokens
                yield index, outcome
        finally:
            if item is not _DONE:  # the caller stopped reading: stop the members, wait until they have
                cancel_all()
                pool.shutdown(wait=True)
        total = sum(map(len, prompts))
        # A pinned prefix is computed once by the pin, then reused by every member: what the
        # batch saved is what members reused minus what the pins computed.
        pinned = sum(g.computed_tokens for g in groups) + sum(p.computed_tokens for p in ancestors.values() if p)
        yield None, router_pb2.BatchSummary(
            requests=len(prompts), failed=failed, prompt_tokens=total,
            planned_saved_tokens=plan.total_prompt_tokens - plan.computed_tokens, cached_tokens=cached,
            planned_saving_ratio=plan.saving_ratio, optimum_saving_ratio=plan.optimum_saving_ratio,
            actual_saving_ratio=(cached - pinned) / total if total else 0.0, groups=len(plan.groups),
            pinned_computed_tokens=pinned,
            seconds=time.monotonic() - started, routing_accuracy=stats.accuracy)

    def _groups(self, plan, prompts) -> list[_Group]:
        block = self.dispatcher.block_size
        shapes = []
        for g in plan.groups:
            members = sorted(g.request_ids)
            shapes.append((members, g.prefix_len if g.size > 1 and g.prefix_len >= block else 0))
        return [_Group(uuid.uuid4().hex, members, prompts[members[0]][:shared], levels, remaining=len(members))
                for (members, shared), levels in zip(shapes, group_levels(prompts, shapes))]

    def _collect(self, request_id, prompt, sampling, timeout, group: _Group, stats: RoutingStats, on_done,
                 carrier=None):
        """Run one request to the end and fold its stream into one response."""
        result = router_pb2.GenerateResponse(request_id=request_id)
        text = []
        span = tracing.request_span("baton.request", carrier, **{"baton.request_id": request_id,
                                                                  "baton.prompt_tokens": len(prompt),
                                                                  "baton.batch_group": group.id})
        try:
            for msg in self.dispatcher.run(request_id, prompt, sampling, timeout, on_done=on_done,
                                           prefill_address=group.prefill_address,
                                           pinned_tokens=group.pinned_tokens(prompt), span=span):
                result.prompt_token_ids.extend(msg.prompt_token_ids)
                result.token_ids.extend(msg.token_ids)
                result.logprobs.extend(msg.logprobs)
                text.append(msg.text_delta)
                if msg.finish_reason:
                    result.finish_reason = msg.finish_reason
                    result.usage.CopyFrom(msg.usage)
                    result.trace.CopyFrom(msg.trace)
        except Exception as exc:
            span.end(error=tracing.error_text(exc))
            raise
        span.end(**{"baton.finish_reason": result.finish_reason,
                    "baton.completion_tokens": result.usage.completion_tokens})
        result.text_delta = "".join(text)
        stats.record(result.trace.predicted_cached_tokens, result.trace.cached_tokens)
        return result

    def _pin_group(self, group: _Group, ancestors: dict, room: int) -> int:
        """Pin a group's levels on one prefill worker, as its turn comes: the levels above it (once
        per batch), its prefix, then its members' sub-prefixes, each computing only what the one
        before left. Members then go to that worker. Returns how many pins it took (at most `room`)."""
        taken, address = 0, None
        for level in group.levels.ancestors:
            if level not in ancestors:
                ancestors[level] = self._pin(level, address) if taken < room else None
                taken += ancestors[level] is not None
            if ancestors[level] is not None:
                address = ancestors[level].address
        for level in ([tuple(group.prefix)] if group.prefix else []) + list(group.levels.sub_prefixes):
            if taken >= room:
                break
            pin = self._pin(level, group.prefill_address or address)
            if pin is None:
                break  # the members are routed as usual, by the prefix index and load
            group.pins.append(pin)
            group.prefill_address = pin.address
            taken += 1
        if group.prefill_address is None and address is not None:
            group.prefill_address = address  # no prefix of its own: its members continue the level above
        return taken

    def _pin(self, tokens: tuple[int, ...], address: str | None = None) -> _Pin | None:
        pin_id = uuid.uuid4().hex
        try:
            route = self.dispatcher.route(list(tokens), prefill_address=address)
        except DispatchError:
            return None
        try:
            reply = route.prefill.stub.PinPrefix(
                workers_pb2.PinPrefixRequest(group_id=pin_id, token_ids=tokens), timeout=120)
        except grpc.RpcError:
            return None
        finally:
            route.release()
        # The worker may hold less than asked (no prefix cache, or no room for a partial block).
        return _Pin(pin_id, route.prefill.view.address, tuple(tokens[:reply.pinned_tokens]), reply.computed_tokens)

    def _unpin(self, pin: _Pin) -> None:
        worker = self.dispatcher.pool.get("prefill", pin.address)
        if worker is not None:
            try:
                worker.stub.UnpinPrefix(workers_pb2.UnpinPrefixRequest(group_id=pin.id), timeout=30)
            except grpc.RpcError:
                pass  # a worker that left took its pins with it
