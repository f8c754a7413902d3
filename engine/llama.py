"""Baton's own executor for the Llama family (Llama, Mistral, Qwen2, SmolLM).

It reads the weights of a loaded Hugging Face model once, fuses them for our layouts and runs
the forward itself, with the same interface as the `transformers` reference runner:

- one fused QKV and one fused gate/up projection per layer, weights prepacked for the CPU GEMM
  (`engine.linear`); RMSNorm and SiLU as single fused calls; rotary applied to queries and keys
  together from a cos/sin table built once;
- decode writes each step's keys and values straight into each row's next page slot and attends
  over the row's pages (`engine.paged_kv`; Triton's paged kernel on CUDA, on CPU every layer of
  a step in one C call);
- prefill writes the new tokens' KV into one preallocated tensor; a cached prefix (a BatchLLM
  group's, shared by every prompt of the forward) stays one tensor that all of them attend to;
  the LM head runs on each prompt's last token only.

On CPU with Baton's kernels, weights and KV stay in the model's dtype while activations and sums
are fp32, and every kernel reduces each row alone in a fixed order: a request's tokens are the
same whatever rows share its step, however its prompt was chunked or cached, and whether its KV
was computed by prefill or by decode (batch invariance; prefill attention runs decode's kernel).
In fp32, numerics follow transformers' Llama forward operation for operation (norms in fp32, the
same rotary tables), so greedy tokens equal `generate`'s. On CUDA the model's dtype throughout.
In bf16/fp16 there, batch invariance (`batch_invariant`, on by default) runs Baton's Triton
kernels in the same spirit: a fixed-order GEMM and RMSNorm (`engine.kernels.invariant`, residuals
added in the GEMM's launch), rotary with the KV write and SiLU * up each one kernel
(`engine.kernels.fused`), and decode and prefill attention through one query-tiled kernel
(`engine.kernels.tiled`); without it cuBLAS and torch's flash prefill, whose rounding depends on
the batch. fp32 on
CUDA keeps cuBLAS: its contract is equality with `generate`, which uses cuBLAS too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from baton.engine import attention, checkpoint, fp8, quantized
from baton.engine.attention import DecodeAttention, PrefillAttention
from baton.engine.collectives import Group
from baton.engine.cpu import kernels as cpu_kernels
from baton.engine.cuda_graphs import StepGraphs
from baton.engine.kv import PrefillOutput, SequenceKV
from baton.engine.linear import Linear, best_layout
from baton.engine.model import LoadedModel
from baton.engine.paged_kv import DecodeStep, PagedKV
from baton.engine.quantized import BlockWeight
from baton.engine.shard import Shard

log = logging.getLogger(__name__)

ARCHITECTURES = checkpoint.ARCHITECTURES  # the Llama family: what the reader reads is what this runs


def unsupported_reason(loaded: LoadedModel) -> str | None:
    """Why the Baton executor cannot run this model (None: it can)."""
    cfg = loaded.config
    arch = (getattr(cfg, "architectures", None) or [type(loaded.model).__name__])[0]
    if arch not in ARCHITECTURES:
        return f"architecture {arch} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (only silu)"
    window = getattr(cfg, "sliding_window", None)
    if window and (getattr(cfg, "use_sliding_window", True) and window < loaded.max_context):
        return f"sliding-window attention ({window} tokens)"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    return None


def _fused(loaded: LoadedModel, names: list[str]) -> torch.Tensor:
    """One weight for several projections of the same input. The model's weights by those names
    (and transformers' module's, where there is one) become views of the fused one, so the
    weights are held once (an 8B model's q, k, v, gate and up projections are 9 GB), and the
    reference executor still runs."""
    if any(isinstance(loaded.tensors[name], BlockWeight) for name in names):  # module-less: no views to make
        return quantized.cat([_blocks(loaded.tensors[name]) for name in names])
    if any(isinstance(loaded.tensors[name], fp8.Fp8Weight) for name in names):
        return fp8.cat([loaded.tensors[name] for name in names])
    parts = [loaded.tensors[name].detach() for name in names]
    fused = torch.cat(parts)
    at = 0
    for name, part in zip(names, parts):
        view = fused[at:at + part.shape[0]]
        loaded.tensors[name] = view
        if loaded.model is not None:
            projection = loaded.model.get_submodule(name.removesuffix(".weight"))
            projection.weight = torch.nn.Parameter(view, requires_grad=False)
        at += part.shape[0]
    return fused


def _blocks(weight: torch.Tensor | BlockWeight) -> BlockWeight:
    """A fused part left in floats beside quantized ones (a width not of whole blocks cannot be): Q8_0."""
    return weight if isinstance(weight, BlockWeight) else quantized.quantize_q8_0(weight)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear  # [hidden] -> [(q_heads + 2 * kv_heads) * head_dim]
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [hidden] -> [2 * intermediate]
    down: Linear


class LlamaRunner:
    """Prefill and BATON decode for a Llama-family model, without transformers on the hot path."""

    name = "baton"

    def __init__(self, loaded: LoadedModel, attention_backend: str = "auto", cuda_graphs: bool = True,
                 batch_invariant: bool = True, layout: str | None = None, tp: Group | None = None):
        """batch_invariant: on CUDA in bf16/fp16, Baton's fixed-order Triton kernels (on CPU Baton's C
        kernels are invariant anyway). layout: the weights' layout (None: `best_layout`'s choice;
        tests name 'triton' to run CUDA's invariant kernels in Triton's interpreter). tp: this rank's
        group when the worker is tensor-parallel; `loaded` then holds this rank's rows
        (`engine.shard`), and every forward is run by all ranks at once (`engine.tensor_parallel`)."""
        reason = unsupported_reason(loaded)
        if reason:
            raise ValueError(f"the Baton executor cannot run {loaded.name}: {reason}")
        if loaded.handed_over is not None:
            raise ValueError(f"{loaded.name}'s weights were handed over to a runner already: load it again")
        self.loaded = loaded
        self.backend = attention.resolve_backend(attention_backend, loaded.device)
        cfg, model = loaded.config, loaded.model
        shape = loaded.kv_shape
        self.tp = tp
        self.shards = Shard.all(cfg, tp.size) if tp is not None else None
        shard = self.shards[tp.rank] if tp is not None else None
        self.num_heads = shard.num_q_heads if shard else cfg.num_attention_heads
        self.num_kv_heads = shard.num_kv_heads if shard else shape.num_kv_heads
        self.head_dim = shape.head_dim
        # with tensor parallelism, every rank's part of each gathered axis
        self.widths = {
            "attention": [s.num_q_heads * self.head_dim for s in self.shards],
            "kv_heads": [s.num_kv_heads for s in self.shards],
            "hidden": [s.hidden[1] - s.hidden[0] for s in self.shards],
            "intermediate": [s.intermediate[1] - s.intermediate[0] for s in self.shards],
            "vocab": [s.vocab[1] - s.vocab[0] for s in self.shards],
        } if shard else None
        self.eps = float(cfg.rms_norm_eps)
        self.dtype = loaded.dtype  # weights and KV as stored
        invariant = batch_invariant and self.backend == "triton"
        if layout is None and loaded.quantization == "fp8":  # the fp8 GEMMs: Baton's invariant one, or cuBLASLt's
            layout = "triton" if invariant and loaded.device.type == "cuda" else "plain"
        self.layout = layout or best_layout(loaded.device, loaded.dtype, invariant)
        if self.layout == "triton" and self.backend != "triton":
            raise ValueError("the triton weight layout needs the triton attention backend")
        # where the kernels must be batch-invariant, decode attention runs prefill's query-tiled kernel
        self.invariant_attention = self.layout == "triton"
        # Baton's CPU kernels compute in fp32 whatever the stored dtype; elsewhere the model's dtype
        self.compute_dtype = torch.float32 if self.layout == "panels" else self.dtype
        tensors = loaded.tensors
        self.scale = self.head_dim ** -0.5
        self.embed = tensors["model.embed_tokens.weight"]  # [vocab, hidden]
        self.layers = [self._fuse(loaded, f"model.layers.{i}.", self.layout, self.compute_dtype)
                       for i in range(cfg.num_hidden_layers)]
        self.norm = tensors["model.norm.weight"].to(self.compute_dtype)
        head = tensors.get("lm_head.weight", self.embed if getattr(cfg, "tie_word_embeddings", False) else None)
        if head is None:
            raise ValueError(f"{loaded.name} has no lm_head.weight and does not tie it to its embeddings")
        self.lm_head = Linear(head, tensors.get("lm_head.bias"), layout=self.layout)
        if isinstance(self.embed, BlockWeight) and head is self.embed:
            self.embed = None  # looked up in the LM head's panels: the table is held once
        # Baton's C attention (and a decode step's layers as one C call) unless the Triton kernels
        # were asked for by name: tests run those on CPU in Triton's interpreter
        self.c_attention = self.layout == "panels" and self.backend != "triton"
        self.decode_layers = None  # None: layer by layer (and with tensor parallelism: ranks gather between ops)
        if self.c_attention and tp is None:
            self.decode_layers = cpu_kernels.DecodeLayers(
                self.layers, dtype=self.dtype, hidden=cfg.hidden_size, heads=self.num_heads,
                kv_heads=self.num_kv_heads, head_dim=self.head_dim, intermediate=cfg.intermediate_size, eps=self.eps,
                scale=self.scale)
        # cos, sin: [max_context, head_dim]: transformers' own module where there is one (any RoPE
        # scaling), else the same tables computed here (engine.checkpoint reads only those it can)
        if model is not None:
            positions = torch.arange(loaded.max_context, device=loaded.device)[None]
            probe = torch.zeros(1, dtype=self.compute_dtype, device=loaded.device)
            cos, sin = model.get_decoder().rotary_emb(probe, positions)
            cos, sin = cos[0], sin[0]
        else:
            cos, sin = checkpoint.rotary_tables(cfg, loaded.max_context, loaded.device, self.compute_dtype)
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        # CUDA: decode steps replay captured graphs (engine.cuda_graphs); None: launched op by op
        self.graphs = StepGraphs(self._captured_step, loaded.device, loaded.max_context) \
            if cuda_graphs and loaded.device.type == "cuda" and tp is None else None
        # Counted, so tests and metrics can prove where each kind of token was computed.
        self.prompt_tokens_forwarded = 0
        self.decode_tokens_forwarded = 0
        self.decode_steps = 0
        # Called between two layers of a prefill forward, if set: a prefill worker runs urgent
        # prompts there (nested forwards on this thread) rather than making them wait for a long
        # low-priority forward. Each forward's state is its own, so nesting changes no result.
        self.between_layers: Callable[[], None] | None = None

    @staticmethod
    def _fuse(loaded: LoadedModel, prefix: str, layout: str, compute_dtype: torch.dtype) -> _Layer:
        """One layer's weights (named `prefix`...) fused for Baton's layouts."""
        tensors = loaded.tensors
        qkv_names = [f"{prefix}self_attn.{p}_proj" for p in "qkv"]
        qkv_bias = None
        if any(f"{name}.bias" in tensors for name in qkv_names):
            qkv_bias = torch.cat([tensors[f"{name}.bias"] if f"{name}.bias" in tensors else
                                  torch.zeros(tensors[f"{name}.weight"].shape[0], dtype=tensors[f"{name}.weight"].dtype,
                                              device=tensors[f"{name}.weight"].device)
                                  for name in qkv_names]).to(compute_dtype)
        return _Layer(  # norms (and the bias) in the dtype activations are computed in
            input_norm=tensors[f"{prefix}input_layernorm.weight"].to(compute_dtype),
            qkv=Linear(_fused(loaded, [f"{name}.weight" for name in qkv_names]), qkv_bias, layout=layout),
            o=Linear(tensors[f"{prefix}self_attn.o_proj.weight"], tensors.get(f"{prefix}self_attn.o_proj.bias"),
                     layout=layout),
            post_norm=tensors[f"{prefix}post_attention_layernorm.weight"].to(compute_dtype),
            gate_up=Linear(_fused(loaded, [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"]),
                           layout=layout),
            down=Linear(tensors[f"{prefix}mlp.down_proj.weight"], layout=layout),
        )

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    # -- the pieces every forward shares ------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if self.layout == "panels":  # Baton's C kernels are built here: one call, not torch's six
                return cpu_kernels.rms_norm(x, weight, self.eps)
        if self.layout == "triton":  # one program a row: the same bits in any batch
            from baton.engine.kernels import invariant_rms_norm

            return invariant_rms_norm(x, weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        # transformers normalises in fp32 and casts back before the weight multiplies
        return weight * F.rms_norm(x.float(), weight.shape, None, self.eps).to(x.dtype)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin: [N, 1, D] for token positions [N], gathered once per forward for every layer.
        rotate_half(x) * sin == roll(x, D/2) * signed_sin with the first half of sin negated: the
        same products, one op instead of four."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None].clone()
        sin[..., :self.head_dim // 2].neg_()
        return cos, sin

    def _qkv(self, layer: _Layer, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """x: [N, hidden] -> q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D], rotary applied."""
        n, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x).view(n, hq + 2 * hkv, d)
        cos, signed_sin = rotary
        if self.layout == "panels":  # in place, one C call
            cpu_kernels.rotary(qkv, hq + hkv, cos, signed_sin)
            return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        qk, v = qkv[:, :hq + hkv], qkv[:, hq + hkv:]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * signed_sin
        return qk[:, :hq], qk[:, hq:], v

    def _fused_qkv(self, layer: _Layer, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                   k_dst: torch.Tensor, v_dst: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The triton layout's `_qkv` and KV write in one kernel after the projection: x [N, hidden]
        -> q [N, Hq, D]; token i's keys and values written at k_dst / v_dst + offsets[i] (views
        whose last two dimensions are KV heads and head dims)."""
        from baton.engine.kernels import rotary_kv

        qkv = layer.qkv(x)  # [N, (Hq + 2 Hkv) * D]
        cos, signed_sin = rotary
        rotary_kv(qkv, cos[:, 0], signed_sin[:, 0], self.num_heads, self.num_kv_heads, k_dst, v_dst, offsets)
        return qkv[:, :self.num_heads * self.head_dim].view(-1, self.num_heads, self.head_dim)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(ids)
        # each rank holds a run of the vocabulary: the others' rows are zeros, so the sum is exact
        start, stop = self.shards[self.tp.rank].vocab
        mine = (ids >= start) & (ids < stop)
        h = self._lookup(torch.where(mine, ids - start, 0))
        h[~mine] = 0
        return self.tp.all_reduce(h)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:  # quantized and tied: the LM head's panels
            head = self.lm_head
            return quantized.panel_rows(head.format, head.packed, ids, head.in_features)
        if isinstance(self.embed, BlockWeight):
            return self.embed.rows(ids).dequantize()
        return self.embed[ids].to(self.compute_dtype)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate_up = layer.gate_up(self._rms_norm(h, layer.post_norm))
        if self.layout == "panels":  # the decode step's own SiLU, so prefill computes as decode does
            return self._project(layer.down, cpu_kernels.silu_mul(gate_up), "intermediate", h)
        if self.layout == "triton":  # one kernel for SiLU(gate) * up
            from baton.engine.kernels import silu_mul

            return self._project(layer.down, silu_mul(gate_up), "intermediate", h)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._project(layer.down, F.silu(gate) * up, "intermediate", h)

    def _project(self, linear: Linear, x: torch.Tensor, part: str, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(x) for the O and down projections (the triton layout adds it in the
        GEMM's own launch). With tensor parallelism x is this rank's part of the input (the `part`
        axis) and linear holds this rank's output features: the input is gathered whole first and
        the output after, so each feature is one kernel's full sum."""
        if self.tp is None:
            if self.layout == "triton":
                return linear(x, residual=residual)
            return residual + linear(x)
        out = linear(self.tp.all_gather(x, -1, self.widths[part]))
        return residual + self.tp.all_gather(out, -1, self.widths["hidden"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head (its vocabulary split over ranks with tensor parallelism, then gathered)."""
        logits = self.lm_head(x)
        return logits if self.tp is None else self.tp.all_gather(logits, -1, self.widths["vocab"])

    # -- decode -------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, kv: PagedKV, step: DecodeStep, input_ids: list[int]) -> torch.Tensor:
        """One step: feeds input_ids[i] to row i at position step.lengths[i] - 1, writes its keys and
        values there, returns next-token logits [rows, vocab] float32."""
        rows = step.num_rows
        if len(input_ids) != rows:
            raise ValueError(f"decode needs one token per row: {rows} rows, {len(input_ids)} tokens")
        if self.graphs is not None:
            logits = self._replay(kv, step, input_ids)
            if logits is not None:
                self.decode_tokens_forwarded += rows
                self.decode_steps += 1
                return logits
        lengths = torch.tensor(step.lengths, dtype=torch.int64, device=self.device)
        table = step.table_tensor(device=self.device)
        rotary = self._rotary(lengths - 1)
        h = self._embed(torch.tensor(input_ids, device=self.device))  # [R, hidden]
        if self.decode_layers is not None:
            cos, signed_sin = rotary
            self.decode_layers(h, cos, signed_sin, kv.pages, table, lengths)
        else:
            ctx = DecodeAttention.for_step(table, lengths, kv.page_size, self.backend, self.invariant_attention)
            h = self._decode_layers(kv.pages, h, rotary, ctx)
        logits = self._logits(self._rms_norm(h, self.norm))
        self.decode_tokens_forwarded += rows
        self.decode_steps += 1
        return logits.float()

    def _replay(self, kv: PagedKV, step: DecodeStep, input_ids: list[int]) -> torch.Tensor | None:
        try:
            return self.graphs.step(kv, step, input_ids)
        except Exception as exc:  # a step that cannot be captured must not fail every request
            log.warning("capturing the decode step as a CUDA graph failed (%s); this worker decodes without graphs",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self.graphs = None
            return None

    def _captured_step(self, pages, ids, lengths, table) -> torch.Tensor:
        """The decode step a CUDA graph records: every input a device tensor (engine.cuda_graphs).
        pages: the paged KV; ids, lengths int64 [R]; table int64 [R, width]."""
        ctx = DecodeAttention.for_step(table, lengths, pages.shape[4], self.backend, self.invariant_attention)
        h = self._decode_layers(pages, self._embed(ids), self._rotary(lengths - 1), ctx)
        return self.lm_head(self._rms_norm(h, self.norm)).float()

    def _decode_layers(self, pages: torch.Tensor, h, rotary, ctx: DecodeAttention):
        """Layer by layer from Python: the reference for the one-call step, and the path for other
        dtypes and devices. pages: [layers, 2, pages, kv_heads, page_size, head_dim]."""
        rows, page_size = h.shape[0], pages.shape[4]
        last = ctx.lengths - 1  # each row's new token: page and slot
        page = ctx.table.gather(1, (last // page_size)[:, None])[:, 0]
        slot = last % page_size
        fused = self.layout == "triton"
        offsets = page * pages.stride(2) + slot * pages.stride(4) if fused else None  # in one layer's keys
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            if fused:  # keys [pages, P, Hkv, D] as the kernel addresses them
                q = self._fused_qkv(layer, x, rotary, pages[index, 0].transpose(1, 2), pages[index, 1].transpose(1, 2),
                                    offsets)
            else:
                q, k, v = self._qkv(layer, x, rotary)
                pages[index, 0, page, :, slot] = k.to(pages.dtype)  # [R, Hkv, D], as stored (fp32 sums, bf16 KV)
                pages[index, 1, page, :, slot] = v.to(pages.dtype)
            out = self._decode_attention(q, pages, index, ctx)  # [R, Hq, D]
            h = self._project(layer.o, out.reshape(rows, -1), "attention", h)
            h = self._mlp(layer, h)
        return h

    def _decode_attention(self, q, pages, layer: int, ctx: DecodeAttention):
        try:
            return attention.decode(q, pages, layer, ctx, self.scale)
        except Exception as exc:  # a Triton kernel that cannot build here must not fail every request
            if ctx.backend != "triton":
                raise
            log.warning("Triton decode attention failed (%s); falling back to the torch path for this worker",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self.backend = "torch"
            fallback = DecodeAttention.for_step(ctx.table, ctx.lengths, pages.shape[4], "torch")
            ctx.backend, ctx.mask = fallback.backend, fallback.mask
            return attention.decode(q, pages, layer, ctx, self.scale)

    # -- prefill ------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, token_ids: list[int], prefix: SequenceKV | None = None, own_heads: bool = False) -> PrefillOutput:
        """own_heads: `prefix` holds this rank's KV heads only ([layers, 2, own heads, C, D]: a
        tensor-parallel rank's kept chunks, engine.tensor_parallel); the new tokens' KV still comes
        back whole, the prefix does not (rank 0 holds it whole)."""
        cached = prefix.num_tokens if prefix is not None else 0
        if not 0 <= cached < len(token_ids):
            raise ValueError(f"a prefix of {cached} tokens must be shorter than the {len(token_ids)}-token prompt")
        return self._prefill([token_ids], prefix, own_heads=own_heads)[0]

    @torch.no_grad()
    def prefill_batch(self, prompts: list[list[int]], prefix: SequenceKV | None = None) -> list[PrefillOutput]:
        """Several prompts in one forward, right-padded: under the causal mask a real token never
        sees the padding after it, so each prompt's KV and logits are its own. With `prefix`, every
        prompt starts with those cached tokens (a BatchLLM group); only the rest is computed."""
        cached = prefix.num_tokens if prefix is not None else 0
        if any(len(p) <= cached for p in prompts):
            raise ValueError(f"every prompt needs a token after the {cached}-token prefix")
        return self._prefill(prompts, prefix)

    @torch.no_grad()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The next-token logits after every token of a prompt: [T, vocab] float32 (a text's
        perplexity, its tokens' log-probabilities)."""
        if not token_ids:
            raise ValueError("prompt_logits needs at least one token")
        return self._prefill([token_ids], None, every_position=True)

    def _prefill(self, prompts: list[list[int]], prefix: SequenceKV | None, every_position: bool = False,
                 own_heads: bool = False):
        """own_heads: `prefix` holds this rank's KV heads only (`prefill`)."""
        cached = prefix.num_tokens if prefix is not None else 0
        suffixes = [p[cached:] for p in prompts]
        b, t = len(prompts), max(map(len, suffixes))
        ids = torch.zeros(b, t, dtype=torch.long, device=self.device)
        for i, s in enumerate(suffixes):
            ids[i, :len(s)] = torch.tensor(s, device=self.device)
        positions = torch.arange(cached, cached + t, device=self.device).repeat(b)  # [B * T]
        # kv: [layers, 2, B, Hkv, T, D], the new tokens only: the prefix is one tensor every
        # prompt's attention reads (a BatchLLM group's members reference it, none copies it)
        kv = torch.empty(len(self.layers), 2, b, self.num_kv_heads, t, self.head_dim,
                         dtype=self.dtype, device=self.device)
        shared = (prefix.data if own_heads else self._own_heads(prefix.data)).to(kv) if cached else None
        rotary = self._rotary(positions)
        h = self._embed(ids.view(-1))  # [B * T, hidden]
        fused = self.layout == "triton"
        if fused:  # token (i, j)'s place in one layer's keys [B, Hkv, T, D]
            offsets = (torch.arange(b, device=self.device)[:, None] * kv.stride(2)
                       + torch.arange(t, device=self.device)[None, :] * kv.stride(4)).view(-1)
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            if fused:
                q = self._fused_qkv(layer, x, rotary, kv[index, 0].transpose(1, 2), kv[index, 1].transpose(1, 2),
                                    offsets)
            else:
                q, k, v = self._qkv(layer, x, rotary)
                kv[index, 0] = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
                kv[index, 1] = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            out = self._prefill_attention(q, kv[index], None if shared is None else shared[index], b, t)
            h = self._project(layer.o, out, "attention", h)
            h = self._mlp(layer, h)
            if self.between_layers is not None:
                self.between_layers()
        if every_position:  # one prompt: every token's logits, no KV kept
            return self._logits(self._rms_norm(h, self.norm)).float()
        last = torch.tensor([i * t + len(s) - 1 for i, s in enumerate(suffixes)], device=self.device)
        logits = self._logits(self._rms_norm(h[last], self.norm)).float()  # [B, vocab]
        if self.tp is not None:  # the KV leaves the worker whole: every rank's heads
            kv = self.tp.all_gather(kv, 3, self.widths["kv_heads"])
            shared = prefix.data.to(kv) if cached and not own_heads else None
        self.prompt_tokens_forwarded += sum(map(len, suffixes))
        own = (kv[:, :, i, :, :len(s)] for i, s in enumerate(suffixes))
        reference = SequenceKV(shared) if shared is not None else None
        return [PrefillOutput(logits[i], SequenceKV(data.contiguous()), len(s), reference)
                for i, (data, s) in enumerate(zip(own, suffixes))]

    def _own_heads(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of a whole KV [layers, 2, kv_heads, ...] (all of them without TP)."""
        if self.tp is None:
            return data
        start, stop = self.shards[self.tp.rank].kv_heads
        return data[:, :, start:stop]

    def _prefill_attention(self, q, kv, shared, b: int, t: int) -> torch.Tensor:
        """q [B * T, Hq, D]; kv: this layer's new KV [2, B, Hkv, T, D]; shared: the cached prefix's
        [2, Hkv, C, D] or None -> [B * T, Hq * D]."""
        if self.c_attention:  # decode's kernel over the stored KV: each token as decode computes it
            out = cpu_kernels.prefill_attention(q, kv[0], kv[1], None if shared is None else shared[0],
                                                None if shared is None else shared[1], self.scale)
            return out.view(b * t, -1)
        if self.layout == "triton":  # the kernel decode runs too: each token as a decode step would compute it
            from baton.engine.kernels import prefill_over_pages

            out = prefill_over_pages(q, kv[0], kv[1], None if shared is None else shared[0],
                                     None if shared is None else shared[1], self.scale)
            return out.view(b * t, -1)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        if shared is None:
            out = attention.prefill(q, kv[0], kv[1], PrefillAttention(0, self.backend), self.scale)  # [B, T, Hq, D]
        else:
            out = attention.prefill_continued(q, kv[0], kv[1], shared[0], shared[1], self.backend, self.scale)
        return out.reshape(b * t, -1)
