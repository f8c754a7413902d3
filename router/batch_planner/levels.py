"""The shared prefixes above and below a plan's groups, for a multi-level prefill.

A group (`groups.py`) shares one prefix, but prompts share more than that: an instruction
template above several groups' documents, a sub-prefix below part of one group's members.
The prefill worker's prefix cache reuses whole blocks only, so each such level would lose up
to a block of tokens per prompt; pinning the level makes the worker hold it to the token. Every
level is a point where the prompts branch, and the branch points of a set of sequences are the
common prefixes of neighbours in sorted order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from baton.block_hash import common_prefix

MIN_LEVEL_TOKENS = 4  # a shorter shared level is not worth a pin


@dataclass(frozen=True)
class GroupLevels:
    ancestors: tuple[tuple[int, ...], ...]  # shared prefixes above the group's, shortest first
    sub_prefixes: tuple[tuple[int, ...], ...]  # shared by some members below it, shortest first


def branch_points(sequences: Sequence[Sequence[int]], min_tokens: int = MIN_LEVEL_TOKENS) -> list[tuple[int, ...]]:
    """Every prefix that at least two of the sequences continue, at least `min_tokens` long and
    where they branch (or one ends), shortest first."""
    ordered = sorted(tuple(s) for s in sequences)
    points = set()
    for a, b in zip(ordered, ordered[1:]):
        n = common_prefix(a, b)
        if n >= min_tokens:
            points.add(a[:n])
    return sorted(points, key=len)


def group_levels(prompts: Sequence[Sequence[int]], groups: Sequence[tuple[Sequence[int], int]],
                 min_tokens: int = MIN_LEVEL_TOKENS) -> list[GroupLevels]:
    """For each group, given as (member request ids, shared prefix length): the levels to pin
    above its prefix (shared with other groups) and below it (shared by some of its members).
    A prompt's last token is always computed, so no level covers it."""
    def heads(members: Sequence[int], prefix_len: int) -> list[tuple[int, ...]]:
        return [tuple(prompts[members[0]][:prefix_len])] if prefix_len else [tuple(prompts[m][:-1]) for m in members]

    above = branch_points([h for members, prefix_len in groups for h in heads(members, prefix_len)], min_tokens)
    levels = []
    for members, prefix_len in groups:
        own = heads(members, prefix_len)
        prefix = own[0] if prefix_len else ()
        ancestors = tuple(a for a in above if a != prefix and any(h[:len(a)] == a for h in own))
        below = branch_points([prompts[m][:-1] for m in members], min_tokens) if len(members) > 1 else []
        levels.append(GroupLevels(ancestors, tuple(p for p in below if len(p) > prefix_len)))
    return levels
