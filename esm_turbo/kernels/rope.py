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


#: channels one program of the packed kernel embeds (pairs of a token and a head × the head's width): on an H200 a
#: 16K-token 650M-shaped batch embeds in 51 µs at 2,048 (52 at 4,096, 65 at 8,192; a copy of the same bytes 47.5 µs;
#: one program per token and 8 heads took 60)
PAIR_ELEMENTS = 2048


@triton.jit
def _rope_packed_kernel(qkv_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, n_pairs, s_tok, s_cos, scale, H: tl.constexpr,
                        D: tl.constexpr, DP: tl.constexpr, P: tl.constexpr):
    """Program i: (token, head) pairs [i·P, (i + 1)·P) of a packed batch, pair t·H + j being head j of token t; q of
    the pair at qkv_ptr + t·s_tok + j·D, k H·D further on. cos, sin [N, D] (row stride s_cos); qo, ko [N, H, D]
    contiguous, so a pair's output row is the pair's index. The same arithmetic as :func:`_embed_rows`."""
    pairs = tl.program_id(0) * P + tl.arange(0, P)
    dims = tl.arange(0, DP)
    tok = pairs // H
    mask = (pairs[:, None] < n_pairs) & (dims[None, :] < D)
    partner = tl.where(dims < D // 2, dims + D // 2, dims - D // 2)
    trig = tok[:, None].to(tl.int64) * s_cos + dims[None, :]
    cos = tl.load(cos_ptr + trig, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + trig, mask=mask, other=0.0).to(tl.float32)
    row = qkv_ptr + tok[:, None].to(tl.int64) * s_tok + (pairs % H)[:, None] * D
    out = pairs[:, None].to(tl.int64) * D + dims[None, :]
    first = dims[None, :] < D // 2
    for part in tl.static_range(2):  # q (scaled first, rounded to its dtype, as transformers does), then k
        x = tl.load(row + part * H * D + dims[None, :], mask=mask, other=0.0)
        xp = tl.load(row + part * H * D + partner[None, :], mask=mask, other=0.0)
        if part == 0:
            x = (x.to(tl.float32) * scale).to(x.dtype)
            xp = (xp.to(tl.float32) * scale).to(xp.dtype)
        xp = tl.where(first, -xp.to(tl.float32), xp.to(tl.float32))
        y = x.to(tl.float32) * cos + xp * sin
        tl.store((qo_ptr if part == 0 else ko_ptr) + out, y.to(qo_ptr.dtype.element_ty), mask=mask)


def rope_packed_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`rope_packed_triton` computes, in PyTorch: qkv [N, 3·H·d], cos, sin [N, d] float32 → q (times
    d ** -0.5, rounded to qkv's dtype), k, each ``x · cos + rotate_half(x) · sin`` in float32 rounded once,
    [N, H, d]."""
    n, width = qkv.shape
    dim = width // 3
    d = dim // heads
    q = (qkv[:, :dim].float() * d ** -0.5).to(qkv.dtype).view(n, heads, d)
    k = qkv[:, dim: 2 * dim].reshape(n, heads, d)
    c, s = cos[:, None, :], sin[:, None, :]

    def rotated(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
        return (x * c + half * s).to(qkv.dtype)
    return rotated(q), rotated(k)


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
    qo = torch.empty(n, heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    ko = torch.empty_like(qo)
    dp = triton.next_power_of_2(head_dim)
    pairs = max(1, PAIR_ELEMENTS // dp)
    if n:
        _rope_packed_kernel[(triton.cdiv(n * heads, pairs),)](qkv, cos, sin, qo, ko, n * heads, qkv.stride(0),
                                                              cos.stride(0), head_dim ** -0.5, H=heads, D=head_dim,
                                                              DP=dp, P=pairs, num_warps=4, enable_fp_fusion=False)
    return qo, ko
