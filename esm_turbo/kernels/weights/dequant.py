"""A whole 4-bit weight dequantized back to its original domain (Triton), for many rows, where cuBLAS then multiplies;
reference ``QuantPass.decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP_FUSION, interpreting
from .lookup import _weight_tile
from .rotate import _precision, _turn


@triton.jit
def _dequant_kernel(codes_ptr, cb_ptr, scales_ptr, sign_ptr, rot_scale, prev_ptr, out_ptr, M, N, G,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, ROTATE: tl.constexpr,
                    HAS_PREV: tl.constexpr, PRECISION: tl.constexpr, LUT: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), N / BLOCK_K). out [M, N] (its dtype) = Ŵ_rot, or with ``ROTATE`` the original-domain
    Ŵ (each group of GROUP channels times sign · rot_scale), + prev [M, N] float32. codes [M, N/8] int32."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    mmask = offs_m < M
    w = _weight_tile(codes_ptr, cb_ptr, scales_ptr, offs_m, mmask, k0, N, G, BLOCK_K, GROUP, tl.float32, LUT)
    if ROTATE:
        w = _turn(w, sign_ptr, rot_scale, BLOCK_M, BLOCK_K, GROUP, PRECISION)
    at = offs_m[:, None].to(tl.int64) * N + k0 + tl.arange(0, BLOCK_K)[None, :]
    if HAS_PREV:
        w += tl.load(prev_ptr + at, mask=mmask[:, None], other=0.0)
    tl.store(out_ptr + at, w.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def dequantize_triton(codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, dtype: torch.dtype,
                      *, rotation: tuple[torch.Tensor, float] | None = None,
                      prev: torch.Tensor | None = None) -> torch.Tensor:
    """Ŵ_rot [M, N] in ``dtype`` (one launch), or with ``rotation`` = :func:`sign_matrix` of Π the original-domain Ŵ
    (each group of d channels times Π); ``prev`` [M, N] float32 (an earlier pass) added. Reference:
    ``QuantPass.decode`` (then ``@ Π``)."""
    m, groups = scales.shape
    n = codes.shape[1] * 2
    group = n // groups
    block_k = max(64, group)
    if n % block_k:
        block_k = group
    out = torch.empty(m, n, device=codes.device, dtype=dtype)
    sign, c = rotation if rotation is not None else (out, 1.0)
    block_m = 64
    _dequant_kernel[(triton.cdiv(m, block_m), n // block_k)](
        codes.view(torch.int32), codebook, scales, sign, c, out if prev is None else prev, out, m, n, groups,
        BLOCK_M=block_m, BLOCK_K=block_k, GROUP=group, ROTATE=rotation is not None, HAS_PREV=prev is not None,
        PRECISION=_precision(out), LUT=not interpreting(), num_warps=4, enable_fp_fusion=FP_FUSION)
    return out
