"""Runs the stock `transformers` model over Baton's KV layouts.

`prefill` runs one prompt (optionally continuing from a cached prefix KV) and returns its KV;
`decode` runs one step for every row of a decode batch over paged KV, one token per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from baton.engine import attention
from baton.engine.attention import DecodeAttention, PrefillAttention
from baton.engine.kv import PrefillOutput, SequenceKV
from baton.engine.model import LoadedModel
from baton.engine.paged_kv import DecodeStep, PagedKV


class _PagedCache(Cache):
    """Writes a step's new keys into each row's next page slot and hands the model each row's
    pages side by side (the attention context masks the columns past a row's length)."""

    def __init__(self, pages: torch.Tensor, ctx: DecodeAttention):
        super().__init__(layers=[])
        self.pages = pages
        self.ctx = ctx
        last = ctx.lengths - 1
        self.page = ctx.table.gather(1, (last // pages.shape[4])[:, None])[:, 0]
        self.slot = last % pages.shape[4]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [rows, kv_heads, 1, head_dim]
        self.pages[layer_idx, 0, self.page, :, self.slot] = key_states[:, :, 0]
        self.pages[layer_idx, 1, self.page, :, self.slot] = value_states[:, :, 0]
        return (attention.gathered(self.pages[layer_idx, 0], self.ctx.table),
                attention.gathered(self.pages[layer_idx, 1], self.ctx.table))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.ctx.lengths.max()) - 1


class _PrefillCache(Cache):
    """Starts from a cached prefix KV (or nothing) and keeps the prompt's full KV per layer."""

    def __init__(self, prefix: SequenceKV | None, num_layers: int):
        super().__init__(layers=[])
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.prefix = prefix

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [prompts, kv_heads, new_tokens, head_dim]; one prefix for all
        if self.prefix is not None and self.prefix.num_tokens:
            rows = key_states.shape[0]
            keys = self.prefix.keys(layer_idx)[None].to(key_states).expand(rows, -1, -1, -1)
            values = self.prefix.values(layer_idx)[None].to(value_states).expand(rows, -1, -1, -1)
            key_states = torch.cat([keys, key_states], dim=2)
            value_states = torch.cat([values, value_states], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefix.num_tokens if self.prefix is not None else 0

    def batch_kv(self) -> torch.Tensor:
        return torch.stack([torch.stack([k, v]) for k, v in zip(self.keys, self.values)])

    def sequence_kv(self) -> SequenceKV:
        return SequenceKV(torch.stack([torch.stack([k[0], v[0]]) for k, v in zip(self.keys, self.values)]))


class TransformersRunner:
    """The reference executor: the stock transformers forward, for any model it loads."""

    name = "transformers"

    def __init__(self, loaded: LoadedModel, attention_backend: str = "auto"):
        self.loaded = loaded
        self.model = loaded.model
        self.backend = attention.resolve_backend(attention_backend, loaded.device)
        attention.register()
        self.model.set_attn_implementation(attention.ATTENTION_NAME)
        # Counted, so tests and metrics can prove where each kind of token was computed.
        self.prompt_tokens_forwarded = 0
        self.decode_tokens_forwarded = 0
        self.decode_steps = 0

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @torch.no_grad()
    def prefill(self, token_ids: list[int], prefix: SequenceKV | None = None) -> PrefillOutput:
        cached = prefix.num_tokens if prefix is not None else 0
        if not 0 <= cached < len(token_ids):
            raise ValueError(f"a prefix of {cached} tokens must be shorter than the {len(token_ids)}-token prompt")
        new_ids = torch.tensor([token_ids[cached:]], device=self.device)
        positions = torch.arange(cached, len(token_ids), device=self.device)[None]
        cache = _PrefillCache(prefix, self.loaded.kv_shape.num_layers)
        out = self.model(
            input_ids=new_ids, position_ids=positions, past_key_values=cache, use_cache=True,
            logits_to_keep=1, baton=PrefillAttention(cached, self.backend),
        )
        self.prompt_tokens_forwarded += new_ids.shape[1]
        return PrefillOutput(out.logits[0, -1].float(), cache.sequence_kv(), new_ids.shape[1])

    @torch.no_grad()
    def prefill_batch(self, prompts: list[list[int]], prefix: SequenceKV | None = None) -> list[PrefillOutput]:
        """Several prompts in one forward, right-padded: under the causal mask a real token never
        sees the padding after it, so each prompt's KV and logits are its own. With `prefix`, every
        prompt starts with those cached tokens (a BatchLLM group); only the rest is computed."""
        if len(prompts) == 1:
            return [self.prefill(prompts[0], prefix)]
        cached = prefix.num_tokens if prefix is not None else 0
        if any(len(p) <= cached for p in prompts):
            raise ValueError(f"every prompt needs a token after the {cached}-token prefix")
        suffixes = [p[cached:] for p in prompts]
        longest = max(map(len, suffixes))
        ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=self.device)
        for i, s in enumerate(suffixes):
            ids[i, :len(s)] = torch.tensor(s, device=self.device)
        positions = torch.arange(cached, cached + longest, device=self.device)[None].expand(len(prompts), -1)
        cache = _PrefillCache(prefix, self.loaded.kv_shape.num_layers)
        hidden = self.model.get_decoder()(
            input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
            baton=PrefillAttention(cached, self.backend),
        ).last_hidden_state  # [B, T, hidden]
        last = torch.tensor([len(s) - 1 for s in suffixes], device=self.device)
        logits = self.model.get_output_embeddings()(hidden[torch.arange(len(prompts)), last]).float()  # [B, V]
        self.prompt_tokens_forwarded += sum(map(len, suffixes))
        kv = cache.batch_kv()  # [layers, 2, B, kv_heads, cached + T, head_dim]
        return [PrefillOutput(logits[i], SequenceKV(kv[:, :, i, :, :len(p)].contiguous()), len(s))
                for i, (p, s) in enumerate(zip(prompts, suffixes))]

    @torch.no_grad()
    def decode(self, kv: PagedKV, step: DecodeStep, input_ids: list[int]) -> torch.Tensor:
        """One step: feeds input_ids[i] to row i at position step.lengths[i] - 1, returns next-token
        logits [rows, vocab] float32."""
        rows = step.num_rows
        if len(input_ids) != rows:
            raise ValueError(f"decode needs one token per row: {rows} rows, {len(input_ids)} tokens")
        lengths = torch.tensor(step.lengths, dtype=torch.int64, device=self.device)
        ctx = DecodeAttention.for_step(step.table_tensor(device=self.device), lengths, kv.page_size, "torch")
        out = self.model(
            input_ids=torch.tensor(input_ids, device=self.device)[:, None], position_ids=(lengths - 1)[:, None],
            past_key_values=_PagedCache(kv.pages, ctx), use_cache=True, baton=ctx,
        )
        self.decode_tokens_forwarded += rows
        self.decode_steps += 1
        return out.logits[:, -1].float()
