"""The prefill worker's prefix cache policy: locks, LRU leaves-first eviction, bounds, events."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from baton.block_hash import BlockHasher
from baton.prefill_worker.prefix_cache import KVEvents, PrefixCache

HASHER = BlockHasher("test-model", block_size=1)
BLOCK_BYTES = 100


def chain(*tokens: int) -> list[int]:
    return HASHER.hash_prompt(list(tokens))


def slots(hashes: list[int]) -> list[str]:
    return [f"slot-{h:x}" for h in hashes]


def make_cache(capacity_blocks: int):
    evicted: list[tuple[int, object]] = []
    cache = PrefixCache(capacity_blocks * BLOCK_BYTES + BLOCK_BYTES // 2, BLOCK_BYTES,
                        on_evict=lambda h, payload: evicted.append((h, payload)))
    return cache, evicted


A = chain(1, 2, 3, 4)
B = chain(1, 2, 8, 9)  # shares A's first two blocks
C = chain(5, 6)


def test_capacity_is_whole_blocks_of_the_given_bytes():
    cache, _ = make_cache(3)
    assert (cache.capacity_blocks, cache.capacity_bytes, cache.free_blocks) == (3, 300, 3)
    with pytest.raises(ValueError, match="bytes_per_block"):
        PrefixCache(100, 0)


def test_insert_stores_only_new_blocks_and_match_returns_their_payloads():
    cache, _ = make_cache(10)
    assert cache.match(A) == 0
    assert cache.insert(A[:2], slots(A[:2])) == A[:2]
    assert cache.insert(A, slots(A)) == A[2:]
    assert cache.insert(B, slots(B)) == B[2:]
    assert cache.match(A) == 4 and cache.match(B) == 4 and cache.match(A[:1] + C) == 1
    assert cache.payloads(A) == slots(A)
    assert (len(cache), cache.used_bytes) == (6, 600)
    assert cache.insert(A, slots(A)) == []


def test_reserved_room_counts_against_the_capacity_and_evicts_like_an_insert():
    cache, _ = make_cache(4)
    cache.insert(A, slots(A))
    cache.lock(A[:2])
    assert cache.reserve(2)  # evicts the two unlocked leaves
    assert (cache.num_blocks, cache.reserved_blocks, cache.free_blocks, cache.used_bytes) == (2, 2, 0, 400)
    assert not cache.reserve(1)  # only locked blocks left: nothing changes
    assert cache.insert(C, slots(C)) is None
    cache.release(2)
    assert cache.free_blocks == 2 and cache.insert(C, slots(C)) == C
    with pytest.raises(ValueError, match="reserved"):
        cache.release(1)


def test_lru_evicts_least_recently_used_leaves_first():
    cache, evicted = make_cache(6)
    cache.insert(A, slots(A))
    cache.insert(C, slots(C))
    cache.match(A)  # A is now more recent than C
    assert cache.insert(B, slots(B)) == B[2:]  # needs 2 blocks: C's leaf, then C's root
    assert evicted == [(C[1], f"slot-{C[1]:x}"), (C[0], f"slot-{C[0]:x}")]
    evicted.clear()
    cache.match(B)
    cache.insert(C, slots(C))  # now A's tail is the oldest: its leaf goes first
    assert [h for h, _ in evicted] == [A[3], A[2]]
    assert cache.match(A) == 2 and cache.match(B) == 4


def test_eviction_takes_exactly_the_missing_room():
    cache, evicted = make_cache(5)
    cache.insert(A, slots(A))
    assert cache.insert(C, slots(C)) == C
    assert [h for h, _ in evicted] == [A[3]]
    assert cache.match(A) == 3
    assert cache.evict(0) == 0 and cache.evict(-3) == 0
    assert cache.evict(100) == 5 and len(cache) == 0


def test_locked_blocks_are_never_evicted_and_a_full_locked_cache_refuses():
    cache, evicted = make_cache(4)
    cache.insert(A, slots(A))
    assert cache.lock(A[:3]) == slots(A[:3])
    assert cache.num_evictable_blocks == 1
    assert cache.insert(C, slots(C)) is None  # 1 evictable < 2 needed: nothing changes
    assert evicted == [] and cache.match(A) == 4 and cache.match(C) == 0
    assert cache.insert(C[:1], slots(C[:1])) == C[:1]
    assert [h for h, _ in evicted] == [A[3]]
    cache.lock(A[:3])  # a second request shares the prefix
    cache.unlock(A[:3])
    assert cache.ref_count(A[0]) == 1
    cache.unlock(A[:3])
    assert cache.ref_count(A[0]) == 0 and cache.num_evictable_blocks == 4


def test_a_locked_chain_survives_even_when_it_is_the_least_recently_used():
    cache, evicted = make_cache(6)
    cache.insert(A, slots(A), lock=True)
    cache.insert(C, slots(C))
    assert cache.insert(chain(7, 7), slots(chain(7, 7))) is not None
    assert [h for h, _ in evicted] == [C[1], C[0]]
    assert cache.match(A) == 4


def test_insert_never_evicts_the_prefix_it_extends():
    cache, evicted = make_cache(3)
    cache.insert(A[:2], slots(A[:2]))
    # A[1] is the only leaf, yet inserting A[2] under it must not evict it.
    assert cache.insert(A[:3], slots(A[:3])) == [A[2]]
    assert cache.insert(A, slots(A)) is None
    assert evicted == [] and cache.match(A) == 3


def test_insert_with_lock_holds_the_whole_chain():
    cache, _ = make_cache(4)
    cache.insert(A[:2], slots(A[:2]))
    assert cache.insert(A, slots(A), lock=True) == A[2:]
    assert [cache.ref_count(h) for h in A] == [1, 1, 1, 1]
    assert cache.insert(C, slots(C)) is None
    cache.unlock(A)
    assert cache.insert(C, slots(C)) == C


def test_events_are_net_changes_in_order():
    cache, _ = make_cache(4)
    assert not cache.drain_events()
    cache.insert(A, slots(A))
    assert cache.drain_events() == KVEvents(stored=A, evicted=[])
    cache.insert(C, slots(C))  # evicts A[3], A[2]
    cache.match(A)
    cache.evict(2)  # evicts C (stored since the last drain: the index never hears of it)
    assert cache.drain_events() == KVEvents(stored=[], evicted=[A[3], A[2]])
    cache.evict(1)
    cache.insert(A[:2], slots(A[:2]))  # A[1] evicted and stored again: no net change
    assert cache.drain_events() == KVEvents(stored=[], evicted=[])


def test_misuse_is_refused_with_a_clear_error():
    cache, _ = make_cache(8)
    cache.insert(A, slots(A))
    with pytest.raises(KeyError, match="not cached"):
        cache.lock(C)
    with pytest.raises(ValueError, match="leading blocks"):
        cache.lock(A[1:])
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(A[:2])
    with pytest.raises(ValueError, match="payloads"):
        cache.insert(C, ["only one"])
    with pytest.raises(ValueError, match="one chain"):
        cache.insert(C + [A[1]])
    assert len(cache) == 4 and not cache.drain_events().evicted


class CacheMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, unlocks and evictions against a simple model."""

    @initialize(capacity=st.integers(0, 8))
    def setup(self, capacity):
        self.cache, self.evicted = make_cache(capacity)
        self.locks: list[list[int]] = []  # chains held by pretend requests
        self.published: set[int] = set()  # what the index knows after replaying events

    prompts = st.lists(st.integers(0, 2), min_size=1, max_size=5).map(lambda t: chain(*t))

    @rule(prompt=prompts, lock=st.booleans())
    def insert(self, prompt, lock):
        cached = self.cache.match(prompt)
        before = len(self.cache)
        held = {h for chain_ in self.locks for h in chain_}
        # Room: free blocks plus unlocked ones, less the cached prefix being extended.
        pinned = sum(1 for h in prompt[:cached] if h not in held)
        room = self.cache.free_blocks + self.cache.num_evictable_blocks - pinned
        self.evicted.clear()
        stored = self.cache.insert(prompt, slots(prompt), lock=lock)
        if stored is None:
            assert len(prompt) - cached > room
            assert len(self.cache) == before and not self.evicted
            return
        assert len(prompt) - cached <= room
        assert stored == prompt[cached:]
        assert len(self.evicted) == max(0, len(stored) - (self.cache.capacity_blocks - before))
        assert not {h for h, _ in self.evicted} & held
        assert all(payload == f"slot-{h:x}" for h, payload in self.evicted)
        if lock:
            self.locks.append(list(prompt))

    @rule(prompt=prompts)
    def lock_cached_prefix(self, prompt):
        cached = self.cache.match(prompt)
        if cached:
            assert self.cache.lock(prompt[:cached]) == slots(prompt[:cached])
            self.locks.append(prompt[:cached])

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        self.cache.unlock(self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1))))

    @rule(count=st.integers(0, 4))
    def evict(self, count):
        evictable = self.cache.num_evictable_blocks
        assert self.cache.evict(count) == min(count, evictable)

    @rule()
    def drain(self):
        events = self.cache.drain_events()
        assert not set(events.stored) & set(events.evicted)
        self.published |= set(events.stored)
        self.published -= set(events.evicted)

    @invariant()
    def within_capacity_and_prefix_closed(self):
        blocks = self.cache._blocks
        assert len(blocks) <= self.cache.capacity_blocks
        assert all(b.parent is None or b.parent in blocks for b in blocks.values())

    @invariant()
    def locks_are_counted_and_held(self):
        for h, block in self.cache._blocks.items():
            assert block.ref_count == sum(chain_.count(h) for chain_ in self.locks)
        assert all(h in self.cache for chain_ in self.locks for h in chain_)
        assert self.cache.num_evictable_blocks == sum(
            1 for b in self.cache._blocks.values() if b.ref_count == 0)

    def teardown(self):
        if hasattr(self, "cache"):
            self.drain()
            assert self.published == set(self.cache._blocks)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
