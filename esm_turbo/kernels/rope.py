"""ESM-2's query scaling and rotary position embedding of a decode step's new tokens, q and k in one launch (Triton).
Reference: ``esm_turbo.ops.reference.rope_reference``, transformers' own ``apply_rotary_pos_emb`` after the query's
``head_dim ** -0.5`` scaling, which the kernel reproduces bit for bit (the same roundings, products and sums in
float32, no fused multiply-add).

Eagerly, that reference is about fifteen small launches a layer (casts, slices, a concatenation, products, a sum), a
large share of a small-batch decode step's time on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _embed_rows(x_ptr, out_ptr, cos, sin, b, s, S, sxb, sxs, scale, offs_h, offs_d, partner, H: tl.constexpr,
                D: tl.constexpr, SCALE: tl.constexpr):
    """Heads ``offs_h`` [BH] of token (b, s) of x [B, S, H·D] (strides sxb, sxs; channels contiguous) → out
    [B, S, H, D] contiguous: x (times ``scale``, rounded to x's dtype, with ``SCALE``) · cos + rotate_half(x) · sin,
    in float32, stored in out's dtype. cos, sin [1, DP] float32; ``partner`` [DP]: the channel rotate_half reads."""
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    row = x_ptr + b.to(tl.int64) * sxb + s.to(tl.int64) * sxs + offs_h[:, None] * D
    x = tl.load(row + offs_d[None, :], mask=mask, other=0.0)
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0)
    if SCALE:  # q * head_dim ** -0.5 in x's dtype, as transformers scales before the embedding
        x = (x.to(tl.float32) * scale).to(x.dtype)
        xp = (xp.to(tl.float32) * scale).to(xp.dtype)
    xp = tl.where(offs_d[None, :] < D // 2, -xp.to(tl.float32), xp.to(tl.float32))
    y = x.to(tl.float32) * cos + xp * sin
    at = ((b * S + s).to(tl.int64) * H + offs_h[:, None]) * D + offs_d[None, :]
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, S, sqb, sqs, skb, sks, scb, scs, scale,
                 H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr):
    """Grid (B·S, cdiv(H, BH)). Program (t, j): token t = (b, s), heads [j·BH, (j + 1)·BH) of q and of k (see
    :func:`rope_triton`); cos, sin [B, S, D] (strides scb, scs) of the token's position."""
    t = tl.program_id(0)
    b, s = t // S, t % S
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, DP)
    partner = tl.where(offs_d < D // 2, offs_d + D // 2, offs_d - D // 2)
    dmask = offs_d < D
    at = b.to(tl.int64) * scb + s.to(tl.int64) * scs + offs_d
    cos = tl.load(cos_ptr + at, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + at, mask=dmask, other=0.0).to(tl.float32)[None, :]
    _embed_rows(q_ptr, qo_ptr, cos, sin, b, s, S, sqb, sqs, scale, offs_h, offs_d, partner, H, D, True)
    _embed_rows(k_ptr, ko_ptr, cos, sin, b, s, S, skb, sks, scale, offs_h, offs_d, partner, H, D, False)


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.reference.rope_reference`` in one launch (CUDA, or CPU under Triton's interpreter). q, k may be column
    slices of a wider output (a shared q/k/v launch's); the results are [B, H, S, d] views of [B, S, H, d] buffers,
    the layout the reference's transposes give."""
    b, s, width = q.shape
    heads = width // head_dim
    if width % head_dim or k.shape != q.shape or cos.shape != (b, s, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"q, k {tuple(q.shape)}, {tuple(k.shape)} and cos, sin {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)} do not describe {head_dim}-wide heads of one batch")
    q, k, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin))
    qo = torch.empty(b, s, heads, head_dim, device=q.device, dtype=q.dtype)
    ko = torch.empty_like(qo)
    dp = triton.next_power_of_2(head_dim)
    bh = min(triton.next_power_of_2(heads), max(1, 512 // dp))
    _rope_kernel[(b * s, triton.cdiv(heads, bh))](q, k, cos, sin, qo, ko, s, q.stride(0), q.stride(1), k.stride(0),
                                                  k.stride(1), cos.stride(0), cos.stride(1), head_dim ** -0.5,
                                                  H=heads, D=head_dim, DP=dp, BH=bh, num_warps=4,
                                                  enable_fp_fusion=False)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def rope_packed_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same embedding for a packed batch (FastEsm): qkv [N, 3·H·d] (q, k, v side by side, as the fused
    projection writes them; rows may be strided), cos, sin [N, d] float32 of each token's position. Returns q (scaled
    by d ** -0.5, as transformers scales it) and k, [N, H, d] contiguous."""
    n, width = qkv.shape
    dim = width // 3
    head_dim = dim // heads
    if width % 3 or dim % heads or cos.shape != (n, head_dim) or sin.shape != cos.shape or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} and cos, sin {tuple(cos.shape)}, {tuple(sin.shape)} do not describe "
                         f"{heads} heads of a packed batch")
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    qo = torch.empty(1, n, heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    ko = torch.empty_like(qo)
    dp = triton.next_power_of_2(head_dim)
    bh = min(triton.next_power_of_2(heads), max(1, 512 // dp))
    q, k = qkv[:, :dim], qkv[:, dim: 2 * dim]
    _rope_kernel[(n, triton.cdiv(heads, bh))](q, k, cos, sin, qo, ko, n, 0, q.stride(0), 0, k.stride(0), 0,
                                              cos.stride(0), head_dim ** -0.5, H=heads, D=head_dim, DP=dp, BH=bh,
                                              num_warps=4, enable_fp_fusion=False)
    return qo[0], ko[0]
