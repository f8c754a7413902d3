"""Which rows of a decode batch share one copy of a prompt prefix's KV: plain Python over token
lists, no tensors.

A row joining the batch continues the longest shared prefix its prompt begins with; failing
that, it forms a new one with the running row whose prompt it shares most with, if that is at
least `min_tokens` long. The prefix's KV is then held once (`engine.batch_kv`), and every row
of it keeps only its own tokens in the padded window, so KV bytes fall by the share degree and
the window no longer pads short rows to the prefix's length. One level: a row continues at most
one shared prefix.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from baton.block_hash import common_prefix


@dataclass
class Group:
    id: int
    tokens: tuple[int, ...]  # the shared prefix
    # request ids whose row continues it, or which hold it until their KV lands (that KV then
    # covers only the tokens after the prefix: the prefill sent no more)
    members: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Placement:
    """Where a joining row's KV goes: after `tokens` tokens of shared prefix `group`; a new group
    is formed with `partner`, a running row, whose own copy of those tokens is then dropped."""

    group: int
    tokens: int
    partner: str | None = None


class PrefixSharing:
    def __init__(self, min_tokens: int):
        if min_tokens < 1:
            raise ValueError(f"a shared prefix needs at least one token (got min_tokens={min_tokens})")
        self.min_tokens = min_tokens
        self.groups: dict[int, Group] = {}
        self.group_of: dict[str, int] = {}  # request id -> its group
        self._ids = itertools.count()

    def continuing(self, prompt: Sequence[int]) -> Placement | None:
        """The longest shared prefix held now that `prompt` continues (leaving it a token of its own)."""
        prompt = tuple(prompt)
        best = max((g for g in self.groups.values()
                    if len(g.tokens) < len(prompt) and prompt[:len(g.tokens)] == g.tokens),
                   key=lambda g: len(g.tokens), default=None)
        return None if best is None else Placement(best.id, len(best.tokens))

    def place(self, request_id: str, prompt: Sequence[int], running: dict[str, Sequence[int]]) -> Placement | None:
        """Where the row of `request_id` (prompt `prompt`) goes, given the running rows' prompts
        by request id; None: it keeps its whole KV. A prefix always leaves the prompt's last token
        to the row (so every row has a token of its own), and only running rows outside any group
        can be partners."""
        usable = len(prompt) - 1
        joined = self.continuing(prompt)
        if joined is not None:
            return joined
        partner, shared = None, 0
        for other, other_prompt in running.items():
            if other in self.group_of or other == request_id:
                continue
            n = min(common_prefix(prompt, other_prompt), usable, len(other_prompt) - 1)
            if n > shared:
                partner, shared = other, n
        if partner is None or shared < self.min_tokens:
            return None
        return Placement(next(self._ids), shared, partner)

    def join(self, request_id: str, placement: Placement, prompt: Sequence[int]) -> None:
        """Record a placement once the row took it."""
        group = self.groups.get(placement.group)
        if group is None:
            group = self.groups[placement.group] = Group(placement.group, tuple(prompt[:placement.tokens]))
            group.members.add(placement.partner)
            self.group_of[placement.partner] = group.id
        group.members.add(request_id)
        self.group_of[request_id] = group.id

    def leave(self, request_id: str) -> None:
        """The row left the batch (or a request holding the group ended); a group with no members
        left is forgotten (the batch then drops its KV)."""
        group_id = self.group_of.pop(request_id, None)
        if group_id is None:
            return
        group = self.groups[group_id]
        group.members.discard(request_id)
        if not group.members:
            del self.groups[group_id]

    def shared_tokens(self, request_id: str) -> int:
        group_id = self.group_of.get(request_id)
        return 0 if group_id is None else len(self.groups[group_id].tokens)

    def prefix_tokens(self) -> int:
        """Tokens of shared prefix KV held, each prefix once."""
        return sum(len(g.tokens) for g in self.groups.values())
