"""Large offline batches, BatchLLM style, on top of the per-request dispatcher.

The batch planner finds the shared prefixes of the whole batch ahead of time and orders the
prefix-sharing groups (largest R = 1/(L_prefix + sum L_distinct) first). For each group the
router pins its prefix on one prefill worker (computed once, held in that worker's prefix
cache), sends every member there, and unpins when the last member is done. At most
`max_concurrency` requests are in flight, so groups are pinned as their turn comes, and at most
MAX_PINS_PER_BATCH at once: one caller's batch cannot hold every prefill worker's pins (the
groups past it run unpinned, routed by the prefix index).
"""
from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from baton import tracing
from baton.v1 import router_pb2, workers_pb2
from baton.router.batch_planner import plan_batch
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
class _Group:
    id: str
    members: list[int]
    prefix: list[int]
    prefill_address: str | None = None
    pinned_tokens: int = 0
    computed_tokens: int = 0  # what pinning the prefix cost
    remaining: int = 0


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
            if last and group.prefill_address:
                self._unpin(group)
                with lock:
                    pins_held[0] -= 1

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
                    if index == group.members[0] and group.prefix and pins_held[0] < MAX_PINS_PER_BATCH:
                        self._pin(group)
                        if group.prefill_address:
                            with lock:
                                pins_held[0] += 1
                    try:
                        pool.submit(run_one, index, group)
                    except RuntimeError:  # cancelled between the check and here: the pool is shut
                        slots.release()
                        member_done(group)
            pool.shutdown(wait=True)
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
        pinned = sum(g.computed_tokens for g in groups)
        yield None, router_pb2.BatchSummary(
            requests=len(prompts), failed=failed, prompt_tokens=total,
            planned_saved_tokens=plan.total_prompt_tokens - plan.computed_tokens, cached_tokens=cached,
            planned_saving_ratio=plan.saving_ratio, optimum_saving_ratio=plan.optimum_saving_ratio,
            actual_saving_ratio=(cached - pinned) / total if total else 0.0, groups=len(plan.groups),
            pinned_computed_tokens=pinned,
            seconds=time.monotonic() - started, routing_accuracy=stats.accuracy)

    def _groups(self, plan, prompts) -> list[_Group]:
        block = self.dispatcher.block_size
        groups = []
        for g in plan.groups:
            members = sorted(g.request_ids)
            shared = g.prefix_len if g.size > 1 and g.prefix_len >= block else 0
            groups.append(_Group(uuid.uuid4().hex, members, prompts[members[0]][:shared], remaining=len(members)))
        return groups

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
                                           prefill_address=group.prefill_address, pinned_tokens=group.pinned_tokens,
                                           span=span):
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

    def _pin(self, group: _Group) -> None:
        try:
            route = self.dispatcher.route(group.prefix)
            reply = route.prefill.stub.PinPrefix(
                workers_pb2.PinPrefixRequest(group_id=group.id, token_ids=group.prefix), timeout=120)
        except (grpc.RpcError, DispatchError):
            return  # members are then routed as usual, by the prefix index and load
        group.prefill_address = route.prefill.view.address
        group.pinned_tokens = reply.pinned_tokens
        group.computed_tokens = reply.computed_tokens

    def _unpin(self, group: _Group) -> None:
        worker = self.dispatcher.pool.get("prefill", group.prefill_address)
        if worker is not None:
            try:
                worker.stub.UnpinPrefix(workers_pb2.UnpinPrefixRequest(group_id=group.id), timeout=30)
            except grpc.RpcError:
                pass  # a worker that left took its pins with it
