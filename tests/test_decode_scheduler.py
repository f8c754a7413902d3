"""The decode scheduler's policy, without a model: admission by pages, row reuse, parking, limits.

No model runs here: after each `schedule()` the test appends one token per running row, as the
decode core does after its decode step.
"""
import random
import threading

import pytest

from baton.decode_worker.kv_pages import NULL_PAGE
from baton.decode_worker.scheduler import (
    Admitted, DecodeScheduler, DecodeSequence, Parked, SchedulerConfig, SchedulerOutput, Status,
)


def seq(rid: str, prompt: int = 4, max_new: int = 3, priority: int = 0) -> DecodeSequence:
    return DecodeSequence(rid, prompt_len=prompt, max_new_tokens=max_new, output_ids=[7], priority=priority)


def config(**kw) -> SchedulerConfig:
    """Small pages (4 tokens) and no growth reserve unless a test asks: page counts stay easy to follow."""
    return SchedulerConfig(**{"max_rows": 2, "num_pages": 65, "page_size": 4, "growth_reserve_tokens": 0, **kw})


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def used(sched: DecodeScheduler) -> int:
    return sched.pages.total_pages - sched.pages.num_free_pages()


def check(sched: DecodeScheduler, out: SchedulerOutput) -> None:
    """What the core relies on: row i is running[i], with the pool's table and length for it, and
    room for exactly its KV plus this step's token."""
    pool = sched.pages
    assert out.running == sched.rows
    assert len(out.tables) == len(out.lengths) == len(out.running)
    for i, (s, table, length) in enumerate(zip(out.running, out.tables, out.lengths)):
        assert s.row == i and s.status is Status.RUNNING
        assert table == pool.page_table(s.request_id) and NULL_PAGE not in table
        assert length == pool.tokens(s.request_id) == s.num_kv_tokens + 1
        assert len(table) == pool.pages_for(length)
    for admitted in out.admitted:
        assert isinstance(admitted, Admitted) and admitted.table == pool.page_table(admitted.seq.request_id)
    assert set(out.resumed) <= {a.seq for a in out.admitted}
    for s in out.dropped + [p.seq for p in out.parked]:
        assert s.status is Status.PARKED or s in out.resumed


def step(sched: DecodeScheduler, token: int = 9) -> SchedulerOutput:
    out = sched.schedule()
    check(sched, out)
    sched.append_tokens([token] * len(out.running))
    return out


# -- rows ------------------------------------------------------------------------------------


def test_admits_while_rows_free_and_reuses_released_rows():
    sched = DecodeScheduler(config(max_rows=2))
    for i in range(3):
        sched.add_staged(seq(f"r{i}"))
    out = sched.schedule()
    check(sched, out)
    assert ids(a.seq for a in out.admitted) == ["r0", "r1"] and [a.shared_tokens for a in out.admitted] == [0, 0]
    assert [s.row for s in out.running] == [0, 1]
    sched.append_tokens([8, 9])
    assert sched.rows[0].output_ids == [7, 8] and sched.rows[1].output_ids == [7, 9]
    assert sched.finish(sched.rows[0], Status.FINISHED_STOPPED) is None
    assert sched.rows[0].request_id == "r1" and sched.rows[0].row == 0
    assert not sched.pages.holds("r0")
    out = step(sched)
    assert ids(a.seq for a in out.admitted) == ["r2"] and out.admitted[0].seq.row == 1
    assert sched.finished_total == 1


def test_releasing_a_row_moves_the_rows_after_it_up_in_order():
    sched = DecodeScheduler(config(max_rows=4))
    for rid in "abcd":
        sched.add_staged(seq(rid))
    step(sched)
    tables = {s.request_id: sched.pages.page_table(s.request_id) for s in sched.rows}
    assert sched.finish(sched.find("b"), Status.FINISHED_LENGTH) is None
    assert ids(sched.rows) == ["a", "c", "d"] and [s.row for s in sched.rows] == [0, 1, 2]
    out = step(sched)  # the others keep their pages: only the row indices moved
    assert all(out.tables[i][:len(tables[s.request_id])] == tables[s.request_id] for i, s in enumerate(out.running))


def test_admission_is_first_come_first_served():
    sched = DecodeScheduler(config(max_rows=1, num_pages=6))  # 5 pages: 20 tokens, one row
    for rid in ("a", "b", "c"):
        sched.add_staged(seq(rid, prompt=15, max_new=5))  # 19 KV tokens at its longest: fits one row
    order = []
    while sched.has_work():
        out = step(sched)
        order += ids(a.seq for a in out.admitted)
        sched.finish(out.running[0], Status.FINISHED_LENGTH)
    assert order == ["a", "b", "c"] and sched.pages.num_free_pages() == 5


def test_request_that_can_never_fit_is_refused_with_advice():
    sched = DecodeScheduler(config(max_rows=1, num_pages=3))  # 2 pages of 4: 8 KV tokens for one row
    assert sched.max_row_tokens == 8
    with pytest.raises(ValueError, match="lower max_tokens"):
        sched.add_staged(seq("x", prompt=5, max_new=5))  # 9 KV tokens at its longest
    with pytest.raises(ValueError, match="lower max_tokens"):
        sched.register(seq("x", prompt=5, max_new=5))
    assert not sched.requests
    sched.add_staged(seq("y", prompt=5, max_new=4))  # 8: fits, alone
    capped = DecodeScheduler(config(max_row_tokens=10))
    assert capped.max_row_tokens == 10 and capped.fits_ever(seq("z", prompt=9, max_new=2))
    with pytest.raises(ValueError, match="lower max_tokens"):
        capped.register(seq("z", prompt=9, max_new=3))


def test_finishing_a_staged_request_removes_it():
    sched = DecodeScheduler(config(max_rows=1))
    a = seq("a")
    sched.add_staged(a)
    assert sched.finish(a, Status.FINISHED_ABORTED) is None
    assert not sched.has_work() and a.finish_reason == "abort" and sched.find("a") is None
    with pytest.raises(ValueError, match="already ended"):
        sched.add_staged(a)  # its KV landing after the cancel
    assert used(sched) == 0


def test_the_config_is_checked():
    with pytest.raises(ValueError):
        SchedulerConfig(max_rows=0, num_pages=8)
    with pytest.raises(ValueError):
        SchedulerConfig(max_rows=1, num_pages=1)
    with pytest.raises(ValueError):
        SchedulerConfig(max_rows=1, num_pages=8, page_size=0)
    with pytest.raises(ValueError, match="low KV watermark"):
        SchedulerConfig(max_rows=1, num_pages=8, high_watermark_pages=3, low_watermark_pages=4)
    with pytest.raises(ValueError):
        SchedulerConfig(max_rows=1, num_pages=8, growth_reserve_tokens=-1)
    with pytest.raises(ValueError):
        SchedulerConfig(max_rows=1, num_pages=8, share_min_tokens=-1)


# -- priority ----------------------------------------------------------------------------------


def test_higher_priority_parks_the_lowest_priority_row():
    sched = DecodeScheduler(config(max_rows=2))
    a, b = seq("a", priority=1), seq("b", priority=0)
    sched.add_staged(a)
    sched.add_staged(b)
    step(sched)
    b_table = sched.pages.page_table("b")
    urgent = seq("urgent", priority=5)
    sched.add_staged(urgent)
    out = step(sched)
    assert [(p.seq, p.table, p.tokens) for p in out.parked] == [(b, b_table, 5)]
    assert isinstance(out.parked[0], Parked) and out.dropped == []
    assert ids(a.seq for a in out.admitted) == ["urgent"] and ids(out.running) == ["a", "urgent"]
    assert ids(sched.staged) == ["b"] and b.status is Status.PARKED and b.row is None
    assert not sched.pages.holds("b") and sched.parked_total == 1 and sched.parked_for_memory_total == 0
    same = seq("same", priority=1)  # equal priority never preempts
    sched.add_staged(same)
    out = step(sched)
    assert out.parked == [] and ids(sched.staged) == ["same", "b"]


def test_among_the_lowest_priority_the_latest_row_is_parked():
    sched = DecodeScheduler(config(max_rows=3))
    for rid in "abc":
        sched.add_staged(seq(rid))
    step(sched)
    sched.add_staged(seq("urgent", priority=1))
    out = step(sched)
    assert ids(p.seq for p in out.parked) == ["c"] and ids(out.running) == ["a", "b", "urgent"]


def test_a_priority_park_the_host_refuses_keeps_the_row():
    asked = []
    sched = DecodeScheduler(config(max_rows=1), can_park=lambda s: asked.append(s.request_id) or False)
    a = seq("a", prompt=10)
    sched.add_staged(a)
    step(sched)
    urgent = seq("urgent", priority=5)
    sched.add_staged(urgent)
    out = step(sched)  # the host is full: "a" keeps its row and its KV
    assert out.parked == [] and out.dropped == [] and ids(out.running) == ["a"]
    assert urgent.status is Status.STAGED and not a.recompute and a.status is Status.RUNNING
    assert asked == ["a"] and sched.park_refused_total == 1 and sched.parked_total == 0


def test_a_request_lives_in_the_scheduler_from_registration_to_its_end():
    sched = DecodeScheduler(config(max_rows=1))
    a = DecodeSequence("a", prompt_len=4, max_new_tokens=3, output_ids=[])
    sched.register(a)
    assert a.status is Status.WAITING and sched.find("a") is a and sched.num_waiting == 1
    assert sched.held_tokens("a") == 0 and not sched.pages.holds("a")
    assert not sched.has_work()  # nothing to decode until its KV lands
    a.output_ids.append(7)
    sched.add_staged(a)
    assert a.status is Status.STAGED and sched.num_waiting == 0 and sched.num_staged == 1
    step(sched)
    assert a.status is Status.RUNNING and a.row == 0 and sched.num_running == 1
    urgent = seq("urgent", priority=1)
    sched.add_staged(urgent)
    out = step(sched)
    assert a.status is Status.PARKED and out.resumed == [] and ids(p.seq for p in out.parked) == ["a"]
    assert sched.ids(Status.PARKED) == ["a"]
    sched.finish(urgent, Status.FINISHED_LENGTH)
    out = step(sched)
    assert out.resumed == [a] and a.status is Status.RUNNING and sched.resumed_total == 1
    assert out.admitted[0].seq is a and out.admitted[0].shared_tokens == 0
    assert sched.statuses() == {"a": Status.RUNNING}
    sched.finish(a, Status.FINISHED_STOPPED)
    assert sched.find("a") is None and not sched.requests and a.finish_reason == "stop"
    assert used(sched) == 0
    with pytest.raises(LookupError, match="already ended"):
        sched.finish(a, Status.FINISHED_ABORTED)


# -- limits and moving -------------------------------------------------------------------------


def test_registration_is_bounded_and_ids_are_unique():
    sched = DecodeScheduler(config(max_rows=1, max_waiting=2, max_requests=3))
    sched.register(seq("a"))
    with pytest.raises(ValueError, match="already being decoded"):
        sched.register(seq("a"))
    sched.register(seq("b"))
    with pytest.raises(OverflowError, match="2 requests are already waiting for KV"):
        sched.register(seq("c"))
    sched.add_staged(sched.find("a"))
    sched.add_staged(sched.find("b"))
    sched.register(seq("c"))  # a and b landed: only c waits
    with pytest.raises(OverflowError, match="3 requests are already here"):
        sched.register(seq("d"))
    sched.finish(sched.find("b"), Status.FINISHED_ABORTED)
    sched.register(seq("d"))


def test_a_moving_request_leaves_the_batch_and_is_taken_once():
    sched = DecodeScheduler(config(max_rows=2))
    a, b = seq("a"), seq("b")
    sched.add_staged(a)
    sched.add_staged(b)
    step(sched)
    assert sched.move(a) is None and b.row == 0 and a.status is Status.MOVING  # b took its row
    assert sched.rows == [b] and not sched.staged and sched.find("a") is a and not sched.pages.holds("a")
    with pytest.raises(ValueError, match="running"):
        sched.move(a)
    with pytest.raises(ValueError, match="not moving"):
        sched.take_moving("b")
    assert sched.take_moving("a") is a and a.status is Status.MOVED and sched.find("a") is None
    with pytest.raises(LookupError):
        sched.take_moving("a")
    assert sched.finished_total == 0  # moved away, not finished here
    c = seq("c")
    sched.register(c)
    with pytest.raises(ValueError, match="WAITING"):
        sched.move(c)  # its KV has not landed: nothing to move


def test_staged_and_parked_requests_can_move():
    sched = DecodeScheduler(config(max_rows=1))
    a, b = seq("a"), seq("b")
    sched.add_staged(a)
    sched.add_staged(b)
    step(sched)
    sched.move(b)  # staged
    sched.add_staged(seq("urgent", priority=1))
    step(sched)
    assert a.status is Status.PARKED
    sched.move(a)  # parked
    assert ids(sched.staged) == [] and ids(sched.rows) == ["urgent"]
    assert sched.take_moving("a") is a and sched.take_moving("b") is b


# -- paged admission ---------------------------------------------------------------------------


def test_rows_join_by_what_they_hold_never_by_max_tokens():
    """Every row may grow to every page (max_new_tokens huge), yet eight join: each holds 2 pages
    now, and the next needs its 2 + a 1-page growth reserve free. Memory, not max_rows, stops the ninth."""
    sched = DecodeScheduler(config(max_rows=10, num_pages=18, growth_reserve_tokens=4))  # 17 pages
    assert sched.max_row_tokens == 68
    for i in range(10):
        sched.add_staged(seq(f"r{i}", prompt=4, max_new=65))  # 68 KV tokens at its longest: the whole pool
    out = step(sched)
    assert ids(a.seq for a in out.admitted) == [f"r{i}" for i in range(8)]
    assert used(sched) == 16 and sched.pages.num_free_pages() == 1  # the ninth needs 2 + 1 reserve
    assert out.lengths == [5] * 8 and all(len(t) == 2 for t in out.tables)
    assert sorted(p for t in out.tables for p in t) == list(range(1, 17))  # no page twice, never page 0


def test_a_joining_row_needs_its_kv_plus_the_growth_reserve_and_an_empty_batch_needs_no_reserve():
    sched = DecodeScheduler(config(max_rows=4, num_pages=5, growth_reserve_tokens=8))  # 4 pages of 4
    big = seq("big", prompt=11, max_new=6)  # 12 tokens this step: 3 pages, and the reserve would make 5
    sched.add_staged(big)
    out = step(sched)
    assert out.admitted[0].seq is big and used(sched) == 3  # alone: no reserve, or it would never run
    small = seq("small", prompt=2, max_new=2)  # 3 tokens: 1 page, free; + 8 reserve: 3 pages, not free
    sched.add_staged(small)
    out = step(sched)
    assert out.admitted == [] and small.status is Status.STAGED
    sched.finish(big, Status.FINISHED_STOPPED)
    assert step(sched).admitted[0].seq is small


def test_pages_running_out_mid_decode_park_the_latest_row_until_pages_free():
    sched = DecodeScheduler(config(max_rows=3, num_pages=5))  # 4 pages of 4 tokens
    a, b, c = seq("a", prompt=3, max_new=9), seq("b", prompt=3, max_new=9), seq("c", prompt=3, max_new=9)
    for s in (a, b, c):
        sched.add_staged(s)
    out = step(sched)  # 4 tokens each: one page each, one page free
    assert ids(out.running) == ["a", "b", "c"] and used(sched) == 3
    c_table = sched.pages.page_table("c")
    out = step(sched)  # each needs a 5th token: a takes the last page, b needs one: c, the latest, goes
    assert [(p.seq, p.table, p.tokens) for p in out.parked] == [(c, c_table, 4)]
    assert out.dropped == [] and ids(out.running) == ["a", "b"] and out.lengths == [5, 5]
    assert c.status is Status.PARKED and ids(sched.staged) == ["c"] and not sched.pages.holds("c")
    assert sched.parked_total == sched.parked_for_memory_total == 1 and sched.pages.num_free_pages() == 0
    out = step(sched)  # 6 tokens fit in the pages a and b hold: c still has none to come back to
    assert out.parked == out.admitted == [] and c.status is Status.PARKED
    sched.finish(a, Status.FINISHED_STOPPED)
    out = step(sched)
    assert out.resumed == [c] and ids(a.seq for a in out.admitted) == ["c"] and ids(out.running) == ["b", "c"]
    assert out.admitted[0].shared_tokens == 0 and out.lengths == [7, 5]  # c: its 4 tokens' KV + this step's
    assert c.output_ids == [7, 9, 9]  # nothing was appended while it was parked
    assert sched.resumed_total == 1 and not c.recompute


def test_pages_running_out_park_the_lowest_priority_row_before_a_later_one():
    sched = DecodeScheduler(config(max_rows=2, num_pages=4))  # 3 pages of 4 tokens
    low, high = seq("low", prompt=4, max_new=6), seq("high", prompt=3, max_new=6, priority=1)
    sched.add_staged(low)
    step(sched)  # low: 5 tokens, 2 pages
    sched.add_staged(high)
    out = step(sched)  # high: 4 tokens, 1 page
    assert ids(out.running) == ["low", "high"] and used(sched) == 3
    low_table = sched.pages.page_table("low")
    out = step(sched)  # high needs a page and none is free: "low" goes though "high" came later
    assert [(p.seq, p.table, p.tokens) for p in out.parked] == [(low, low_table, 6)]
    assert ids(out.running) == ["high"] and out.lengths == [5] and high.row == 0


def test_the_host_refusing_a_memory_park_drops_the_kv_for_recompute():
    asked = []
    sched = DecodeScheduler(config(max_rows=3, num_pages=5), can_park=lambda s: asked.append(s.request_id) or False)
    a, b, c = seq("a", prompt=3, max_new=9), seq("b", prompt=3, max_new=9), seq("c", prompt=3, max_new=9)
    for s in (a, b, c):
        sched.add_staged(s)
    step(sched)
    out = step(sched)
    assert out.parked == [] and out.dropped == [c] and c.recompute and c.status is Status.PARKED
    assert asked == ["c"] and sched.park_refused_total == 1 and sched.parked_for_memory_total == 1
    assert ids(out.running) == ["a", "b"] and not sched.pages.holds("c")
    sched.finish(a, Status.FINISHED_STOPPED)
    out = step(sched)
    assert out.resumed == [c] and c.status is Status.RUNNING
    assert c.recompute  # the core computes its KV again and clears the flag


def test_watermarks_in_pages_park_above_high_and_admit_at_or_below_low():
    # Rows of 4 prompt tokens + 1 output take 2 pages of 4 tokens to join.
    sched = DecodeScheduler(config(max_rows=4, high_watermark_pages=7, low_watermark_pages=5))
    for rid in "abcd":
        sched.add_staged(seq(rid, max_new=30))
    out = step(sched)
    assert ids(out.running) == ["a", "b"]  # a third row would make 6 pages used > low 5
    while used(sched) <= 7:
        out = step(sched)
        assert out.parked == [] and out.admitted == []
    assert used(sched) == 8 and out.lengths == [13, 13]  # 4 pages each: above high, parked next step
    out = step(sched)
    assert ids(p.seq for p in out.parked) == ["b"] and ids(out.running) == ["a"] and out.admitted == []
    assert sched.parked_for_memory_total == 1 and ids(sched.staged) == ["b", "c", "d"]
    assert used(sched) == 4  # a, with this step's token: b (4 more pages) would go above low


def test_the_high_watermark_never_parks_the_last_row():
    sched = DecodeScheduler(config(max_rows=2, high_watermark_pages=1, low_watermark_pages=1))
    a = seq("a", prompt=8, max_new=3)
    sched.add_staged(a)
    for _ in range(2):
        out = step(sched)
        assert out.parked == [] and ids(out.running) == ["a"]


def test_tables_and_lengths_match_the_pool_through_a_busy_run():
    """Many requests of random sizes and priorities, few pages: parking, dropping, resuming and
    finishing in every order; each step the rows, their tables and lengths agree with the pool."""
    rng = random.Random(1)
    refuse = {"n": 0}

    def can_park(s):
        refuse["n"] += 1
        return refuse["n"] % 3 != 0  # the host refuses one park in three

    sched = DecodeScheduler(config(max_rows=6, num_pages=21, growth_reserve_tokens=4), can_park)
    pending = [seq(f"r{i}", prompt=rng.randint(1, 20), max_new=rng.randint(1, 40), priority=rng.randint(0, 2))
               for i in range(40)]
    finished = 0
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            sched.add_staged(pending.pop())
        out = step(sched, token=rng.randint(0, 100))
        pages = [p for t in out.tables for p in t]
        assert len(pages) == len(set(pages))  # nothing shared without prompt ids
        assert used(sched) == len(pages)  # every used page is a running row's
        for s in list(sched.rows):
            if len(s.output_ids) >= s.max_new_tokens or rng.random() < 0.02:
                sched.finish(s, Status.FINISHED_LENGTH)
                finished += 1
        if not pending and not sched.has_work():
            break
    assert finished == 40 and used(sched) == 0 and not sched.requests
    assert sched.parked_total > 0 and sched.park_refused_total > 0 and sched.resumed_total > 0


# -- threads -----------------------------------------------------------------------------------


def test_registration_from_many_threads_while_the_loop_schedules():
    sched = DecodeScheduler(config(max_rows=8, num_pages=200))
    errors = []

    def register(t: int):
        try:
            for i in range(50):
                s = seq(f"t{t}-{i}", max_new=2)
                sched.register(s)
                sched.add_staged(s)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=register, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    ended = 0
    while ended < 200 and not errors:
        out = step(sched)
        for s in out.running:
            if len(s.output_ids) >= s.max_new_tokens:
                sched.finish(s, Status.FINISHED_STOPPED)
                ended += 1
    for t in threads:
        t.join()
    assert not errors and ended == 200 and not sched.requests and used(sched) == 0


def test_a_high_watermark_alone_also_bounds_admission():
    """With no low watermark, admission stops at the high one: a row admitted past it would be
    parked and admitted again step after step."""
    sched = DecodeScheduler(config(max_rows=4, num_pages=20, high_watermark_pages=3))  # low: 0, off
    for rid in "ab":
        sched.add_staged(seq(rid, max_new=50))
    for _ in range(4):
        out = step(sched)  # a holds 2 pages; b's 2 more would be 4 > 3
        assert ids(out.running) == ["a"] and out.parked == [] and out.resumed == []
    assert ids(sched.staged) == ["b"]


# -- retained pages: a finished request's KV serves its conversation's next turn -------------------


class Heard:
    """The scheduler's KV listener: which keys hold which tokens here now."""

    def __init__(self):
        self.keys: dict[str, tuple] = {}

    def held(self, key, tokens):
        self.keys[key] = tuple(tokens)

    def dropped(self, key):
        self.keys.pop(key, None)


def talk(rid: str, prompt: list[int], max_new: int = 3, local: bool = False) -> DecodeSequence:
    return DecodeSequence(rid, len(prompt), max_new, [], prompt_ids=prompt, local=local)


def run_to_end(sched: DecodeScheduler, s: DecodeSequence, answer: list[int]) -> None:
    """Land `s` (first token answer[0]), decode the rest of `answer`, finish it (stop)."""
    s.output_ids.append(answer[0])
    sched.add_staged(s)
    for token in answer[1:]:
        out = sched.schedule()
        check(sched, out)
        sched.append_tokens([token if r is s else 0 for r in out.running])
    sched.finish(s, Status.FINISHED_STOPPED)


def test_a_finished_turns_pages_stay_and_its_next_turn_holds_them():
    heard = Heard()
    sched = DecodeScheduler(config(retain=True, share_min_tokens=4), listener=heard)
    first = list(range(100, 110))  # 10 prompt tokens
    run_to_end(sched, talk("t1", first), [1, 2, 3, 4, 5, 6])  # KV of 10 + 5 tokens: 3 full pages and 3 tokens
    assert sched.kv_usage().used == 0 and sched.kv_usage().retained == 4 and sched.retained_total == 1
    assert heard.keys == {"retained:t1": tuple(first + [1, 2, 3, 4, 5])}
    second = first + [1, 2, 3, 4, 5, 6, 50, 51, 52]
    turn = talk("t2", second, local=True)
    sched.register(turn)
    assert turn.held_tokens == 12  # three full pages; the fourth holds the answer's 3, 4, 5 to copy
    assert turn.tail is not None and turn.tail[1] == 3
    sched.untail(turn)
    run_to_end(sched, turn, [7, 8])
    # the second turn's entry continues the first's: that one is dropped, nothing is held twice
    assert list(heard.keys) == ["retained:t2"] and sched.pages.num_retained == 1
    assert sched.kv_usage().used == 0


def test_retained_pages_go_first_when_a_row_needs_them():
    heard = Heard()
    sched = DecodeScheduler(config(retain=True, share_min_tokens=4, num_pages=9, max_rows=1), listener=heard)
    for n in range(3):  # each leaves 2 pages (6 prompt + 2 answer tokens of KV)
        run_to_end(sched, talk(f"r{n}", [n * 10 + i for i in range(6)]), [1, 2, 3])
    assert sched.kv_usage().retained == 6 and sched.pages.num_free_pages() == 2
    big = talk("big", list(range(200, 220)), max_new=2)  # 20 tokens + 1: 6 pages
    big.output_ids.append(1)
    sched.add_staged(big)
    out = step(sched)
    assert [a.seq.request_id for a in out.admitted] == ["big"] and not out.parked
    # the least recently used went first: r0 and r1, handed over with their pages to read before
    # the step writes (the core keeps them on the host, or forgets them); r2 stayed
    assert [(d.key, len(d.table), len(d.tokens)) for d in out.demoted] == [("retained:r0", 2, 8), ("retained:r1", 2, 8)]
    assert {page for d in out.demoted for page in d.table} & {page for a in out.admitted for page in a.table}
    for d in out.demoted:
        sched.forget(d.key)
    assert list(heard.keys) == ["retained:r2", "big"] and sched.reclaimed_total == 2
    sched.finish(big, Status.FINISHED_ABORTED)
    assert sched.kv_usage().used == 0 and "big" not in heard.keys


def test_turns_holding_each_others_pages_do_not_wait_for_each_other():
    """Two conversations' next turns land holding their earlier turns' pages (3 each), and each
    needs 4 more of the 3 their holds leave: with no row decoding, neither could ever start. The one
    behind gives its pages up, handed over to read first (its KV goes to the host), and the head runs."""
    sched = DecodeScheduler(config(retain=True, share_min_tokens=4, num_pages=9, max_rows=1))
    said = {c: [base + i for i in range(10)] for c, base in (("a", 100), ("b", 200))}
    for c in "ab":  # 10 prompt + 5 answer tokens of KV retained each: 3 full pages and a partial one
        run_to_end(sched, talk(f"{c}1", said[c]), [1, 2, 3, 4, 5, 6])
    turns = {c: talk(f"{c}2", said[c] + [1, 2, 3, 4, 5, 6] + [300 + i for i in range(9)]) for c in "ab"}
    for c in "ab":
        sched.register(turns[c])
        assert turns[c].held_tokens == 12
        turns[c].output_ids.append(1)
        sched.add_staged(turns[c])
    b_table = sched.pages.page_table("b2")
    out = step(sched)
    assert ids(out.running) == ["a2"] and sched.unheld_total == 1
    assert [(p.seq, p.table, p.tokens) for p in out.unheld] == [(turns["b"], b_table, 12)]
    assert not sched.pages.holds("b2") and turns["b"].held_tokens == 0 and ids(sched.staged) == ["b2"]
    for _ in range(2):
        step(sched)
    sched.finish(turns["a"], Status.FINISHED_STOPPED)
    assert ids(step(sched).running) == ["b2"] and sched.standstill() is None


def test_retained_pages_never_park_a_row_nor_count_as_used():
    sched = DecodeScheduler(config(retain=True, share_min_tokens=4, num_pages=7, max_rows=2,
                                   high_watermark_pages=4))
    run_to_end(sched, talk("old", list(range(12))), [1, 2, 3, 4, 5])  # 4 pages retained
    assert sched.kv_usage().used == 0 and sched.kv_usage().free == 6
    a = talk("a", list(range(50, 58)), max_new=8)
    a.output_ids.append(1)
    sched.add_staged(a)
    for _ in range(6):
        out = step(sched)
        assert not out.parked and not out.dropped
    assert sched.kv_usage().retained < 4  # taken as the row grew


def test_a_drained_worker_forgets_its_retained_pages_with_events():
    heard = Heard()
    sched = DecodeScheduler(config(retain=True, share_min_tokens=4), listener=heard)
    run_to_end(sched, talk("x", list(range(9))), [1, 2])
    assert sched.release_retained() == 1
    assert heard.keys == {} and sched.pages.num_free_pages() == sched.pages.total_pages


def test_without_retain_a_finished_request_frees_everything():
    sched = DecodeScheduler(config(share_min_tokens=4))
    run_to_end(sched, talk("x", list(range(9))), [1, 2])
    assert sched.pages.num_free_pages() == sched.pages.total_pages and sched.pages.num_retained == 0


def test_conversations_sharing_only_a_first_page_each_find_their_own_turns():
    """Two conversations whose prompts share one page (a chat template's start) and no more: each
    next turn finds all of its own conversation's pages, not only that first one."""
    sched = DecodeScheduler(config(retain=True, share_min_tokens=16))
    header = [1, 2, 3, 4]  # one page of 4 tokens
    for name in "ab":
        run_to_end(sched, talk(name, header + [ord(name)] * 9), [5, 6, 7])
    for name in "ab":
        turn = talk(f"{name}2", header + [ord(name)] * 9 + [5, 6, 7, 8, 9], local=True)
        sched.register(turn)
        assert turn.held_tokens == 12 and turn.tail == (turn.tail[0], 3), name  # 15 tokens of KV: 3 pages + 3
        sched.finish(turn, Status.FINISHED_ABORTED)
