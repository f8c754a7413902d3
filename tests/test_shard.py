"""Which rows of each weight a tensor-parallel rank holds (engine.shard): plain Python."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from baton.engine.shard import FEATURE_UNIT, Shard, spans

SMOLLM2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536,
                          vocab_size=49152)
LLAMA_8B = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, intermediate_size=14336,
                           vocab_size=128256, head_dim=128)


def test_spans_are_contiguous_even_and_in_whole_units():
    assert spans(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert spans(576, 2, 16) == [(0, 288), (288, 576)]
    assert spans(100, 2, 16) == [(0, 48), (48, 100)]  # 6.25 units: the tail goes to the last
    with pytest.raises(ValueError):
        spans(4, 0)


@pytest.mark.parametrize("config,size", [(SMOLLM2, 2), (SMOLLM2, 1), (LLAMA_8B, 4), (LLAMA_8B, 8)])
def test_shards_cover_every_head_and_feature_once(config, size):
    shards = Shard.all(config, size)
    for axis, total in [("kv_heads", config.num_key_value_heads), ("q_heads", config.num_attention_heads),
                        ("hidden", config.hidden_size), ("intermediate", config.intermediate_size),
                        ("vocab", config.vocab_size)]:
        ranges = [getattr(s, axis) for s in shards]
        assert ranges[0][0] == 0 and ranges[-1][1] == total, axis
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), axis
    group = config.num_attention_heads // config.num_key_value_heads
    for s in shards:  # a GQA group is never split: a rank's query heads read its own KV heads
        assert s.num_q_heads == group * s.num_kv_heads and s.q_heads[0] == group * s.kv_heads[0]
        assert (s.hidden[1] - s.hidden[0]) % FEATURE_UNIT == 0 or s.rank == size - 1


def test_uneven_heads_split_by_groups():
    first, second = Shard.all(SMOLLM2, 2)
    assert (first.kv_heads, first.q_heads) == ((0, 2), (0, 6))
    assert (second.kv_heads, second.q_heads) == ((2, 3), (6, 9))


def test_rows_name_each_weights_part():
    s = Shard.of(LLAMA_8B, 1, 4)
    assert s.rows("model.layers.3.self_attn.q_proj.weight") == (8 * 128, 16 * 128)
    assert s.rows("model.layers.3.self_attn.k_proj.weight") == (2 * 128, 4 * 128)
    assert s.rows("model.layers.3.self_attn.v_proj.bias") == (2 * 128, 4 * 128)
    assert s.rows("model.layers.3.self_attn.o_proj.weight") == (1024, 2048)
    assert s.rows("model.layers.3.mlp.gate_proj.weight") == s.rows("model.layers.3.mlp.up_proj.weight") == (3584, 7168)
    assert s.rows("model.layers.3.mlp.down_proj.weight") == (1024, 2048)
    assert s.rows("model.embed_tokens.weight") == s.rows("lm_head.weight") == s.vocab
    assert s.rows("model.layers.3.input_layernorm.weight") is None and s.rows("model.norm.weight") is None


def test_degrees_a_model_cannot_take_are_refused():
    with pytest.raises(ValueError, match="at least 4 KV heads"):
        Shard.all(SMOLLM2, 4)
    with pytest.raises(ValueError, match="one of"):
        Shard.all(LLAMA_8B, 3)
