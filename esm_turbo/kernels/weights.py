"""Fused dequantize-and-multiply for 4-bit quantized weights (Triton): ``out = x_rot Ŵ_rotᵀ`` where
``Ŵ_rot[m, k] = codebook[code[m, k]] · scale[m, k / group]``, one pass. The PyTorch reference with the same
contract is :func:`matmul_reference`; ``esm_turbo.weights.linear.QuantizedLinear`` rotates the input (batched over
its groups) and sums the passes.

Each program owns a [BLOCK_B, BLOCK_M] tile of the output and walks the input channels BLOCK_K at a time: the packed
codes of its rows (two per byte, the first in the low nibble) are split in registers, looked up in the layer's
16-entry codebook (L1), scaled per (row, group) and fed to a tensor-core dot with the input tile. The dequantized
weight never reaches global memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP_FUSION, interpreting


@triton.jit
def _dequant_matmul_kernel(x_ptr, codes_ptr, scales_ptr, cb_ptr, out_ptr, B, M, N, G, sxb, sob,
                           BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                           PRECISION: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), cdiv(B, BLOCK_B)). x [B, N] (rows strided by sxb), codes [M, N/2] uint8, scales
    [M, G] fp16, codebook [16] fp16, out [B, M] float32 (rows strided by sob). N % BLOCK_K == 0; BLOCK_K and GROUP
    powers of two."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mmask = offs_m < M
    bmask = offs_b < B
    SUB: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # channels per scale within a tile
    NG: tl.constexpr = BLOCK_K // SUB
    acc = tl.zeros((BLOCK_B, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_b[:, None].to(tl.int64) * sxb + offs_k[None, :], mask=bmask[:, None], other=0.0)
        offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(codes_ptr + offs_m[:, None].to(tl.int64) * (N // 2) + offs_h[None, :], mask=mmask[:, None],
                       other=0).to(tl.int32)
        idx = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_M, BLOCK_K))  # value 2j: low nibble, 2j + 1: high
        w = tl.load(cb_ptr + idx).to(tl.float32)
        groups = (k0 + tl.arange(0, NG) * SUB) // GROUP
        scale = tl.load(scales_ptr + offs_m[:, None].to(tl.int64) * G + groups[None, :], mask=mmask[:, None],
                        other=0.0).to(tl.float32)
        w = tl.reshape(tl.reshape(w, (BLOCK_M, NG, SUB)) * scale[:, :, None], (BLOCK_M, BLOCK_K))
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    tl.store(out_ptr + offs_b[:, None].to(tl.int64) * sob + offs_m[None, :], acc,
             mask=bmask[:, None] & mmask[None, :])


def matmul_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """x [B, N] times the 4-bit pass's Ŵ_rotᵀ → [B, M] float32 (PyTorch; the kernel's contract)."""
    from ..quant.packing import unpack_4bit_u8
    m, n = codes.shape[0], x.shape[1]
    w = codebook.float()[unpack_4bit_u8(codes).long()].view(m, scales.shape[1], -1) * scales.float()[:, :, None]
    return x.float() @ w.view(m, n).T


def launch_config(rows: int, out_features: int) -> dict:
    """Launch constants for ``rows`` × ``out_features``: the fastest of ``esm-turbo bench weights --tune``'s grid on
    an H100 (results/weights/bench_weights_h100.txt). Few rows read weights: narrow row blocks (more programs) and
    long input tiles, wider blocks as the layer grows; many rows multiply: 64 × 128 tiles."""
    if rows <= 16:
        block_m = 16 if out_features <= 5120 else 32 if out_features <= 10240 else 64
        return dict(block_b=16, block_m=block_m, block_k=256 if block_m == 16 else 128, num_warps=4, num_stages=3)
    block_b = triton.next_power_of_2(min(rows, 64))
    return dict(block_b=block_b, block_m=128 if rows >= 64 else 64, block_k=64, num_warps=4, num_stages=3)


def matmul_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
                  config: dict | None = None) -> torch.Tensor:
    """:func:`matmul_reference` in one launch (CUDA, or CPU under Triton's interpreter). ``config`` overrides
    block_b / block_m / block_k / num_warps / num_stages."""
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
    out = torch.empty(b, m, device=x.device, dtype=torch.float32)
    precision = "ieee" if interpreting() or x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(b, cfg["block_b"]))
    _dequant_matmul_kernel[grid](x, codes, scales, codebook, out, b, m, n, groups, x.stride(0), out.stride(0),
                                 BLOCK_B=cfg["block_b"], BLOCK_M=cfg["block_m"], BLOCK_K=cfg["block_k"], GROUP=group,
                                 PRECISION=precision, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                 enable_fp_fusion=FP_FUSION)
    return out
