"""Attention over a packed token stream: every sequence attends only to itself, no padding.

``varlen_attention`` takes queries, keys and values of all sequences one after another
(``[N, H, d]``) with their boundaries ``cu_seqlens`` ([S + 1] int32, ``cu_seqlens[s]`` the first
token of sequence ``s``). On CUDA in fp16/bf16 it runs flash-attention's variable-length kernel
(the aten op behind ``torch.nn.attention.varlen``); everywhere else
one batched scaled-dot-product attention over a padded copy with a key mask. Beside them,
``varlen_attention_reference``: attention once per sequence, the PyTorch reference both are tested
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                               scale: float | None = None) -> torch.Tensor:
    """Softmax attention within each sequence. ``q, k, v``: [N, H, d]; ``lengths``: tokens per
    sequence (summing to N). Returns [N, H, d] in q's dtype; ``scale`` default 1/sqrt(d)."""
    out = torch.empty_like(q)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        out[sl] = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                                                 v[sl].transpose(0, 1), scale=scale).transpose(0, 1)
        start += n
    return out


def padded_layout(positions: torch.Tensor, segment: torch.Tensor, lengths: list[int]) -> tuple:
    """Where each packed token sits in a padded [S, L_max] batch, and which keys are real there:
    (flat index [N] long, key mask [S, 1, 1, L_max] bool, S, L_max). Built once per batch."""
    s, width = len(lengths), max(lengths)
    index = segment.long() * width + positions
    real = torch.tensor(lengths, device=positions.device)
    mask = torch.arange(width, device=positions.device)[None, :] < real[:, None]
    return index, mask[:, None, None, :], s, width


def varlen_attention_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: tuple,
                            scale: float | None = None) -> torch.Tensor:
    """The same attention as one batched SDPA call over a padded copy (the CPU path: one call per layer,
    not one per sequence; batches are length-sorted, so little padding). q, k, v: [N, H, d] → [N, H, d]."""
    index, mask, s, width = layout
    n, heads, d = q.shape

    def pad(x):
        return x.new_zeros(s * width, heads, d).index_copy_(0, index, x).view(s, width, heads, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(s * width, heads, d).index_select(0, index)


def flash_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the flash variable-length kernel takes such inputs (CUDA, fp16/bf16, head dim ≤ 256, % 8)."""
    return device.type == "cuda" and dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, layout: tuple | None = None, scale: float | None = None,
                     blocks=None) -> torch.Tensor:
    """Attention of each sequence of a packed batch to itself (``scale`` default 1/sqrt(d)).

    q, k, v: [N, H, d]; cu_seqlens: [S + 1] int32 on q's device; max_seqlen: the longest sequence;
    layout: :func:`padded_layout` of the batch, for where the flash kernel cannot run; blocks: the batch's
    :func:`~esm_turbo.kernels.varlen_attention.attention_plan`, to run the Triton kernel of tiles cut to the
    sequences instead of flash attention's (short sequences waste less of it on padding), or the Gluon kernel where
    the plan says ``gluon``. Returns [N, H, d].
    """
    if blocks is not None and blocks.gluon:
        from ..kernels.varlen_attention_gluon import varlen_attention_gluon_plan
        return varlen_attention_gluon_plan(q, k, v, blocks, scale)
    if blocks is not None:
        from ..kernels.varlen_attention import varlen_attention_triton
        return varlen_attention_triton(q, k, v, blocks, scale)
    if not flash_available(q.device, q.dtype, q.shape[-1]):
        return varlen_attention_padded(q, k, v, layout, scale)
    # the kernel torch.nn.attention.varlen.varlen_attn wraps, called directly: that module imports torch._dynamo
    # (seconds at every start) for its custom-op registration, which inference does not need
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False, scale=scale)[0]


__all__ = ["flash_available", "padded_layout", "varlen_attention", "varlen_attention_padded",
           "varlen_attention_reference"]
