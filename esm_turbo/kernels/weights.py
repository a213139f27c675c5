"""4-bit quantized weights on the GPU (Triton): the fused dequantize-and-multiply ``out = x_rot Ŵ_rotᵀ`` where
``Ŵ_rot[m, k] = codebook[code[m, k]] · scale[m, k / group]``, the rotation of the input per group, and the
dequantization of a whole weight back to the original domain for many rows. The PyTorch references with the same
contracts are :func:`matmul_reference`, ``QuantizedLinear.rotate_input`` and ``QuantPass.decode``;
``esm_turbo.weights.linear.QuantizedLinear`` picks between them.

The codes are read as int32 words, eight 4-bit codes a word, and each is looked up in the layer's 16-entry fp16
codebook in registers (``_lookup8``: PTX ``prmt`` byte permutes over the codebook's bytes, about 2.6 integer
instructions a code, no memory access; Triton's interpreter, which runs no PTX, gathers through memory instead).
The matmul, for one or two rows (:data:`GEMV_ROWS`) on the CUDA cores (``_gemv_kernel``), stays in the code words'
own layout: each word's eight products with an input row are summed in float32 and scaled once, into a float32 sum a
word, reduced once at the end (no tile reshaped or moved between threads). For more rows on the tensor cores
(``_dequant_matmul_kernel``): each program owns a [BLOCK_B, BLOCK_M] tile of the output and walks its run of input
channels BLOCK_K at a time, the decoded tile scaled per (row, group) and fed to a dot with the input tile; a layer
with few outputs splits its input channels over programs (float32 partial sums, added by the last program of each
tile to finish). Both add a bias and an earlier pass's output in the epilogue (then, for FFN up, the GELU); the
dequantized weight never reaches global memory. A rotation (the layer's Hadamard matrix, ±1 entries) is one small
dot per group of channels, in a launch of its own or after the LayerNorm that makes the input
(:func:`norm_rotate_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP_FUSION, interpreting, num_sms, split_counters


def _lookup_half(sel: str, mask: str, pairs: tuple[str, str], tab: list[str]) -> str:
    """PTX decoding four codes into two fp16-pair registers ``pairs`` (codes 0 and 1, codes 2 and 3): ``sel`` holds
    their low three bits (nibbles 0–3), ``mask`` the byte permute that spreads each code's fourth bit over a byte (from
    ``w`` and ``w4`` = w << 4, whose bytes carry those bits as their sign bits); ``tab`` the codebook's eight byte
    words (:func:`_byte_word`)."""
    return f"""
prmt.b32 m, w4, w, {mask};
prmt.b32 la, {tab[0]}, {tab[1]}, {sel};
prmt.b32 lb, {tab[2]}, {tab[3]}, {sel};
prmt.b32 ha, {tab[4]}, {tab[5]}, {sel};
prmt.b32 hb, {tab[6]}, {tab[7]}, {sel};
lop3.b32 lo, la, lb, m, 0xD8;
lop3.b32 hi, ha, hb, m, 0xD8;
prmt.b32 {pairs[0]}, lo, hi, 0x5140;
prmt.b32 {pairs[1]}, lo, hi, 0x7362;
"""


#: the PTX registers :func:`lookup_word` works in
LOOKUP_REGS = ".reg .b32 w, w4, s, t, m, la, lb, ha, hb, lo, hi;\n"


def lookup_word(word: str, pairs: list[str], tab: list[str]) -> str:
    """PTX looking up the eight codes of the int32 ``word`` (channel i in nibble i) in the codebook whose byte words
    are ``tab`` (eight operands, :func:`_byte_word`) into four fp16-pair registers ``pairs`` (codes 0–1, 2–3, 4–5,
    6–7). Each code's low three bits pick one of eight bytes, twice (entries 0–7, 8–15) for each byte half; its fourth
    bit, spread to a byte mask ``m`` (a sign-replicating byte permute of w and w << 4), picks between them; the low and
    high bytes interleave into fp16 pairs. About 2.6 integer instructions a code. Needs :data:`LOOKUP_REGS`."""
    return (f"mov.b32 w, {word};\nshl.b32 w4, w, 4;\nand.b32 s, w, 0x77777777;\nshr.b32 t, s, 16;"
            + _lookup_half("s", "0xD9C8", (pairs[0], pairs[1]), tab)
            + _lookup_half("t", "0xFBEA", (pairs[2], pairs[3]), tab))


#: the codebook lookup of eight codes in registers (:func:`lookup_word`): $8 holds eight codes, $9–$16 the codebook's
#: byte words (low bytes of entries 0–3, 4–7, 8–11, 12–15, then the high bytes); $0–$7 the eight fp16 values
_LOOKUP_ASM = tl.constexpr("{\n" + LOOKUP_REGS + ".reg .b32 p0, p1, p2, p3;\n"
                           + lookup_word("$8", ["p0", "p1", "p2", "p3"], [f"${9 + i}" for i in range(8)])
                           + "".join(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p{i};\n" for i in range(4)) + "}")


@triton.jit
def _byte_word(a, b, SHIFT: tl.constexpr):
    """Bytes SHIFT/8 and SHIFT/8 + 2 of the int32 words a and b, as bytes 0–3 of one word."""
    return (((a >> SHIFT) & 255) | (((a >> (SHIFT + 16)) & 255) << 8) | (((b >> SHIFT) & 255) << 16)
            | (((b >> (SHIFT + 16)) & 255) << 24))


@triton.jit
def codebook_bytes(words):
    """The 16-entry fp16 codebook as the eight byte words the PTX lookup takes (:func:`lookup_word`), from its int32
    view ``words`` (entries 2j and 2j + 1 in word j; a pointer, or a tensor of pointers to the same codebook, which
    keeps the words in each thread's own registers)."""
    c0 = tl.load(words)
    c1 = tl.load(words + 1)
    c2 = tl.load(words + 2)
    c3 = tl.load(words + 3)
    c4 = tl.load(words + 4)
    c5 = tl.load(words + 5)
    c6 = tl.load(words + 6)
    c7 = tl.load(words + 7)
    return (_byte_word(c0, c1, 0), _byte_word(c2, c3, 0), _byte_word(c4, c5, 0), _byte_word(c6, c7, 0),
            _byte_word(c0, c1, 8), _byte_word(c2, c3, 8), _byte_word(c4, c5, 8), _byte_word(c6, c7, 8))


@triton.jit
def _lookup8(word, cb_ptr, LUT: tl.constexpr):
    """word [A, W] int32 (eight 4-bit codes, channel i of the word in nibble i) → eight fp16 [A, W] (v0 … v7): each
    word's code i looked up in the 16-entry codebook (fp16). ``LUT``: in registers (:data:`_LOOKUP_ASM`); else
    gathered through L1 (Triton's interpreter, which runs no PTX)."""
    if LUT:
        t0, t1, t2, t3, t4, t5, t6, t7 = codebook_bytes(cb_ptr.to(tl.pointer_type(tl.int32)))
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _LOOKUP_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r", [word, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        v0 = tl.load(cb_ptr + (word & 15))
        v1 = tl.load(cb_ptr + ((word >> 4) & 15))
        v2 = tl.load(cb_ptr + ((word >> 8) & 15))
        v3 = tl.load(cb_ptr + ((word >> 12) & 15))
        v4 = tl.load(cb_ptr + ((word >> 16) & 15))
        v5 = tl.load(cb_ptr + ((word >> 20) & 15))
        v6 = tl.load(cb_ptr + ((word >> 24) & 15))
        v7 = tl.load(cb_ptr + ((word >> 28) & 15))
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _lookup(word, cb_ptr, LUT: tl.constexpr):
    """word [A, W] int32 → fp16 [A, 8W]: :func:`_lookup8`'s values in channel order."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _lookup8(word, cb_ptr, LUT)
    # stacked in bit-reversed order, so that [A, W, 2, 2, 2] flattens to channel order
    v = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(v, (word.shape[0], word.shape[1] * 8))


@triton.jit
def _code_words(words_ptr, offs_m, mmask, offs_w, N):
    """Code words [len(offs_m), len(offs_w)] int32 of rows ``offs_m`` (zeros off ``mmask``), word columns ``offs_w``
    (eight input channels a word of the packed codes, the first in the lowest nibble)."""
    return tl.load(words_ptr + offs_m[:, None].to(tl.int64) * (N // 8) + offs_w[None, :], mask=mmask[:, None], other=0)


@triton.jit
def _tile_codes(words_ptr, scales_ptr, offs_m, mmask, k0, N, G, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The stored parts of Ŵ_rot[offs_m, k0 : k0 + BLOCK_K]: its code words [BLOCK_M, BLOCK_K / 8] int32
    (:func:`_code_words`) and its scales [BLOCK_M, BLOCK_K / SUB] fp16 (SUB: channels per scale within the tile).
    Rows off ``mmask`` read as zeros."""
    word = _code_words(words_ptr, offs_m, mmask, k0 // 8 + tl.arange(0, BLOCK_K // 8), N)
    SUB: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    groups = (k0 + tl.arange(0, BLOCK_K // SUB) * SUB) // GROUP
    scale = tl.load(scales_ptr + offs_m[:, None].to(tl.int64) * G + groups[None, :], mask=mmask[:, None], other=0.0)
    return word, scale


@triton.jit
def _tile_values(word, scale, cb_ptr, DTYPE: tl.constexpr, LUT: tl.constexpr):
    """:func:`_tile_codes`' word [BM, BK / 8] and scale [BM, NG] → DTYPE [BM, BK]: each code looked up in the 16-entry
    codebook (:func:`_lookup`), then scaled per (row, group) in DTYPE (a 16-bit product rounded once, as a float32
    product cast to 16 bits is)."""
    w = _lookup(word, cb_ptr, LUT)
    BM: tl.constexpr = word.shape[0]
    BK: tl.constexpr = word.shape[1] * 8
    NG: tl.constexpr = scale.shape[1]
    return tl.reshape(tl.reshape(w.to(DTYPE), (BM, NG, BK // NG)) * scale[:, :, None].to(DTYPE), (BM, BK))


@triton.jit
def _weight_tile(words_ptr, cb_ptr, scales_ptr, offs_m, mmask, k0, N, G, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 DTYPE: tl.constexpr, LUT: tl.constexpr):
    """Ŵ_rot[offs_m, k0 : k0 + BLOCK_K] as DTYPE [len(offs_m), BLOCK_K]: :func:`_tile_codes`, then
    :func:`_tile_values`."""
    word, scale = _tile_codes(words_ptr, scales_ptr, offs_m, mmask, k0, N, G, BLOCK_K, GROUP)
    return _tile_values(word, scale, cb_ptr, DTYPE, LUT)


@triton.jit
def _tile_ahead(words_ptr, cb_ptr, scales_ptr, word, scale, offs_m, mmask, k0, start, stop, N, G,
                BLOCK_K: tl.constexpr, GROUP: tl.constexpr, DTYPE: tl.constexpr, LUT: tl.constexpr):
    """A walk over tiles [start, stop) with each tile's codes requested one tile ahead: (the tile at k0 decoded from
    its codes ``word``, ``scale`` requested before, the next tile's codes, requested now; past ``stop``, start's)."""
    nxt = k0 + BLOCK_K
    nxt = tl.where(nxt < stop, nxt, start)
    word_n, scale_n = _tile_codes(words_ptr, scales_ptr, offs_m, mmask, nxt, N, G, BLOCK_K, GROUP)
    return _tile_values(word, scale, cb_ptr, DTYPE, LUT), word_n, scale_n


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
        acc = acc * 0.5 * (1.0 + tl.math.erf(acc * 0.7071067811865476))
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
                           AHEAD: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), cdiv(B, BLOCK_B), SPLIT). x [B, N] (rows strided by sxb; rotated), codes [M, N/8] int32
    (the packed uint8 codes read as words), scales [M, G] fp16, codebook [16] fp16, out [B, M] (rows strided by sob;
    its dtype) = x Ŵ_rotᵀ (+ prev [B, M], + bias [M], GELU: :func:`_finish`). Parts: output rows [p·PR, (p + 1)·PR)
    take codebook p ([M / PR, 16]) and the input x + p·sxp (PR = M, sxp = 0: one part; BLOCK_M divides PR). With
    SPLIT > 1 program (i, j, s) sums the s-th of SPLIT equal runs of input channels into partials [SPLIT, B, M] float32 (``part_ptr``)
    and counts its arrival in ``count_ptr[j·grid(0) + i]`` (int32, zero at launch and left zero); the last of a tile
    adds the SPLIT partials and finishes the tile. N % (SPLIT·BLOCK_K) == 0; BLOCK_K and GROUP powers of two.
    ``AHEAD``: each tile's codes and scales are requested a tile before it is decoded (:func:`_tile_ahead`)."""
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
    if AHEAD:  # each tile's codes requested a tile before it is decoded, carried in registers
        word, scale = _tile_codes(codes_ptr, scales_ptr, offs_m, mmask, start, N, G, BLOCK_K, GROUP)
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


@triton.jit
def _rotate_kernel(x_ptr, sign_ptr, rot_scale, out_ptr, w_ptr, b_ptr, y_ptr, eps, B, N, sxb, BLOCK_B: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr):
    """Grid (cdiv(B, BLOCK_B), N / BLOCK_K, P). out [P, B, N] (contiguous, its dtype): part p = each group of GROUP
    channels of x [B, N] (rows strided by sxb) times sign[p] ([P, GROUP, GROUP]) · rot_scale. With ``NORM`` (= N, a
    multiple of BLOCK_K; 0: off) x is first layer-normalized (weight w [N], bias b [N], ``eps``; each row's statistics
    in float32 from one unrolled pass of sums shifted by its first value) and rounded to y's dtype, the values
    rotated; part 0's programs also store them to y [B, N] (contiguous)."""
    sign_ptr += tl.program_id(2) * GROUP * GROUP
    out_ptr += tl.program_id(2).to(tl.int64) * B * N
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    bmask = offs_b[:, None] < B
    rows = x_ptr + offs_b[:, None].to(tl.int64) * sxb
    x = tl.load(rows + offs_k[None, :], mask=bmask, other=0.0)
    if NORM:
        shift = tl.load(rows, mask=bmask, other=0.0).to(tl.float32)  # [BLOCK_B, 1]
        total = tl.zeros((BLOCK_B,), tl.float32)
        squares = tl.zeros((BLOCK_B,), tl.float32)
        for k0 in tl.static_range(0, NORM, BLOCK_K):
            c = tl.load(rows + k0 + tl.arange(0, BLOCK_K)[None, :], mask=bmask, other=0.0).to(tl.float32) - shift
            total += tl.sum(c, axis=1)
            squares += tl.sum(c * c, axis=1)
        centred = total / NORM
        mean = shift + centred[:, None]
        rstd = 1.0 / tl.sqrt(tl.maximum(squares / NORM - centred * centred, 0.0) + eps)
        w = tl.load(w_ptr + offs_k).to(tl.float32)[None, :]
        b = tl.load(b_ptr + offs_k).to(tl.float32)[None, :]
        x = ((x.to(tl.float32) - mean) * rstd[:, None] * w + b).to(y_ptr.dtype.element_ty)
        if tl.program_id(2) == 0:
            tl.store(y_ptr + offs_b[:, None].to(tl.int64) * N + offs_k[None, :], x, mask=bmask)
    y = _turn(x, sign_ptr, rot_scale, BLOCK_B, BLOCK_K, GROUP, PRECISION)
    tl.store(out_ptr + offs_b[:, None].to(tl.int64) * N + offs_k[None, :], y.to(out_ptr.dtype.element_ty), mask=bmask)


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


def sign_matrix(rot: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(S, c) with rot = c·S, S [d, d] float32 of ±1 on rot's device: how the kernels take a Hadamard rotation (made
    once per layer; refused for another matrix)."""
    host = rot.detach().float().cpu()
    c = float(host[0, 0].abs())
    sign = host / c
    if not torch.equal(sign.abs(), torch.ones_like(sign)):
        raise ValueError("the weight kernels rotate by Hadamard matrices (entries ±c) only")
    return sign.contiguous().to(rot.device), c


#: most rows the CUDA-core kernel (``_gemv_kernel``) multiplies by default; more take the tensor-core tiles
GEMV_ROWS = 2


def matmul_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """x [B, N] times the 4-bit pass's Ŵ_rotᵀ → [B, M] float32 (PyTorch; the kernel's contract)."""
    from ..quant.packing import unpack_4bit_u8
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
    programs (2 past 8 rows from 5,120 outputs), codes requested a step ahead up to 8 rows."""
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
               gemv_ahead=1, split=1, ahead=0)
    cfg |= dict(mma=rows <= 16 and m * n >= (50e6 if rows == 1 else 16e6 if rows == 2 or rows > 8 else 4e6),
                mma_warps=8 if m == n else 4, mma_words=4,
                mma_split=(2 if rows > 8 and m >= 5120 else 4) if long_input else 1,
                mma_ahead=int(rows <= 8))
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
    register-fed tensor-core kernel, taken where :func:`~.weights_mma.mma_fits` and compiled) with mma_warps /
    mma_words / mma_split / mma_ahead.

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
    sxp = x.stride(0) if parts > 1 else 0
    out = torch.empty(b, m, device=x.device, dtype=out_dtype)
    if cfg["mma"] and lut:
        from .weights_mma import mma_fits, mma_matmul
        if mma_fits(x, words, m, n, part_rows, group):
            return mma_matmul(x, words, codebook, scales, out, part_rows, sxp, prev=prev, bias=bias, gelu=gelu,
                              warps=cfg["mma_warps"], words_per_lane=cfg["mma_words"], split=cfg["mma_split"],
                              ahead=cfg["mma_ahead"])
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
                                 LUT=lut, SPLIT=split, AHEAD=cfg["ahead"],
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=FP_FUSION)
    return out


#: rows a program of :func:`norm_rotate_triton` normalizes and rotates (each reads its rows whole for their statistics):
#: at 16 rows of 1,280–5,120 channels on an H100, 4 took 0.69–0.76× the time of 16 (2 and 8 in between)
NORM_ROWS = 4


def rotate_triton(x: torch.Tensor, rotation: tuple[torch.Tensor, float]) -> torch.Tensor:
    """x [B, N] with each group of d channels times c·S (``rotation`` = :func:`sign_matrix` of Πᵀ: x_rot = x_g Πᵀ),
    in x's dtype, one launch. Reference: ``QuantizedLinear.rotate_input``. With S [P, d, d] (P rotations of one
    scale c, as :func:`matmul_triton`'s parts take them): → [P, B, N]."""
    return _launch_rotate(x, rotation)[1]


def norm_rotate_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       rotation: tuple[torch.Tensor, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """y = layer_norm(x [B, N]; weight, bias, eps) in x's dtype, and y rotated as :func:`rotate_triton` rotates
    (→ [B, N] or [P, B, N]), in one launch. Reference: ``torch.nn.functional.layer_norm`` then
    :func:`rotate_triton`."""
    return _launch_rotate(x, rotation, (weight, bias, eps))


def _launch_rotate(x: torch.Tensor, rotation: tuple[torch.Tensor, float],
                   norm: tuple | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One :func:`_rotate_kernel` launch: (the normalized x or None, the rotation(s))."""
    b, n = x.shape
    sign = rotation[0]
    parts = sign.shape[0] if sign.dim() == 3 else 1
    group = sign.shape[-1]
    block_k = 256  # the largest power of two up to 256 dividing n
    while n % block_k:
        block_k //= 2
    if block_k < group:
        raise ValueError(f"input width {n} is not a multiple of the rotation group {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(*([parts] if sign.dim() == 3 else []), b, n, device=x.device, dtype=x.dtype)
    y = torch.empty(b, n, device=x.device, dtype=x.dtype) if norm is not None else None
    w, bias, eps = norm if norm is not None else (x, x, 0.0)
    block_b = NORM_ROWS if norm is not None else 16
    _rotate_kernel[(triton.cdiv(b, block_b), n // block_k, parts)](x, sign, rotation[1], out, w, bias,
                                                                   out if y is None else y, eps, b, n, x.stride(0),
                                                                   BLOCK_B=block_b, BLOCK_K=block_k, GROUP=group,
                                                                   PRECISION=_precision(x), NORM=0 if y is None else n,
                                                                   num_warps=4, enable_fp_fusion=FP_FUSION)
    return y, out


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


def _pairs(x: torch.Tensor) -> bool:
    """Whether the one-row kernel, compiled, may read x [P, B, N] (fp16) as int32 pairs: 4-byte aligned, even
    strides."""
    return (x.dtype == torch.float16 and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
            and x.stride(1) % 2 == 0)


def _precision(t: torch.Tensor) -> str:
    """A dot's input precision for ``t``'s dtype: fp32 inputs in full (as the interpreter has only that)."""
    return "ieee" if interpreting() or t.dtype == torch.float32 else "tf32"
