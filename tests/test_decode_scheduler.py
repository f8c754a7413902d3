"""The decode scheduler's policy, without a model: admission, row reuse, release, limits."""
import pytest

from baton.decode_worker.scheduler import DecodeScheduler, DecodeSequence, SchedulerConfig, Status


def seq(rid: str, prompt: int = 4, max_new: int = 3) -> DecodeSequence:
    return DecodeSequence(rid, prompt_len=prompt, max_new_tokens=max_new, output_ids=[7])


def test_admits_while_rows_free_and_reuses_released_rows():
    sched = DecodeScheduler(SchedulerConfig(max_rows=2, max_columns=100))
    for i in range(3):
        sched.add_staged(seq(f"r{i}"))
    out = sched.schedule()
    assert [s.request_id for s in out.admitted] == ["r0", "r1"]
    assert [s.row for s in out.running] == [0, 1]
    sched.append_tokens([8, 9])
    assert sched.rows[0].output_ids == [7, 8]
    moved = sched.finish(sched.rows[0], Status.FINISHED_STOPPED)
    assert moved == 1 and sched.rows[0].request_id == "r1" and sched.rows[0].row == 0
    out = sched.schedule()
    assert [s.request_id for s in out.admitted] == ["r2"] and out.admitted[0].row == 1


def test_admission_is_first_come_first_served():
    sched = DecodeScheduler(SchedulerConfig(max_rows=1, max_columns=20))
    for rid in ("a", "b", "c"):
        sched.add_staged(seq(rid, prompt=15, max_new=5))  # 19 columns each: fits one row
    order = []
    while sched.has_work():
        out = sched.schedule()
        order += [s.request_id for s in out.admitted]
        sched.finish(out.running[0], Status.FINISHED_LENGTH)
    assert order == ["a", "b", "c"]


def test_request_that_can_never_fit_is_refused_with_advice():
    sched = DecodeScheduler(SchedulerConfig(max_rows=1, max_columns=10))
    with pytest.raises(ValueError, match="lower max_tokens"):
        sched.add_staged(seq("x", prompt=9, max_new=5))


def test_finishing_a_staged_request_removes_it():
    sched = DecodeScheduler(SchedulerConfig(max_rows=1, max_columns=10))
    a = seq("a")
    sched.add_staged(a)
    assert sched.finish(a, Status.FINISHED_ABORTED) is None
    assert not sched.has_work() and a.finish_reason == "abort"


def test_higher_priority_parks_the_lowest_priority_row():
    sched = DecodeScheduler(SchedulerConfig(max_rows=2, max_columns=100))
    a, b = seq("a"), seq("b")
    a.priority, b.priority = 1, 0
    sched.add_staged(a)
    sched.add_staged(b)
    sched.schedule()
    urgent = seq("urgent")
    urgent.priority = 5
    sched.add_staged(urgent)
    out = sched.schedule()
    assert [(s.request_id, row) for s, row in out.parked] == [("b", 1)]
    assert [s.request_id for s in out.admitted] == ["urgent"]
    assert [s.request_id for s in sched.staged] == ["b"] and b.status is Status.PARKED
    same = seq("same")  # equal priority never preempts
    sched.add_staged(same)
    assert sched.schedule().parked == []


def test_a_row_the_host_has_no_room_for_stays_in_the_batch():
    asked = []
    sched = DecodeScheduler(SchedulerConfig(max_rows=1, max_columns=100, high_watermark_slots=4),
                            can_park=lambda s: asked.append(s.request_id) or False)
    a = seq("a", prompt=10)
    sched.add_staged(a)
    sched.schedule()
    urgent = seq("urgent")
    urgent.priority = 5
    sched.add_staged(urgent)
    out = sched.schedule()  # neither the watermark nor the priority can park "a": the host is full
    assert out.parked == [] and [s.request_id for s in out.running] == ["a"] and urgent.status is Status.STAGED
    assert asked == ["a"] and sched.park_refused_total == 1


def test_watermarks_park_above_high_and_admit_below_low():
    # Each row holds 4 prompt tokens + 1 output; a step's window needs one more column per row.
    sched = DecodeScheduler(SchedulerConfig(max_rows=4, max_columns=100, high_watermark_slots=12,
                                            low_watermark_slots=10))
    for rid in "abcd":
        sched.add_staged(seq(rid))
    out = sched.schedule()
    assert len(out.admitted) == 2  # a third row would need 3 x 5 = 15 slots > low watermark 10
    for _ in range(2):
        sched.append_tokens([9] * len(sched.rows))
    out = sched.schedule()  # 2 rows x 7 slots = 14 > high watermark 12: park one
    assert len(out.parked) == 1 and len(sched.rows) == 1


def test_a_request_lives_in_the_scheduler_from_registration_to_its_end():
    sched = DecodeScheduler(SchedulerConfig(max_rows=1, max_columns=100))
    a = DecodeSequence("a", prompt_len=4, max_new_tokens=3, output_ids=[])
    sched.register(a)
    assert a.status is Status.WAITING and sched.find("a") is a and sched.num_waiting == 1
    assert not sched.has_work()  # nothing to decode until its KV lands
    a.output_ids.append(7)
    sched.add_staged(a)
    assert a.status is Status.STAGED and sched.num_waiting == 0
    sched.schedule()
    assert a.status is Status.RUNNING and a.row == 0
    urgent = seq("urgent")
    urgent.priority = 1
    sched.add_staged(urgent)
    out = sched.schedule()
    assert a.status is Status.PARKED and out.resumed == []
    sched.finish(urgent, Status.FINISHED_LENGTH)
    out = sched.schedule()
    assert out.resumed == [a] and a.status is Status.RUNNING
    assert sched.statuses() == {"a": Status.RUNNING}
    sched.finish(a, Status.FINISHED_STOPPED)
    assert sched.find("a") is None and not sched.requests and a.finish_reason == "stop"
    with pytest.raises(LookupError, match="already ended"):
        sched.finish(a, Status.FINISHED_ABORTED)


def test_registration_is_bounded_and_ids_are_unique():
    sched = DecodeScheduler(SchedulerConfig(max_rows=1, max_columns=100, max_waiting=2, max_requests=3))
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
    sched = DecodeScheduler(SchedulerConfig(max_rows=2, max_columns=100))
    a, b = seq("a"), seq("b")
    sched.add_staged(a)
    sched.add_staged(b)
    sched.schedule()
    assert sched.move(a) == 1 and b.row == 0 and a.status is Status.MOVING  # b took its row
    assert sched.rows == [b] and not sched.staged and sched.find("a") is a
    with pytest.raises(ValueError, match="running"):
        sched.move(a)
    with pytest.raises(ValueError, match="not moving"):
        sched.take_moving("b")
    assert sched.take_moving("a") is a and a.status is Status.MOVED and sched.find("a") is None
    with pytest.raises(LookupError):
        sched.take_moving("a")


def test_the_kv_budget_sets_the_batch_size_and_max_rows_caps_it():
    """Rows join while every row at its longest fits the budget: many short requests, one long one."""
    sched = DecodeScheduler(SchedulerConfig(max_rows=8, max_columns=100, budget_slots=120))
    for i in range(10):
        sched.add_staged(seq(f"short{i}", prompt=10, max_new=5))  # 15 slots each at its longest
    assert len(sched.schedule().running) == 8  # 8 x 15 = 120 fits: max_rows is the limit
    for row in list(sched.rows):
        sched.finish(row, Status.FINISHED_LENGTH)
    sched.add_staged(seq("long", prompt=60, max_new=40))  # 100 slots at its longest
    out = sched.schedule()
    assert [s.request_id for s in out.admitted] == ["short8", "short9"]  # queued first
    for row in list(sched.rows):
        sched.finish(row, Status.FINISHED_LENGTH)
    assert [s.request_id for s in sched.schedule().running] == ["long"]
    sched.add_staged(seq("short10", prompt=10, max_new=5))
    assert sched.schedule().admitted == []  # 2 rows x 100 > 120: it waits for the long one
    assert sched.worst_case_slots() == 100
