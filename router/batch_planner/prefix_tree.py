"""Compact prefix tree (radix tree) over one batch of token-id prompts.

The tree is built once, ahead of time, over the whole batch. That is the point of
BatchLLM's global prefix identification: the planner sees every shared prefix at
once instead of discovering sharing one arrival at a time, as a cache does.

Nodes do not copy tokens: a node is the span of prompt positions
``[start, depth)`` of one prompt (``source``) that contains it, so building the
tree and splitting edges cost O(total prompt tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence


@dataclass(eq=False)
class PrefixNode:
    """One compacted edge: positions ``[start, depth)`` of prompt ``source``.

    Every prompt that passes through the node has exactly these tokens at these
    positions. ``depth`` is the number of tokens from the root to the node's end.
    """

    node_id: int
    parent: PrefixNode | None
    start: int
    depth: int
    source: int
    children: dict[int, PrefixNode] = field(default_factory=dict)
    # Request indices whose prompt ends exactly at this node's last token.
    ending: list[int] = field(default_factory=list)
    # Requests ending at this node or anywhere below it.
    num_requests: int = 0

    @property
    def span_len(self) -> int:
        return self.depth - self.start

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (
            f"PrefixNode(id={self.node_id}, span=[{self.start},{self.depth}), "
            f"requests={self.num_requests}, children={len(self.children)})"
        )


class PrefixTree:
    """Radix tree of a batch; request ``i`` is ``prompts[i]``."""

    def __init__(self, prompts: Sequence[Sequence[int]]):
        self.prompts: list[Sequence[int]] = list(prompts)
        for index, prompt in enumerate(self.prompts):
            if len(prompt) == 0:
                raise ValueError(
                    f"prompt {index} is empty; every request needs at least one token "
                    "to produce its first output token"
                )
        self.root = PrefixNode(node_id=0, parent=None, start=0, depth=0, source=-1)
        self.nodes: list[PrefixNode] = [self.root]
        self._end_nodes: list[PrefixNode] = []
        for request_id in range(len(self.prompts)):
            self._insert(request_id)
        for node in self.post_order():
            node.num_requests = len(node.ending) + sum(
                child.num_requests for child in node.children.values()
            )

    # ----------------------------------------------------------------- queries
    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def tokens(self, node: PrefixNode) -> list[int]:
        """The tokens of the node's own span (not the whole root path)."""
        if node.is_root:
            return []
        return list(self.prompts[node.source][node.start : node.depth])

    def path_tokens(self, node: PrefixNode) -> list[int]:
        """The tokens from the root to the end of ``node``."""
        if node.is_root:
            return []
        return list(self.prompts[node.source][: node.depth])

    def first_level(self) -> list[PrefixNode]:
        """Children of the root: the prefixes the tree alone would group by."""
        return list(self.root.children.values())

    def end_node(self, request_id: int) -> PrefixNode:
        """The node at which request ``request_id``'s prompt ends."""
        return self._end_nodes[request_id]

    def requests_under(self, node: PrefixNode) -> list[int]:
        """Sorted ids of the requests whose prompt passes through ``node``."""
        found: list[int] = []
        stack = [node]
        while stack:
            current = stack.pop()
            found.extend(current.ending)
            stack.extend(current.children.values())
        return sorted(found)

    def total_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    def unique_tokens(self) -> int:
        """Tokens in the tree: the prefill cost if every node were computed once."""
        return sum(node.span_len for node in self.nodes)

    def post_order(self) -> Iterator[PrefixNode]:
        """Children before parents; iterative so deep trees do not hit recursion limits."""
        stack: list[tuple[PrefixNode, bool]] = [(self.root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                yield node
                continue
            stack.append((node, True))
            for child in reversed(list(node.children.values())):
                stack.append((child, False))

    def pre_order(self) -> Iterator[PrefixNode]:
        """Parents before children, children in insertion order."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))

    # ---------------------------------------------------------------- building
    def _insert(self, request_id: int) -> None:
        prompt = self.prompts[request_id]
        node, position = self.root, 0
        while position < len(prompt):
            child = node.children.get(prompt[position])
            if child is None:
                node = self._new_node(node, position, len(prompt), request_id)
                position = len(prompt)
                break
            edge_source = self.prompts[child.source]
            limit = min(child.depth, len(prompt))
            matched = position + 1  # the first token matched via the child key
            while matched < limit and edge_source[matched] == prompt[matched]:
                matched += 1
            if matched < child.depth:
                child = self._split(child, matched)
            node, position = child, matched
        node.ending.append(request_id)
        self._end_nodes.append(node)

    def _new_node(self, parent: PrefixNode, start: int, depth: int, source: int) -> PrefixNode:
        node = PrefixNode(
            node_id=len(self.nodes), parent=parent, start=start, depth=depth, source=source
        )
        self.nodes.append(node)
        parent.children[self.prompts[source][start]] = node
        return node

    def _split(self, node: PrefixNode, at: int) -> PrefixNode:
        """Cut ``node`` at absolute position ``at``; returns the new upper half."""
        parent = node.parent
        assert parent is not None and node.start < at < node.depth
        upper = self._new_node(parent, node.start, at, node.source)
        node.parent = upper
        node.start = at
        upper.children[self.prompts[node.source][at]] = node
        return upper
