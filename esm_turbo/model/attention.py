"""TurboEsmSelfAttention: wraps a loaded model's self-attention (ESM-2's ``EsmSelfAttention``, ESM C's
``EsmcAttention``; no copy of transformers' files).

Modes, set through a shared :class:`RunContext`:

* no context / ``plain``: exactly the original computation (same projections, ESM C's query/key LayerNorms,
  transformers' ``apply_rotary_pos_emb`` and attention interface, ESM C's output projection);
* ``prefill``: the exact computation, then post-RoPE K and V are written to ``ctx.cache`` (quantized
  by its codec) and/or handed to ``ctx.recorder`` (calibration);
* ``decode``: new tokens attend to the cached prefix (dequantized, or read packed by the fused
  kernel) plus their own full-precision K/V; with ``ctx.commit`` their K/V are then written to the
  cache. Cached prefix states are never recomputed;
* ``custom``: ``ctx.attend(layer, q, k, v)`` computes the attention output [B, H, S, d] (evaluation's
  teacher-forced decode of every step at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.esm.modeling_esm import eager_attention_forward

from .. import ops
from ..cache_contract import DecodeCache
from ..ops.reference import rope_reference
from .family import ESM2, ESMC, Family, family_of_net


@dataclass
class RunContext:
    """What the attention layers of one forward pass should do besides attending."""

    mode: str = "plain"  # plain | prefill | decode | custom
    cache: DecodeCache | None = None  # the only cache interface the attention layers use
    new_valid: torch.Tensor | None = None  # [B, S] bool, decode only
    commit: bool = True
    recorder: Callable | None = None  # recorder(layer, q, k, v, valid [B,S] or None)
    probe: Callable | None = None  # probe(layer, q, k, v, out) during decode (evaluation)
    valid: torch.Tensor | None = None  # [B, S] bool, prefill token validity for recorders
    attend: Callable | None = None  # attend(layer, q, k, v) → out [B, H, S, d], custom mode only
    memo: dict = field(default_factory=dict)  # what the layers of one pass compute once and share (ops.attend_dense)


def _esmc_rope():
    from transformers.models.esmc.modeling_esmc import apply_rotary_pos_emb
    return apply_rotary_pos_emb


class TurboEsmSelfAttention(nn.Module):
    """Drop-in replacement for the family's self-attention module; holds the original as ``inner``. ESM-2's returns
    the attention output before its output projection (``EsmSelfOutput`` follows), ESM C's after ``o_proj``, as the
    modules they replace do. The cache holds post-RoPE K (ESM C's after its key LayerNorm) and V."""

    def __init__(self, inner: nn.Module, layer_idx: int, family: Family = ESM2):
        super().__init__()
        self.inner = inner
        self.layer_idx = layer_idx
        self.family = family
        self.context: RunContext | None = None
        self.heads = inner.config.num_attention_heads
        self.head_dim = inner.config.hidden_size // self.heads

    def _projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [B, S, H·d] before RoPE (ESM C's after its LayerNorms) and v [B, H, S, d]."""
        inner = self.inner
        if self.family is ESMC:
            q = inner.q_norm(inner.q_proj(hidden_states)).to(hidden_states.dtype)
            k = inner.k_norm(inner.k_proj(hidden_states)).to(hidden_states.dtype)
            v = inner.v_proj(hidden_states)
        else:
            q, k, v = inner.query(hidden_states), inner.key(hidden_states), inner.value(hidden_states)
        return q, k, v.view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def project(self, hidden_states: torch.Tensor, position_embeddings,
                fused: bool = False) -> tuple[torch.Tensor, ...]:
        """hidden [B, S, D] → q (scaled, RoPE'd), k (RoPE'd), v: each [B, H, S, d]. ``fused``: the scaling and the
        embedding in one launch (``kernels.rope``, the same values)."""
        q, k, v = self._projections(hidden_states)
        if fused:
            from ..kernels.rope import rope_triton
            return (*rope_triton(q, k, *position_embeddings, self.head_dim), v)
        return (*rope_reference(q, k, *position_embeddings, self.head_dim), v)

    def _exact(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, **kwargs):
        """The original module's computation, op for op: (q scaled and RoPE'd, k RoPE'd, v, out [B, S, H·d] before
        any output projection, attention weights)."""
        if self.family is ESM2:
            q, k, v = self.project(hidden_states, position_embeddings)
            interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.inner.config._attn_implementation,
                                                              eager_attention_forward)
            out, weights = interface(self.inner, q, k, v, attention_mask, dropout=0.0, scaling=1.0, **kwargs)
            return q, k, v, out, weights
        from transformers.models.esmc.modeling_esmc import eager_attention_forward as esmc_eager
        q, k, v = self._projections(hidden_states)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k = _esmc_rope()(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), *position_embeddings)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.inner.config._attn_implementation, esmc_eager)
        out, weights = interface(self.inner, q, k, v, attention_mask, dropout=0.0, scaling=self.inner.scaling,
                                 **kwargs)
        return q * self.inner.scaling, k, v, out, weights

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, S, H·d] → what the replaced module returns (ESM C's through its output projection)."""
        return self.inner.o_proj(out) if self.family is ESMC else out

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states=None, encoder_attention_mask=None, position_embeddings=None,
                **kwargs):
        if encoder_hidden_states is not None:
            raise NotImplementedError(f"cross-attention is not used by {self.family.label}")
        if position_embeddings is None:
            raise ValueError("TurboEsmSelfAttention needs rotary position embeddings")
        ctx = self.context
        batch, seq = hidden_states.shape[:2]
        if ctx is None or ctx.mode in ("plain", "prefill"):
            q, k, v, out, weights = self._exact(hidden_states, position_embeddings, attention_mask, **kwargs)
            if ctx is not None and ctx.mode == "prefill":
                if ctx.recorder is not None:
                    ctx.recorder(self.layer_idx, q, k, v, ctx.valid)
                if ctx.cache is not None:
                    ctx.cache.write(self.layer_idx, k, v, ctx.valid)
            return self._output(out.reshape(batch, seq, -1).contiguous()), weights
        decode = ctx.mode == "decode"
        q, k, v = self.project(hidden_states, position_embeddings, fused=decode and ops.use_kernels(hidden_states))
        if ctx.mode == "custom":
            out = ctx.attend(self.layer_idx, q, k, v).to(q.dtype)
            return self._output(out.transpose(1, 2).reshape(batch, seq, -1).contiguous()), None
        if ctx.mode != "decode":
            raise ValueError(f"unknown attention mode {ctx.mode!r}")
        out = decode_attend(ctx, self.layer_idx, q, k, v)
        if ctx.probe is not None:
            ctx.probe(self.layer_idx, q, k, v, out)
        return self._output(out.transpose(1, 2).reshape(batch, seq, -1).contiguous()), None


def decode_attend(ctx: RunContext, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A decode step's attention in ``layer``: the new tokens' k, v written to ``ctx.cache`` (uncommitted until the
    step commits) where the step commits or the cache attends in place, then q attends to the committed prefix and
    the new tokens. q (scaled and rotated), k (rotated), v: [B, H, S, d]; returns [B, H, S, d]."""
    cache = ctx.cache
    # attention only reads: the committed prefix from the cache and the new tokens as they are, or an uncompressed
    # GPU cache in place, new tokens included
    if ctx.commit or cache.attends_from_storage(layer):
        cache.write(layer, k, v, ctx.new_valid)
    return ops.decode_attention(q, cache, layer, k, v, ctx.new_valid, ctx.memo)


def install(model: nn.Module) -> list[TurboEsmSelfAttention]:
    """Replace every self-attention module of ``model`` (an ESM-2 or ESM C masked-LM or base model) in place;
    idempotent."""
    family = family_of_net(model)
    mods = []
    for i, layer in enumerate(family.layers(model)):
        attn = family.attention_module(layer)
        if not isinstance(attn, TurboEsmSelfAttention):
            attn = TurboEsmSelfAttention(attn, i, family)
            family.set_attention_module(layer, attn)
        mods.append(attn)
    return mods
