"""Which part of a Llama-family model each rank of a tensor-parallel worker holds.

Every weight a rank holds is a range of rows of a checkpoint tensor, so a rank reads only its
rows from the files (`engine.checkpoint.read_weights`):

- attention by KV head: rank r holds a contiguous run of KV heads and the query heads that read
  them (GQA groups are never split), so its attention and its pages are its own;
- gate and up projections by intermediate feature; the O and down projections, and the LM head
  and embedding, by output feature (hidden and vocabulary).

Each output feature is computed whole on one rank, over all of its inputs in the kernel's own
order, and ranks gather the parts (`engine.collectives`). Nothing is summed across ranks, so a
TP=2 or TP=4 worker computes the same bits as TP=1: KV prefilled at one degree decodes at any
other as if nothing was split. The price is gathering inputs as well as outputs: four gathers a
layer where a row-parallel split all-reduces twice.

Plain Python: no torch, so the geometry is unit-tested in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.config import TP_SIZES

# Output features are split in runs of this many: the CPU GEMM's panel width (engine.cpu),
# so no rank's weights end in a padded panel that a TP=1 worker's would not.
FEATURE_UNIT = 16


def spans(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """`total` split into `parts` contiguous runs, as even as whole `unit`s allow (the last takes
    what is not a whole unit)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    units, tail = divmod(total, unit)
    share, extra = divmod(units, parts)
    out, at = [], 0
    for i in range(parts):
        n = (share + (1 if i < extra else 0)) * unit + (tail if i == parts - 1 else 0)
        out.append((at, at + n))
        at += n
    return out


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: its [start, stop) ranges, in heads or features."""

    rank: int
    size: int
    head_dim: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    hidden: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @classmethod
    def of(cls, config, rank: int, size: int) -> "Shard":
        """Rank `rank` of a `size`-way split of a model with this (Hugging Face) config."""
        return cls.all(config, size)[rank]

    @staticmethod
    def all(config, size: int) -> list["Shard"]:
        """Every rank's shard (each rank knows the others' widths: it gathers their parts)."""
        if size not in TP_SIZES:
            raise ValueError(f"tensor_parallel_size must be one of {', '.join(map(str, TP_SIZES))}, not {size}")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if size > kv_heads:
            raise ValueError(f"tensor parallelism of {size} needs at least {size} KV heads; this model has {kv_heads}")
        group = heads // kv_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = spans(kv_heads, size)
        hidden = spans(config.hidden_size, size, FEATURE_UNIT)
        inter = spans(config.intermediate_size, size, FEATURE_UNIT)
        vocab = spans(config.vocab_size, size, FEATURE_UNIT)
        return [Shard(r, size, head_dim, kv[r], (kv[r][0] * group, kv[r][1] * group), hidden[r], inter[r], vocab[r])
                for r in range(size)]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    def rows(self, name: str) -> tuple[int, int] | None:
        """The rows of checkpoint tensor `name` this rank holds (None: all of it)."""
        d = self.head_dim
        if ".self_attn.q_proj." in name:
            return self.q_heads[0] * d, self.q_heads[1] * d
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            return self.kv_heads[0] * d, self.kv_heads[1] * d
        if ".self_attn.o_proj." in name or ".mlp.down_proj." in name:
            return self.hidden
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return self.intermediate
        if name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            return self.vocab
        return None  # norms: every rank holds them whole
