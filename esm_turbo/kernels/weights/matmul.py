"""The fused dequantize-and-multiply ``out = x_rot Ŵ_rotᵀ`` (Triton), ``Ŵ_rot[m, k] = codebook[code[m, k]] ·
scale[m, k / group]``; reference :func:`matmul_reference`. For one or two rows (:data:`GEMV_ROWS`) on the CUDA cores
(``_gemv_kernel``) the matmul stays in the code words' own layout: each word's eight products with an input row are
summed in float32 and scaled once, reduced once at the end. For more rows on the tensor cores
(``_dequant_matmul_kernel``) each program owns a [BLOCK_B, BLOCK_M] tile of the output and walks its run of input
channels BLOCK_K at a time; a layer with few outputs splits its input channels over programs (float32 partial sums,
added by the last program of each tile to finish). Both add a bias and an earlier pass's output in the epilogue
(then, for FFN up, the GELU); the dequantized weight never reaches global memory. :func:`launch_config` holds the
H100-tuned launch rules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP_FUSION, gelu, interpreting, num_sms, sm90, split_counters
from ..prefetch import prefetch_rows
from .lookup import _code_words, _lookup8, _tile_ahead, _tile_codes, _weight_tile
from .rotate import _precision


@triton.jit
def _finish(acc, rows, outs, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV: tl.constexpr,
            HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """The matmuls' epilogue: acc float32 at input rows ``rows`` and outputs ``outs`` (broadcast to acc's shape: [R, 1]
    and [1, BM] for a tile, a row and [BM], or a pair an element) + prev [B, M] (any float dtype) + bias [M], then with
    ``GELU`` ESM-2's activation (exact, erf), stored into out [B, M] (rows strided by sob; its dtype)."""
    at = rows.to(tl.int64) * sob + outs
    mask = (rows < B) & (outs < M)
    if HAS_PREV:
        acc += tl.load(prev_ptr + at, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=outs < M, other=0.0).to(tl.float32)
    if GELU:
        acc = gelu(acc, 0)  # libdevice's erf: a few rows, where the erf's arithmetic costs nothing
    tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _last_to_arrive(count_ptr, SPLIT: tl.constexpr):
    """After a program stored its partial sums: counts its arrival at ``count_ptr`` (int32, zero before the first of
    the tile's SPLIT programs); whether it is the last, which then adds the partials and stores the count back to
    zero for the next launch."""
    tl.debug_barrier()  # every thread's stores made before the (one-thread, releasing) count
    return tl.atomic_add(count_ptr, 1, sem="acq_rel") == SPLIT - 1


@triton.jit
def _dequant_matmul_kernel(x_ptr, codes_ptr, cb_ptr, scales_ptr, prev_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                           B, M, N, G, sxb, sob, PR, sxp, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP: tl.constexpr, HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr,
                           GELU: tl.constexpr, PRECISION: tl.constexpr, LUT: tl.constexpr, SPLIT: tl.constexpr,
                           AHEAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), cdiv(B, BLOCK_B), SPLIT). x [B, N] (rows strided by sxb; rotated), codes [M, N/8] int32
    (the packed uint8 codes read as words), scales [M, G] fp16, codebook [16] fp16, out [B, M] (rows strided by sob;
    its dtype) = x Ŵ_rotᵀ (+ prev [B, M], + bias [M], GELU: :func:`_finish`). Parts: output rows [p·PR, (p + 1)·PR)
    take codebook p ([M / PR, 16]) and the input x + p·sxp (PR = M, sxp = 0: one part; BLOCK_M divides PR). With
    SPLIT > 1 program (i, j, s) sums the s-th of SPLIT equal runs of input channels into partials [SPLIT, B, M] float32 (``part_ptr``)
    and counts its arrival in ``count_ptr[j·grid(0) + i]`` (int32, zero at launch and left zero); the last of a tile
    adds the SPLIT partials and finishes the tile. N % (SPLIT·BLOCK_K) == 0; BLOCK_K and GROUP powers of two.
    ``AHEAD``: each tile's codes and scales are requested a tile before it is decoded (:func:`_tile_ahead`). ``PDL``
    (a programmatic dependent launch): the next kernel may launch at once, and the first tile's codes (weights) are
    requested before this one waits for the kernel before it to finish. ``PREFETCH``: the program's codes and scales
    are asked into L2 at its start (``kernels.prefetch``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mmask = offs_m < M
    bmask = offs_b < B
    part = tl.program_id(0) * BLOCK_M // PR
    x_ptr += part.to(tl.int64) * sxp
    cb_ptr += part * 16
    RUN = N // SPLIT
    start = tl.program_id(2) * RUN
    acc = tl.zeros((BLOCK_B, BLOCK_M), dtype=tl.float32)
    if PREFETCH:
        prefetch_rows(codes_ptr, offs_m, N // 8, start // 8, RUN // 8, mmask)
        prefetch_rows(scales_ptr, offs_m, G, start // GROUP, (start + RUN + GROUP - 1) // GROUP - start // GROUP, mmask)
    if AHEAD:  # each tile's codes requested a tile before it is decoded, carried in registers
        word, scale = _tile_codes(codes_ptr, scales_ptr, offs_m, mmask, start, N, G, BLOCK_K, GROUP)
    if PDL:  # the input, the sums' buffers and the counts only once the kernel before has finished
        tl.extra.cuda.gdc_wait()
    for k0 in range(start, start + RUN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_b[:, None].to(tl.int64) * sxb + offs_k[None, :], mask=bmask[:, None], other=0.0)
        if AHEAD:
            w, word, scale = _tile_ahead(codes_ptr, cb_ptr, scales_ptr, word, scale, offs_m, mmask, k0, start,
                                         start + RUN, N, G, BLOCK_K, GROUP, x.dtype, LUT)
        else:
            w = _weight_tile(codes_ptr, cb_ptr, scales_ptr, offs_m, mmask, k0, N, G, BLOCK_K, GROUP, x.dtype, LUT)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if SPLIT > 1:  # the partial sum stored; the tile's last program to arrive adds them all and finishes
        at = offs_b[:, None].to(tl.int64) * M + offs_m[None, :]
        mask = bmask[:, None] & mmask[None, :]
        tl.store(part_ptr + tl.program_id(2).to(tl.int64) * B * M + at, acc, mask=mask)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if _last_to_arrive(count_ptr + tile, SPLIT):
            acc = tl.zeros((BLOCK_B, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(part_ptr + s * B * M + at, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(acc, offs_b[:, None], offs_m[None, :], B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV,
                    HAS_BIAS, GELU)
            tl.store(count_ptr + tile, 0)  # every split has counted: zero again for the next launch
    else:
        _finish(acc, offs_b[:, None], offs_m[None, :], B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV,
                HAS_BIAS, GELU)


#: fp16 pair (int32) → its two halves as float32
_HALVES_ASM = tl.constexpr("{\n.reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.f32.f16 $0, l;\ncvt.f32.f16 $1, h;\n}")


@triton.jit
def _input_pair(x32_ptr, offs, mask):
    """Two fp16 channels of the input read as one int32 at ``offs`` (of the int32 view; zeros off ``mask``), as
    float32 (PTX: compiled only)."""
    p = tl.load(x32_ptr + offs, mask=mask, other=0)
    return tl.inline_asm_elementwise(_HALVES_ASM, "=f,=f,r", [p], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x_ptr, offs, rmask, X16: tl.constexpr):
    """Σ_j f_j · x[offs + j] in float32: f0 … f7 float32 [BM, W] (each word's eight weights), the input row's
    channels ``offs`` … ``offs`` + 7 for word column w ([1, W]; with X16 x is fp16, read as four int32 pairs (compiled
    only), else any float read channel by channel); a row off ``rmask`` reads zeros → [BM, W]."""
    if X16:
        x32 = x_ptr.to(tl.pointer_type(tl.int32))
        x0, x1 = _input_pair(x32, offs // 2, rmask)
        x2, x3 = _input_pair(x32, offs // 2 + 1, rmask)
        x4, x5 = _input_pair(x32, offs // 2 + 2, rmask)
        x6, x7 = _input_pair(x32, offs // 2 + 3, rmask)
    else:
        x0 = tl.load(x_ptr + offs, mask=rmask, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + offs + 1, mask=rmask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offs + 2, mask=rmask, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + offs + 3, mask=rmask, other=0.0).to(tl.float32)
        x4 = tl.load(x_ptr + offs + 4, mask=rmask, other=0.0).to(tl.float32)
        x5 = tl.load(x_ptr + offs + 5, mask=rmask, other=0.0).to(tl.float32)
        x6 = tl.load(x_ptr + offs + 6, mask=rmask, other=0.0).to(tl.float32)
        x7 = tl.load(x_ptr + offs + 7, mask=rmask, other=0.0).to(tl.float32)
    d = f0 * x0
    d += f1 * x1
    d += f2 * x2
    d += f3 * x3
    d += f4 * x4
    d += f5 * x5
    d += f6 * x6
    d += f7 * x7
    return d


@triton.jit
def _word_codes(words_ptr, scales_ptr, offs_m, mmask, k0, N, G, W: tl.constexpr, GROUP: tl.constexpr):
    """Ŵ_rot[offs_m, k0 : k0 + 8W]'s code words [BM, W] int32 and each word's scale [BM, W] fp16 (rows off
    ``mmask`` read as zeros)."""
    offs_w = k0 // 8 + tl.arange(0, W)
    scale = tl.load(scales_ptr + offs_m[:, None].to(tl.int64) * G + (offs_w * 8 // GROUP)[None, :], mask=mmask[:, None],
                    other=0.0)
    return _code_words(words_ptr, offs_m, mmask, offs_w, N), scale


@triton.jit
def _gemv_kernel(x_ptr, codes_ptr, cb_ptr, scales_ptr, prev_ptr, bias_ptr, out_ptr, B, M, N, G, sxb, sob, PR, sxp,
                 R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, LUT: tl.constexpr,
                 X16: tl.constexpr, STAGES: tl.constexpr, AHEAD: tl.constexpr):
    """A few rows, R (1, 2 or 4) a pass over the weights: grid (cdiv(M, BLOCK_M),). out [B, M] (rows strided by sob;
    its dtype) = x [B, N] (rows strided by sxb; fp16 read in pairs when X16) Ŵ_rotᵀ (+ prev [B, M], + bias [M],
    GELU: :func:`_finish`), on the CUDA cores and in the code words' own layout: each word's eight codes looked up
    (:func:`_lookup8`) once for the R rows, multiplied by each row's input channels and summed in float32 (:func:`_row_dot`), times the
    word's scale into a float32 [BLOCK_M, BLOCK_K / 8] sum a row, reduced once a pass at the end. codes [M, N/8]
    int32; parts (PR, sxp) and ``AHEAD`` (codes requested a tile ahead) as the tensor-core kernel's.
    N % BLOCK_K == 0."""
    W: tl.constexpr = BLOCK_K // 8
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    part = tl.program_id(0) * BLOCK_M // PR
    x_ptr += part.to(tl.int64) * sxp
    cb_ptr += part * 16
    mmask = offs_m < M
    offs_x = tl.arange(0, W)[None, :] * 8
    for r in range(0, B, R):
        xr = x_ptr + r * sxb  # the pass's first input row: under 2^31 elements
        left = tl.zeros((1, W), dtype=tl.int32) + (B - r)  # rows left from this pass's first
        acc0 = tl.zeros((BLOCK_M, W), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, W), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, W), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, W), dtype=tl.float32)
        if AHEAD:
            word, scale = _word_codes(codes_ptr, scales_ptr, offs_m, mmask, 0, N, G, W, GROUP)
        for k0 in tl.range(0, N, BLOCK_K, num_stages=STAGES):  # STAGES None: the launch's num_stages
            if AHEAD:  # the next tile's codes requested before this one's are decoded (past the end: the first's)
                nxt = k0 + BLOCK_K
                word_n, scale_n = _word_codes(codes_ptr, scales_ptr, offs_m, mmask, tl.where(nxt < N, nxt, 0), N, G,
                                              W, GROUP)
            else:
                word, scale = _word_codes(codes_ptr, scales_ptr, offs_m, mmask, k0, N, G, W, GROUP)
            v0, v1, v2, v3, v4, v5, v6, v7 = _lookup8(word, cb_ptr, LUT)
            f0, f1, f2, f3 = v0.to(tl.float32), v1.to(tl.float32), v2.to(tl.float32), v3.to(tl.float32)
            f4, f5, f6, f7 = v4.to(tl.float32), v5.to(tl.float32), v6.to(tl.float32), v7.to(tl.float32)
            sc = scale.to(tl.float32)
            offs = k0 + offs_x
            acc0 += _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, xr, offs, left > 0, X16) * sc
            if R > 1:
                acc1 += _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, xr + sxb, offs, left > 1, X16) * sc
            if R > 2:
                acc2 += _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, xr + 2 * sxb, offs, left > 2, X16) * sc
                acc3 += _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, xr + 3 * sxb, offs, left > 3, X16) * sc
            if AHEAD:
                word, scale = word_n, scale_n
        row = r + tl.zeros((1,), dtype=tl.int32)  # the pass's first row (a tensor, also under the interpreter)
        _finish(tl.sum(acc0, axis=1), row, offs_m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV, HAS_BIAS,
                GELU)
        if R > 1:
            _finish(tl.sum(acc1, axis=1), row + 1, offs_m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV,
                    HAS_BIAS, GELU)
        if R > 2:
            _finish(tl.sum(acc2, axis=1), row + 2, offs_m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV,
                    HAS_BIAS, GELU)
            _finish(tl.sum(acc3, axis=1), row + 3, offs_m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV,
                    HAS_BIAS, GELU)


#: most rows the CUDA-core kernel (``_gemv_kernel``) multiplies by default; more take the tensor-core tiles
GEMV_ROWS = 2
#: overrides of :func:`launch_config`'s keys (the register-fed kernel's mma_*, ``pdl``, any other) in every launch (a
#: timing study's variants: ``tools/mma_launch_speed.py``)
LAUNCH_OVERRIDES: dict = {}


def matmul_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """x [B, N] times the 4-bit pass's Ŵ_rotᵀ → [B, M] float32 (PyTorch; the kernel's contract)."""
    from ...quant.packing import unpack_4bit_u8
    m, n = codes.shape[0], x.shape[1]
    w = codebook.float()[unpack_4bit_u8(codes).long()].view(m, scales.shape[1], -1) * scales.float()[:, :, None]
    return x.float() @ w.view(m, n).T


def launch_config(rows: int, out_features: int, in_features: int, sms: int = 132) -> dict:
    """Launch constants for ``rows`` × a [out_features, in_features] weight on a GPU of ``sms`` multiprocessors: the
    fastest of grids timed on an H100 (``esm-turbo bench weights --tune`` times one again). Both kernels request each
    tile's codes a tile ahead. One row: the CUDA-core kernel, Triton's software pipelining three deep, 8 outputs × 512
    input channels a program of 4 warps; FFN down (inputs at least twice the outputs) 2 outputs (4 from 2,560 up) ×
    1,024 channels, and 2 warps on 15B-wide layers; a q/k/v stack at least 2,560 wide 2 warps, and 4 outputs × 1,024
    channels on 15B-wide ones. Two rows: the CUDA-core kernel too, both rows in one pass, 2 warps; 8 outputs × 1,024
    channels where the outputs are at least three times the inputs (q/k/v, FFN up), else 4 × 512. Up to 16 rows:
    tensor-core tiles of 16 × 32 outputs (16 for narrow layers) × 128 or 256 input channels, the input channels split
    over at least 2 programs and up to 8, to about 3.6 programs a multiprocessor. More rows multiply: 64 × 128
    tiles. Larger layers take the register-fed tensor-core kernel (``weights_mma``; fp16 input) instead, where it
    measured faster: from 50 M weights at one row, 16 M at two and at 9–16 rows, 4 M at 3–8 rows; 4 warps (8 on a
    square layer), 4 code words a lane and row (2 where the channels ask), FFN down's input channels split over 4
    programs (2 past 8 rows from 5,120 outputs), codes requested a step ahead (over cold weights at 16 rows, as in a
    step, the faster: ``tools/tune_weights_step.py``). Programmatic dependent launch and the L2 prefetch of a
    program's codes (``pdl``, ``prefetch``) are options, off: at a step's 16 rows on an H200 they made the products
    slower (``results/gpu/weights_step_h200.txt``)."""
    m, n = out_features, in_features
    long_input = n >= 2 * m  # FFN down
    if rows > 1:
        gemv = (8, 1024, 2) if m >= 3 * n else (4, 512, 2)
    elif long_input:
        gemv = (2 if m <= 1280 else 4, 1024, 4 if m <= 2560 else 2)
    elif m == 3 * n and n >= 2560:  # q, k and v in one launch
        gemv = (8, 512, 2) if n < 5120 else (4, 1024, 2)
    else:
        gemv = (8, 512, 4)
    cfg = dict(gemv=rows <= GEMV_ROWS, gemv_m=gemv[0], gemv_k=gemv[1], gemv_warps=gemv[2], gemv_stages=3,
               gemv_ahead=1, split=1, ahead=0, pdl=False, prefetch=False)
    cfg |= dict(mma=rows <= 16 and m * n >= (50e6 if rows == 1 else 16e6 if rows == 2 or rows > 8 else 4e6),
                mma_warps=8 if m == n else 4, mma_words=4,
                mma_split=(2 if rows > 8 and m >= 5120 else 4) if long_input else 1,
                mma_ahead=1, mma_maxnreg=None, mma_upfront=False) | LAUNCH_OVERRIDES
    if rows > 16:
        block_b = triton.next_power_of_2(min(rows, 64))
        return cfg | dict(block_b=block_b, block_m=128 if rows >= 64 else 64, block_k=64, num_warps=4, num_stages=3)
    narrow = m < 2560 and not long_input
    cfg |= dict(block_b=16, block_m=16 if narrow else 32,
                block_k=256 if narrow or (long_input and m >= 5120) else 128, num_warps=4,
                num_stages=2 if long_input and m < 2560 else 3, ahead=1)
    programs = triton.cdiv(m, cfg["block_m"]) * triton.cdiv(rows, 16)
    cfg["split"] = min(8, max(2, triton.next_power_of_2(triton.cdiv(int(3.6 * sms), programs))))
    return cfg


def matmul_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
                  config: dict | None = None, *, bias: torch.Tensor | None = None, prev: torch.Tensor | None = None,
                  gelu: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`matmul_reference` in one launch (CUDA, or CPU under Triton's interpreter; a split's partial sums are
    added by the last program of each tile): x [B, N] (rotated) → [B, M] in ``out_dtype``; ``bias`` [M] and ``prev``
    [B, M] contiguous (an earlier pass in float32, or a block's input to add) are added in its epilogue, then with
    ``gelu`` ESM-2's GELU (erf) is applied.
    ``config`` overrides :func:`launch_config`'s block_b / block_m / block_k / num_warps / num_stages / split / ahead,
    ``gemv`` (the CUDA-core kernel) with gemv_m / gemv_k / gemv_warps / gemv_stages / gemv_ahead, and ``mma`` (the
    register-fed tensor-core kernel, taken where :func:`esm_turbo.kernels.weights_mma.mma_fits` and compiled) with
    mma_warps / mma_words / mma_split / mma_ahead / mma_maxnreg / mma_upfront (and mma_probe, a timing study's stage
    left out: wrong results).

    Several linears of one input in one launch (parts): x [P, B, N] (each part's rotation of the input), codebook
    [P·16], and codes, scales and bias the P weights stacked along their rows (M/P each): → [B, M], part p's outputs
    in columns [p·M/P, (p + 1)·M/P)."""
    parts = x.shape[0] if x.dim() == 3 else 1
    if codebook.numel() != 16 * parts:
        raise ValueError(f"{parts} part(s) of the input take {parts} codebooks of 16, got {tuple(codebook.shape)}")
    x = x if x.dim() == 3 else x[None]
    x = x if x.stride(-1) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
    _, b, n = x.shape
    m, groups = scales.shape
    group = n // groups
    part_rows = m // parts
    if n % 16:
        raise ValueError(f"input width {n} is not a multiple of 16")
    cfg = launch_config(b, m, n, num_sms(x.device))
    cfg.update(config or {})
    if parts > 1:  # a program's rows within one part
        while part_rows % cfg["block_m"]:
            cfg["block_m"] //= 2
        while part_rows % cfg["gemv_m"]:
            cfg["gemv_m"] //= 2
    words = codes.view(torch.int32)  # eight codes a word
    lut = not interpreting()
    hopper = bool(cfg["pdl"] or cfg["prefetch"]) and sm90(x.device)  # asked only when either is asked for
    pdl, prefetch = bool(cfg["pdl"]) and hopper, bool(cfg["prefetch"]) and hopper
    sxp = x.stride(0) if parts > 1 else 0
    out = torch.empty(b, m, device=x.device, dtype=out_dtype)
    if cfg["mma"] and lut:
        from ..weights_mma import mma_fits, mma_matmul
        if mma_fits(x, words, m, n, part_rows, group):
            return mma_matmul(x, words, codebook, scales, out, part_rows, sxp, prev=prev, bias=bias, gelu=gelu,
                              warps=cfg["mma_warps"], words_per_lane=cfg["mma_words"], split=cfg["mma_split"],
                              ahead=cfg["mma_ahead"], pdl=pdl, prefetch=prefetch, probe=cfg.get("mma_probe", 0),
                              maxnreg=cfg["mma_maxnreg"], upfront=cfg["mma_upfront"])
    prev_arg, bias_arg = x if prev is None else prev, x if bias is None else bias
    if cfg["gemv"]:  # a few rows: on the CUDA cores
        block_k = cfg["gemv_k"]
        while n % block_k:
            block_k //= 2
        _gemv_kernel[(triton.cdiv(m, cfg["gemv_m"]),)](
            x, words, codebook, scales, prev_arg, bias_arg, out, b, m, n, groups, x.stride(1), out.stride(0),
            part_rows, sxp, R=min(4, triton.next_power_of_2(b)), BLOCK_M=cfg["gemv_m"], BLOCK_K=block_k, GROUP=group,
            HAS_PREV=prev is not None, HAS_BIAS=bias is not None, GELU=gelu, LUT=lut, X16=lut and _pairs(x),
            STAGES=cfg["gemv_stages"], AHEAD=cfg["gemv_ahead"], num_warps=cfg["gemv_warps"], enable_fp_fusion=FP_FUSION)
        return out
    while n % cfg["block_k"]:
        cfg["block_k"] //= 2
    split = cfg["split"]
    while n % (split * cfg["block_k"]):
        split //= 2
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(b, cfg["block_b"]), split)
    partials = torch.empty(split, b, m, device=x.device, dtype=torch.float32) if split > 1 else out
    counts = split_counters(grid[0] * grid[1], x.device) if split > 1 else words
    _dequant_matmul_kernel[grid](x, words, codebook, scales, prev_arg, bias_arg, out, partials, counts, b, m, n,
                                 groups, x.stride(1), m, part_rows, sxp,
                                 BLOCK_B=cfg["block_b"], BLOCK_M=cfg["block_m"], BLOCK_K=cfg["block_k"], GROUP=group,
                                 HAS_PREV=prev is not None, HAS_BIAS=bias is not None, GELU=gelu,
                                 PRECISION=_precision(x),
                                 LUT=lut, SPLIT=split, AHEAD=cfg["ahead"], PDL=pdl, PREFETCH=prefetch, launch_pdl=pdl,
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=FP_FUSION)
    return out


def _pairs(x: torch.Tensor) -> bool:
    """Whether the one-row kernel, compiled, may read x [P, B, N] (fp16) as int32 pairs: 4-byte aligned, even
    strides."""
    return (x.dtype == torch.float16 and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
            and x.stride(1) % 2 == 0)
