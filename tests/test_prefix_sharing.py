"""Which decode rows share a prefix's KV (decode_worker.sharing): plain Python, milliseconds."""
import pytest

from baton.decode_worker.scheduler import DecodeScheduler, DecodeSequence, SchedulerConfig
from baton.block_hash import common_prefix
from baton.decode_worker.sharing import Placement, PrefixSharing

DOC = list(range(1000, 1100))  # a 100-token shared document


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5] * 300, [5] * 300) == 300


def test_a_row_pairs_with_the_running_row_it_shares_most_with_then_others_join():
    sharing = PrefixSharing(min_tokens=64)
    running = {"a": DOC + [1], "b": DOC[:70] + [2] * 40, "c": [9] * 120}
    first = sharing.place("x", DOC + [5, 6], running)
    assert first is not None and (first.tokens, first.partner) == (100, "a")
    sharing.join("x", first, DOC + [5, 6])
    assert sharing.shared_tokens("a") == sharing.shared_tokens("x") == 100
    # the next one continues the existing group, not a new pair
    assert sharing.place("y", DOC + [7], {**running, "x": DOC + [5, 6]}) == Placement(first.group, 100)
    # a prompt that shares only 70 tokens with the group cannot continue it; "b" (74 in common) pairs
    third = sharing.place("z", DOC[:70] + [2] * 5, running)
    assert third is not None and (third.tokens, third.partner) == (74, "b")
    assert sharing.prefix_tokens() == 100


def test_short_common_prefixes_and_a_prompt_that_is_all_prefix_share_nothing():
    sharing = PrefixSharing(min_tokens=64)
    assert sharing.place("x", DOC[:63] + [1], {"a": DOC[:63] + [2]}) is None
    # the prompt's last token always stays the row's own
    placement = sharing.place("x", DOC[:65], {"a": DOC + [1]})
    assert placement is not None and placement.tokens == 64
    with pytest.raises(ValueError):
        PrefixSharing(min_tokens=0)


def test_a_group_is_forgotten_when_its_last_row_leaves():
    sharing = PrefixSharing(min_tokens=10)
    placement = sharing.place("x", DOC + [1], {"a": DOC + [2]})
    sharing.join("x", placement, DOC + [1])
    sharing.leave("a")
    assert sharing.shared_tokens("x") == 100 and sharing.groups
    sharing.leave("x")
    sharing.leave("never-joined")
    assert not sharing.groups and not sharing.group_of and sharing.prefix_tokens() == 0


def test_the_scheduler_counts_a_shared_prefix_once_against_the_budget():
    """Four rows of a 100-token prefix plus 10 own tokens (max 20 new): 4 x 120 slots unshared,
    but 4 x 20 + 100 shared; a 300-slot budget admits all four only when they share."""
    def admitted(share: int) -> int:
        sched = DecodeScheduler(SchedulerConfig(max_rows=4, max_columns=1000, budget_slots=300,
                                                share_min_tokens=share))
        for i in range(4):
            seq = DecodeSequence(f"r{i}", 110, 20, [7], prompt_ids=DOC + [i] * 10)
            sched.register(seq)
            sched.add_staged(seq)
        out = sched.schedule()
        return len(out.admitted)

    assert admitted(share=0) == 2
    assert admitted(share=64) == 4


def test_rows_leaving_the_scheduler_leave_their_group():
    sched = DecodeScheduler(SchedulerConfig(max_rows=4, max_columns=1000, share_min_tokens=64))
    seqs = [DecodeSequence(f"r{i}", 101, 5, [7], prompt_ids=DOC + [i]) for i in range(3)]
    for seq in seqs:
        sched.register(seq)
        sched.add_staged(seq)
    out = sched.schedule()
    assert [s.placement for s in out.admitted][0] is None  # the first one has nobody to share with
    assert out.admitted[1].placement.partner == "r0" and out.admitted[2].placement.partner is None
    from baton.decode_worker.scheduler import Status
    for seq in seqs:
        sched.finish(seq, Status.FINISHED_STOPPED)
    assert not sched.sharing.groups
