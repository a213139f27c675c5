"""Placeholder seam for the fused Triton decode-attention kernel (GPU issue): nothing is fused yet,
so ``supports`` answers False and dispatch stays on the PyTorch reference."""

from __future__ import annotations


def supports(cache, layer: int) -> bool:
    return False


def decode_attention_fused(*args, **kwargs):
    raise NotImplementedError("the fused Triton decode kernel is not built yet; the reference path is used")
