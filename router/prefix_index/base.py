"""The interface every prefix index backend implements, and the policy they share.

Workers publish KV events: `stored` block hashes (new blocks, parents listed before their
children) and `evicted` ones. Hashes are chained (see `baton.block_hash`), so block i names
the whole prefix up to it, and a worker's cache is prefix-closed: it holds a block's parents
for as long as it holds the block. `match` therefore walks a prompt's hashes from the first
one and, per worker, counts how many leading blocks that worker holds without a gap.

Bounds, identical in every backend (an "entry" is one distinct block hash with its set of
holders, so memory is at most `max_blocks` times the number of workers holding each block):
- `max_blocks`: when a stored event pushes the entry count above it, the least recently
  touched entries are dropped until it fits. An entry is touched when a worker stores it and
  when a `match` walks through it. Within one event or match the parents count as touched
  later than their children, so a chain loses its deepest blocks first and a match keeps
  working on what is left.
- `ttl_s` (optional): an entry untouched for `ttl_s` seconds is dropped (before any
  operation looks at it), so a crashed worker that never sends its evictions fades out.
Dropping entries only ever under-reports what a worker holds: a routing hint lost, never a
wrong claim.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from baton.block_hash import MAX_BLOCK_HASH

DEFAULT_MAX_BLOCKS = 262_144  # 4M tokens at 16 tokens per block
Clock = Callable[[], float]


@dataclass(frozen=True)
class IndexStats:
    blocks: int  # distinct block hashes indexed (entries)
    block_workers: int  # (block, worker) pairs: what memory grows with
    workers: int  # workers holding at least one indexed block
    max_blocks: int
    capacity_evictions: int  # entries dropped to stay within max_blocks
    expirations: int  # entries dropped after ttl_s untouched


def check_worker_id(worker_id: object) -> str:
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
    return worker_id


def check_block_hashes(hashes: Iterable[int], what: str) -> list[int]:
    if isinstance(hashes, (str, bytes)):
        raise TypeError(f"{what} must be a list of block hashes (ints), not {type(hashes).__name__}")
    checked = list(hashes)
    for h in checked:
        if type(h) is not int or not 0 <= h <= MAX_BLOCK_HASH:
            raise ValueError(f"{what} holds {h!r}: block hashes are unsigned 64-bit ints "
                             "from baton.block_hash")
    return checked


class PrefixIndex(ABC):
    """Which worker holds which KV blocks. Public methods validate, backends implement `_x`."""

    def __init__(self, max_blocks: int, ttl_s: float | None, clock: Clock):
        if not isinstance(max_blocks, int) or max_blocks < 1:
            raise ValueError(f"max_blocks must be a positive int, got {max_blocks!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive seconds or None (no expiry), got {ttl_s!r}")
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._clock = clock
        self._generation = uuid.uuid4().hex

    def apply_event(self, worker_id: str, stored: Sequence[int] = (),
                    evicted: Sequence[int] = ()) -> None:
        """Record that `worker_id` now holds `stored` and no longer holds `evicted`.

        `stored` is applied first, then `evicted`, so a hash in both ends up absent.
        Events are idempotent: storing a held block only touches it; evicting an unknown one
        is a no-op."""
        worker_id = check_worker_id(worker_id)
        stored = check_block_hashes(stored, "stored")
        evicted = check_block_hashes(evicted, "evicted")
        if stored or evicted:
            self._apply_event(worker_id, stored, evicted)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding the prompt's first block: how many leading blocks of
        `block_hashes` it holds, contiguously from the first. Workers with 0 are left out."""
        hashes = check_block_hashes(block_hashes, "block_hashes")
        return self._match(hashes) if hashes else {}

    def match_many(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, int]]:
        """`match` for several prompts (a batch request); backends may share round trips."""
        return [self.match(hashes) for hashes in prompts]

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything `worker_id` holds (it left, crashed or restarted empty)."""
        self._remove_worker(check_worker_id(worker_id))

    def generation(self) -> str:
        """Names this index's contents' lifetime: it changes only when they were lost (a Redis
        restarted empty), which tells the router to fill the index again from the workers."""
        return self._generation

    @abstractmethod
    def workers(self) -> set[str]:
        """Workers holding at least one indexed block."""

    @abstractmethod
    def stats(self) -> IndexStats: ...

    def close(self) -> None:
        """Release connections; the index's contents stay where they live."""

    def _now(self) -> float:
        return float(self._clock())

    @abstractmethod
    def _apply_event(self, worker_id: str, stored: list[int], evicted: list[int]) -> None: ...

    @abstractmethod
    def _match(self, hashes: list[int]) -> dict[str, int]: ...

    @abstractmethod
    def _remove_worker(self, worker_id: str) -> None: ...


@dataclass(frozen=True)
class PrefixIndexConfig:
    """The router's choice of prefix index; parsed once at start and passed down."""

    backend: str = "memory"  # "memory" (one router) or "redis" (router replicas share it)
    max_blocks: int = DEFAULT_MAX_BLOCKS
    ttl_s: float | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "baton"  # one per model/deployment sharing a Redis
    redis_password: str = field(default="", repr=False)  # wins over one in the URL

    def __post_init__(self):
        if self.backend not in ("memory", "redis"):
            raise ValueError(f"prefix index backend must be 'memory' or 'redis', got {self.backend!r}")

