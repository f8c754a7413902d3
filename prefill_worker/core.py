"""Prefill without networking: reuse cached prefix KV, run the rest, sample the first token.

Prompts are cut into blocks of B tokens with chained hashes (`baton.block_hash`); the KV of
every full block computed here is kept in a bounded prefix cache (LRU, locked while in use), so
a later prompt sharing those blocks computes only its suffix. A large batch's prefix-sharing
group pins its prefix until the group is done (BatchLLM); the pin also keeps the prefix's last,
partial block, so members reuse the shared prefix to the token, not just to the block.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from baton.block_hash import BlockHasher
from baton.engine.request import GenerationRequest, PrefilledRequest
from baton.engine.executors import Runner
from baton.engine.kv import PrefillOutput, SequenceKV, joined
from baton.engine.sampling import first_token
from baton.prefill_worker.prefix_cache import KVEvents, PrefixCache

DEFAULT_BLOCK_SIZE = 16


@dataclass
class Reuse:
    """What a prompt can take from the cache: `blocks` full blocks, then a pinned partial block."""

    hashes: list[int]  # the prompt's full-block hashes
    blocks: int = 0
    partial: tuple | None = None  # key of a pinned partial block continuing those blocks
    tokens: int = 0  # prompt tokens covered


@dataclass
class _Pin:
    blocks: list[int]  # full-block hashes held locked
    expires: float  # time.monotonic() after which the pin is dropped (a router that died never unpins)
    partial: tuple | None = None
    partial_kv: torch.Tensor | None = field(default=None, repr=False)  # [layers, 2, kv_heads, tail, head_dim]


@dataclass
class Chunked:
    """A prompt being prefilled a chunk per iteration: its KV so far covers `done` tokens of one
    tensor sized for the whole prompt, which each chunk continues and writes on: no chunk copies
    the KV before it (joining it anew each chunk moved O(n^2) bytes for an n-token prompt)."""

    request: GenerationRequest
    plan: Reuse
    buffer: torch.Tensor = field(repr=False)  # [layers, 2, kv_heads, prompt tokens, head_dim]
    done: int
    chunks: int = 0
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # a tensor-parallel runner's name for it

    @property
    def kv(self) -> SequenceKV | None:
        """The KV so far (a view of the buffer), None before any."""
        return SequenceKV(self.buffer[:, :, :, :self.done]) if self.done else None

    @property
    def held_bytes(self) -> int:
        return self.buffer.nbytes


DEFAULT_MAX_PINS = 256
DEFAULT_PIN_TTL_S = 3600.0


class PrefillCore:
    def __init__(self, runner: Runner, *, prefix_cache_bytes: int = 256 << 20,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_pins: int = DEFAULT_MAX_PINS,
                 pin_ttl_s: float = DEFAULT_PIN_TTL_S):
        self.runner = runner
        self.block_size = block_size
        self.hasher = BlockHasher(str(runner.loaded.fingerprint), block_size)
        block_bytes = runner.loaded.kv_shape.bytes_per_token() * block_size
        self.cache = PrefixCache(prefix_cache_bytes, block_bytes) if prefix_cache_bytes >= block_bytes else None
        # Pins are bounded three ways: their full blocks live in the prefix cache (locked), each
        # partial block reserves a block of the same budget, and there are at most max_pins of
        # them, each dropped pin_ttl_s after it was made.
        self.max_pins = max_pins
        self.pin_ttl_s = pin_ttl_s
        self.pins: dict[str, _Pin] = {}
        self.partials: dict[tuple, torch.Tensor] = {}  # (parent hash, tail tokens) -> KV, while pinned
        self.cached_tokens_total = 0

    def reuse_for(self, prompt: list[int]) -> Reuse:
        """The cached prefix a prompt can use. Its last token is always computed: its logits
        give the first output token."""
        reuse = Reuse(self.hasher.hash_prompt(prompt))
        if self.cache is None:
            return reuse
        b = self.block_size
        reuse.blocks = min(self.cache.match(reuse.hashes), (len(prompt) - 1) // b)
        reuse.tokens = reuse.blocks * b
        if self.partials:
            parent = reuse.hashes[reuse.blocks - 1] if reuse.blocks else None
            start = reuse.tokens
            for tail in range(min(b - 1, len(prompt) - 1 - start), 0, -1):
                key = (parent, tuple(prompt[start:start + tail]))
                if key in self.partials:
                    reuse.partial, reuse.tokens = key, start + tail
                    break
        return reuse

    def adopt(self, prompt: list[int], kv: SequenceKV) -> int:
        """Cache KV computed elsewhere for the prompt's first kv.num_tokens tokens (a decode
        worker's, of a conversation's earlier turns: `kv_pull`): its whole blocks join the prefix
        cache as if prefilled here, so the prompt, planned next, computes only the rest. Returns
        the prompt tokens the cache holds from it that it lacked before (0: no cache, or no room);
        blocks it had already are its own, and the router's index rightly predicted them."""
        b = self.block_size
        blocks = min(kv.num_tokens, len(prompt) - 1) // b  # the last token is always computed
        hashes = self.hasher.hash_prompt(prompt[:blocks * b])
        return b * self._remember(hashes, None, SequenceKV(kv.data.to(self.runner.device)))

    def cached_tokens(self, prompt: list[int]) -> int:
        """Leading tokens of `prompt` whose whole blocks the cache holds. It only reads the cache, so
        an RPC thread may ask: an estimate, as the compute thread may change the cache meanwhile."""
        if self.cache is None:
            return 0
        return self.cache.cached_blocks(self.hasher.hash_prompt(prompt)) * self.block_size

    def first_new_block(self, prompt: list[int]) -> int | None:
        """The hash of the prompt's first whole block the cache lacks (None: no cache, or nothing
        new to cache). Prompts sharing it would each compute it if they prefilled together."""
        if self.cache is None:
            return None
        hashes = self.hasher.hash_prompt(prompt[:len(prompt) - 1])  # the last token is always computed
        cached = self.cache.cached_blocks(hashes)
        return hashes[cached] if cached < len(hashes) else None

    def prefill(self, requests: list[GenerationRequest],
                on_finished: Callable[[int, PrefilledRequest], None] | None = None) -> list[PrefilledRequest]:
        """Prompts run in batches of equal cached prefix: those with none as one right-padded
        batch, and those continuing the same cached blocks (a BatchLLM group) as another.
        on_finished(i, done) is told of each prompt as soon as its first token is sampled, so its
        KV can leave while the next one's is cached and sampled."""
        for request in requests:
            request.trace.mark("prefill_start")
        plans = [self.reuse_for(r.prompt_token_ids) for r in requests]
        outs: list[PrefillOutput | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, plan in enumerate(plans):
            groups.setdefault((tuple(plan.hashes[:plan.blocks]), plan.partial), []).append(i)
        # Every group's cached prefix is copied before any forward runs: a forward may pause for
        # urgent prompts (`runner.between_layers`), whose new blocks could evict a later group's.
        runs = [(members, self._cached_prefix(plans[members[0]])) for members in groups.values()]
        for members, prefix in runs:
            prompts = [requests[i].prompt_token_ids for i in members]
            for i, out in zip(members, self.runner.prefill_batch(prompts, prefix)):
                outs[i] = out
        finished = []
        for i, (request, plan, out) in enumerate(zip(requests, plans, outs)):
            finished.append(self._finish(request, plan, out))
            if on_finished is not None:
                on_finished(i, finished[-1])
        return finished

    def _finish(self, request: GenerationRequest, plan: Reuse, out: PrefillOutput) -> PrefilledRequest:
        """Cache the prompt's new blocks and sample its first token."""
        self._remember(plan.hashes, out.prefix, out.own)
        token, logprob, seed = first_token(request, out.logits, self.runner.loaded)
        request.trace.cached_tokens = plan.tokens
        request.trace.mark("prefill_end")
        self.cached_tokens_total += plan.tokens
        return PrefilledRequest(request, out.own, token, seed, plan.tokens, logprob, shared_prefix=out.prefix)

    # -- chunked prefill (Sarathi) -----------------------------------------------------------

    def begin_chunks(self, request: GenerationRequest, plan: Reuse | None = None) -> "Chunked":
        """Start prefilling a long prompt a chunk at a time (`plan`: its `reuse_for`, if already
        known); `advance` runs each chunk. Its cached prefix is copied out now, so no cache block
        stays locked between chunks."""
        request.trace.mark("prefill_start")
        plan = plan or self.reuse_for(request.prompt_token_ids)
        shape, runner = self.runner.loaded.kv_shape, self.runner
        buffer = torch.empty(shape.num_layers, 2, shape.num_kv_heads, len(request.prompt_token_ids), shape.head_dim,
                             dtype=shape.dtype, device=runner.device)
        prefix = self._cached_prefix(plan)
        if prefix is not None:
            buffer[:, :, :, :plan.tokens].copy_(prefix.data)
        return Chunked(request, plan, buffer, plan.tokens)

    def advance(self, chunked: "Chunked", budget: int) -> PrefilledRequest | None:
        """Prefill the next `budget` tokens of the prompt on top of the KV so far; once the last
        chunk is done, its logits give the first token and the whole KV is returned, as `prefill`
        would have (the same maths, split where the chunks meet)."""
        if budget < 1:
            raise ValueError(f"a chunk needs at least one token (got a budget of {budget})")
        prompt = chunked.request.prompt_token_ids
        start, end = chunked.done, min(len(prompt), chunked.done + budget)
        chunk = getattr(self.runner, "prefill_chunk", None)  # tensor parallel: each rank keeps its heads of it
        if chunk is not None:
            out = chunk(chunked.key, prompt[:end], chunked.kv, len(prompt))
        else:
            out = self.runner.prefill_batch([prompt[:end]], chunked.kv)[0]
        chunked.buffer[:, :, :, start:end].copy_(joined(out.prefix, out.own, start).data)  # a view for Baton's executor
        chunked.done = end
        chunked.chunks += 1
        whole = PrefillOutput(out.logits, SequenceKV(chunked.buffer[:, :, :, :end]), out.computed_tokens)
        if end < len(prompt):
            # Its whole blocks so far are cached at once: a prompt sharing them need not wait for
            # the last chunk, nor compute them again (SGLang caches unfinished requests alike).
            self._remember(chunked.plan.hashes[:end // self.block_size], whole.prefix, whole.own)
            return None
        return self._finish(chunked.request, chunked.plan, whole)

    @property
    def kept_chunk_bytes(self) -> int:
        """KV the runner keeps of the prompts being chunked beyond their buffers (a tensor-parallel
        rank's heads)."""
        return getattr(self.runner, "kept_chunk_bytes", 0)

    def end_chunks(self, chunked: "Chunked") -> None:
        """A chunked prompt ended before its last chunk (cancelled, failed): whatever the runner
        keeps of it goes."""
        end = getattr(self.runner, "end_chunks", None)
        if end is not None and chunked.done < len(chunked.request.prompt_token_ids):
            end(chunked.key)

    def _run_on_prefix(self, prompts: list[list[int]], plan: Reuse) -> list[PrefillOutput]:
        """Prefill prompts that share `plan`'s cached blocks and pinned partial block; with
        nothing cached, a plain batch."""
        return self.runner.prefill_batch(prompts, self._cached_prefix(plan))

    def _cached_prefix(self, plan: Reuse) -> SequenceKV | None:
        """A copy of the KV `plan` reuses (its blocks locked only while copied), or None."""
        if not plan.tokens:
            return None
        held = plan.hashes[:plan.blocks]
        parts = self.cache.lock(held)
        if plan.partial is not None:
            parts = parts + [self.partials[plan.partial]]
        try:
            return SequenceKV(torch.cat(parts, dim=3))
        finally:
            self.cache.unlock(held)

    def _remember(self, hashes: list[int], prefix: SequenceKV | None, own: SequenceKV) -> int:
        """Cache the blocks `hashes` of the KV `prefix` + `own`; returns how many it lacked and
        now holds (0 also when nothing could be cached: no cache, or everything locked)."""
        if self.cache is None or not hashes:
            return 0
        b = self.block_size
        known = self.cache.match(hashes)
        # Only the new blocks need their own copy; the cache keeps them after this KV is shipped.
        # They are usually all past the prefix the prompt continued: then `new` is a view.
        start = known * b
        new = joined(prefix, own, start).data
        payloads = [None] * known + [new[:, :, :, i * b - start:(i + 1) * b - start].clone()
                                     for i in range(known, len(hashes))]
        stored = self.cache.insert(hashes, payloads)  # None when everything is locked: not cached
        return len(stored) if stored is not None else 0

    # -- BatchLLM groups ---------------------------------------------------------------------

    def pin(self, group_id: str, prefix: list[int]) -> tuple[int, int]:
        """Compute (if needed) and hold a group's shared prefix until `unpin`.
        Returns (tokens held, tokens computed to get there)."""
        if self.cache is None:
            return 0, 0
        if group_id in self.pins:
            raise ValueError(f"group {group_id!r} is already pinned")
        if not prefix:
            raise ValueError("a pinned prefix needs at least one token")
        self.expire_pins()
        if len(self.pins) >= self.max_pins:
            raise OverflowError(f"{self.max_pins} prefixes are pinned on this worker already (prefill.max_pins); "
                                "the group runs unpinned")
        b = self.block_size
        full = self.hasher.hash_prompt(prefix)
        tail = prefix[len(full) * b:]
        computed = 0
        if self.cache.match(full) < len(full) or tail:
            plan = self.reuse_for(prefix)
            out = self._run_on_prefix([prefix], plan)[0]
            computed = out.computed_tokens
            self._remember(full, out.prefix, out.own)
        held = full[:self.cache.match(full)]
        self.cache.lock(held)
        pin = _Pin(held, time.monotonic() + self.pin_ttl_s)
        if tail and len(held) == len(full) and self.cache.reserve(1):  # a partial block is charged as a whole one
            pin.partial = (held[-1] if held else None, tuple(tail))
            pin.partial_kv = joined(out.prefix, out.own, len(full) * b).data.clone()
            self.partials[pin.partial] = pin.partial_kv
        self.pins[group_id] = pin
        return len(held) * b + (len(tail) if pin.partial else 0), computed

    def unpin(self, group_id: str) -> bool:
        pin = self.pins.pop(group_id, None)
        if pin is None:
            return False
        self.cache.unlock(pin.blocks)
        if pin.partial is not None:
            self.cache.release(1)
            if not any(p.partial == pin.partial for p in self.pins.values()):
                self.partials.pop(pin.partial, None)
        return True

    def expire_pins(self, now: float | None = None) -> list[str]:
        """Drop the pins past their time; returns their group ids."""
        now = time.monotonic() if now is None else now
        expired = [group_id for group_id, pin in self.pins.items() if pin.expires <= now]
        for group_id in expired:
            self.unpin(group_id)
        return expired

    def drain_events(self) -> KVEvents:
        return self.cache.drain_events() if self.cache is not None else KVEvents()
