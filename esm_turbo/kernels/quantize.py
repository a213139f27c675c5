"""Fused quantize-and-pack of a layer's new keys *and* values into the cache (Triton), one launch:
rotation, affine, LUT search, index packing and sign bits (or one combined code ``2·idx + sign``).
Reference: ``esm_turbo.ops.compressed.quantize_pack_reference`` (per tensor kind).

For each (sequence b, head h) and token n < S: ``y = (x Πᵀ − offset) / scale``; ``idx = #{bounds < y}``
(``torch.searchsorted`` semantics); ``sign = y ≥ c[idx]``; both packed into the cache rows
``pos[b] + n`` (the layout of ``esm_turbo.quant.packing``), or a paged cache's through its block table. A grid
codec's (``VectorQuantizer.grid``) evenly spaced levels are found by rounding, not by comparing with every bound
(:func:`_grid_code`).

Constants: ``INDEX_BITS`` (``KINDEX_BITS`` / ``VINDEX_BITS``) are a kind's index bits, the sign not counted
(:attr:`CodeLayout.index_bits`); ``PART_T`` is the stored parts' token axis (``part.shape[2]``: a contiguous cache's
capacity, a paged pool's block size).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..quant.layout import CodeLayout
from .common import (FP_FUSION, dot_precision, field_shift, field_width, interpreting, kernel_slots, load_rows,
                     part_or, rotate, split8, split16, split_counters, token_strides)
from .decode.codes import _field_layout


@triton.jit
def _quantize_one(x_ptr, sxb, sxh, sxs, rot_ptr, offset_ptr, scale_ptr, bounds_ptr, cent_ptr, lay_ptr, idx_ptr,
                  sign_ptr, pos_ptr, pages_ptr, PW, h, b, s_idx, nmask, H, PART_T, slot_ptr, tab_ptr, scratch_ptr,
                  count_ptr, tok, unit,
                  D: tl.constexpr, INDEX_BITS: tl.constexpr, K: tl.constexpr, FIELDS: tl.constexpr, SIGN: tl.constexpr,
                  COMBINE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SPLIT16: tl.constexpr,
                  PER_SEQ: tl.constexpr, BY_POSITION: tl.constexpr, GRID: tl.constexpr, ASM: tl.constexpr,
                  PAGED: tl.constexpr, SLOTS: tl.constexpr, RELATIVE: tl.constexpr, NT: tl.constexpr):
    """Encode BLOCK_N tokens — sequence ``b``, position ``s_idx`` among the new ones (each a scalar or
    [BLOCK_N]; ``nmask``: which exist) — of head ``h`` of one tensor kind into its cache part (K levels per
    channel's LUT, bounds [H, K-1, D] level-major; codes at the field shifts ``FIELDS`` compiled in when every
    head shares them, else those of this head's layout row ``lay_ptr``). ``PAGED``: the parts are pools of blocks of
    PART_T tokens, position t of sequence b in the slot at ``pages_ptr[b·PW + t // PART_T]``, row ``t % PART_T``.

    A prefill (``PER_SEQ``) has many programs and is bound by instructions. With ``BY_POSITION`` (field shifts
    compiled in) the channels are split by their place in a group of 8, whose widths are then constants, so a
    w-bit channel runs 2^w − 1 compares, not K − 1 (:func:`_field_code`); otherwise the compares run as a loop
    that carries the centroid reached for the sign. A decode step has a few programs and is bound by their
    latency: the compares are unrolled and the centroid is gathered once after them (each measured faster
    on an H100, ``docs/kernels.md``). ``GRID`` (a grid codec: level j
    of every channel is j): no compares and no gather, the codes are rounded (:func:`_grid_code`). ``SLOTS``: each
    token's worst-coded value over all heads kept as its slot word (:func:`_pick_slot`; ``tok``: the tokens' places
    in this kind's scratch, ``unit``: this token block's arrival count)."""
    offs_d = tl.arange(0, D)
    zero = tl.zeros((BLOCK_N,), dtype=tl.int64)
    x_rows = zero + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + s_idx.to(tl.int64) * sxs
    x = load_rows(x_ptr, x_rows, nmask, D)
    rot_ptr += h * (1 + (SPLIT16 == 2)) * D * D

    D8: tl.constexpr = D // 8
    g = tl.arange(0, D8)
    r = tl.arange(0, 8)
    pos = tl.load(pos_ptr + (zero + b), mask=nmask, other=0)
    if PAGED:  # one table entry per token (a decode step's tokens are in different sequences)
        t = pos + s_idx
        slot = tl.load(pages_ptr + (zero + b) * PW + t // PART_T, mask=nmask, other=0)
        rows = (slot.to(tl.int64) * H + h) * PART_T + t % PART_T
        srows = slot.to(tl.int64) * PART_T + t % PART_T  # the token part's rows (one "head")
    else:
        rows = (b * H + h).to(tl.int64) * PART_T + pos + s_idx  # cache rows [BLOCK_N]
        srows = b.to(tl.int64) * PART_T + pos + s_idx
    if BY_POSITION:
        # WIDE (64-token blocks, one warpgroup's wgmma): Π's rows taken place-major (product column j·D/8 + g is
        # channel 8g + j) leave the place j in the dot's register index, so the places split apart without moving
        # data, and the compares run channel-major ([D/8, N]: a thread's values share two channels, so few bound
        # loads). 32-token blocks run faster in channel order, token-major
        WIDE: tl.constexpr = BLOCK_N >= 64
        if WIDE:
            perm = (offs_d % D8) * 8 + offs_d // D8
        else:
            perm = offs_d
        y = _affine(rotate(x, rot_ptr, perm, D, PRECISION, SPLIT16), offset_ptr, scale_ptr, h * D + perm)
        if WIDE:
            y = tl.permute(tl.reshape(y, (BLOCK_N, 8, D8)), (0, 2, 1))
            word = tl.zeros((D8, BLOCK_N), dtype=tl.int32)
        else:
            word = tl.zeros((BLOCK_N, D8), dtype=tl.int32)
        sword = tl.zeros_like(word)
        ys = split8(tl.reshape(y, (BLOCK_N, D8, 2, 2, 2)))
        for j in tl.static_range(8):
            yj = ys[j]
            if WIDE:
                yj = tl.trans(yj)
            code, s = _field_code(yj, j, h, bounds_ptr, cent_ptr, D, K, FIELDS, SIGN, COMBINE, WIDE, GRID, ASM)
            word |= code << field_shift(FIELDS, j)
            sword |= s << j
        if WIDE:
            word = tl.trans(word)
            sword = tl.trans(sword)
    else:
        y = _affine(rotate(x, rot_ptr, offs_d, D, PRECISION, SPLIT16), offset_ptr, scale_ptr, h * D + offs_d)
        cent_rows = cent_ptr + (h * D + offs_d) * K  # centroids [H, D, K]
        bound_row = bounds_ptr + h * ((K - 1) * D) + offs_d  # level k at bound_row + k·D
        if GRID:
            idx, s = _grid_code(y, _top_index(offs_d, lay_ptr + h * D, FIELDS, COMBINE)[None, :], SIGN)
        elif PER_SEQ:  # bounds ascend, so y > b_k holds for a prefix of k: the last level passed is idx
            idx = tl.zeros((BLOCK_N, D), dtype=tl.int32)
            cy = tl.zeros((BLOCK_N, D), dtype=tl.float32) + tl.load(cent_rows)[None, :]
            for k in range(K - 1):
                up = y > tl.load(bound_row + k * D)[None, :]
                idx += up.to(tl.int32)
                if SIGN:
                    cy = tl.where(up, tl.load(cent_rows + k + 1)[None, :], cy)
            s = (y >= cy).to(tl.int32)
        else:
            idx = _levels_passed(y, bound_row, K - 1, D, False, ASM)
            if SIGN:
                s = (y >= tl.load(cent_rows[None, :] + idx)).to(tl.int32)

        if SIGN:
            if COMBINE:  # one code 2·idx + sign of INDEX_BITS + 1 bits
                idx = idx * 2 + s
            else:
                sword = tl.sum(tl.reshape(s, (BLOCK_N, D8, 8)) << r[None, None, :], axis=2)
        if FIELDS >= 0:  # field j of every group word at bit field_shift(FIELDS, j) (packing.packed_shifts)
            shift = tl.zeros((8,), dtype=tl.int32)
            for j in tl.static_range(8):
                shift = tl.where(r == j, field_shift(FIELDS, j), shift)
            word = tl.sum(tl.reshape(idx, (BLOCK_N, D8, 8)) << shift[None, None, :], axis=2)
        else:
            shift = tl.load(lay_ptr + h * D + offs_d) & 255
            word = tl.sum(tl.reshape(idx << shift[None, :], (BLOCK_N, D8, 8)), axis=2)  # the fields do not overlap
    if SIGN and not COMBINE:  # the sign bits of a group of 8 in one byte
        tl.store(sign_ptr + rows[:, None] * D8 + g[None, :], sword.to(tl.uint8), mask=nmask[:, None])
    else:
        sword = word  # no sign plane (never read)
    _store_words(idx_ptr, rows, word, nmask, D, INDEX_BITS + COMBINE)
    if SLOTS:
        _pick_slot(tl.reshape(y, (BLOCK_N, D8, 8)), word, sword, h, scale_ptr, lay_ptr, tab_ptr, slot_ptr, srows,
                   scratch_ptr, count_ptr, tok, unit, nmask, H, D, FIELDS, SIGN and not COMBINE, GRID, RELATIVE, NT)


@triton.jit
def _pick_slot(y3, word, sword, h, scale_ptr, lay_ptr, tab_ptr, slot_ptr, srows, scratch_ptr, count_ptr, tok, unit,
               nmask, H, D: tl.constexpr, FIELDS: tl.constexpr, PLANE: tl.constexpr, GRID: tl.constexpr,
               RELATIVE: tl.constexpr, NT: tl.constexpr):
    """The slot (``esm_turbo.quant.slots``, one a token) of the program's tokens over all heads. y3 [N, D/8, 8]: the
    affine values (channel 8g + r at [n, g, r]); word / sword [N, D/8]: their packed group words and sign bytes
    (``PLANE``), decoded back to ŷ as the decode kernels read them (the code itself for a grid codec, else its value
    in the head's table ``tab_ptr`` [H, D, NT]). Each program offers its head's worst value of each token —
    (error's float bits << 32 | slot word) in int64, so one ``atomic_max`` in the token's scratch keeps the largest
    error over the heads — and the last of the H programs of its token block to arrive (``count_ptr + unit``) takes
    the words (resetting scratch and count to zero for the next launch) into the slot part's rows ``srows``."""
    D8: tl.constexpr = D // 8
    r = tl.arange(0, 8)[None, None, :]
    chan = tl.arange(0, D8)[None, :, None] * 8 + r  # [1, D8, 8]
    shift, mask = _field_layout(lay_ptr + h * D, FIELDS)
    code = (word[:, :, None] >> shift) & mask
    if PLANE:
        code = code * 2 + ((sword[:, :, None] >> r) & 1)
    if GRID:
        y_hat = code.to(tl.float32)
    else:
        y_hat = tl.load(tab_ptr + (h * D + chan) * NT + code).to(tl.float32)
    diff = y3 - y_hat
    err = tl.abs(diff)
    if not RELATIVE:
        err = err * tl.load(scale_ptr + h * D + chan)
    best, c = tl.max(tl.reshape(err, (err.shape[0], D)), axis=1, return_indices=True)
    offs_d = tl.arange(0, D)
    delta = tl.sum(tl.where(offs_d[None, :] == c[:, None], tl.reshape(diff, (diff.shape[0], D)), 0.0), axis=1)
    bits = delta.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    slot = ((h * D + c) << 16) | bits
    key = (best.to(tl.int32, bitcast=True).to(tl.int64) << 32) | slot.to(tl.int64)
    tl.atomic_max(scratch_ptr + tok, key, mask=nmask, sem="relaxed")
    tl.debug_barrier()  # every thread's offer made before the (one-thread, releasing) count
    if tl.atomic_add(count_ptr + unit, 1, sem="acq_rel") == H - 1:
        won = tl.atomic_xchg(scratch_ptr + tok, tl.zeros_like(key), mask=nmask, sem="relaxed")
        tl.store(slot_ptr + srows, won.to(tl.int32), mask=nmask)
        tl.store(count_ptr + unit, 0)  # every head has offered: zero again for the next launch


@triton.jit
def _affine(xr, offset_ptr, scale_ptr, at):
    """(x Πᵀ − offset) / scale of rotated rows xr [N, E], the channels' offset and scale at ``at`` [E]: one
    multiply-add per value (a division per value costs seven instructions)."""
    inv = 1.0 / tl.load(scale_ptr + at)
    return xr * inv[None, :] - (tl.load(offset_ptr + at) * inv)[None, :]


@triton.jit
def _field_code(yj, J: tl.constexpr, h, bounds_ptr, cent_ptr, D: tl.constexpr, K: tl.constexpr,
                FIELDS: tl.constexpr, SIGN: tl.constexpr, COMBINE: tl.constexpr, CHANNEL_MAJOR: tl.constexpr,
                GRID: tl.constexpr, ASM: tl.constexpr):
    """Codes of yj [N, D/8] (or [D/8, N] if CHANNEL_MAJOR; affine domain; channels 8g + J, whose field width the
    shifts FIELDS fix): a w-bit channel's bounds past its 2^w − 1 are +inf (``lut_bounds``), so only those are
    compared; the sign's centroid is gathered after (``GRID``: both rounded, :func:`_grid_code`). Returns (code,
    sign bit) int32 shaped as yj; code = 2·idx + sign if COMBINE."""
    W: tl.constexpr = field_width(FIELDS, J) - COMBINE
    if GRID:
        idx, s = _grid_code(yj, (1 << W) - 1.0, SIGN)
    else:
        chan = tl.arange(0, D // 8) * 8 + J
        row = bounds_ptr + h * ((K - 1) * D) + chan  # level k at row + k·D: constant offsets from one address
        idx = _levels_passed(yj, row, (1 << W) - 1, D, CHANNEL_MAJOR, ASM)
        s = tl.zeros(yj.shape, dtype=tl.int32)
        if SIGN:
            s = (yj >= tl.load(_per_channel((h * D + chan) * K, CHANNEL_MAJOR) + cent_ptr + idx)).to(tl.int32)
    if COMBINE:
        idx = idx * 2 + s
    return idx, s


@triton.jit
def _grid_code(y, top, SIGN: tl.constexpr):
    """(index, sign bit) int32 of y (any shape; affine domain) on a grid codec's levels, where the code j of every
    channel decodes to j (``esm_turbo.quant.fit._fold_grid``): with a sign residual index i's centroid is 2i + 0.5 and
    its upper bound 2i + 1.5, so ``#{bounds < y} = clamp(⌈(y − 1.5)/2⌉, 0, top)`` and ``sign = y ≥ 2i + 0.5``;
    without one the levels are i, so ``clamp(⌈y − 0.5⌉, 0, top)``. ``top`` (float32, broadcast to y): the channel's
    last index, 2^w − 1. The LUT search's answers, ties included: y·0.5 − 0.75 and y − 0.5 are exact wherever
    the answer is not clamped (|y| < 2^22), so a y on a bound rounds as ``#{bounds < y}`` counts it."""
    if SIGN:
        t = tl.ceil(y * 0.5 - 0.75)
    else:
        t = tl.ceil(y - 0.5)
    idx = tl.minimum(tl.maximum(t, 0.0), top)
    s = tl.zeros(y.shape, dtype=tl.int32)
    if SIGN:
        s = (y >= idx * 2.0 + 0.5).to(tl.int32)
    return idx.to(tl.int32), s


@triton.jit
def _top_index(chan, lay_ptr, FIELDS: tl.constexpr, COMBINE: tl.constexpr):
    """The last index 2^w − 1 (float32 [C]) of channels ``chan`` [C] of one head: from the field shifts FIELDS when
    every head shares them, else from the head's layout row ``lay_ptr`` (field mask at bit 8); a combined sign
    bit (``COMBINE``) is not the index's."""
    if FIELDS >= 0:
        top = tl.zeros(chan.shape, dtype=tl.float32)
        for j in tl.static_range(8):
            width = field_width(FIELDS, j) - COMBINE
            top = tl.where(chan % 8 == j, (1 << width) - 1.0, top)
    else:
        top = ((tl.load(lay_ptr + chan) >> 8) >> COMBINE).to(tl.float32)
    return top


@triton.jit
def _levels_passed(y, row, LEVELS: tl.constexpr, D: tl.constexpr, CHANNEL_MAJOR: tl.constexpr, ASM: tl.constexpr):
    """#{k < LEVELS : y > bound_k} as int32, shaped as y; bound k of y's channels at ``row + k·D`` (a vector
    along y's channel axis, see :func:`_per_channel`), compares unrolled."""
    above = tl.zeros(y.shape, dtype=tl.float32)
    for k in tl.static_range(LEVELS):
        above += _above(y, _per_channel(tl.load(row + k * D), CHANNEL_MAJOR), ASM)
    return above.to(tl.int32)


@triton.jit
def _above(y, bound, ASM: tl.constexpr):
    """1.0 where y > bound (broadcast to y's shape), else 0.0, float32. Compiled as one FSET.BF per value (inline
    PTX ``set.gt.f32.f32``), which a float add counts; a compare cast to an integer took a compare, a select and an
    add (a tenth of a 1024-token prefill's launch). ``ASM`` False:
    Triton's interpreter, which runs no PTX, compares."""
    bound = tl.broadcast_to(bound, y.shape)
    if ASM:
        return tl.inline_asm_elementwise("set.gt.f32.f32 $0, $1, $2;", "=f,f,f", [y, bound], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return (y > bound).to(tl.float32)


@triton.jit
def _per_channel(v, CHANNEL_MAJOR: tl.constexpr):
    """A per-channel vector [C] broadcast along the tokens of a [C, N] (CHANNEL_MAJOR) or [N, C] tensor."""
    if CHANNEL_MAJOR:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def _store_words(idx_ptr, rows, word, nmask, D: tl.constexpr, WIDTH: tl.constexpr):
    """Group words [N, D/8] (8 codes of WIDTH bits on average each) into cache rows ``rows`` [N]."""
    D8: tl.constexpr = D // 8
    NB: tl.constexpr = D * WIDTH // 8
    g = tl.arange(0, D8)
    if WIDTH == 4:  # a group of 8 codes is one aligned int32
        tl.store(idx_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * D8 + g[None, :], word, mask=nmask[:, None])
    else:
        for i in tl.static_range(WIDTH):
            tl.store(idx_ptr + rows[:, None] * NB + g[None, :] * WIDTH + i,
                     ((word >> (8 * i)) & 255).to(tl.uint8), mask=nmask[:, None])


@triton.jit
def _quantize_pack_kernel(k_ptr, skb, skh, sks, k_rot, k_offset, k_scale, k_bounds, k_cent, k_lay, k_idx, k_sign,
                          v_ptr, svb, svh, svs, v_rot, v_offset, v_scale, v_bounds, v_cent, v_lay, v_idx, v_sign,
                          pos_ptr, pages_ptr, PW, B, H, S, PART_T, k_slot, v_slot, k_tab, v_tab, scratch_ptr,
                          count_ptr,
                          D: tl.constexpr, KINDEX_BITS: tl.constexpr, KK: tl.constexpr, KFIELDS: tl.constexpr,
                          KSIGN: tl.constexpr, KCOMB: tl.constexpr, VINDEX_BITS: tl.constexpr, VK: tl.constexpr,
                          VFIELDS: tl.constexpr, VSIGN: tl.constexpr, VCOMB: tl.constexpr,
                          BLOCK_N: tl.constexpr, PER_SEQ: tl.constexpr, PRECISION: tl.constexpr,
                          KSPLIT: tl.constexpr, VSPLIT: tl.constexpr, KPOS: tl.constexpr, VPOS: tl.constexpr,
                          KGRID: tl.constexpr, VGRID: tl.constexpr, ASM: tl.constexpr, PAGED: tl.constexpr,
                          SLOTS: tl.constexpr, RELATIVE: tl.constexpr, KNT: tl.constexpr, VNT: tl.constexpr):
    """Programs [0, H) of grid axis 0 encode keys, [H, 2H) values. ``PER_SEQ`` (a prefill, S > 1): grid
    (2·H, cdiv(S, BLOCK_N), B), each program BLOCK_N new tokens of one sequence; else (a decode step, S = 1):
    grid (2·H, cdiv(B, BLOCK_N)), each program the new token of BLOCK_N sequences, so one head's Π serves
    many sequences. No division per token either way (it cost a quarter of the instructions). ``SLOTS``: the values'
    scratch and arrival counts follow the keys' (B·S tokens, one count a token block)."""
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PER_SEQ:
        b = tl.program_id(2)
        s_idx = offs
        nmask = offs < S
        unit = b * tl.num_programs(1) + tl.program_id(1)
    else:
        b = offs
        s_idx = tl.zeros((BLOCK_N,), dtype=tl.int32)
        nmask = offs < B
        unit = tl.program_id(1)
    tok = b * S + s_idx
    units = tl.num_programs(1) * tl.num_programs(2)
    if pid < H:
        _quantize_one(k_ptr, skb, skh, sks, k_rot, k_offset, k_scale, k_bounds, k_cent, k_lay, k_idx, k_sign,
                      pos_ptr, pages_ptr, PW, pid, b, s_idx, nmask, H, PART_T, k_slot, k_tab, scratch_ptr, count_ptr,
                      tok, unit, D, KINDEX_BITS, KK, KFIELDS, KSIGN, KCOMB, BLOCK_N, PRECISION, KSPLIT, PER_SEQ, KPOS,
                      KGRID, ASM, PAGED, SLOTS, RELATIVE, KNT)
    else:
        _quantize_one(v_ptr, svb, svh, svs, v_rot, v_offset, v_scale, v_bounds, v_cent, v_lay, v_idx, v_sign,
                      pos_ptr, pages_ptr, PW, pid - H, b, s_idx, nmask, H, PART_T, v_slot, v_tab,
                      scratch_ptr + B * S, count_ptr + units, tok, unit, D, VINDEX_BITS, VK, VFIELDS, VSIGN, VCOMB,
                      BLOCK_N, PRECISION, VSPLIT, PER_SEQ, VPOS, VGRID, ASM, PAGED, SLOTS, RELATIVE, VNT)


class _KindConsts(NamedTuple):
    """The constexprs of one tensor kind (keys or values) of ``_quantize_pack_kernel``."""
    bits: int  # index bits per value (on average)
    levels: int  # K: levels of each channel's LUT
    fields: int  # field shifts compiled in (packing.packed_shifts), or −1: each head's layout row is read
    sign: bool  # a sign residual
    combine: bool  # … stored fused with the index as one code 2·idx + sign
    split: int  # Π in fp32 (0), split into fp16 halves in the kernel (1) or read as halves (2)
    by_position: bool  # channels split by their place in a group of 8 (_quantize_one)
    grid: bool  # a grid codec's levels: codes rounded, not searched (_grid_code)


def quantize_pack_triton(k: torch.Tensor, v: torch.Tensor, k_tables: tuple, v_tables: tuple,
                         k_out: tuple, v_out: tuple, pos: torch.Tensor, k_code: CodeLayout, v_code: CodeLayout,
                         rot_halves: tuple | None = None, config: dict | None = None,
                         pages: torch.Tensor | None = None, slots: tuple | None = None,
                         one_kind: bool = False) -> None:
    """Same contract as ``quantize_pack_reference`` applied to keys and values, in one launch (CUDA).

    k, v [B,H,S,d] (strided views read in place); ``*_tables`` = (rot [H,d,d], offset [H,d], scale [H,d],
    bounds [H,K-1,d] (level-major: ``FusedTables.k_bounds``), centroids [H,d,K], field layout [H,d] int32 or
    empty: equal widths); ``*_out`` = (codes part, sign plane or empty) written in place; ``*_code``: how the codes
    are stored (:class:`~esm_turbo.quant.layout.CodeLayout`: shared field shifts are compiled in, else each head's
    layout row is read; a grid codec's codes are rounded instead of searched for); ``rot_halves``: (keys', values')
    Π in fp16 halves [H, 2, d, d] (``esm_turbo.ops.compressed.split_rotation``; empty: none), read for fp16 inputs
    instead of splitting Π in every program. ``pages`` [B, blocks] int32 (a paged cache; None or empty: contiguous):
    the parts are pools [slots, H, block, ·] written through it. ``config`` overrides block_n / num_warps / precision
    (``ieee`` fp32, or ``tf32x3``) / by_position / maxnreg (a register cap) for tuning. ``slots`` = (keys' slot part,
    values' slot part, keys' code table [H, d, codes], values' table, relative ranking) or None: each token's slot
    of each kind (one a token, ``esm_turbo.quant.slots``) written at its rows of the parts [B, 1, T_cap, 1] (a
    paged cache's pools [slots, 1, block, 1]) as ``quantize_pack_reference`` picks it. ``one_kind``: the kind passed as
    the keys alone is written (either kind: both run the same code), without slots; ``v`` and its tables and parts
    may be the keys', never read."""
    batch, heads, s, d = k.shape
    # 4 warps (2 spilled registers at 1024-token blocks); the block size is chosen below; tf32x3 (or the fp16 split)
    # keeps fp32 accuracy on tensor cores
    cfg = dict(block_n=None, num_warps=4, precision=dot_precision(k), by_position=True, maxnreg=None)
    cfg.update(config or {})
    if dot_precision(k) == "ieee":  # the interpreter has nothing else
        cfg["precision"] = "ieee"
    per_seq = s > 1
    k, k_strides = token_strides(k)
    v, v_strides = token_strides(v)
    halves = rot_halves or (k.new_empty(0), v.new_empty(0))

    def kind(x, tables, out, code: CodeLayout, rot16) -> tuple[tuple, _KindConsts]:
        """(kernel args of one kind, its constexprs)."""
        main, sign = out
        layout = tables[5]
        fields = code.kernel_fields()  # −1: each head's layout row is read; an empty part is never read
        split = split16(x, cfg["precision"])
        rot = rot16 if split and rot16.numel() else tables[0]
        args = (rot, *tables[1:5], part_or(layout, tables[4]), main, part_or(sign, main))
        # by position pays where it skips compares (allocated widths) or gathers the sign's centroid; equal
        # widths without a sign run the loop faster
        by_position = cfg["by_position"] and per_seq and fields >= 0 and (layout.numel() > 0 or code.has_sign)
        return args, _KindConsts(code.index_bits, tables[4].shape[-1], fields, code.has_sign,
                                 code.sign == "combined", 2 if rot is rot16 else int(split), by_position, code.grid)

    k_args, kc = kind(k, k_tables, k_out, k_code, halves[0])
    v_args, vc = kind(v, v_tables, v_out, v_code, halves[1])
    # 64-token blocks (WIDE in _quantize_one) for 3-bit codes split by position in prefills of 1024 tokens or more,
    # 32 where 64 runs slower: shorter prefills, 2- and 4-bit codes (docs/kernels.md)
    wide = per_seq and kc.by_position and vc.by_position and batch * s >= 1024 and kc.bits == vc.bits == 3
    block_n = cfg["block_n"] or (64 if wide else 32)
    # capped at 96 registers (108 uncapped, 8 bytes of stack), five 64-token programs share an SM: a 1024-token
    # prefill's 640 programs run in one wave, not 1.2 (caps at 32 tokens gained nothing)
    maxnreg = cfg["maxnreg"] or (96 if block_n >= 64 else None)
    kinds = 1 if one_kind else 2  # grid axis 0: keys' programs, then values'
    launch = ((kinds * heads, triton.cdiv(s, block_n), batch) if per_seq
              else (kinds * heads, triton.cdiv(batch, block_n)))
    paged = pages is not None and pages.numel() > 0
    if not paged:
        pages = pos  # never read
    slot_args, relative, nts = (pos,) * 6, False, (1, 1)  # never read without slots
    if slots is not None:
        k_slot, v_slot, k_tab, v_tab, relative = slots
        kernel_slots(k_slot, v_slot)
        k_tab, v_tab = k_tab.contiguous(), v_tab.contiguous()
        units = 2 * launch[1] * (launch[2] if per_seq else 1)
        slot_args = (k_slot, v_slot, k_tab, v_tab, split_counters(2 * batch * s, k.device, torch.int64),
                     split_counters(units, k.device))
        nts = (k_tab.shape[-1], v_tab.shape[-1])
    _quantize_pack_kernel[launch](
        k, *k_strides, *k_args, v, *v_strides, *v_args, pos, pages, pages.shape[-1], batch, heads, s,
        k_out[0].shape[2], *slot_args, D=d,
        KINDEX_BITS=kc.bits, KK=kc.levels, KFIELDS=kc.fields, KSIGN=kc.sign, KCOMB=kc.combine, VINDEX_BITS=vc.bits,
        VK=vc.levels, VFIELDS=vc.fields, VSIGN=vc.sign, VCOMB=vc.combine, BLOCK_N=block_n, PER_SEQ=per_seq,
        PRECISION=cfg["precision"], KSPLIT=kc.split, VSPLIT=vc.split, KPOS=kc.by_position, VPOS=vc.by_position,
        KGRID=kc.grid, VGRID=vc.grid, ASM=not interpreting(), PAGED=paged, SLOTS=slots is not None,
        RELATIVE=bool(relative), KNT=nts[0], VNT=nts[1], num_warps=cfg["num_warps"],
        maxnreg=maxnreg, enable_fp_fusion=FP_FUSION)
