"""Fused quantize-and-pack into the cache (Triton): rotation, affine, LUT search, index packing and
sign bits (or one combined code ``2·idx + sign``) in one launch per tensor kind. Reference: ``esm_turbo.ops.compressed.quantize_pack_reference``.

For each (sequence b, head h) and token n < S: ``y = (x Πᵀ − offset) / scale``; ``idx = #{bounds < y}``
(``torch.searchsorted`` semantics); ``sign = y ≥ c[idx]``; both packed into the cache rows
``pos[b] + n`` (the layout of ``esm_turbo.quant.packing``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_pack_kernel(x_ptr, rot_ptr, offset_ptr, scale_ptr, bounds_ptr, cent_ptr,
                          idx_ptr, sign_ptr, pos_ptr,
                          B, H, S, T_CAP,
                          D: tl.constexpr, BITS: tl.constexpr, SIGN: tl.constexpr, COMBINE: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (H, cdiv(B·S, BLOCK_N)): one head's Π serves BLOCK_N tokens drawn from every sequence, so a
    decode step (S = 1, large B) loads each rotation a few times instead of once per sequence."""
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # token index over (b, s)
    nmask = offs_n < B * S
    b = offs_n // S
    s_in = offs_n % S
    offs_d = tl.arange(0, D)

    x_rows = ((b * H + h) * S + s_in).to(tl.int64)
    x = tl.load(x_ptr + x_rows[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
    rot = tl.load(rot_ptr + h * D * D + offs_d[:, None] * D + offs_d[None, :])  # Π[e, d]
    y = tl.dot(x, tl.trans(rot), input_precision=PRECISION)
    y = (y - tl.load(offset_ptr + h * D + offs_d)[None, :]) / tl.load(scale_ptr + h * D + offs_d)[None, :]

    K: tl.constexpr = 1 << BITS
    idx = tl.zeros((BLOCK_N, D), dtype=tl.int32)
    for k in tl.static_range(K - 1):
        idx += (y > tl.load(bounds_ptr + h * (K - 1) + k)).to(tl.int32)

    D8: tl.constexpr = D // 8
    g = tl.arange(0, D8)
    r = tl.arange(0, 8)
    pos = tl.load(pos_ptr + b, mask=nmask, other=0)
    rows = (b * H + h).to(tl.int64) * T_CAP + pos + s_in  # cache rows
    if SIGN:
        s = (y >= tl.load(cent_ptr + h * K + idx)).to(tl.int32)
        if COMBINE:  # one code 2·idx + sign of BITS + 1 bits
            idx = idx * 2 + s
        else:
            sword = tl.sum(tl.reshape(s, (BLOCK_N, D8, 8)) << r[None, None, :], axis=2)
            tl.store(sign_ptr + rows[:, None] * D8 + g[None, :], sword.to(tl.uint8), mask=nmask[:, None])
    WIDTH: tl.constexpr = BITS + COMBINE
    NB: tl.constexpr = D * WIDTH // 8
    word = tl.sum(tl.reshape(idx, (BLOCK_N, D8, 8)) << (r * WIDTH)[None, None, :], axis=2)
    if WIDTH == 4:  # a group of 8 codes is one aligned int32
        tl.store(idx_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * D8 + g[None, :], word, mask=nmask[:, None])
    else:
        for i in tl.static_range(WIDTH):
            tl.store(idx_ptr + rows[:, None] * NB + g[None, :] * WIDTH + i,
                     ((word >> (8 * i)) & 255).to(tl.uint8), mask=nmask[:, None])


def quantize_pack_triton(x: torch.Tensor, rot: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor,
                         bounds: torch.Tensor, centroids: torch.Tensor, idx_out: torch.Tensor,
                         sign_out: torch.Tensor, pos: torch.Tensor, bits: int, combine: bool,
                         config: dict | None = None) -> None:
    """Same contract as ``quantize_pack_reference``; CUDA tensors, writes ``idx_out``/``sign_out`` in place.
    ``config`` overrides block_n / num_warps / precision (``ieee`` fp32, or ``tf32x3``) for tuning."""
    batch, heads, s, d = x.shape
    # tuned on an H100 (results/gpu/tune_quantize_h100.txt); tf32x3 keeps fp32 accuracy on tensor cores
    cfg = dict(block_n=64, num_warps=4, precision="tf32x3")
    cfg.update(config or {})
    if x.device.type != "cuda":  # Triton's interpreter (tests) has no tf32x3
        cfg["precision"] = "ieee"
    block_n = cfg["block_n"]
    has_sign = combine or sign_out.numel() > 0
    grid = (heads, triton.cdiv(batch * s, block_n))
    _quantize_pack_kernel[grid](
        x, rot, offset, scale, bounds, centroids, idx_out, sign_out if has_sign else idx_out, pos,
        batch, heads, s, idx_out.shape[2], D=d, BITS=bits, SIGN=has_sign, COMBINE=combine, BLOCK_N=block_n,
        PRECISION=cfg["precision"], num_warps=cfg["num_warps"])
