"""The decode worker's KV pages (decode_worker.kv_pages) and the prefix sharing they carry, alone
and through the decode scheduler: plain Python, milliseconds."""
import pytest

from baton.block_hash import common_prefix
from baton.decode_worker.kv_pages import NULL_PAGE, PagePool, PageUsage
from baton.decode_worker.scheduler import DecodeScheduler, DecodeSequence, SchedulerConfig, Status

DOC = list(range(1000, 1100))  # a 100-token shared document


def used(pool: PagePool) -> int:
    return pool.total_pages - pool.num_free_pages()


# -- holding pages -----------------------------------------------------------------------------


def test_a_pool_needs_the_null_page_and_one_more():
    with pytest.raises(ValueError, match="null page"):
        PagePool(1, 16)
    with pytest.raises(ValueError, match="page_size"):
        PagePool(4, 0)
    pool = PagePool(2, 16)
    assert pool.total_pages == 1 and pool.num_free_pages() == 1
    with pytest.raises(ValueError):
        pool.allocate_slots("a", -1)


def test_allocation_grows_by_pages_and_never_gives_the_null_page():
    pool = PagePool(8, 4)  # pages 1..7 for requests
    assert pool.allocate_slots("a", 1) == [1]  # low page ids first
    assert pool.allocate_slots("a", 3) == []  # the page has room for 4
    assert pool.allocate_slots("a", 1) == [2]
    assert pool.allocate_slots("a", 0) == []
    assert pool.page_table("a") == [1, 2] and pool.tokens("a") == 5
    assert pool.allocate_slots("b", 9) == [3, 4, 5]
    assert pool.new_pages_for("b", 12) == 0 and pool.new_pages_for("b", 13) == 1 and pool.new_pages_for("c", 5) == 2
    assert pool.allocate_slots("c", 8) == [6, 7]
    assert pool.num_free_pages() == 0
    assert NULL_PAGE not in pool.page_table("a") + pool.page_table("b") + pool.page_table("c")
    assert pool.pages_for(0) == 0 and pool.pages_for(4) == 1 and pool.pages_for(5) == 2


def test_free_gives_the_pages_back_and_they_are_taken_again():
    pool = PagePool(5, 4)
    pool.allocate_slots("a", 8)
    pool.allocate_slots("b", 4)
    pool.free("a")
    assert not pool.holds("a") and pool.page_table("a") == [] and pool.tokens("a") == 0
    assert pool.num_free_pages() == 3
    assert sorted(pool.allocate_slots("c", 12)) == [1, 2, 4]
    pool.free("never-held")  # nothing to give back
    pool.free("a")
    assert pool.num_free_pages() == 0


def test_allocate_slots_returns_none_and_takes_nothing_when_short():
    pool = PagePool(4, 4)  # 3 pages
    pool.allocate_slots("a", 6)  # 2 pages
    assert pool.allocate_slots("a", 7) is None  # 13 tokens: 4 pages
    assert pool.page_table("a") == [1, 2] and pool.tokens("a") == 6 and pool.num_free_pages() == 1
    assert pool.allocate_slots("b", 5) is None
    assert not pool.holds("b") and pool.num_free_pages() == 1
    assert pool.allocate_slots("a", 6) == [3]  # exactly what is free


def test_allocate_slots_with_shared_pages_takes_nothing_when_short():
    pool = PagePool(4, 4)  # 3 pages
    pool.allocate_slots("a", 9)  # 3 pages
    pool.publish("a", DOC[:8])
    shared = pool.matching(DOC[:8], 8)
    assert shared == [1, 2]
    assert pool.allocate_slots("b", 5, shared_pages=shared) is None  # 8 shared + 5: a 4th page
    assert not pool.holds("b") and pool.usage().shared == 0


def test_allocate_slots_can_start_a_request_on_shared_pages():
    pool = PagePool(6, 4)
    pool.allocate_slots("a", 9)
    pool.publish("a", DOC[:9])
    assert pool.allocate_slots("b", 2, shared_pages=pool.matching(DOC[:9], 8)) == [4]
    assert pool.page_table("b") == [1, 2, 4] and pool.tokens("b") == 10


def test_hold_counts_references_and_a_page_is_free_after_its_last_holder():
    pool = PagePool(6, 4)
    pool.allocate_slots("a", 10)  # pages 1, 2, 3
    pool.hold("b", [1, 2])
    assert pool.tokens("b") == 8 and pool.page_table("b") == [1, 2]
    pool.hold("c", [1])
    assert used(pool) == 3 and pool.usage().shared == 2
    with pytest.raises(ValueError, match="already holds"):
        pool.hold("b", [1])
    with pytest.raises(ValueError, match="is free"):
        pool.hold("d", [4])
    assert not pool.holds("d")
    pool.free("a")
    assert pool.num_free_pages() == 3  # page 3 was a's alone; 1 and 2 are still held
    pool.free("b")
    assert pool.num_free_pages() == 4 and pool.page_table("c") == [1]
    pool.free("c")
    assert pool.num_free_pages() == 5
    assert pool.allocate_slots("b", 3) == [1]  # its page counts from 1 again, not from what b held


# -- sharing full prompt pages -----------------------------------------------------------------


def test_only_full_prompt_pages_are_published_and_matched():
    pool = PagePool(10, 16)
    pool.allocate_slots("a", 41)  # a 40-token prompt + this step's token: 3 pages, 2 of them full of prompt
    pool.publish("a", DOC[:40])
    a = pool.page_table("a")
    assert pool.matching(DOC, 100) == a[:2]  # the third page holds 8 prompt tokens: never shared
    assert pool.matching(DOC[:40], 40) == a[:2]
    assert pool.matching(DOC[:31], 100) == a[:1]  # a partial page of the new prompt matches nothing
    assert pool.matching(DOC, 31) == a[:1]  # max_tokens caps it, whole pages only
    assert pool.matching(DOC, 15) == []
    assert pool.matching([5] + DOC[1:], 100) == []  # the first page differs: nothing
    assert pool.matching(DOC[:16] + [5] + DOC[17:], 100) == a[:1]  # the second differs: the first only


def test_a_match_is_an_exact_chain_not_equal_pages_anywhere():
    pool = PagePool(10, 4)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    pool.allocate_slots("a", 9)
    pool.publish("a", x + y + [0])
    # y after another first page is another page's tokens: the chain breaks at the first page
    assert pool.matching([9, 9, 9, 9] + y, 8) == []
    assert pool.matching(y + x, 8) == []
    pool.allocate_slots("b", 9)
    pool.publish("b", y + y + [0])  # y first: a different key than a's y after x
    b = pool.page_table("b")
    assert pool.matching(y + y, 8) == b[:2] and pool.matching(x + y, 8) == pool.page_table("a")[:2]


def test_publishing_again_or_a_copy_of_known_pages_changes_nothing():
    pool = PagePool(10, 4)
    pool.allocate_slots("a", 9)
    pool.publish("a", DOC[:9])
    pool.publish("a", DOC[:9])
    a = pool.page_table("a")
    pool.allocate_slots("b", 9)  # the same prompt in its own pages (it did not share)
    pool.publish("b", DOC[:9])
    assert pool.matching(DOC[:8], 8) == a[:2]
    pool.free("a")  # a's pages are unpublished; b's copy never was
    assert pool.matching(DOC[:8], 8) == []
    pool.publish("b", DOC[:9])
    assert pool.matching(DOC[:8], 8) == pool.page_table("b")[:2]


def test_shared_pages_stay_published_until_their_last_holder_leaves():
    pool = PagePool(10, 4)
    pool.allocate_slots("a", 9)
    pool.publish("a", DOC[:9])
    shared = pool.matching(DOC[:9], 8)
    pool.hold("b", shared)
    pool.allocate_slots("b", 1)
    pool.publish("b", DOC[:8] + [7])
    pool.free("a")
    assert pool.matching(DOC[:9], 8) == shared  # b still holds them
    pool.free("b")
    assert pool.matching(DOC[:9], 8) == [] and pool.num_free_pages() == 9
    pool.allocate_slots("c", 8)  # the same pages, other tokens: the old keys are gone
    pool.publish("c", [0] * 8)
    assert pool.matching(DOC[:8], 8) == [] and pool.matching([0] * 8, 8) == pool.page_table("c")


def test_usage_counts_used_shared_pages_and_tokens():
    pool = PagePool(11, 4)
    assert pool.usage() == PageUsage(total=10, used=0, shared=0, tokens=0, page_size=4)
    assert pool.usage().allocated_over_useful == 1.0 and pool.usage().free == 10
    pool.allocate_slots("a", 9)  # 3 pages for 9 tokens
    usage = pool.usage()
    assert (usage.used, usage.shared, usage.tokens, usage.free) == (3, 0, 9, 7)
    assert usage.allocated_over_useful == pytest.approx(12 / 9)
    pool.hold("b", pool.page_table("a")[:2])
    pool.allocate_slots("b", 2)  # 10 tokens: its third page is its own
    usage = pool.usage()  # the 8 shared tokens count once: 9 + 2
    assert (usage.used, usage.shared, usage.tokens) == (4, 2, 11)
    assert usage.allocated_over_useful == pytest.approx(16 / 11)
    pool.free("a")
    pool.free("b")
    assert pool.usage() == PageUsage(10, 0, 0, 0, 4)


def test_common_prefix():
    # baton.block_hash.common_prefix (the router's batch planner uses it) was tested with the old
    # decode_worker.sharing; it belongs in test_block_hash.py.
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5] * 300, [5] * 300) == 300


# -- sharing through the decode scheduler ------------------------------------------------------


def sched_of(share: int = 32, **kw) -> DecodeScheduler:
    return DecodeScheduler(SchedulerConfig(**{"max_rows": 4, "num_pages": 64, "page_size": 16,
                                              "growth_reserve_tokens": 0, "share_min_tokens": share, **kw}))


def request(rid: str, prompt: list[int], max_new: int = 8, landed: bool = True) -> DecodeSequence:
    return DecodeSequence(rid, len(prompt), max_new, [7] if landed else [], prompt_ids=prompt)


def run(sched: DecodeScheduler):
    out = sched.schedule()
    for s, table, length in zip(out.running, out.tables, out.lengths):
        assert table == sched.pages.page_table(s.request_id) and length == s.num_kv_tokens + 1
    sched.append_tokens([9] * len(out.running))
    return out


def test_a_request_registered_while_matching_pages_are_held_holds_them():
    sched = sched_of(share=32)
    sched.add_staged(request("a", DOC + [1]))
    run(sched)
    a_table = sched.pages.page_table("a")
    b = request("b", DOC + [2], landed=False)
    sched.register(b)
    assert b.held_tokens == sched.held_tokens("b") == 96  # 6 full pages of 16; the 4 tokens after are its own
    assert sched.pages.page_table("b") == a_table[:6] and sched.pages.tokens("b") == 96
    b.output_ids.append(7)
    sched.add_staged(b)
    assert sched.held_tokens("b") == 0  # only while its KV is on its way
    out = run(sched)
    assert [(x.seq, x.shared_tokens) for x in out.admitted] == [(b, 96)]
    assert out.admitted[0].table[:6] == a_table[:6] and out.lengths == [103, 102]
    assert sched.kv_usage().shared == 6


def test_held_tokens_are_whole_pages_at_least_share_min_tokens_and_leave_the_last_prompt_token():
    sched = sched_of(share=48)
    sched.add_staged(request("a", DOC + [1]))
    run(sched)
    short = request("short", DOC[:40] + [3] * 60, landed=False)  # 40 equal tokens: 2 pages, 32 < 48
    sched.register(short)
    assert short.held_tokens == 0 and not sched.pages.holds("short")
    exact = request("exact", DOC[:64], landed=False)  # all 4 pages held, but the last token must be computed
    sched.register(exact)
    assert exact.held_tokens == 48
    other = request("other", [0] + DOC[1:], landed=False)
    sched.register(other)
    assert other.held_tokens == 0
    off = sched_of(share=0)
    off.add_staged(request("a", DOC + [1]))
    run(off)
    b = request("b", DOC + [1], landed=False)
    off.register(b)
    assert b.held_tokens == 0 and not off.pages.holds("b")
    no_ids = DecodeSequence("c", 101, 8, [], prompt_ids=())
    sched.register(no_ids)
    assert no_ids.held_tokens == 0


def test_rows_admitted_in_the_same_schedule_share():
    """The first row's prompt pages are published as it is admitted: the second matches them in
    the same schedule() (the core writes admitted rows' KV in order, before the step)."""
    sched = sched_of(share=32)
    for i in range(3):
        sched.add_staged(request(f"r{i}", DOC + [i]))
    out = run(sched)
    assert [x.shared_tokens for x in out.admitted] == [0, 96, 96]
    first = out.admitted[0].table
    assert all(x.table[:6] == first[:6] and x.table[6] != first[6] for x in out.admitted[1:])
    usage = sched.kv_usage()
    assert (usage.used, usage.shared) == (7 + 1 + 1, 6)
    assert usage.tokens == 102 + 6 + 6


def test_a_shared_prefix_counts_once_against_the_pages():
    """Four rows of a 100-token prefix plus 10 own tokens: 7 pages each unshared, 7 + 3 x 1 shared;
    16 pages admit all four only when they share."""
    def admitted(share: int) -> int:
        sched = sched_of(share=share, num_pages=17)
        for i in range(4):
            r = request(f"r{i}", DOC + [i] * 10, max_new=20)
            sched.register(r)
            sched.add_staged(r)
        return len(sched.schedule().admitted)

    assert admitted(share=0) == 2
    assert admitted(share=64) == 4


def test_shared_pages_survive_until_their_last_holder_leaves():
    sched = sched_of(share=32)
    seqs = [request(f"r{i}", DOC + [i]) for i in range(3)]
    for s in seqs:
        sched.register(s)
        sched.add_staged(s)
    out = run(sched)
    assert [x.shared_tokens for x in out.admitted] == [0, 96, 96]  # the first has nobody to share with
    prefix = out.admitted[0].table[:6]
    waiting = request("w", DOC + [9], landed=False)
    sched.register(waiting)  # holds the prefix too, while its KV is on its way
    assert waiting.held_tokens == 96
    sched.finish(seqs[0], Status.FINISHED_STOPPED)  # the one that wrote them
    assert sched.pages.matching(DOC, 100) == prefix and sched.kv_usage().shared == 6
    sched.finish(seqs[1], Status.FINISHED_STOPPED)
    sched.finish(seqs[2], Status.FINISHED_STOPPED)
    assert sched.pages.page_table("w") == prefix and sched.kv_usage().used == 6
    late = request("late", DOC + [8], landed=False)
    sched.register(late)
    assert late.held_tokens == 96  # still findable: the waiting request holds them
    sched.finish(waiting, Status.FINISHED_ABORTED)
    sched.finish(late, Status.FINISHED_ABORTED)
    assert sched.pages.matching(DOC, 100) == [] and sched.kv_usage().used == 0 and not sched.requests


def test_a_parked_row_shares_again_when_it_resumes():
    sched = sched_of(share=32, max_rows=2)
    a, b = request("a", DOC + [1], max_new=50), request("b", DOC + [2], max_new=50)
    for s in (a, b):
        sched.add_staged(s)
    run(sched)
    urgent = request("urgent", [5] * 20)
    urgent.priority = 1
    sched.add_staged(urgent)
    out = run(sched)
    assert [p.seq for p in out.parked] == [b] and out.parked[0].table[:6] == sched.pages.page_table("a")[:6]
    assert sched.kv_usage().shared == 0  # a alone holds the prefix now
    sched.finish(urgent, Status.FINISHED_STOPPED)
    out = run(sched)
    assert out.resumed == [b] and out.admitted[0].shared_tokens == 96
    assert sched.kv_usage().shared == 6


def test_pages_held_by_a_staged_request_do_not_stall_the_queue():
    sched = DecodeScheduler(SchedulerConfig(max_rows=2, num_pages=5, page_size=4, growth_reserve_tokens=0,
                                            share_min_tokens=4))  # 4 pages of 4 tokens
    prefix = DOC[:8]
    a = request("a", prefix, max_new=3)
    sched.add_staged(a)
    run(sched)
    b = request("b", prefix + [5], max_new=3, landed=False)
    sched.register(b)
    assert b.held_tokens == 8  # a's 2 prompt pages
    sched.finish(a, Status.FINISHED_STOPPED)  # b alone holds them now: 2 pages free
    c = request("c", [9] * 4, max_new=13)  # 16 KV tokens at its longest: every page, so it fits ever
    sched.add_staged(c)
    b.output_ids.append(7)
    sched.add_staged(b)  # needs 1 page beyond the 2 it holds
    for _ in range(30):
        out = run(sched)
        for s in out.running:
            if len(s.output_ids) >= s.max_new_tokens:
                sched.finish(s, Status.FINISHED_LENGTH)
        if not sched.has_work():
            break
    # got: c grows to 3 pages, is parked (2 free), and stays first in the queue; b, behind it,
    # would run with the 1 page it lacks, but is never tried: no row runs again
    assert not sched.requests


def test_usage_kept_as_holds_change_equals_a_recount():
    """usage() keeps its shared-page counts as pages are held and freed (a load report must not
    scan the pool); after any sequence of holds and frees they equal a count over every page."""
    import random

    rng = random.Random(3)
    pool = PagePool(num_pages=64, page_size=4)
    live: list[str] = []
    for step in range(400):
        if live and rng.random() < 0.4:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            request_id = f"r{step}"
            donor = rng.choice(live) if live and rng.random() < 0.6 else None
            shared = pool.page_table(donor)[:rng.randint(0, 3)] if donor else []
            if pool.allocate_slots(request_id, rng.randint(1, 9), shared_pages=shared) is not None:
                live.append(request_id)
        refs = pool._refs
        usage = pool.usage()
        assert usage.shared == sum(1 for r in refs if r > 1)
        assert usage.tokens == sum(pool._tokens.values()) - sum(r - 1 for r in refs if r > 1) * pool.page_size
