"""Reading packed codes in the decode kernels: loading a tile's code words, turning codes into values (a table
look-up, or for a grid codec a computed value), and the tables' alignment that the look-ups rely on.

Packed layout (``esm_turbo.quant.packing``, :class:`~esm_turbo.quant.layout.CodeLayout`): the codes of one token-head
form a little-endian bit stream; each group of 8 channels is one word of ``code_bits`` bytes whose field r holds
channel 8g + r. Sign planes are 1-bit streams (byte g, bit r). Index and sign fuse into one code ``2·idx + sign``
looked up in a per-(head, channel) table ``tab[h, c, code] = c[idx] ± ε`` (``tab[h, c, idx]`` without a residual).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant.layout import CachedCodes
from ..common import field_shift, field_width, interpreting, kernel_slots

ASM = tl.constexpr(not interpreting())  # inline PTX where the kernels are compiled


@triton.jit
def _load_codes(idx_ptr, sign_ptr, offs_t, tmask, D: tl.constexpr, CODE_BITS: tl.constexpr, SIGN: tl.constexpr,
                BLOCK_T: tl.constexpr, GRID: tl.constexpr):
    """The packed codes of BLOCK_T token rows: (words [BLOCK_T, D/8] int32 — 8 codes each — and sign bytes
    [BLOCK_T, D/8] int32, or the words again without a sign part); [BLOCK_T, D/8, 1] with ``GRID``, whose
    codes become values without a look-up: loaded three-dimensional, the tile keeps a token's groups in one
    thread (a load is what anchors Triton's layout; a 2-D word broadcast to 3-D got a layout of per-thread
    slivers, shuffles and spills, SASS sm_90)."""
    D8: tl.constexpr = D // 8
    NB: tl.constexpr = D * CODE_BITS // 8
    g = tl.arange(0, D8)
    if GRID:
        rows, cols, m = offs_t[:, None, None], g[None, :, None], tmask[:, None, None]
    else:
        rows, cols, m = offs_t[:, None], g[None, :], tmask[:, None]
    if CODE_BITS == 4:  # a group of 8 codes is one aligned int32
        word = tl.load(idx_ptr.to(tl.pointer_type(tl.int32)) + rows * D8 + cols, mask=m, other=0)
    elif CODE_BITS == 2:  # one aligned int16 (a token's run of them loads as vectors; byte pairs did not)
        # at most 4 a vector (8 bytes): a token's groups then lie in two threads, as 4-bit words' do, so a tile of
        # 4-bit keys and 2-bit values (the 3.0-bit default) keeps the layout of the 4-bit one; a vector of a whole
        # token (16 bytes) put each token in one thread, 64 query values a thread, and walked 1.24x slower (H200)
        at = tl.max_contiguous(rows * D8 + cols, [1, 4, 1] if GRID else [1, 4])
        word = tl.load(idx_ptr.to(tl.pointer_type(tl.int16)) + at, mask=m, other=0).to(tl.int32) & 0xFFFF
    else:
        word = tl.zeros(cols.shape, dtype=tl.int32) + tl.zeros(rows.shape, dtype=tl.int32)
        for i in tl.static_range(CODE_BITS):
            byte = tl.load(idx_ptr + rows * NB + cols * CODE_BITS + i, mask=m, other=0)
            word = word | (byte.to(tl.int32) << (8 * i))
    sb = word
    if SIGN:
        sb = tl.load(sign_ptr + rows * D8 + cols, mask=m, other=0).to(tl.int32)
    return word, sb


@triton.jit
def _decode_codes(word, sb, tab_ptr, shift, mask, D: tl.constexpr, SIGN: tl.constexpr, NTAB: tl.constexpr,
                  FIXED: tl.constexpr, ROWS: tl.constexpr, GRID: tl.constexpr, SUBN: tl.constexpr):
    """Codes from ``_load_codes`` → [BLOCK_T, D/8, 8] float32; element (t, g, r) is channel 8g + r, its field
    of the group word at ``shift`` with ``mask`` ([1, 1, 8], ``_field_layout``: constants when every head
    shares one layout, ``FIXED``), looked up in that channel's row of the head's table [D, codes] (float16 or
    float32; NTAB = D·codes; L1 hits; a register tl.gather measured slower).

    A look-up's address is ``base | code·size`` — an OR, not a 64-bit add: every table row starts on a
    multiple of its own size (codes a power of two, :func:`aligned_table`) — plus the rest of the row's
    offset, a constant folded into the load. ``base`` is the head's table (the row offset all constant: a
    token's channels in one thread) or, ``ROWS``, the row of channel 8g (tiles that spread a token's groups
    over threads). With fixed fields the code leaves its word already scaled by the element size: a look-up
    costs a shift, a LOP3 and a move (the address's high half) where a shift, a bit-field extract and a LEA
    pair were four (SASS, sm_90).

    ``GRID`` > 0 (a grid codec, whose code j decodes to j; words [BLOCK_T, D/8, 1]): j·2^−GRID, no memory
    access — the code OR-ed into the mantissa of 1.0 (a shift and one LOP3), then 1 subtracted (exact: j < 2^GRID
    fits the mantissa; folding the 1 into the query and the sums instead cancelled past the tolerance rule at
    4 + 1 bits). Fixed fields without a sign plane skip the shift: j·2^(pos − 23), ``_grid_position``.
    ``_walk`` scales back by :func:`_grid_factor`.

    ``SUBN`` (with ``GRID``): the code's bits masked in a word of exponent zero *are* the float32 subnormal
    j·2^(pos − 149), exact — no exponent OR-ed in and no 1 subtracted: a shift and an AND a value, or one AND
    for fixed fields read in place. Their products with a query or softmax weight scaled up (``_walk``) are
    normal; the FMA units take subnormal operands at full rate (no ``.ftz``)."""
    r = tl.arange(0, 8)[None, None, :]
    if GRID and SUBN:  # j·2^(pos − 149): a subnormal's mantissa holds the field, at bit 0 or where it lies
        if SIGN:
            cb = ((word >> shift) & mask) * 2 + ((sb >> r) & 1)
        elif FIXED:
            pos = _grid_position(shift, mask)
            cb = (word >> (shift - pos)) & (mask << pos)
        else:
            cb = (word >> shift) & mask
        val = cb.to(tl.float32, bitcast=True)
    elif GRID:  # grid codecs: code j is the value j, computed (scaled by a power of two) — no look-up
        P: tl.constexpr = 23 - GRID  # the code's lowest bit in the mantissa
        if SIGN:
            cb = ((((word >> shift) & mask) * 2 + ((sb >> r) & 1)) << P) | 0x3F800000
        else:
            if FIXED:  # fields left where they lie (one shift for the top ones, shared): j·2^(pos − 23)
                pos = _grid_position(shift, mask)
                cb = word >> (shift - pos)
                top = mask << pos
            else:
                cb = (word >> shift) << P
                top = mask << P
            # the field's bits and the exponent of 1.0 in one LOP3 (from two immediates ptxas made two)
            cb = _mask_or(cb, tl.broadcast_to(top, cb.shape), tl.full(cb.shape, 0x3F800000, tl.int32))
        val = cb.to(tl.float32, bitcast=True) - 1.0
    else:
        L: tl.constexpr = 2 if tab_ptr.dtype.element_ty.primitive_bitwidth == 32 else 1  # log2 element bytes
        w = word[:, :, None]
        if SIGN:
            cb = (((w >> shift) & mask) * 2 + ((sb[:, :, None] >> r) & 1)) << L
        elif FIXED:  # constant shifts: one shift (either way) and the masking LOP3
            cb = tl.where(shift >= L, w >> (shift - L), w << (L - shift)) & (mask << L)
        else:
            cb = ((w >> shift) & mask) << L
        NT: tl.constexpr = NTAB // D  # codes per channel
        group = tl.arange(0, D // 8)[None, :, None] * (8 * NT)  # offset of channel 8g's row
        if ROWS:
            base, rest = tab_ptr + group, r * NT
        else:
            base, rest = tab_ptr, group + r * NT
        row = base.to(tl.uint64, bitcast=True)
        addr = ((row >> 32) << 32) | ((row & 0xFFFFFFFF).to(tl.uint32) | cb.to(tl.uint32)).to(tl.uint64)
        val = tl.load(addr.to(tab_ptr.dtype, bitcast=True) + rest).to(tl.float32)
    return val


@triton.jit
def _grid_position(shift, mask):
    """Where ``_decode_codes`` reads each fixed field of a grid code (``_field_layout``'s constants, [1, 1, 8]):
    its lowest bit once in the mantissa's place. A field within bits [0, 23) is OR-ed into the
    mantissa of 1.0 in place — no shift: it decodes to j·2^(pos − 23), exact — and the fields above share one
    9-bit shift of their word (a word holds ≤ 32 bits). A shift per value was a fifth of the walk's
    instructions (128 of 691 a tile, SASS sm_90); :func:`_grid_factor` scales the query and the value sums back."""
    high = ((mask << shift) >> 23) != 0  # (an arithmetic shift: a field up to bit 31 makes it negative)
    return tl.where(high, shift - 9, shift)


#: log2 of the scale a subnormal walk (``SUBN``) keeps its scores at (2^−SUB) and its softmax weights at (2^SUB),
#: so that their products with subnormal codes are normal: the query is scaled by 2^(149 − pos − SUB), |q̃| < 2^75
#: stays finite; a weight is at most 2^(8 + SUB), a run's sums at most 2^(104 + 16) over 2^16 tiles; a product
#: rounds to a subnormal only under 2^−30 of a score's unit, and then errs by at most 2^−54 of one
SUB = tl.constexpr(96)
SUB_UP = tl.constexpr(2.0 ** 96)


@triton.jit
def _grid_factor(lay, SHIFTLESS: tl.constexpr, GRID: tl.constexpr, SUBN: tl.constexpr):
    """[1, 8] powers of two that undo ``_decode_codes``'s scale of a grid code per field: 2^(23 − pos) for fields
    read in place (``SHIFTLESS``: fixed fields, no sign plane), else 2^GRID. Exact. ``SUBN``: 2^(149 − pos − SUB)
    for the subnormal codes j·2^(pos − 149) (pos 0 unless read in place)."""
    if SUBN:
        if SHIFTLESS:
            pos = _grid_position(lay[0], lay[1])
        else:
            pos = tl.zeros([1, 1, 8], tl.int32)
        e = (149 - SUB) - pos
    elif SHIFTLESS:
        e = 23 - _grid_position(lay[0], lay[1])
    else:
        e = tl.full([1, 1, 8], GRID, tl.int32)
    return tl.reshape(((e + 127) << 23).to(tl.float32, bitcast=True), (1, 8))


@triton.jit
def _mask_or(x, m, e):
    """``(x & m) | e`` as one ``lop3`` (PTX; Triton's interpreter, which runs none, computes it)."""
    if ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r", [x, m, e], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return (x & m) | e


@triton.jit
def _prefetch_l2(ptrs):
    """Requests the 128-byte lines at ``ptrs`` into L2 (PTX ``prefetch.global.L2``; nothing under the interpreter)."""
    if ASM:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)



@triton.jit
def _field_layout(lay_ptr, FIELDS: tl.constexpr):
    """(shift, mask) [1, 1, 8] of the 8 code fields of a group word (the same in every group, see
    ``esm_turbo.quant.allocation``). ``FIELDS`` ≥ 0: every head shares them, compile-time constants (field j
    spans bits [b_j, b_{j+1}) with b_j at bits 6j of FIELDS, ``esm_turbo.quant.packing.packed_shifts``); −1:
    loaded from this head's layout row (``shift | mask << 8``), 8 values, kept in registers."""
    r = tl.arange(0, 8)[None, None, :]
    if FIELDS >= 0:
        shift = tl.zeros([1, 1, 8], dtype=tl.int32)
        mask = tl.zeros([1, 1, 8], dtype=tl.int32)
        for j in tl.static_range(8):
            shift = tl.where(r == j, field_shift(FIELDS, j), shift)
            mask = tl.where(r == j, (1 << field_width(FIELDS, j)) - 1, mask)
    else:
        lay = tl.load(lay_ptr + r)
        shift = lay & 255
        mask = (lay >> 8) & 255
    return shift, mask



def slot_parts(keys: CachedCodes, values: CachedCodes, stand_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernels' slot pointers: both kinds' slot words ([B, 1, T_cap, 1] or a paged pool's [slots, 1,
    block, 1], contiguous: one slot a token and kind), or ``stand_in`` twice where the codes have no slots (the kernels
    are then compiled not to read them)."""
    if not kernel_slots(keys.slots, values.slots):
        return stand_in, stand_in
    return keys.slots, values.slots


def aligned_table(tab: torch.Tensor) -> torch.Tensor:
    """A code table [H, d, codes] as the decode kernels read it: ``codes`` a power of two (padded with zeros
    if not) and every row starting on a multiple of its own size, as a table from the CUDA caching allocator
    already does (it is returned as is; else a copy), for the look-ups OR a code's offset into its row's
    address (``_decode_codes``)."""
    codes = triton.next_power_of_2(tab.shape[-1])
    row = codes * tab.element_size()
    if codes == tab.shape[-1] and tab.is_contiguous() and tab.data_ptr() % row == 0:
        return tab
    buf = tab.new_zeros(tab.shape[0] * tab.shape[1] * codes + codes)
    skip = (-buf.data_ptr() % row) // tab.element_size()
    out = buf[skip:skip + tab.shape[0] * tab.shape[1] * codes].view(*tab.shape[:2], codes)
    out[..., :tab.shape[-1]] = tab
    return out

