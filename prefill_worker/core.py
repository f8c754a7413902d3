"""Prefill without networking: reuse cached prefix KV, run the rest, sample the first token.

Prompts are cut into blocks of B tokens with chained hashes (`baton.block_hash`); the KV of
every full block computed here is kept in a bounded prefix cache (LRU, locked while in use), so
a later prompt sharing those blocks computes only its suffix. Groups of a large batch can pin a
shared prefix until the whole group is done (BatchLLM).
"""
from __future__ import annotations

import torch

from baton.block_hash import BlockHasher
from engine.kv import SequenceKV
from engine.request import GenerationRequest, PrefilledRequest
from engine.runner import ModelRunner
from engine.sampling import RequestSampler, sample
from prefill_worker.prefix_cache import KVEvents, PrefixCache

DEFAULT_BLOCK_SIZE = 16


class PrefillCore:
    def __init__(self, runner: ModelRunner, *, prefix_cache_bytes: int = 256 << 20,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.runner = runner
        self.block_size = block_size
        self.hasher = BlockHasher(str(runner.loaded.fingerprint), block_size)
        block_bytes = runner.loaded.kv_shape.bytes_per_token() * block_size
        self.cache = PrefixCache(prefix_cache_bytes, block_bytes) if prefix_cache_bytes >= block_bytes else None
        self.pins: dict[str, list[int]] = {}  # group id -> the block hashes it holds locked
        self.cached_tokens_total = 0

    def usable_prefix(self, prompt: list[int]) -> tuple[list[int], int]:
        """The prompt's block hashes and how many leading blocks can come from the cache; the
        last prompt token is always computed, since its logits give the first output token."""
        hashes = self.hasher.hash_prompt(prompt)
        if self.cache is None:
            return hashes, 0
        blocks = min(self.cache.match(hashes), (len(prompt) - 1) // self.block_size)
        return hashes, blocks

    def prefill(self, requests: list[GenerationRequest]) -> list[PrefilledRequest]:
        """Prompts without a cached prefix run as one right-padded batch; the others one by one."""
        for request in requests:
            request.trace.mark("prefill_start")
        plans = [self.usable_prefix(r.prompt_token_ids) for r in requests]
        results: list[tuple] = [None] * len(requests)
        fresh = [i for i, (_, blocks) in enumerate(plans) if blocks == 0]
        if fresh:
            outs = self.runner.prefill_batch([requests[i].prompt_token_ids for i in fresh])
            for i, out in zip(fresh, outs):
                results[i] = (out, 0)
        for i, (hashes, blocks) in enumerate(plans):
            if blocks:
                results[i] = (self._run_on_prefix(requests[i].prompt_token_ids, hashes[:blocks]),
                              blocks * self.block_size)
        prefilled = []
        for request, (hashes, _), (out, cached) in zip(requests, plans, results):
            self._remember(hashes, out.kv)
            sampler = RequestSampler(request.params)
            first_token = sample(out.logits[None], [sampler])[0]
            request.trace.cached_tokens = cached
            request.trace.mark("prefill_end")
            self.cached_tokens_total += cached
            prefilled.append(PrefilledRequest(request, out.kv, first_token, sampler.seed, cached))
        return prefilled

    def _run_on_prefix(self, prompt: list[int], held: list[int]):
        """Prefill continuing from the cached blocks `held`, locked meanwhile."""
        prefix = SequenceKV(torch.cat(self.cache.lock(held), dim=3))
        try:
            return self.runner.prefill(prompt, prefix)
        finally:
            self.cache.unlock(held)

    def _remember(self, hashes: list[int], kv: SequenceKV) -> None:
        if self.cache is None or not hashes:
            return
        b = self.block_size
        known = self.cache.match(hashes)
        # Only the new blocks need their own copy; the cache keeps them after this KV is shipped.
        payloads = [None] * known + [kv.data[:, :, :, i * b:(i + 1) * b].clone() for i in range(known, len(hashes))]
        self.cache.insert(hashes, payloads)  # None when everything is locked: simply not cached

    # -- BatchLLM groups ---------------------------------------------------------------------

    def pin(self, group_id: str, prefix: list[int]) -> int:
        """Compute (if needed) and hold a group's shared prefix until `unpin`; returns its cached tokens."""
        if self.cache is None:
            return 0
        if group_id in self.pins:
            raise ValueError(f"group {group_id!r} is already pinned")
        full = self.hasher.hash_prompt(prefix)
        if self.cache.match(full) < len(full):
            hashes, blocks = self.usable_prefix(prefix)
            out = self._run_on_prefix(prefix, hashes[:blocks]) if blocks else self.runner.prefill(prefix)
            self._remember(full, out.kv)
        held = full[:self.cache.match(full)]
        self.cache.lock(held)
        self.pins[group_id] = held
        return len(held) * self.block_size

    def unpin(self, group_id: str) -> bool:
        held = self.pins.pop(group_id, None)
        if held is None:
            return False
        self.cache.unlock(held)
        return True

    def drain_events(self) -> KVEvents:
        return self.cache.drain_events() if self.cache is not None else KVEvents()
