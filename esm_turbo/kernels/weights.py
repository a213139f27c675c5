"""4-bit quantized weights on the GPU (Triton): the fused dequantize-and-multiply ``out = x_rot Ŵ_rotᵀ`` where
``Ŵ_rot[m, k] = codebook[code[m, k]] · scale[m, k / group]``, the rotation of the input per group, and the
dequantization of a whole weight back to the original domain for many rows. The PyTorch references with the same
contracts are :func:`matmul_reference`, ``QuantizedLinear.rotate_input`` and ``QuantPass.decode``;
``esm_turbo.weights.linear.QuantizedLinear`` picks between them.

The matmul, for a few rows (:data:`GEMV_ROWS`) on the CUDA cores (``_gemv_kernel``): each byte's two codes are looked
up in the layer's 16-entry codebook (L1) and multiplied by the even and odd input channels, scaled per element and
summed once at the end. For more rows on the tensor cores (``_dequant_matmul_kernel``): each program owns a [BLOCK_B,
BLOCK_M] tile of the output and walks the input channels BLOCK_K at a time, the codes of its rows split in registers,
looked up, scaled per (row, group) and fed to a dot with the input tile. Both add a bias and an earlier pass's output
in the epilogue; the dequantized weight never reaches global memory. A rotation (the layer's Hadamard matrix, ±1
entries) is one small dot per group of channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP_FUSION, interpreting


@triton.jit
def _weight_tile(codes_ptr, cb_ptr, scales_ptr, offs_m, mmask, k0, N, G, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, DTYPE: tl.constexpr):
    """Ŵ_rot[offs_m, k0 : k0 + BLOCK_K] as DTYPE [BLOCK_M, BLOCK_K]: each code (two input channels a byte, the first in
    the low nibble) looked up in the 16-entry codebook, then scaled per (row, group) in DTYPE (a 16-bit product
    rounded once, as a float32 product cast to 16 bits is)."""
    offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(codes_ptr + offs_m[:, None].to(tl.int64) * (N // 2) + offs_h[None, :], mask=mmask[:, None],
                   other=0).to(tl.int32)
    w = tl.load(cb_ptr + tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_M, BLOCK_K)))  # 2j: low nibble, 2j+1: high
    SUB: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # channels per scale within a tile
    NG: tl.constexpr = BLOCK_K // SUB
    groups = (k0 + tl.arange(0, NG) * SUB) // GROUP
    scale = tl.load(scales_ptr + offs_m[:, None].to(tl.int64) * G + groups[None, :], mask=mmask[:, None], other=0.0)
    return tl.reshape(tl.reshape(w.to(DTYPE), (BLOCK_M, NG, SUB)) * scale[:, :, None].to(DTYPE), (BLOCK_M, BLOCK_K))


@triton.jit
def _turn(t, sign_ptr, rot_scale, ROWS: tl.constexpr, COLS: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr):
    """t [ROWS, COLS] with each group of D columns times ``sign`` [D, D] (a Hadamard rotation's ±1 entries, exact in
    any float type), then ``rot_scale``: float32 [ROWS, COLS]. A float32 t is split into fp16 halves for the tensor
    cores (fp32 accuracy), unless PRECISION is ``ieee``."""
    offs = tl.arange(0, D)
    sign = tl.load(sign_ptr + offs[:, None] * D + offs[None, :])
    rows = tl.reshape(t, (ROWS * (COLS // D), D))
    if t.dtype == tl.float32 and PRECISION != "ieee":
        hi = rows.to(tl.float16)
        lo = (rows - hi.to(tl.float32)).to(tl.float16)
        sign = sign.to(tl.float16)
        turned = tl.dot(lo, sign, tl.dot(hi, sign))
    else:
        turned = tl.dot(rows, sign.to(t.dtype), input_precision=PRECISION)
    return tl.reshape(turned, (ROWS, COLS)) * rot_scale


@triton.jit
def _finish(acc, offs_r, offs_m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    """The matmuls' epilogue: acc [R, BM] float32 (rows ``offs_r`` of the input, outputs ``offs_m``) + prev [B, M]
    float32 + bias [M], stored into out [B, M] (rows strided by sob; its dtype)."""
    at = offs_r[:, None].to(tl.int64) * sob + offs_m[None, :]
    mask = (offs_r[:, None] < B) & (offs_m[None, :] < M)
    if HAS_PREV:
        acc += tl.load(prev_ptr + at, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_m, mask=offs_m < M, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_matmul_kernel(x_ptr, codes_ptr, cb_ptr, scales_ptr, prev_ptr, bias_ptr, out_ptr, B, M, N, G, sxb, sob,
                           BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                           HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), cdiv(B, BLOCK_B)). x [B, N] (rows strided by sxb; rotated), codes [M, N/2] uint8, scales
    [M, G] fp16, codebook [16] fp16, out [B, M] (rows strided by sob; its dtype) = x Ŵ_rotᵀ (+ prev [B, M] float32,
    + bias [M]). N % BLOCK_K == 0; BLOCK_K and GROUP powers of two."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mmask = offs_m < M
    bmask = offs_b < B
    acc = tl.zeros((BLOCK_B, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_b[:, None].to(tl.int64) * sxb + offs_k[None, :], mask=bmask[:, None], other=0.0)
        w = _weight_tile(codes_ptr, cb_ptr, scales_ptr, offs_m, mmask, k0, N, G, BLOCK_M, BLOCK_K, GROUP, x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    _finish(acc, offs_b, offs_m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV, HAS_BIAS)


@triton.jit
def _gemv_kernel(x_ptr, codes_ptr, cb_ptr, scales_ptr, prev_ptr, bias_ptr, out_ptr, B, M, N, G, sxb, sob,
                 ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A few rows (B ≤ ROWS): grid (cdiv(M, BLOCK_M),). out [B, M] (rows strided by sob; its dtype) = x [B, N]
    (rows strided by sxb) Ŵ_rotᵀ (+ prev [B, M] float32, + bias [M]), on the CUDA cores: each byte's two codes are
    looked up (L1) and multiplied by the even and odd input channels, scaled per element (the scale read through L1
    with them), and summed over the row once at the end. No tensor-core tile, no reshuffle of the codes.
    N % BLOCK_K == 0."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, ROWS)
    mmask = offs_m[:, None] < M
    rmask = offs_r[:, None] < B
    HALF: tl.constexpr = BLOCK_K // 2
    acc = tl.zeros((ROWS, BLOCK_M, HALF), dtype=tl.float32)
    rows = offs_m[:, None].to(tl.int64)
    xrows = offs_r[:, None].to(tl.int64) * sxb
    for k0 in range(0, N, BLOCK_K):
        offs_h = k0 // 2 + tl.arange(0, HALF)
        byte = tl.load(codes_ptr + rows * (N // 2) + offs_h[None, :], mask=mmask, other=0).to(tl.int32)
        scale = tl.load(scales_ptr + rows * G + (2 * offs_h[None, :]) // GROUP, mask=mmask, other=0.0).to(tl.float32)
        lo = tl.load(cb_ptr + (byte & 15)).to(tl.float32) * scale
        hi = tl.load(cb_ptr + (byte >> 4)).to(tl.float32) * scale
        even = tl.load(x_ptr + xrows + 2 * offs_h[None, :], mask=rmask, other=0.0).to(tl.float32)
        odd = tl.load(x_ptr + xrows + 2 * offs_h[None, :] + 1, mask=rmask, other=0.0).to(tl.float32)
        acc += lo[None, :, :] * even[:, None, :] + hi[None, :, :] * odd[:, None, :]
    _finish(tl.sum(acc, axis=2), offs_r, offs_m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV, HAS_BIAS)


@triton.jit
def _rotate_kernel(x_ptr, sign_ptr, rot_scale, out_ptr, B, N, sxb, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(B, BLOCK_B), N / BLOCK_K). out [B, N] (contiguous, its dtype) = each group of GROUP channels of x
    [B, N] (rows strided by sxb) times sign · rot_scale."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    bmask = offs_b[:, None] < B
    x = tl.load(x_ptr + offs_b[:, None].to(tl.int64) * sxb + offs_k[None, :], mask=bmask, other=0.0)
    y = _turn(x, sign_ptr, rot_scale, BLOCK_B, BLOCK_K, GROUP, PRECISION)
    tl.store(out_ptr + offs_b[:, None].to(tl.int64) * N + offs_k[None, :], y.to(out_ptr.dtype.element_ty), mask=bmask)


@triton.jit
def _dequant_kernel(codes_ptr, cb_ptr, scales_ptr, sign_ptr, rot_scale, prev_ptr, out_ptr, M, N, G,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, ROTATE: tl.constexpr,
                    HAS_PREV: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), N / BLOCK_K). out [M, N] (its dtype) = Ŵ_rot, or with ``ROTATE`` the original-domain
    Ŵ (each group of GROUP channels times sign · rot_scale), + prev [M, N] float32."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    mmask = offs_m < M
    w = _weight_tile(codes_ptr, cb_ptr, scales_ptr, offs_m, mmask, k0, N, G, BLOCK_M, BLOCK_K, GROUP, tl.float32)
    if ROTATE:
        w = _turn(w, sign_ptr, rot_scale, BLOCK_M, BLOCK_K, GROUP, PRECISION)
    at = offs_m[:, None].to(tl.int64) * N + k0 + tl.arange(0, BLOCK_K)[None, :]
    if HAS_PREV:
        w += tl.load(prev_ptr + at, mask=mmask[:, None], other=0.0)
    tl.store(out_ptr + at, w.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def sign_matrix(rot: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(S, c) with rot = c·S, S [d, d] float32 of ±1 on rot's device: how the kernels take a Hadamard rotation (made
    once per layer; refused for another matrix)."""
    host = rot.detach().float().cpu()
    c = float(host[0, 0].abs())
    sign = host / c
    if not torch.equal(sign.abs(), torch.ones_like(sign)):
        raise ValueError("the weight kernels rotate by Hadamard matrices (entries ±c) only")
    return sign.contiguous().to(rot.device), c


#: most rows the CUDA-core kernel (``_gemv_kernel``) multiplies by default; more take the tensor-core tiles (at 4
#: rows the two are even over ESM-2's shapes on an H100; at one the CUDA cores are 1.4–2.5× faster)
GEMV_ROWS = 1


def matmul_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """x [B, N] times the 4-bit pass's Ŵ_rotᵀ → [B, M] float32 (PyTorch; the kernel's contract)."""
    from ..quant.packing import unpack_4bit_u8
    m, n = codes.shape[0], x.shape[1]
    w = codebook.float()[unpack_4bit_u8(codes).long()].view(m, scales.shape[1], -1) * scales.float()[:, :, None]
    return x.float() @ w.view(m, n).T


def launch_config(rows: int, out_features: int) -> dict:
    """The tensor-core kernel's launch constants for ``rows`` × ``out_features``: the fastest of a grid timed on an
    H100 (``esm-turbo bench weights --tune`` times it again). Few rows read weights: narrow row blocks (more programs)
    and long input tiles, wider blocks as the layer grows; many rows multiply: 64 × 128 tiles. The CUDA-core kernel's
    (rows of 4 outputs, 256 or 512 input channels a step) were timed the same way."""
    if rows <= 16:
        block_m = 16 if out_features <= 5120 else 32 if out_features <= 10240 else 64
        return dict(block_b=16, block_m=block_m, block_k=64 if block_m == 64 else 256, num_warps=4, num_stages=3)
    block_b = triton.next_power_of_2(min(rows, 64))
    return dict(block_b=block_b, block_m=128 if rows >= 64 else 64, block_k=64, num_warps=4, num_stages=3)


def matmul_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
                  config: dict | None = None, *, bias: torch.Tensor | None = None, prev: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`matmul_reference` in one launch (CUDA, or CPU under Triton's interpreter): x [B, N] (rotated) → [B, M]
    in ``out_dtype``; ``bias`` [M] and ``prev`` [B, M] float32 (an earlier pass) are added in its epilogue.
    ``config`` overrides block_b / block_m / block_k / num_warps / num_stages, and ``gemv`` (the CUDA-core kernel,
    default for up to :data:`GEMV_ROWS` rows) with gemv_m / gemv_k / gemv_warps."""
    b, n = x.shape
    m, groups = scales.shape
    group = n // groups
    cfg = launch_config(b, m)
    cfg.update(config or {})
    while n % cfg["block_k"]:
        cfg["block_k"] //= 2
    if cfg["block_k"] < 16:
        raise ValueError(f"input width {n} is not a multiple of 16")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(b, m, device=x.device, dtype=out_dtype)
    if cfg.get("gemv", b <= GEMV_ROWS):  # a few rows: on the CUDA cores
        block_k = cfg.get("gemv_k", 512 if n >= 5120 else 256)
        while n % block_k:
            block_k //= 2
        _gemv_kernel[(triton.cdiv(m, cfg.get("gemv_m", 4)),)](
            x, codes, codebook, scales, x if prev is None else prev, x if bias is None else bias, out, b, m, n, groups,
            x.stride(0), out.stride(0), ROWS=triton.next_power_of_2(b), BLOCK_M=cfg.get("gemv_m", 4),
            BLOCK_K=block_k, GROUP=group, HAS_PREV=prev is not None, HAS_BIAS=bias is not None,
            num_warps=cfg.get("gemv_warps", 4), enable_fp_fusion=FP_FUSION)
        return out
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(b, cfg["block_b"]))
    _dequant_matmul_kernel[grid](x, codes, codebook, scales, x if prev is None else prev, x if bias is None else bias,
                                 out, b, m, n, groups, x.stride(0), out.stride(0), BLOCK_B=cfg["block_b"],
                                 BLOCK_M=cfg["block_m"], BLOCK_K=cfg["block_k"], GROUP=group,
                                 HAS_PREV=prev is not None, HAS_BIAS=bias is not None, PRECISION=_precision(x),
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=FP_FUSION)
    return out


def rotate_triton(x: torch.Tensor, rotation: tuple[torch.Tensor, float]) -> torch.Tensor:
    """x [B, N] with each group of d channels times c·S (``rotation`` = :func:`sign_matrix` of Πᵀ: x_rot = x_g Πᵀ),
    in x's dtype, one launch. Reference: ``QuantizedLinear.rotate_input``."""
    b, n = x.shape
    group = rotation[0].shape[0]
    block_k = 256  # the largest power of two up to 256 dividing n
    while n % block_k:
        block_k //= 2
    if block_k < group:
        raise ValueError(f"input width {n} is not a multiple of the rotation group {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(b, n, device=x.device, dtype=x.dtype)
    block_b = 16
    _rotate_kernel[(triton.cdiv(b, block_b), n // block_k)](x, rotation[0], rotation[1], out, b, n, x.stride(0),
                                                            BLOCK_B=block_b, BLOCK_K=block_k, GROUP=group,
                                                            PRECISION=_precision(x), num_warps=4,
                                                            enable_fp_fusion=FP_FUSION)
    return out


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
        codes, codebook, scales, sign, c, out if prev is None else prev, out, m, n, groups, BLOCK_M=block_m,
        BLOCK_K=block_k, GROUP=group, ROTATE=rotation is not None, HAS_PREV=prev is not None,
        PRECISION=_precision(out), num_warps=4, enable_fp_fusion=FP_FUSION)
    return out


def _precision(t: torch.Tensor) -> str:
    """A dot's input precision for ``t``'s dtype: fp32 inputs in full (as the interpreter has only that)."""
    return "ieee" if interpreting() or t.dtype == torch.float32 else "tf32"
