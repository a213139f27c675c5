"""The matrix products of a few rows (a decode step's 16–512), split along K so that every multiprocessor reads
its share of the weights: ``y = x wᵀ + b`` [M, N] from x [M, K] and w [N, K] (fp16 or bf16), finished by the same
epilogue as :func:`~esm_turbo.kernels.gemm.gemm` (``"bias"``, ``"gelu"``, ``"residual"``, ``"rope"``;
:func:`~.gemm._part`). Reached through ``gemm(..., split=SplitTile(...))``, and from a fused block's plain products at
up to :data:`SPLIT_ROWS` rows (0 unless set: :func:`step_tile`).

Measured on an H200 (``tools/tune_split.py``, ``results/gpu/split_h200.txt``), the kernel before its present form
ran slower than cuBLAS at every step shape of 650M and 3B at 16–256 rows, its best launch 1.0–2.8× cuBLAS's time,
and slower with each doubling of the split. Built for sm_90 that form spilled 40, 976 and 2,584 bytes a thread at
splits 2, 4 and 8 (none unsplit): its last program added the partials in an unrolled loop, all SPLIT tiles' loads in
flight at once, over 64-bit addresses of a [split, M, N] layout. The present form lays each tile's partials
contiguous ([tiles, split, BM, BN], whole tiles, no masks) and adds them in a loop that is not unrolled: 128
registers a thread at 64 × 128 tiles and no spills at any split. It has not yet been timed on a GPU, so the
library's products still never take it by default (``docs/kernels.md``).

At a step's rows a product reads its weight once and does little arithmetic a byte (195 rows: about the ridge of an
H200), so its time could be one read of the weight if the whole GPU read it. A tile grid over the output alone
leaves most multiprocessors idle (a [195, 1280] output is 40 tiles of 64 × 128 on 132 multiprocessors), so the grid
here is (output column tiles, row tiles, ``split``): program (j, i, s) sums the s-th of ``split`` equal runs of K into
a float32 partial, counts its arrival, and the tile's last program to arrive adds the partials in split order (the
same sums on every run, eager or replayed) and finishes the tile (the count set back to zero for the next launch,
:func:`~esm_turbo.kernels.common.split_counters`). ``split`` = 1 is a plain tiled product, no partials.

:func:`plan` picks a launch (:class:`SplitTile`) from the shape and the multiprocessors. Reference:
:func:`~esm_turbo.kernels.gemm.gemm_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .common import interpreting, num_sms, split_counters
from .gemm import EPILOGUES, _part
from .weights.matmul import _last_to_arrive


@dataclass(frozen=True)
class SplitTile:
    """One launch: the output tile (bm × bn), the K step, the runs of K (split), stages and warps."""

    bm: int = 64
    bn: int = 128
    bk: int = 64
    split: int = 1
    stages: int = 4
    warps: int = 4


#: programs a multiprocessor the split aims at, and the fewest K steps a run keeps
WAVES = 2
MIN_K_STEPS = 4
#: the most rows at which a block's plain fp16/bf16 products run here (:func:`step_tile`), not in cuBLAS: 0, none
SPLIT_ROWS = 0
#: the epilogues a split product folds
SPLIT_EPILOGUES = ("bias", "gelu", "gelu_tanh", "residual", "rope")


def plan(m: int, n: int, k: int, sms: int, bn: int = 128, bk: int = 64) -> SplitTile:
    """The launch for an [m, k] × [n, k]ᵀ product: rows in tiles of 16–64 (64 from 64 rows), ``bn`` output
    columns, and K split into the fewest equal runs (a power of two, each at least :data:`MIN_K_STEPS` steps of
    ``bk``) that give :data:`WAVES` programs a multiprocessor."""
    bm = min(64, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = triton.cdiv(k, bk)
    split = 1
    while tiles * split < WAVES * sms and steps // (2 * split) >= MIN_K_STEPS:
        split *= 2
    return SplitTile(bm, bn, bk, split)


def step_tile(x: torch.Tensor, w: torch.Tensor, epilogue: str) -> SplitTile | None:
    """The launch a step's product x [M, K] × w [N, K]ᵀ takes here (:func:`plan`'s; 8 warps for the rotary epilogue
    from 64-row tiles), or None where it does not: off the GPU (but under Triton's interpreter), past
    :data:`SPLIT_ROWS` rows, an epilogue not in :data:`SPLIT_EPILOGUES`, or x and w not of one dtype (fp16/bf16 on
    the GPU)."""
    if x.shape[0] > SPLIT_ROWS or epilogue not in SPLIT_EPILOGUES or w.dtype != x.dtype:
        return None
    if not (x.dtype in (torch.float16, torch.bfloat16) if x.is_cuda else interpreting()):
        return None
    tile = plan(x.shape[0], w.shape[0], w.shape[1], num_sms(x.device))
    if epilogue == "rope" and tile.bm >= 64:  # 4 warps rotating [64, 128] spill (sm_90 build); 8 do not
        tile = replace(tile, warps=8)
    return tile


@triton.jit
def tile_product(a_ptr, w_ptr, offs_m, offs_n, M, N, K, stride_am, stride_wn, k_lo, k_hi, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, A_CACHE: tl.constexpr):
    """Rows ``offs_m`` [BM] of a [M, K] times rows ``offs_n`` [BN] of w [N, K]ᵀ over K's run [k_lo, k_hi) in steps of
    BK (rows ``stride_am`` / ``stride_wn`` apart, K contiguous; rows past M or N read row 0, K past K zeros): the
    float32 sums [BM, BN]. ``A_CACHE``: a's loads' cache modifier (``".cg"`` where other programs of the launch wrote
    a)."""
    offs_k = tl.arange(0, BK)
    a_at = a_ptr + tl.where(offs_m < M, offs_m, 0).to(tl.int64)[:, None] * stride_am + (k_lo + offs_k)[None, :]
    w_at = w_ptr + tl.where(offs_n < N, offs_n, 0).to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = offs_k[None, :] < K - k0
        a = tl.load(a_at, mask=k_ok, other=0.0, cache_modifier=A_CACHE)
        w = tl.load(w_at, mask=k_ok, other=0.0)
        acc = tl.dot(a, w.T, acc)
        a_at += BK
        w_at += BK
    return acc


@triton.jit
def _split_gemm_kernel(a_ptr, w_ptr, c_ptr, bias_ptr, res_ptr, part_ptr, count_ptr, cos_ptr, sin_ptr, M, N, K,
                       stride_am, stride_wn, stride_cm, stride_rm, stride_cos, q_cols, res_scale, q_scale,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, EPI: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, GELU: tl.constexpr, HD: tl.constexpr):
    """Grid (cdiv(N, BN), cdiv(M, BM), SPLIT): program (j, i, s) multiplies rows [i·BM, (i + 1)·BM) of x by columns
    [j·BN, (j + 1)·BN) of wᵀ over the s-th run of K (runs of whole BK steps; the last may be shorter or empty), then
    stores a partial (SPLIT > 1, the last to arrive finishes) or finishes the tile (``_part``: the rotary epilogue
    over whole heads of HD in the tile's BN columns, or ``_finish``)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    s = tl.program_id(2)
    steps = tl.cdiv(tl.cdiv(K, BK), SPLIT)
    k_lo = s * steps * BK
    k_hi = tl.minimum(K, k_lo + steps * BK)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tile_product(a_ptr, w_ptr, offs_m, offs_n, M, N, K, stride_am, stride_wn, k_lo, k_hi, BM, BN, BK, "")
    finish = True
    if SPLIT > 1:  # partials [tiles, SPLIT, BM, BN]: a tile's runs contiguous, whole tiles (no masks)
        tile = pid_m * tl.num_programs(0) + pid_n
        inner = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        parts = part_ptr + tile.to(tl.int64) * (SPLIT * BM * BN)
        tl.store(parts + s * (BM * BN) + inner, acc)
        finish = _last_to_arrive(count_ptr + tile, SPLIT)
        if finish:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for t in range(SPLIT):  # a loop, not unrolled: SPLIT tiles' loads in flight at once spill registers
                acc += tl.load(parts + t * (BM * BN) + inner, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)  # every run has counted: zero again for the next launch
    if finish:
        _part(acc, offs_m, offs_n, M, N, c_ptr, stride_cm, bias_ptr, res_ptr, stride_rm, res_scale, c_ptr, c_ptr,
              c_ptr, 0, 1, cos_ptr, sin_ptr, stride_cos, q_cols, q_scale, EPI, HAS_BIAS, False, SCALED, False, GELU,
              BM, BN, HD)


def split_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, epilogue: str,
               residual: torch.Tensor | None, residual_scale: float, gelu_form: int,
               tile: SplitTile | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
               head_dim: int = 2) -> torch.Tensor:
    """The product into ``out`` [M, N] (x [M, K], w [N, K], K contiguous; rope (cos, sin) [M, head_dim] float32 for
    ``"rope"``; checked by the caller, :func:`~esm_turbo.kernels.gemm.gemm`); ``tile`` None: :func:`plan`'s."""
    m, k = x.shape
    n = w.shape[0]
    tile = tile or plan(m, n, k, num_sms(x.device))
    grid = (triton.cdiv(n, tile.bn), triton.cdiv(m, tile.bm), tile.split)
    parts = (torch.empty(grid[0] * grid[1] * tile.split * tile.bm * tile.bn, device=x.device, dtype=torch.float32)
             if tile.split > 1 else out)
    counts = split_counters(grid[0] * grid[1], x.device) if tile.split > 1 else out
    cos, sin = rope if rope is not None else (out, out)
    _split_gemm_kernel[grid](
        x, w, out, bias if bias is not None else out, residual if residual is not None else out, parts, counts, cos,
        sin, m, n, k, x.stride(0), w.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0,
        cos.stride(0) if rope is not None else 0, n // 3, float(residual_scale), head_dim ** -0.5, BM=tile.bm,
        BN=tile.bn, BK=tile.bk, SPLIT=tile.split, EPI=EPILOGUES[epilogue], HAS_BIAS=bias is not None,
        SCALED=residual_scale != 1.0, GELU=gelu_form, HD=head_dim, num_warps=tile.warps, num_stages=tile.stages,
        enable_fp_fusion=rope is None)
    return out


__all__ = ["SPLIT_ROWS", "SplitTile", "plan", "split_gemm", "step_tile", "tile_product"]
