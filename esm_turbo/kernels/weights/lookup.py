"""4-bit code words into weight values, in registers (Triton): each int32 word holds eight codes, each looked up in the
layer's 16-entry fp16 codebook with PTX ``prmt`` byte permutes over the codebook's bytes (about 2.6 integer
instructions a code, no memory access; Triton's interpreter, which runs no PTX, gathers through memory instead), and
a tile's codes requested a tile ahead of their use. Shared by the matmul and dequantize kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
