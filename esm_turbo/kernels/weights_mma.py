"""Up to 16 rows of 4-bit weights on the tensor cores fed from registers (``mma.sync`` m16n8k16, PTX), with the codes
in their stored row-major order: ``out = x_rot Ŵ_rotᵀ`` as :func:`~.weights.matmul.matmul_reference` (the contract), one
launch, bias and an earlier pass's output added in the epilogue.

A program owns 16 weight rows (one MMA tile) and its S warps walk the input channels, 32·WL at a time each. Lane
(g, t) of a warp (g = lane // 4, t = lane % 4) holds weight rows 16·tile + g and + 8 and, of each, WL consecutive
code words (8·WL channels, one vector load). The MMA's k index is permuted alike for the weights and the input: word
j's codes 0–3 are the lane's k = 2t, 2t + 1, 2t + 8, 2t + 9 of one MMA and its codes 4–7 those of a second. So the
input's B fragments are that lane's own 8·WL channels of input rows g (and g + 8 past 8 rows), one vector load each,
and no value moves between threads before the MMA. Each lane scales its looked-up values by its two rows' scales
(fp16 products, as the tensor-core kernel's tiles are scaled) before the MMA, because one MMA's 16 k span four lanes'
channels and so several groups; the MMAs accumulate in float32 registers. The codebook's byte words are loaded per
thread, so the byte permutes read them from ordinary registers.

Tensors are 1-D with one element a thread (element i: lane i % 32 of warp i // 32), so the fragment a lane holds is
fixed whatever layout Triton picks. PTX only: Triton's interpreter takes the other kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP_FUSION, split_counters
from .prefetch import prefetch_rows
from .weights.lookup import LOOKUP_REGS, codebook_bytes, lookup_word
from .weights.matmul import _finish, _last_to_arrive

#: the most input rows one launch takes (two 8-column MMA tiles)
MMA_ROWS = 16


def _mma_asm(tiles: int, words: int) -> str:
    """PTX of one walk step: outputs the 4·tiles float32 sums; inputs the ``words`` code words of row r, those of row
    r + 8, the codebook's 8 byte words, the input's 4·words int32 (fp16 pairs) for each of ``tiles`` row tiles, the
    two rows' fp16 scales, then the sums so far."""
    acc = 4 * tiles
    at = acc
    row_a = [f"${at + i}" for i in range(words)]
    row_b = [f"${at + words + i}" for i in range(words)]
    at += 2 * words
    tab = [f"${at + i}" for i in range(8)]
    at += 8
    xs = [[f"${at + n * 4 * words + i}" for i in range(4 * words)] for n in range(tiles)]
    at += 4 * words * tiles
    body = ("{\n" + LOOKUP_REGS + ".reg .b32 p<4>, q<4>, sp, sq;\n"
            f"mov.b32 sp, {{${at}, ${at}}};\nmov.b32 sq, {{${at + 1}, ${at + 1}}};\n")
    sums_in = [f"${at + 2 + i}" for i in range(acc)]
    for j in range(words):
        body += lookup_word(row_a[j], ["p0", "p1", "p2", "p3"], tab) + lookup_word(row_b[j], ["q0", "q1", "q2", "q3"],
                                                                                    tab)
        body += "".join(f"mul.rn.f16x2 p{r}, p{r}, sp;\nmul.rn.f16x2 q{r}, q{r}, sq;\n" for r in range(4))
        for n in range(tiles):
            d = ", ".join(f"${4 * n + c}" for c in range(4))
            c_in = ", ".join(sums_in[4 * n: 4 * n + 4]) if j == 0 else d
            body += (f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d}}}, {{p0, q0, p1, q1}}, "
                     f"{{{xs[n][4 * j]}, {xs[n][4 * j + 1]}}}, {{{c_in}}};\n"
                     f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d}}}, {{p2, q2, p3, q3}}, "
                     f"{{{xs[n][4 * j + 2]}, {xs[n][4 * j + 3]}}}, {{{d}}};\n")
    return body + "}"


def _load_asm(n: int, predicated: bool, coherent: bool = False) -> str:
    """PTX: ``n`` int32 at the 4n-byte-aligned address $n (zeros where the int32 $n+1 is 0, when ``predicated``),
    through the read-only path (``ld.global.nc``: the data may not change while the kernel runs, and ptxas may move
    the load past a ``griddepcontrol.wait``) unless ``coherent``."""
    regs = ", ".join(f"${i}" for i in range(n))
    load = f"ld.global{'' if coherent else '.nc'}.v{n}.u32 {{{regs}}}, [${n}];"
    if not predicated:
        return load
    return ("{\n.reg .pred p;\n" + f"setp.ne.b32 p, ${n + 1}, 0;\n"
            + "".join(f"mov.u32 ${i}, 0;\n" for i in range(n)) + "@p " + load + "\n}")


_STEP = {(t, w): tl.constexpr(_mma_asm(t, w)) for t in (1, 2) for w in (2, 4)}
_STEP_12, _STEP_14, _STEP_22, _STEP_24 = _STEP[1, 2], _STEP[1, 4], _STEP[2, 2], _STEP[2, 4]
_LOAD2, _LOAD4 = tl.constexpr(_load_asm(2, False)), tl.constexpr(_load_asm(4, False))
_LOAD4_IF = tl.constexpr(_load_asm(4, True))
_LOAD2_COHERENT, _LOAD4_COHERENT = (tl.constexpr(_load_asm(n, False, coherent=True)) for n in (2, 4))
_LOAD4_IF_COHERENT = tl.constexpr(_load_asm(4, True, coherent=True))


@triton.jit
def _code_load(ptr, WL: tl.constexpr, PDL: tl.constexpr):
    """WL (2 or 4) code words at ``ptr`` [T] (int32 pointers, 4·WL-byte aligned) → four int32 [T] (the last two
    repeat the first two when WL = 2). ``PDL``: coherent loads, which ptxas keeps on their side of the kernel's
    ``gdc_wait`` (read-only-path loads it moves across it, both ways)."""
    a = ptr.to(tl.int64, bitcast=True)
    if WL == 2:
        w0, w1 = tl.inline_asm_elementwise(_LOAD2_COHERENT if PDL else _LOAD2, "=r,=r,l", [a],
                                           dtype=(tl.int32,) * 2, is_pure=True, pack=1)
        return w0, w1, w0, w1
    return tl.inline_asm_elementwise(_LOAD4_COHERENT if PDL else _LOAD4, "=r,=r,=r,=r,l", [a],
                                     dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def _input_load(ptr, ok, PDL: tl.constexpr):
    """Eight fp16 input channels at ``ptr`` [T] (int32 pointers, 16-byte aligned) as four int32 [T]; zeros where
    ``ok`` is false. ``PDL`` (the kernel before writes the input while this one starts): a coherent load, kept after
    the kernel's ``gdc_wait`` (not pure, so the compiler keeps its place)."""
    return tl.inline_asm_elementwise(_LOAD4_IF_COHERENT if PDL else _LOAD4_IF, "=r,=r,=r,=r,l,r",
                                     [ptr.to(tl.int64, bitcast=True), ok.to(tl.int32)], dtype=(tl.int32,) * 4,
                                     is_pure=not PDL, pack=1)


@triton.jit
def _step_codes(code_a, code_b, scale_a, scale_b, chan, j, S: tl.constexpr, WL: tl.constexpr, GROUP: tl.constexpr,
                PDL: tl.constexpr):
    """Walk step j's code words (four int32 [T] of row a, four of row b; :func:`_code_load`, ``PDL`` as it takes it)
    and the two rows' scales [T] fp16 of the lanes' channels (``chan``: each lane's first channel at step 0)."""
    a0, a1, a2, a3 = _code_load(code_a + j * (S * 4 * WL), WL, PDL)
    b0, b1, b2, b3 = _code_load(code_b + j * (S * 4 * WL), WL, PDL)
    group = (chan + j * (S * 32 * WL)) // GROUP
    return a0, a1, a2, a3, b0, b1, b2, b3, tl.load(scale_a + group), tl.load(scale_b + group)


@triton.jit
def _input_words(ptr, ok, WL: tl.constexpr, PDL: tl.constexpr):
    """A lane's 8·WL input channels at ``ptr`` [T] (int32 pointers) as 4·WL int32 [T] (:func:`_input_load`, ``PDL``
    as it takes it); with WL = 2 the last eight repeat the first eight (unused)."""
    x0, x1, x2, x3 = _input_load(ptr, ok, PDL)
    x4, x5, x6, x7 = _input_load(ptr + 4, ok, PDL)
    if WL == 4:
        x8, x9, x10, x11 = _input_load(ptr + 8, ok, PDL)
        x12, x13, x14, x15 = _input_load(ptr + 12, ok, PDL)
    else:
        x8, x9, x10, x11, x12, x13, x14, x15 = x0, x1, x2, x3, x4, x5, x6, x7
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _products(codes, tab, xs, ys, sa, sb, sums, TILES: tl.constexpr, WL: tl.constexpr):
    """One walk step's MMAs (:func:`_mma_asm`): codes the eight code words (row a's four, row b's four), tab the
    codebook's eight byte words, xs (and ys with TILES 2) a row tile's 4·WL input words, sa / sb the two rows' scales,
    sums the eight float32 sums so far (the last four unused with TILES 1) → the eight sums."""
    a0, a1, a2, a3, b0, b1, b2, b3 = codes
    t0, t1, t2, t3, t4, t5, t6, t7 = tab
    s0, s1, s2, s3, s4, s5, s6, s7 = sums
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = xs
    if TILES == 1:
        if WL == 2:
            s0, s1, s2, s3 = tl.inline_asm_elementwise(
                _STEP_12, "=f," * 4 + "r," * 20 + "h,h,f,f,f,f",
                [a0, a1, b0, b1, t0, t1, t2, t3, t4, t5, t6, t7, x0, x1, x2, x3, x4, x5, x6, x7, sa, sb,
                 s0, s1, s2, s3], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        else:
            s0, s1, s2, s3 = tl.inline_asm_elementwise(
                _STEP_14, "=f," * 4 + "r," * 32 + "h,h,f,f,f,f",
                [a0, a1, a2, a3, b0, b1, b2, b3, t0, t1, t2, t3, t4, t5, t6, t7, x0, x1, x2, x3, x4, x5, x6, x7,
                 x8, x9, x10, x11, x12, x13, x14, x15, sa, sb, s0, s1, s2, s3],
                dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    else:
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = ys
        if WL == 2:
            s0, s1, s2, s3, s4, s5, s6, s7 = tl.inline_asm_elementwise(
                _STEP_22, "=f," * 8 + "r," * 28 + "h,h" + ",f" * 8,
                [a0, a1, b0, b1, t0, t1, t2, t3, t4, t5, t6, t7, x0, x1, x2, x3, x4, x5, x6, x7,
                 y0, y1, y2, y3, y4, y5, y6, y7, sa, sb, s0, s1, s2, s3, s4, s5, s6, s7],
                dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            s0, s1, s2, s3, s4, s5, s6, s7 = tl.inline_asm_elementwise(
                _STEP_24, "=f," * 8 + "r," * 48 + "h,h" + ",f" * 8,
                [a0, a1, a2, a3, b0, b1, b2, b3, t0, t1, t2, t3, t4, t5, t6, t7,
                 x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                 y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                 sa, sb, s0, s1, s2, s3, s4, s5, s6, s7],
                dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _slot(c: tl.constexpr, tile):
    """Sum register c (0–7) of lane (g, t): (input rows [32], weight rows [32]) over the 32 lanes."""
    lane = tl.arange(0, 32)
    return lane % 4 * 2 + c % 2 + 8 * (c // 4), tile * 16 + lane // 4 + 8 * (c // 2 % 2)


@triton.jit
def _emit(v, c: tl.constexpr, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S: tl.constexpr,
          SPLIT: tl.constexpr, HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """Sum register c [32·S] summed over the warps, then finished into out (SPLIT = 1) or stored as this program's
    partial sum (part [SPLIT, B, M] float32)."""
    r, m = _slot(c, tile)
    v = tl.sum(tl.reshape(v, (S, 32)), axis=0)
    if SPLIT == 1:
        _finish(v, r, m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV, HAS_BIAS, GELU)
    else:
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * B * M + r.to(tl.int64) * M + m, v, mask=r < B)


@triton.jit
def _gather(c: tl.constexpr, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT: tl.constexpr,
            HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """The last program of a split tile: sum register c's SPLIT partial sums, finished into out."""
    r, m = _slot(c, tile)
    at = r.to(tl.int64) * M + m
    v = tl.zeros((32,), tl.float32)
    for s in tl.static_range(SPLIT):
        v += tl.load(part_ptr + s * B * M + at, mask=r < B, other=0.0, cache_modifier=".cg")
    _finish(v, r, m, B, M, sob, prev_ptr, bias_ptr, out_ptr, HAS_PREV, HAS_BIAS, GELU)


@triton.jit(do_not_specialize=["zero"])
def _mma_kernel(x_ptr, codes_ptr, cb_ptr, scales_ptr, prev_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                B, M, N, G, sxb, sob, PR, sxp, zero, TILES: tl.constexpr, S: tl.constexpr, WL: tl.constexpr,
                SPLIT: tl.constexpr, GROUP: tl.constexpr, HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr,
                GELU: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                PROBE: tl.constexpr, STEPS: tl.constexpr):
    """Grid (M / 16, SPLIT), S warps. x [B, N] fp16 (B ≤ 8·TILES; rows strided by sxb, 16-byte aligned), codes
    [M, N/8] int32 (16-byte aligned rows), scales [M, G] fp16, codebook [16] fp16 (read through ``zero`` · lane, zero
    at run time), out [B, M] (rows strided by sob; its dtype) = x Ŵ_rotᵀ (+ prev, + bias, GELU: ``_finish``). Parts
    (PR, sxp) and the split (partials [SPLIT, B, M], arrival counts, the last program finishing) as the tensor-core
    kernel's. The walk: (N / (32·WL)) / SPLIT chunks of 32·WL channels a program, chunk s + S·j to warp s.
    ``AHEAD``: each step's codes and scales are requested a step before. ``PDL`` (launched as a programmatic
    dependent launch): the next kernel may launch at once, and this one reads its codebook and first codes (weights,
    which no earlier kernel writes) before it waits for the kernel before it to finish. ``PREFETCH``: the program's
    codes and scales are asked into L2 at its start (``kernels.prefetch``), 16 threads a row each. ``PROBE`` (0 in
    every product; a timing study's stage left out, ``tools/weights_stages.py``, results then wrong): 1 the input
    read once, before the walk; 2 the codes and scales read once (their look-ups then leave the loop too); 3 both.
    ``STEPS`` (> 0: the walk's step count, compiled in): every step's codes and scales requested before the walk."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    CH: tl.constexpr = 32 * WL
    chunks = N // CH // SPLIT
    steps = chunks // S
    i = tl.arange(0, 32 * S)
    lane = i % 32
    g = lane // 4
    t = lane % 4
    tile = tl.program_id(0)
    part = tile * 16 // PR
    x_ptr += part.to(tl.int64) * sxp
    t0, t1, t2, t3, t4, t5, t6, t7 = codebook_bytes((cb_ptr + part * 16).to(tl.pointer_type(tl.int32)) + zero * i)
    first = tl.program_id(1) * chunks + i // 32  # the warp's first chunk
    row = tile * 16 + g
    code_a = codes_ptr + row.to(tl.int64) * (N // 8) + first * (4 * WL) + t * WL
    code_b = code_a + 8 * (N // 8)
    scale_a = scales_ptr + row.to(tl.int64) * G
    scale_b = scale_a + 8 * G
    chan = first * CH + t * (8 * WL)  # the lane's first input channel
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    x_a = x32 + g * (sxb // 2) + first * (CH // 2) + t * (4 * WL)
    x_b = x_a + 8 * (sxb // 2)
    ok_a = g < B
    ok_b = g + 8 < B
    if PREFETCH:
        prefetch_rows(codes_ptr, tile * 16 + i, N // 8, tl.program_id(1) * chunks * (4 * WL), chunks * (4 * WL), i < 16)
        g0 = tl.program_id(1) * chunks * CH // GROUP
        g1 = ((tl.program_id(1) + 1) * chunks * CH + GROUP - 1) // GROUP
        prefetch_rows(scales_ptr, tile * 16 + i - 16, G, g0, g1 - g0, (i >= 16) & (i < 32))
    s0 = tl.zeros((32 * S,), tl.float32)
    s1 = tl.zeros((32 * S,), tl.float32)
    s2 = tl.zeros((32 * S,), tl.float32)
    s3 = tl.zeros((32 * S,), tl.float32)
    s4 = tl.zeros((32 * S,), tl.float32)
    s5 = tl.zeros((32 * S,), tl.float32)
    s6 = tl.zeros((32 * S,), tl.float32)
    s7 = tl.zeros((32 * S,), tl.float32)
    if STEPS:  # every step's codes and scales requested before the walk
        pre = ()
        for j in tl.static_range(STEPS):
            pre = pre + (_step_codes(code_a, code_b, scale_a, scale_b, chan, j, S, WL, GROUP, PDL),)
    elif AHEAD or PROBE & 2:
        a0, a1, a2, a3, b0, b1, b2, b3, sa, sb = _step_codes(code_a, code_b, scale_a, scale_b, chan, 0, S, WL, GROUP,
                                                              PDL)
    if PDL:  # the input, the sums' buffers and the counts only once the kernel before has finished
        tl.extra.cuda.gdc_wait()
    if PROBE & 1:
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _input_words(x_a, ok_a, WL, PDL)
        if TILES == 2:
            y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _input_words(x_b, ok_b, WL, PDL)
    if STEPS:
        for j in tl.static_range(STEPS):
            a0, a1, a2, a3, b0, b1, b2, b3, sa, sb = pre[j]
            xo = j * (S * CH // 2)
            xs = _input_words(x_a + xo, ok_a, WL, PDL)
            ys = _input_words(x_b + xo, ok_b, WL, PDL) if TILES == 2 else ()
            s0, s1, s2, s3, s4, s5, s6, s7 = _products(
                (a0, a1, a2, a3, b0, b1, b2, b3), (t0, t1, t2, t3, t4, t5, t6, t7), xs, ys, sa, sb,
                (s0, s1, s2, s3, s4, s5, s6, s7), TILES, WL)
    for j in range(0 if STEPS else steps):
        if PROBE & 2:
            pass
        elif AHEAD:  # the next step's codes requested before this one's are decoded (the last step: its own again)
            na0, na1, na2, na3, nb0, nb1, nb2, nb3, nsa, nsb = _step_codes(
                code_a, code_b, scale_a, scale_b, chan, tl.where(j + 1 < steps, j + 1, j), S, WL, GROUP, PDL)
        else:
            a0, a1, a2, a3, b0, b1, b2, b3, sa, sb = _step_codes(code_a, code_b, scale_a, scale_b, chan, j, S, WL,
                                                                  GROUP, PDL)
        xo = j * (S * CH // 2)
        if not PROBE & 1:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _input_words(x_a + xo, ok_a, WL, PDL)
            if TILES == 2:
                y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _input_words(x_b + xo, ok_b,
                                                                                                    WL, PDL)
        s0, s1, s2, s3, s4, s5, s6, s7 = _products(
            (a0, a1, a2, a3, b0, b1, b2, b3), (t0, t1, t2, t3, t4, t5, t6, t7),
            (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15),
            (y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15) if TILES == 2 else (),
            sa, sb, (s0, s1, s2, s3, s4, s5, s6, s7), TILES, WL)
        if AHEAD and not PROBE & 2:
            a0, a1, a2, a3, b0, b1, b2, b3, sa, sb = na0, na1, na2, na3, nb0, nb1, nb2, nb3, nsa, nsb
    _emit(s0, 0, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S, SPLIT, HAS_PREV, HAS_BIAS, GELU)
    _emit(s1, 1, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S, SPLIT, HAS_PREV, HAS_BIAS, GELU)
    _emit(s2, 2, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S, SPLIT, HAS_PREV, HAS_BIAS, GELU)
    _emit(s3, 3, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S, SPLIT, HAS_PREV, HAS_BIAS, GELU)
    if TILES == 2:
        _emit(s4, 4, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S, SPLIT, HAS_PREV, HAS_BIAS, GELU)
        _emit(s5, 5, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S, SPLIT, HAS_PREV, HAS_BIAS, GELU)
        _emit(s6, 6, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S, SPLIT, HAS_PREV, HAS_BIAS, GELU)
        _emit(s7, 7, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, S, SPLIT, HAS_PREV, HAS_BIAS, GELU)
    if SPLIT > 1:  # the tile's last program to arrive adds the partial sums and finishes
        if _last_to_arrive(count_ptr + tile, SPLIT):
            _gather(0, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_PREV, HAS_BIAS, GELU)
            _gather(1, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_PREV, HAS_BIAS, GELU)
            _gather(2, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_PREV, HAS_BIAS, GELU)
            _gather(3, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_PREV, HAS_BIAS, GELU)
            if TILES == 2:
                _gather(4, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_PREV, HAS_BIAS, GELU)
                _gather(5, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_PREV, HAS_BIAS, GELU)
                _gather(6, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_PREV, HAS_BIAS, GELU)
                _gather(7, tile, B, M, sob, prev_ptr, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_PREV, HAS_BIAS, GELU)
            tl.store(count_ptr + tile, 0)  # every split has counted: zero again for the next launch


def mma_fits(x: torch.Tensor, words: torch.Tensor, m: int, n: int, part_rows: int, group: int) -> bool:
    """Whether :func:`mma_matmul` takes x [P, B, N] times the weight of ``words`` [M, N/8] int32 in scale groups of
    ``group`` channels: fp16 input of at most :data:`MMA_ROWS` rows, 16-byte aligned rows of both, whole 16-row
    tiles within each part, 64 channels a chunk at least, and a lane's 32 channels within one group."""
    return (x.dtype == torch.float16 and x.shape[1] <= MMA_ROWS and m % 16 == 0 and part_rows % 16 == 0
            and n % 64 == 0 and group >= 32 and x.data_ptr() % 16 == 0 and x.stride(1) % 8 == 0 and x.stride(0) % 8 == 0
            and words.data_ptr() % 16 == 0)


def mma_launch(n: int, warps: int, words: int, split: int) -> tuple[int, int, int]:
    """(warps, words, split) as asked, each reduced (code words a lane from 4 to 2 first, then split and warps halved)
    until the N input channels are whole chunks of 32·words that divide evenly over split × warps."""
    while n % (32 * words) or (n // (32 * words)) % (split * warps):
        if words > 2:
            words = 2
        elif split > 1:
            split //= 2
        else:
            warps //= 2
    return warps, words, split


def mma_matmul(x: torch.Tensor, words: torch.Tensor, codebook: torch.Tensor, scales: torch.Tensor,
               out: torch.Tensor, part_rows: int, sxp: int, *, prev: torch.Tensor | None, bias: torch.Tensor | None,
               gelu: bool = False, warps: int = 4, words_per_lane: int = 4, split: int = 1,
               ahead: int = 1, pdl: bool = False, prefetch: bool = False, probe: int = 0,
               maxnreg: int | None = None, upfront: bool = False) -> torch.Tensor:
    """``out`` [B, M] = x Ŵ_rotᵀ (+ prev + bias, then GELU with ``gelu``) in one launch of :func:`_mma_kernel`
    (CUDA; :func:`mma_fits`): x [P, B, N] fp16 (each part's rotated input, parts ``sxp`` elements apart,
    ``part_rows`` outputs each), words [M, N/8] int32, codebook [P·16], scales [M, G] fp16. ``pdl``: launched as a
    programmatic dependent launch (sm_90 and up); ``prefetch``: the codes and scales asked into L2 first (sm_90);
    ``probe``: a stage left out for a timing study (:func:`_mma_kernel`'s ``PROBE``; the result is then wrong);
    ``maxnreg``: the registers a thread ptxas may use (None: its own choice, 68 at sm_90; with more room it issues a
    step's input loads and the next step's code loads at the step's start rather than just before their use);
    ``upfront``: the walk's step count compiled in and every step's codes and scales requested before it starts."""
    _, b, n = x.shape
    m, groups = scales.shape
    warps, wl, split = mma_launch(n, warps, words_per_lane, split)
    steps = n // (32 * wl) // split // warps
    partials = torch.empty(split, b, m, device=x.device, dtype=torch.float32) if split > 1 else out
    counts = split_counters(m // 16, x.device) if split > 1 else words
    _mma_kernel[(m // 16, split)](
        x, words, codebook, scales, x if prev is None else prev, x if bias is None else bias, out, partials, counts,
        b, m, n, groups, x.stride(1), out.stride(0), part_rows, sxp, 0,
        TILES=1 if b <= 8 else 2, S=warps, WL=wl, SPLIT=split, GROUP=n // groups, HAS_PREV=prev is not None,
        HAS_BIAS=bias is not None, GELU=gelu, AHEAD=ahead, PDL=pdl, PREFETCH=prefetch, PROBE=probe,
        STEPS=steps if upfront else 0, num_warps=warps, launch_pdl=pdl, enable_fp_fusion=FP_FUSION,
        **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    return out
