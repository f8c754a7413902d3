"""The BATON batch KV layout: embedding, left growth, column release, row reuse, accounting."""
import pytest
import torch

from baton.engine.batch_kv import BatchKV, BatchKVFull
from baton.engine.kv import KVShape, SequenceKV

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def kv_of(tokens: int, fill: float) -> SequenceKV:
    data = torch.arange(tokens, dtype=torch.float32).view(1, 1, 1, tokens, 1) + fill
    return SequenceKV(data.expand(2, 2, 2, tokens, 4).contiguous())


def row_kv(batch: BatchKV, row: int) -> torch.Tensor:
    return batch.extract(row).data


def test_embed_end_aligned_and_grow_left():
    batch = BatchKV(SHAPE, max_rows=3, max_columns=64, initial_columns=4)
    a, b = kv_of(3, 100.0), kv_of(7, 200.0)
    assert batch.embed(a) == 0
    assert (batch.length, batch.starts) == (3, [0])
    assert batch.embed(b) == 1  # longer than the window: grows on the left
    assert batch.length == 7 and batch.starts == [4, 0]
    assert torch.equal(row_kv(batch, 0), a.data) and torch.equal(row_kv(batch, 1), b.data)
    assert batch.reallocations >= 1


def test_append_release_and_leading_columns():
    batch = BatchKV(SHAPE, max_rows=2, max_columns=64, initial_columns=8)
    batch.embed(kv_of(6, 0.0))
    batch.embed(kv_of(2, 50.0))
    col = batch.append_column()
    keys = torch.full((2, 2, 4), 9.0)
    for layer in range(2):
        batch.write_column(layer, col, keys, keys)
    assert batch.row_tokens(0) == 7 and batch.row_tokens(1) == 3
    useful = batch.useful_bytes()
    assert useful == 10 * SHAPE.bytes_per_token()
    assert batch.window_bytes() == 2 * 7 * SHAPE.bytes_per_token()
    moved = batch.release(0)  # the long row leaves; the short row moves into row 0
    assert moved == 1
    assert batch.length == 3 and batch.starts == [0]  # padding columns released
    assert torch.equal(row_kv(batch, 0)[..., :2, :], kv_of(2, 50.0).data)
    assert torch.all(row_kv(batch, 0)[..., 2, :] == 9.0)


def test_batch_empties_back_to_initial_allocation():
    batch = BatchKV(SHAPE, max_rows=2, max_columns=256, initial_columns=4)
    start = batch.allocated_bytes()
    batch.embed(kv_of(40, 0.0))
    for _ in range(30):
        batch.append_column()
    assert batch.allocated_bytes() > start
    batch.release(0)
    assert batch.allocated_bytes() == start and batch.length == 0


def test_limits_refuse_instead_of_overallocating():
    batch = BatchKV(SHAPE, max_rows=1, max_columns=8, initial_columns=4)
    try:
        batch.embed(kv_of(9, 0.0))
        raise AssertionError("a 9-column KV must not fit 8 columns")
    except BatchKVFull:
        pass
    batch.embed(kv_of(8, 0.0))
    try:
        batch.embed(kv_of(1, 0.0))
        raise AssertionError("no free row")
    except BatchKVFull:
        pass
    try:
        batch.append_column()
        raise AssertionError("window at its limit")
    except BatchKVFull:
        pass


def test_placeholder_columns_are_always_finite():
    """Masked columns get zero attention weight; garbage there must never be NaN or inf."""
    batch = BatchKV(SHAPE, max_rows=2, max_columns=512, initial_columns=4)
    batch.embed(kv_of(3, 0.0))
    for _ in range(20):  # forces right-side relayouts
        batch.append_column()
    batch.embed(kv_of(60, 1.0))  # forces a left growth
    assert torch.isfinite(batch.buffer).all()


def test_the_buffer_follows_its_rows_and_window_through_a_burst():
    """Rows double as they join and the allocation shrinks once a burst has left, contents intact."""
    per_token = SHAPE.bytes_per_token()
    batch = BatchKV(SHAPE, max_rows=16, max_columns=4096, initial_columns=8)
    kvs = [kv_of(30 + i, 10.0 * i) for i in range(12)]
    for kv in kvs:
        batch.embed(kv)
        assert batch.num_rows <= batch.row_capacity <= 2 * batch.num_rows  # never more than twice the rows
    assert batch.row_capacity == 16
    for _ in range(300):  # a long decode: the window grows to ~340 columns
        batch.append_column()
    peak = batch.allocated_bytes()
    assert peak <= 2 * 16 * (batch.length + 1) * per_token
    for _ in range(11):  # the burst leaves; the first row stays
        batch.release(batch.num_rows - 1)
    assert batch.num_rows == 1 and batch.row_capacity <= 2 and batch.shrinks >= 1
    assert batch.allocated_bytes() <= peak / 8
    survivor = batch.extract(0).data
    assert torch.equal(survivor[..., :30, :], kvs[0].data)  # its prefilled KV survived every relayout
    assert batch.allocated_bytes() <= 4 * batch.window_bytes()


def test_growth_stops_at_the_byte_budget():
    """Doubling never allocates past budget_bytes: headroom is trimmed to what is used."""
    per_token = SHAPE.bytes_per_token()
    budget = 5 * 40 * per_token  # five rows of 40 columns
    batch = BatchKV(SHAPE, max_rows=8, max_columns=40, initial_columns=4, budget_bytes=budget)
    for i in range(5):
        batch.embed(kv_of(20 + i, float(i)))
        assert batch.allocated_bytes() <= budget
    for _ in range(15):  # the window reaches 40 columns
        batch.append_column()
        assert batch.allocated_bytes() <= budget
    assert (batch.num_rows, batch.length) == (5, 39)
    try:
        batch.embed(kv_of(10, 9.0))  # a sixth row at this window would pass the budget
        raise AssertionError("the budget must refuse a sixth row")
    except BatchKVFull:
        pass


def test_rows_sharing_a_prefix_hold_it_once():
    """A shared prefix lives once outside the window; rows keep only their own tokens, extract
    gives the whole KV back, and the prefix stays until dropped (the scheduler says when)."""
    batch = BatchKV(SHAPE, max_rows=4, max_columns=64, initial_columns=4)
    whole = kv_of(30, 0.0)  # a 30-token prompt: 24 shared, 6 its own
    partner = batch.embed(whole)
    batch.add_prefix(7, whole.prefix(24))
    batch.share(partner, 7)  # the partner drops its copy of the prefix
    own = SequenceKV(kv_of(33, 0.0).data[:, :, :, 24:].contiguous())  # the same 24 tokens, then 9 of its own
    row = batch.embed(own, prefix=7)
    assert batch.length == 9 and batch.starts == [3, 0], "the window holds only the rows' own tokens"
    assert [batch.sequence_tokens(r) for r in (partner, row)] == [30, 33]
    assert torch.equal(row_kv(batch, partner), whole.data) and torch.equal(row_kv(batch, row), kv_of(33, 0.0).data)
    per_token = SHAPE.bytes_per_token()
    assert batch.useful_bytes() == (24 + 6 + 9) * per_token  # the prefix once
    assert batch.shared_groups() == {7: [0, 1]} and batch.rows_sharing == 2
    batch.release(partner)
    assert batch.shared_groups() == {7: [0]}
    with pytest.raises(ValueError):  # a row still continues it
        batch.drop_prefix(7)
    batch.release(0)
    assert batch.shared_groups() == {} and 7 in batch.prefixes
    batch.drop_prefix(7)
    assert not batch.prefixes and batch.allocated_bytes() == batch.buffer.numel() * 4


def test_a_shared_prefix_counts_against_the_byte_budget():
    per_token = SHAPE.bytes_per_token()
    batch = BatchKV(SHAPE, max_rows=2, max_columns=64, initial_columns=4, budget_bytes=40 * per_token)
    with pytest.raises(BatchKVFull):
        batch.add_prefix(1, kv_of(41, 0.0))
    batch.add_prefix(1, kv_of(32, 0.0))
    with pytest.raises(BatchKVFull):  # 32 + 2 rows x 5 columns > 40
        batch.embed(kv_of(5, 1.0), prefix=1)
        batch.embed(kv_of(5, 1.0), prefix=1)
    with pytest.raises(ValueError):
        batch.embed(kv_of(5, 1.0), prefix=99)
    assert batch.allocated_bytes() <= 40 * per_token


def test_a_new_shared_prefix_takes_the_buffers_headroom_before_it_is_refused():
    per_token = SHAPE.bytes_per_token()
    batch = BatchKV(SHAPE, max_rows=2, max_columns=64, initial_columns=64, budget_bytes=100 * per_token)
    whole = kv_of(50, 0.0)
    batch.embed(whole)  # 50 tokens in a 64-column buffer: 64 + 40 would exceed 100
    batch.add_prefix(1, kv_of(40, 0.0))
    assert batch.capacity == 50 and batch.allocated_bytes() == 90 * per_token  # the headroom went
    assert torch.equal(row_kv(batch, 0), whole.data)  # the row's KV is untouched
    with pytest.raises(BatchKVFull):
        batch.add_prefix(2, kv_of(11, 0.0))  # 50 + 40 + 11 > 100 even without headroom
