"""Memory-centric token batching of prefill work (after BatchLLM Algorithm 2).

Request-count limits leave iterations half empty ("valleys") whenever the running
requests are few or short. Here an iteration is bounded only by a token budget
(``max_tokens_per_iteration``) and by the KV memory the prefill worker can hold
(``kv_token_budget``, in tokens), however many requests that takes.

Work follows the dispatch order of the groups. A group's prefix is prefilled first
(chunked if long) and stays pinned until the group's last member finishes; its
members start in the iteration after the prefix's last chunk, so their distinct
tokens can attend to the prefix KV. In Baton decoding runs on decode workers, so
a member's KV is shipped and freed at the end of the iteration that finishes it.

Memory is reserved up front (a prefix's full length when its group starts, a
member's full distinct length when it starts), so the plan never preempts.
A new group starts only if ``pinned prefixes + its prefix + the longest member of
any active group`` fits the budget: even if every in-flight member finished, the
largest waiting member could still start, so the plan cannot deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .groups import PrefixGroup


@dataclass(frozen=True)
class WorkItem:
    """Prefill prompt positions ``[start, start + tokens)`` in one iteration.

    ``request_id`` is None for the group's shared prefix (positions below
    ``prefix_len``, computed once for all members). A member item covers its own
    positions at or after ``prefix_len`` and reuses the prefix KV. A member with
    no distinct tokens gets one zero-token item: its first output token is sampled
    from the prefix's last logits.
    """

    group_index: int
    request_id: int | None
    start: int
    tokens: int

    @property
    def end(self) -> int:
        return self.start + self.tokens


@dataclass(frozen=True)
class Iteration:
    """One forward pass of the prefill worker."""

    items: tuple[WorkItem, ...]
    # KV tokens reserved while this iteration runs (pinned prefixes + started members).
    kv_tokens_reserved: int

    @property
    def num_tokens(self) -> int:
        return sum(item.tokens for item in self.items)


def token_batch_sizes(iterations: Sequence[Iteration]) -> list[int]:
    """Tokens per iteration: the timeline whose dips are BatchLLM's "valleys"."""
    return [iteration.num_tokens for iteration in iterations]


def plan_token_batches(
    groups: Sequence[PrefixGroup], *, kv_token_budget: int, max_tokens_per_iteration: int
) -> list[Iteration]:
    """Pack the groups' prefill work, in the given order, into iterations."""
    if kv_token_budget <= 0 or max_tokens_per_iteration <= 0:
        raise ValueError(
            f"kv_token_budget ({kv_token_budget}) and max_tokens_per_iteration "
            f"({max_tokens_per_iteration}) must both be positive"
        )
    for index, group in enumerate(groups):
        need = group.prefix_len + group.max_distinct_len
        if need > kv_token_budget:
            raise ValueError(
                f"group {index} needs {need} KV tokens at once (prefix {group.prefix_len} "
                f"+ longest distinct part {group.max_distinct_len}) but kv_token_budget is "
                f"{kv_token_budget}; raise kv_token_budget to at least {need}"
            )
    return _TokenBatcher(list(groups), kv_token_budget, max_tokens_per_iteration).run()


@dataclass
class _Job:
    """Prefill of one prefix or one member's distinct part, possibly over several iterations."""

    group_index: int
    request_id: int | None
    next_position: int
    end_position: int

    @property
    def remaining(self) -> int:
        return self.end_position - self.next_position


@dataclass
class _ActiveGroup:
    index: int
    group: PrefixGroup
    prefix_ready: bool
    waiting: deque[tuple[int, int]] = field(default_factory=deque)  # (request, distinct len)
    unfinished: int = 0


class _TokenBatcher:
    def __init__(self, groups: list[PrefixGroup], kv_budget: int, max_tokens: int):
        self.groups = groups
        self.kv_budget = kv_budget
        self.max_tokens = max_tokens
        self.next_group = 0
        self.active: dict[int, _ActiveGroup] = {}  # insertion order = dispatch order
        self.jobs: list[_Job] = []  # in start order
        self.reserved = 0
        self.pinned = 0

    def run(self) -> list[Iteration]:
        iterations: list[Iteration] = []
        while self.next_group < len(self.groups) or self.active:
            items: list[WorkItem] = []
            room = self._continue_jobs(items, self.max_tokens)
            self._start_new_work(items, room)
            if not items:
                raise RuntimeError(
                    "token batching made no progress; this is a planner bug "
                    f"(reserved={self.reserved}, pinned={self.pinned})"
                )
            iterations.append(Iteration(tuple(items), self.reserved))
            self._retire_finished()
        return iterations

    def _continue_jobs(self, items: list[WorkItem], room: int) -> int:
        for job in self.jobs:
            if room == 0:
                break
            take = min(job.remaining, room)
            if take:
                items.append(WorkItem(job.group_index, job.request_id, job.next_position, take))
                job.next_position += take
                room -= take
        return room

    def _start_new_work(self, items: list[WorkItem], room: int) -> None:
        while True:
            room, blocked = self._start_members(items, room)
            if blocked or not self._can_start_next_group(room):
                return
            room = self._start_next_group(items, room)

    def _start_members(self, items: list[WorkItem], room: int) -> tuple[int, bool]:
        """Start waiting members of ready groups; True if one had to keep waiting."""
        blocked = False
        for active in self.active.values():
            if not active.prefix_ready:
                continue
            while active.waiting:
                request_id, distinct = active.waiting[0]
                if self.reserved + distinct > self.kv_budget or (distinct and room == 0):
                    blocked = True
                    break
                active.waiting.popleft()
                self.reserved += distinct
                start = active.group.prefix_len
                take = min(distinct, room)
                items.append(WorkItem(active.index, request_id, start, take))
                self.jobs.append(_Job(active.index, request_id, start + take, start + distinct))
                room -= take
        return room, blocked

    def _can_start_next_group(self, room: int) -> bool:
        if self.next_group >= len(self.groups) or room == 0:
            return False
        group = self.groups[self.next_group]
        if group.prefix_len == 0:
            return self.reserved + group.max_distinct_len <= self.kv_budget
        longest_member = max(
            [group.max_distinct_len] + [a.group.max_distinct_len for a in self.active.values()]
        )
        return (
            self.reserved + group.prefix_len <= self.kv_budget
            and self.pinned + group.prefix_len + longest_member <= self.kv_budget
        )

    def _start_next_group(self, items: list[WorkItem], room: int) -> int:
        index = self.next_group
        group = self.groups[index]
        self.next_group += 1
        active = _ActiveGroup(index, group, prefix_ready=group.prefix_len == 0)
        active.waiting.extend(zip(group.request_ids, group.distinct_lens))
        active.unfinished = group.size
        self.active[index] = active
        if group.prefix_len:
            self.reserved += group.prefix_len
            self.pinned += group.prefix_len
            take = min(group.prefix_len, room)
            items.append(WorkItem(index, None, 0, take))
            self.jobs.append(_Job(index, None, take, group.prefix_len))
            room -= take
        return room

    def _retire_finished(self) -> None:
        still_running: list[_Job] = []
        for job in self.jobs:
            if job.remaining:
                still_running.append(job)
                continue
            active = self.active[job.group_index]
            if job.request_id is None:
                active.prefix_ready = True
            else:
                self.reserved -= job.end_position - active.group.prefix_len
                active.unfinished -= 1
        self.jobs = still_running
        for index in [i for i, a in self.active.items() if a.prefix_ready and not a.unfinished]:
            prefix_len = self.active.pop(index).group.prefix_len
            self.reserved -= prefix_len
            self.pinned -= prefix_len
