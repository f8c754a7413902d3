"""Which waiting prompts prefill together: plain Python, no tensors.

The oldest prompt of the highest priority goes first (interactive requests before batch members,
which the router runs at a lower priority; within one priority nothing starves); prompts of that
priority and similar length join it, because a batch is padded to its longest prompt and padding
is wasted compute. Two prompts whose first uncached block is the same never share a batch, and a
prompt waits while that block is being computed in chunks (`busy`): together each would compute
the shared part, a little later the second finds it cached (`key`, the first new block's hash,
comes from the prefix cache).
"""
from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable

SIMILAR_LENGTH_RATIO = 1.5
# Where the executor cannot pause a forward between layers (the transformers fallback), prompts
# below priority 0 (batch members) prefill in batches of at most this many tokens, so that an
# interactive prompt arriving meanwhile waits for a short forward. Baton's executor pauses
# instead, and members there take whole batches: short forwards cost a batch ~10% end to end.
BACKGROUND_BATCH_TOKENS = 96
URGENT_PRIORITY = 0  # prompts at or above it (interactive ones) may pause a background forward


def pick_batch(lengths: list[int], max_batch_tokens: int, max_batch_size: int,
               priorities: list[int] | None = None,
               key: Callable[[int], Hashable | None] | None = None, busy: Collection[Hashable] = (),
               background_tokens: int | None = BACKGROUND_BATCH_TOKENS) -> list[int]:
    """Indices (into arrival order) of the next batch: the oldest prompt of the highest priority
    plus length-similar ones of that priority while the padded size (count x longest) stays
    within max_batch_tokens, leaving out any whose `key(i)` (not None) is in `busy` or is one a
    prompt already chosen has. A batch of prompts below priority 0 holds at most
    `background_tokens` (None: no cap of its own)."""
    if not lengths:
        return []
    if priorities is None:
        priorities = [0] * len(lengths)
    top = max(priorities)
    if top < 0 and background_tokens is not None:
        max_batch_tokens = min(max_batch_tokens, background_tokens)
    same = [i for i in range(len(lengths)) if priorities[i] == top]
    if key is not None:
        key = functools.cache(key)  # each prompt's key at most once per pick (it hashes the prompt)
    if key is not None and busy:
        same = [i for i in same if key(i) is None or key(i) not in busy]
        if not same:
            return []  # all wait for the chunks in progress, which the caller runs meanwhile
    first = same[0]
    head = lengths[first]
    chosen = [first]
    keys = {key(first)} if key is not None else set()
    longest = head
    for i in sorted(same[1:], key=lambda i: abs(lengths[i] - head)):
        if len(chosen) >= max_batch_size:
            break
        n = lengths[i]
        if max(n, head) > SIMILAR_LENGTH_RATIO * min(n, head):
            continue
        if (len(chosen) + 1) * max(longest, n) > max_batch_tokens:
            continue
        if key is not None:
            k = key(i)
            if k is not None and k in keys:
                continue
            keys.add(k)
        chosen.append(i)
        longest = max(longest, n)
    return sorted(chosen)


class PrefillQueue:
    """Bounded, thread-safe; items are keyed by request id and carry their prompt length and priority."""

    def __init__(self, max_queue: int, max_batch_tokens: int, max_batch_size: int,
                 background_tokens: int | None = BACKGROUND_BATCH_TOKENS):
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.background_tokens = background_tokens  # see pick_batch
        self._items: OrderedDict[str, tuple[object, int, int]] = OrderedDict()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def queued_tokens(self) -> int:
        with self._cond:
            return sum(n for _, n, _ in self._items.values())

    def put(self, job, num_tokens: int, priority: int = 0) -> None:
        request_id = job.request.request_id
        with self._cond:
            if self._closed:
                raise ConnectionAbortedError("this prefill worker stopped; send the prompt elsewhere")
            if len(self._items) >= self.max_queue:
                raise OverflowError(f"{self.max_queue} prompts are already queued for prefill; retry later")
            if request_id in self._items:
                raise ValueError(f"request id {request_id!r} is already queued")
            self._items[request_id] = (job, num_tokens, priority)
            self._cond.notify()

    def remove(self, request_id: str, job=None):
        """Take a queued item out; with `job`, only if that very item is still queued under the id."""
        with self._cond:
            item = self._items.get(request_id)
            if item is None or (job is not None and item[0] is not job):
                return None
            del self._items[request_id]
        return item[0]

    def take_batch(self, timeout: float, min_priority: int | None = None,
                   key: Callable[[object], Hashable | None] | None = None, busy: Collection[Hashable] = (),
                   max_tokens: int | None = None, at_least_one: bool = True):
        """The next batch (see pick_batch; `key` of a job), waiting up to `timeout` for one; with
        `min_priority`, only if a prompt of at least that priority is queued, and then without waiting.
        With `max_tokens` (the KV memory left) the batch's padded tokens fit it; a first prompt
        larger than that goes alone if `at_least_one`, else nothing is taken."""
        with self._cond:
            if min_priority is not None:
                if not any(p >= min_priority for _, _, p in self._items.values()):
                    return []
            elif not self._items and not self._closed:
                self._cond.wait(timeout)
            if not self._items:
                return []
            ids = list(self._items)
            lengths = [self._items[i][1] for i in ids]
            budget = self.max_batch_tokens if max_tokens is None else min(self.max_batch_tokens, max_tokens)
            picked = pick_batch(lengths, budget, self.max_batch_size, [self._items[i][2] for i in ids],
                                None if key is None else lambda i: key(self._items[ids[i]][0]), busy,
                                self.background_tokens)
            if max_tokens is not None and picked and lengths[picked[0]] > max_tokens and not at_least_one:
                return []  # not even its first prompt fits the memory left: pushes will free some
            return [self._items.pop(ids[i])[0] for i in picked]

    def close(self) -> list:
        """Take nothing more; returns the jobs still queued, for the caller to refuse."""
        with self._cond:
            self._closed = True
            left = [job for job, _, _ in self._items.values()]
            self._items.clear()
            self._cond.notify_all()
        return left
