"""Attention over a packed token stream: every sequence attends only to itself, no padding.

``varlen_attention`` takes queries, keys and values of all sequences one after another
(``[N, H, d]``) with their boundaries ``cu_seqlens`` ([S + 1] int32, ``cu_seqlens[s]`` the first
token of sequence ``s``). On CUDA in fp16/bf16 it runs flash-attention's variable-length kernel
(``torch.nn.attention.varlen``, falling back to the aten op on older PyTorch); everywhere else
``varlen_attention_reference``: scaled-dot-product attention once per sequence, the PyTorch
reference the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # PyTorch >= 2.9
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older PyTorch: the aten op the public function wraps
    _varlen_attn = None

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               lengths: list[int]) -> torch.Tensor:
    """Softmax attention within each sequence. ``q, k, v``: [N, H, d]; ``lengths``: tokens per
    sequence (summing to N). Returns [N, H, d] in q's dtype; scale 1/sqrt(d)."""
    out = torch.empty_like(q)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        out[sl] = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                                                 v[sl].transpose(0, 1)).transpose(0, 1)
        start += n
    return out


def flash_available(q: torch.Tensor) -> bool:
    """Whether the flash variable-length kernel can take ``q`` (CUDA, fp16/bf16, head dim ≤ 256, % 8)."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in FLASH_DTYPES and d % 8 == 0 and d <= 256


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, lengths: list[int]) -> torch.Tensor:
    """Attention of each sequence of a packed batch to itself (scale 1/sqrt(d)).

    q, k, v: [N, H, d]; cu_seqlens: [S + 1] int32 on q's device; max_seqlen: the longest sequence;
    lengths: the same boundaries on the host (for the reference path). Returns [N, H, d].
    """
    if not flash_available(q):
        return varlen_attention_reference(q, k, v, lengths)
    if _varlen_attn is not None:
        return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return torch.ops.aten._flash_attention_forward(  # pragma: no cover - PyTorch < 2.9
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False)[0]


__all__ = ["flash_available", "varlen_attention", "varlen_attention_reference"]
