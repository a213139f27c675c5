"""One dispatch seam: CUDA tensors go to the Triton kernels, everything else to the PyTorch reference.

Set ``ESM_TURBO_FORCE_REFERENCE=1`` (or call :func:`force_reference`) to use the reference everywhere.
"""

from __future__ import annotations

import os

import torch

from .reference import attend, decode_attention_reference

_FORCE_REFERENCE = False


def force_reference(flag: bool = True) -> None:
    """Force (or stop forcing) the PyTorch reference path, also on CUDA."""
    global _FORCE_REFERENCE
    _FORCE_REFERENCE = bool(flag)


def use_kernels(t: torch.Tensor) -> bool:
    if _FORCE_REFERENCE or os.environ.get("ESM_TURBO_FORCE_REFERENCE", "0") not in ("", "0"):
        return False
    if not t.is_cuda:
        return False
    from ..kernels import triton_available
    return triton_available()


def decode_attention(q: torch.Tensor, cache, layer: int, k_new: torch.Tensor, v_new: torch.Tensor,
                     new_valid: torch.Tensor) -> torch.Tensor:
    """Attention of new tokens over the compressed prefix of ``layer`` plus themselves.

    q, k_new, v_new: [B, H, S, d]; new_valid: [B, S] bool. Returns [B, H, S, d].
    """
    if use_kernels(q):
        from ..kernels.decode import decode_attention_fused, supports
        if supports(cache, layer):
            return decode_attention_fused(q, cache, layer, k_new, v_new, new_valid)
    return decode_attention_reference(q, cache, layer, k_new, v_new, new_valid)


__all__ = ["attend", "decode_attention", "decode_attention_reference", "force_reference", "use_kernels"]
