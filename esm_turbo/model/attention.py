"""TurboEsmSelfAttention: wraps a loaded model's EsmSelfAttention (no copy of transformers' file).

Modes, set through a shared :class:`RunContext`:

* no context / ``plain``: exactly the original computation (same projections, transformers'
  ``apply_rotary_pos_emb`` and attention interface);
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
from ..ops.reference import rope_reference


@dataclass
class RunContext:
    """What the attention layers of one forward pass should do besides attending."""

    mode: str = "plain"  # plain | prefill | decode | custom
    cache: object | None = None
    new_valid: torch.Tensor | None = None  # [B, S] bool, decode only
    commit: bool = True
    recorder: Callable | None = None  # recorder(layer, q, k, v, valid [B,S] or None)
    probe: Callable | None = None  # probe(layer, q, k, v, out) during decode (evaluation)
    valid: torch.Tensor | None = None  # [B, S] bool, prefill token validity for recorders
    attend: Callable | None = None  # attend(layer, q, k, v) → out [B, H, S, d], custom mode only
    extras: dict = field(default_factory=dict)


class TurboEsmSelfAttention(nn.Module):
    """Drop-in replacement for ``EsmSelfAttention``; holds the original as ``inner``."""

    def __init__(self, inner: nn.Module, layer_idx: int):
        super().__init__()
        self.inner = inner
        self.layer_idx = layer_idx
        self.context: RunContext | None = None
        self.head_dim = inner.attention_head_size
        self.heads = inner.num_attention_heads

    def project(self, hidden_states: torch.Tensor, position_embeddings,
                fused: bool = False) -> tuple[torch.Tensor, ...]:
        """hidden [B, S, D] → q (scaled, RoPE'd), k (RoPE'd), v: each [B, H, S, d]. ``fused``: the scaling and the
        embedding in one launch (``kernels.rope``, the same values)."""
        inner = self.inner
        q, k = inner.query(hidden_states), inner.key(hidden_states)
        v = inner.value(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        if fused:
            from ..kernels.rope import rope_triton
            return (*rope_triton(q, k, *position_embeddings, self.head_dim), v)
        return (*rope_reference(q, k, *position_embeddings, self.head_dim), v)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states=None, encoder_attention_mask=None, position_embeddings=None,
                **kwargs):
        if encoder_hidden_states is not None:
            raise NotImplementedError("cross-attention is not used by ESM-2")
        if position_embeddings is None:
            raise ValueError("TurboEsmSelfAttention needs rotary position embeddings (ESM-2)")
        ctx = self.context
        decode = ctx is not None and ctx.mode == "decode"
        q, k, v = self.project(hidden_states, position_embeddings, fused=decode and ops.use_kernels(hidden_states))
        batch, seq = hidden_states.shape[:2]
        if ctx is None or ctx.mode in ("plain", "prefill"):
            interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.inner.config._attn_implementation,
                                                              eager_attention_forward)
            out, weights = interface(self.inner, q, k, v, attention_mask, dropout=0.0, scaling=1.0, **kwargs)
            if ctx is not None and ctx.mode == "prefill":
                if ctx.recorder is not None:
                    ctx.recorder(self.layer_idx, q, k, v, ctx.valid)
                if ctx.cache is not None:
                    ctx.cache.write(self.layer_idx, k, v, ctx.valid)
            return out.reshape(batch, seq, -1).contiguous(), weights
        if ctx.mode == "custom":
            out = ctx.attend(self.layer_idx, q, k, v).to(q.dtype)
            return out.transpose(1, 2).reshape(batch, seq, -1).contiguous(), None
        if ctx.mode != "decode":
            raise ValueError(f"unknown attention mode {ctx.mode!r}")
        cache = ctx.cache
        # the engine writes (uncommitted until the step commits); attention only reads: the committed prefix from
        # the cache and the new tokens as they are, or an uncompressed GPU cache in place, new tokens included
        if ctx.commit or cache.attends_from_storage(self.layer_idx):
            cache.write(self.layer_idx, k, v, ctx.new_valid)
        out = ops.decode_attention(q, cache, self.layer_idx, k, v, ctx.new_valid)
        if ctx.probe is not None:
            ctx.probe(self.layer_idx, q, k, v, out)
        return out.transpose(1, 2).reshape(batch, seq, -1).contiguous(), None


def install(model: nn.Module) -> list[TurboEsmSelfAttention]:
    """Replace every EsmSelfAttention of ``model`` (EsmForMaskedLM or EsmModel) in place; idempotent."""
    esm = getattr(model, "esm", model)
    mods = []
    for i, layer in enumerate(esm.encoder.layer):
        attn = layer.attention
        if not isinstance(attn.self, TurboEsmSelfAttention):
            attn.self = TurboEsmSelfAttention(attn.self, i)
        mods.append(attn.self)
    return mods
