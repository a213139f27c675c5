"""Fused decode attention over the packed, compressed KV cache (Triton).

The PyTorch reference with the same contract is ``esm_turbo.ops.compressed.compressed_attention_reference``.

Cached keys and values stay in each head's *affine domain* ``y = (x Πᵀ − offset) / scale`` of its codec, so no
key is ever rotated back: the score of a cached key is ``⟨q̃, ŷ⟩ + c0`` with ``q̃ = (q Πᵀ) ⊙ scale`` (``qt``,
prepared once per step) and ``c0 = ⟨q Πᵀ, offset⟩``, the same for every key of the query, so the walks drop it;
values are accumulated as ``Σ p ŷ`` and mapped back once at the end (``(· ⊙ scale + (Σ p) offset) Πᵥ``). The step's
own keys and values are never rotated: Π is orthogonal, so a new key's score less c0 is ``⟨q, k⟩ − c0`` and a
new value joins the output after the rotation back.

Packed layout (see ``esm_turbo.quant.packing``): for b ∈ {1,2,3,4} bits the indices of one token-head
form a little-endian bit stream with value j at bit ``b·j``; each group of 8 values is therefore a
b-byte word ``w_g`` and value ``8g + r`` is ``(w_g >> b·r) & (2^b − 1)``. Sign bits are the 1-bit stream
(``byte g``, bit ``r``). Index and sign fuse into one code ``2·idx + sign`` looked up in a per-(head,
channel) table ``tab[h, c, code] = c[idx] ± ε`` (``tab[h, c, idx]`` without a residual).

Three launches: ``_prep_kernel`` (grid H × token blocks: ``qt`` and ``c0``, on tensor cores), ``_prefix_kernel``
(grid B·H·S × splits, one query per program; each split walks its share of the prefix with an online softmax and
writes (m, l, acc); tiles stay [BLOCK_T, d/8, 8] so the packed words never need a reshape) — or, for a grid codec's
cache of equal widths (the default), ``_stream_kernel`` (stream-K: the queries' tiles cut in equal runs, one full wave
of programs, a partial per row a run meets) — then ``_merge_kernel`` (grid H × blocks of sequences, one read of the
head's Πᵥ per block) that merges the splits with log-sum-exp, maps the output back to the value domain, adds the
step's own tokens (full precision) and casts it to the query's dtype. On sm_90 and later a grid codec's prefix
kernel is launched while the prep kernel still runs (programmatic dependent launch: it requests its first codes,
then waits for the prep grid before it reads ``qt``). A small step (one query per sequence, few rows:
``one_launch``) takes one launch instead, ``_small_kernel``: split-K programs that rotate the query themselves, and
the last split of each (b, h) to finish merges. No dequantized tensor is written to global memory.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..quant.packing import packed_shifts
from .common import (FP_FUSION, dot_precision, field_shift, field_width, interpreting, load_rows, part_or, rotate,
                     split16, token_offsets, token_strides)

_LOG2E = tl.constexpr(1.4426950408889634)
_ASM = tl.constexpr(not interpreting())  # inline PTX where the kernels are compiled


@triton.jit
def _prep_kernel(q_ptr, sqb, sqh, sqs, k_rot, k_offset, k_scale, qt_ptr, c0_ptr, B, H, S, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, COLS: tl.constexpr, PRECISION: tl.constexpr, SPLIT16: tl.constexpr,
                 PDL: tl.constexpr):
    """Grid (H, cdiv(B·S, BLOCK_N)): the queries in head h's key affine domain, ``qt = (q Πₖᵀ) ⊙ scaleₖ``
    [B,H,S,D] and ``c0 = ⟨q Πₖᵀ, offsetₖ⟩`` [B,H,S], float32 (q strided), COLS output channels per dot (a whole
    [D, D] Π per dot spilled registers at D = 128, SASS sm_90). The step's own keys and values are not rotated:
    the merge takes them as they are (``_merge_kernel``). ``PDL``: the prefix kernel may launch at once (it waits
    for this grid before it reads ``qt``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < B * S
    rows = token_offsets(h, offs_n, S, H * S, S, 1)  # row of the contiguous outputs
    hd = h * D
    x = load_rows(q_ptr, token_offsets(h, offs_n, S, sqb, sqh, sqs), nmask, D)
    c0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(D // COLS):
        cols = c * COLS + tl.arange(0, COLS)
        z = rotate(x, k_rot + hd * D, cols, D, PRECISION, SPLIT16)
        c0 += tl.sum(z * tl.load(k_offset + hd + cols)[None, :], axis=1)
        tl.store(qt_ptr + rows[:, None] * D + cols[None, :], z * tl.load(k_scale + hd + cols)[None, :],
                 mask=nmask[:, None])
    tl.store(c0_ptr + rows, c0, mask=nmask)


@triton.jit
def _merge_kernel(c0_ptr, q_ptr, sqb, sqh, sqs, k_ptr, skb, skh, sks, v_ptr, svb, svh, svs, m_ptr, l_ptr, acc_ptr,
                  valid_ptr, v_scale_ptr, v_offset_ptr, v_rot_ptr, out_ptr, B, H, S, NS, NT, W,
                  D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_NS: tl.constexpr,
                  COLS: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (H, cdiv(B, BLOCK_B)): the S queries of BLOCK_B sequences of head h per program, so the head's Πᵥ is
    read once for all of them (one read per (b, h) cost more than the merge: 57 µs of a 15B-shaped B=64 call,
    results/gpu/decode_splits_session18_h100.txt). Tensors [BLOCK_B, BLOCK_S, …]: partials over the splits'
    axis first.

    The step's own tokens (q, k, v strided, any float dtype) stay in the value domain, unrotated: a key's score
    is ``⟨q, k⟩ − c0`` (``= ⟨q̃, y⟩``, the affine domain's score less the c0 its cached keys drop; Π orthogonal)
    and a value is added after the partials' sum ``Σ p ŷ ⊙ scale + (Σ p) offset`` is rotated back by Πᵥ."""
    h = tl.program_id(0)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_NS)
    rmask = (offs_b < B)[:, None] & (offs_s < S)[None, :]  # [BLOCK_B, BLOCK_S] queries that exist
    row = (offs_b[:, None] * H + h) * S + offs_s[None, :]  # their (b, h, s) rows

    # the step's own keys: each query × its sequence's S keys, log2 units
    b3, s3, d3 = offs_b.to(tl.int64)[:, None, None], offs_s.to(tl.int64)[None, :, None], offs_d[None, None, :]
    m3 = rmask[:, :, None]
    q = tl.load(q_ptr + b3 * sqb + h * sqh + s3 * sqs + d3, mask=m3, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b3 * skb + h * skh + s3 * sks + d3, mask=m3, other=0.0).to(tl.float32)
    c0 = tl.load(c0_ptr + row, mask=rmask, other=0.0)
    s_new = (tl.sum(q[:, :, None, :] * k[:, None, :, :], axis=3) - c0[:, :, None]) * _LOG2E  # [B_, queries, keys]
    kmask = rmask & (tl.load(valid_ptr + offs_b[:, None] * S + offs_s[None, :], mask=rmask, other=0) != 0)
    s_new = tl.where(kmask[:, None, :], s_new, float("-inf"))

    # partials of padded queries (s ≥ S) or rows (b ≥ B) are never written: masked at the load
    part = (((offs_b[:, None] * H + h) * NS)[None, :, :] + offs_n[:, None, None]) * BLOCK_S  # [BLOCK_NS, BLOCK_B, 1]
    part = part + offs_s[None, None, :]
    if W > 0:  # stream-K partials (``_stream_kernel``): as many as programs whose runs meet the query's row
        first, last = _runs_meeting(row, NT, W)
        count = last - first + 1
    else:
        count = tl.zeros_like(row) + NS
    pmask = (offs_n[:, None, None] < count[None, :, :]) & rmask[None, :, :]
    m = tl.load(m_ptr + part, mask=pmask, other=float("-inf"))  # [BLOCK_NS, BLOCK_B, BLOCK_S]
    lp = tl.load(l_ptr + part, mask=pmask, other=0.0)
    accp = tl.load(acc_ptr + part[:, :, :, None] * D + offs_d[None, None, None, :], mask=pmask[:, :, :, None],
                   other=0.0)
    mx = tl.maximum(tl.max(m, axis=0), tl.max(s_new, axis=2))  # [BLOCK_B, BLOCK_S]
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(m - mx[None, :, :])
    p_new = tl.exp2(s_new - mx[:, :, None])
    l_old = tl.sum(w * lp, axis=0)
    l_tot = l_old + tl.sum(p_new, axis=2)
    inv = 1.0 / tl.where(l_tot == 0.0, 1.0, l_tot)  # a query with no valid key: zeros out
    scale = tl.load(v_scale_ptr + h * D + offs_d)
    offset = tl.load(v_offset_ptr + h * D + offs_d)
    out = tl.sum(w[:, :, :, None] * accp, axis=0) * scale[None, None, :] + l_old[:, :, None] * offset[None, None, :]
    R: tl.constexpr = BLOCK_B * BLOCK_S
    P: tl.constexpr = 16 if R < 16 else R
    NC: tl.constexpr = D // COLS
    out = _pad_rows(tl.reshape(out, (R, D)), R, P)
    pn = _pad_rows(tl.reshape(p_new * inv[:, :, None], (R, BLOCK_S)), R, P)  # [P, keys]
    inv = tl.sum(_pad_rows(tl.reshape(inv, (R, 1)), R, P), axis=1)
    offs_p = tl.arange(0, P)
    pb = tl.program_id(1) * BLOCK_B + offs_p // BLOCK_S
    ps = offs_p % BLOCK_S
    keep = (offs_p < R) & (pb < B) & (ps < S)
    out_row = out_ptr + ((pb * H + h) * S + ps)[:, None] * D
    offs_j = tl.arange(0, BLOCK_S)
    v_at = v_ptr + (pb.to(tl.int64) * svb + h * svh)[:, None, None] + offs_j[None, :, None] * svs
    v_mask = (keep[:, None] & (offs_j[None, :] < S))[:, :, None]
    vc = tl.load(v_at + tl.arange(0, COLS)[None, None, :], mask=v_mask, other=0.0)
    for c in tl.static_range(NC):  # COLS output channels per dot (a whole Π spilled registers at D = 128); the new
        # values' next chunk requested before this chunk's store (read after it, it cost 2 µs at 15B-shaped B=1, H100)
        cols = c * COLS + tl.arange(0, COLS)
        if c + 1 < NC:
            vnext = tl.load(v_at + (cols + COLS)[None, None, :], mask=v_mask, other=0.0)
        rot = tl.load(v_rot_ptr + h * D * D + offs_d[:, None] * D + cols[None, :])  # Π[e, cols]
        res = tl.dot(out, rot, input_precision=PRECISION) * inv[:, None]
        res += tl.sum(pn[:, :, None] * vc.to(tl.float32), axis=1)
        tl.store(out_row + cols[None, :], res.to(out_ptr.dtype.element_ty), mask=keep[:, None])
        if c + 1 < NC:
            vc = vnext


@triton.jit
def _pad_rows(x, R: tl.constexpr, P: tl.constexpr):
    """x [R, N] as [P, N], P ≥ R: rows R… zero."""
    if P > R:
        x = tl.sum(tl.where(tl.arange(0, P)[:, None, None] == tl.arange(0, R)[None, :, None], x[None, :, :], 0.0),
                   axis=1)
    return x


@triton.jit
def _load_codes(idx_ptr, sign_ptr, offs_t, tmask, D: tl.constexpr, BITS: tl.constexpr, SIGN: tl.constexpr,
                BLOCK_T: tl.constexpr, GRID: tl.constexpr):
    """The packed codes of BLOCK_T token rows: (words [BLOCK_T, D/8] int32 — 8 codes each — and sign bytes
    [BLOCK_T, D/8] int32, or the words again without a sign part); [BLOCK_T, D/8, 1] with ``GRID``, whose
    codes become values without a look-up: loaded three-dimensional, the tile keeps a token's groups in one
    thread (a load is what anchors Triton's layout; a 2-D word broadcast to 3-D got a layout of per-thread
    slivers, shuffles and spills, SASS sm_90)."""
    D8: tl.constexpr = D // 8
    NB: tl.constexpr = D * BITS // 8
    g = tl.arange(0, D8)
    if GRID:
        rows, cols, m = offs_t[:, None, None], g[None, :, None], tmask[:, None, None]
    else:
        rows, cols, m = offs_t[:, None], g[None, :], tmask[:, None]
    if BITS == 4:  # a group of 8 codes is one aligned int32
        word = tl.load(idx_ptr.to(tl.pointer_type(tl.int32)) + rows * D8 + cols, mask=m, other=0)
    else:
        word = tl.zeros(cols.shape, dtype=tl.int32) + tl.zeros(rows.shape, dtype=tl.int32)
        for i in tl.static_range(BITS):
            byte = tl.load(idx_ptr + rows * NB + cols * BITS + i, mask=m, other=0)
            word = word | (byte.to(tl.int32) << (8 * i))
    sb = word
    if SIGN:
        sb = tl.load(sign_ptr + rows * D8 + cols, mask=m, other=0).to(tl.int32)
    return word, sb


@triton.jit
def _decode_codes(word, sb, tab_ptr, shift, mask, D: tl.constexpr, SIGN: tl.constexpr, NTAB: tl.constexpr,
                  FIXED: tl.constexpr, ROWS: tl.constexpr, GRID: tl.constexpr):
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
    ``_walk`` scales back by :func:`_grid_factor`."""
    r = tl.arange(0, 8)[None, None, :]
    if GRID:  # grid codecs: code j is the value j, computed (scaled by a power of two) — no look-up
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


@triton.jit
def _grid_factor(lay, SHIFTLESS: tl.constexpr, GRID: tl.constexpr):
    """[1, 8] powers of two that undo ``_decode_codes``'s scale of a grid code per field: 2^(23 − pos) for fields
    read in place (``SHIFTLESS``: fixed fields, no sign plane), else 2^GRID. Exact."""
    if SHIFTLESS:
        e = 23 - _grid_position(lay[0], lay[1])
    else:
        e = tl.full([1, 1, 8], GRID, tl.int32)
    return tl.reshape(((e + 127) << 23).to(tl.float32, bitcast=True), (1, 8))


@triton.jit
def _mask_or(x, m, e):
    """``(x & m) | e`` as one ``lop3`` (PTX; Triton's interpreter, which runs none, computes it)."""
    if _ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r", [x, m, e], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return (x & m) | e


@triton.jit
def _prefetch_l2(ptrs):
    """Requests the 128-byte lines at ``ptrs`` into L2 (PTX ``prefetch.global.L2``; nothing under the interpreter)."""
    if _ASM:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _fetch(k_idx, k_sign, v_idx, v_sign, t0, end, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
           KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_T: tl.constexpr, GRID: tl.constexpr):
    """The key and value codes of the tile at ``t0`` (rows ≥ ``end`` masked): fetched together, one memory
    round trip per tile."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    tmask = offs_t < end
    kw, ks = _load_codes(k_idx, k_sign, offs_t, tmask, D, KBITS, KSIGN, BLOCK_T, GRID)
    vw, vs = _load_codes(v_idx, v_sign, offs_t, tmask, D, VBITS, VSIGN, BLOCK_T, GRID)
    return kw, ks, vw, vs


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


@triton.jit
def _prefix_block(q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, k_tab, v_tab, k_lay, v_lay, D: tl.constexpr,
                  KSIGN: tl.constexpr, VSIGN: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
                  BLOCK_T: tl.constexpr, KFIXED: tl.constexpr, VFIXED: tl.constexpr, ROWS: tl.constexpr,
                  GRID: tl.constexpr):
    """One BLOCK_T tile (codes from ``_fetch``) of the online softmax for one query, log2 units; ``l_i`` per token
    row [BLOCK_T] with ``GRID`` (see ``_walk``), else a scalar."""
    tmask = t0 + tl.arange(0, BLOCK_T) < end
    k = _decode_codes(kw, ks, k_tab, k_lay[0], k_lay[1], D, KSIGN, NK, KFIXED, ROWS, GRID)
    s = tl.sum(tl.sum(k * q3[None, :, :], axis=2), axis=1)  # [BLOCK_T]
    s = tl.where(tmask, s, float("-inf"))
    m_tile = tl.max(s, axis=0)
    if m_tile > m_i + 8.0:  # rescale only when the running max grows by > 2^8 (exp2 stays < 256 otherwise)
        alpha = tl.exp2(m_i - m_tile)
        acc = acc * alpha
        l_i = l_i * alpha
        m_i = m_tile
    p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i))  # an all-masked tile (interpreter only)
    if GRID:  # [BLOCK_T]: summed over tokens once, at the end, like acc (one reduction a tile less)
        l_i = l_i + p
    else:
        l_i = l_i + tl.sum(p, axis=0)
    v = _decode_codes(vw, vs, v_tab, v_lay[0], v_lay[1], D, VSIGN, NV, VFIXED, ROWS, GRID)
    acc = acc + p[:, None, None] * v  # [BLOCK_T, D/8, 8]: summed over tokens once, at the end
    return m_i, l_i, acc


@triton.jit
def _split_codes(k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, len_ptr, b, pid_bh, start, stop, T_CAP,
                 D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, KSIGN: tl.constexpr,
                 VSIGN: tl.constexpr, BLOCK_T: tl.constexpr, GRID: tl.constexpr):
    """A program's share [start, stop) of cache row ``pid_bh`` (= b·H + h): its rows [start, end) (end: stop or
    the sequence's length), pointers to row 0 of the row in each packed part, and its first tile's codes —
    requested here, as early as the program can."""
    length = tl.load(len_ptr + b).to(tl.int32)
    end = tl.minimum(stop, length)
    row0 = pid_bh.to(tl.int64) * T_CAP
    k_idx = k_idx_ptr + row0 * (D * KBITS // 8)
    k_sign = k_sign_ptr + row0 * (D // 8)
    v_idx = v_idx_ptr + row0 * (D * VBITS // 8)
    v_sign = v_sign_ptr + row0 * (D // 8)
    kw, ks, vw, vs = _fetch(k_idx, k_sign, v_idx, v_sign, start, end, D, KBITS, VBITS, KSIGN, VSIGN, BLOCK_T,
                            GRID)
    return start, end, k_idx, k_sign, v_idx, v_sign, kw, ks, vw, vs


@triton.jit
def _walk(q3, start, end, kw, ks, vw, vs, k_idx, k_sign, v_idx, v_sign, k_tab, v_tab, k_lay, v_lay,
          D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
          KSIGN: tl.constexpr, VSIGN: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, BLOCK_T: tl.constexpr,
          PREFETCH: tl.constexpr, INTERPRET: tl.constexpr, KFIXED: tl.constexpr, VFIXED: tl.constexpr,
          ROWS: tl.constexpr, GRID: tl.constexpr):
    """Online softmax of one query over cached rows [start, end): (m, l, Σ p·ŷ as [D/8, 8]), log2 units.
    (kw, ks, vw, vs): the first tile's codes, ``_fetch``-ed by the caller as early as it can.
    k_lay / v_lay: (shift, mask) of the packed codes' fields (``_field_layout``). ``PREFETCH``: the next
    tile's codes are requested before this tile is computed (a register double buffer). ``INTERPRET`` > 0
    (Triton's interpreter): that many tiles, unrolled (it needs a static loop). ``GRID`` (``_decode_codes``): the
    tiles hold j scaled by a power of two per field, so the query and the value sums are scaled back by its
    inverse (``_grid_factor``, exact)."""
    if GRID:
        q3 = q3 * _grid_factor(k_lay, KFIXED and not KSIGN, GRID)
    m_i = tl.max(tl.full((2,), float("-inf"), dtype=tl.float32), axis=0)
    if GRID:  # softmax sums per token row, like acc (a LUT walk's registers spilled with them, SASS sm_90)
        l_i = tl.zeros((BLOCK_T,), dtype=tl.float32)
    else:
        l_i = tl.sum(tl.zeros((2,), dtype=tl.float32), axis=0)
    acc = tl.zeros((BLOCK_T, D // 8, 8), dtype=tl.float32)
    if INTERPRET > 0:
        for it in tl.static_range(INTERPRET):
            t0 = start + it * BLOCK_T
            nkw, nks, nvw, nvs = _fetch(k_idx, k_sign, v_idx, v_sign, t0 + BLOCK_T, end, D, KBITS, VBITS, KSIGN,
                                        VSIGN, BLOCK_T, GRID)
            m_i, l_i, acc = _prefix_block(q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, k_tab, v_tab, k_lay,
                                          v_lay, D, KSIGN, VSIGN, NK, NV, BLOCK_T, KFIXED, VFIXED, ROWS, GRID)
            kw, ks, vw, vs = nkw, nks, nvw, nvs
    elif PREFETCH:
        for t0 in range(start, end, BLOCK_T):
            nkw, nks, nvw, nvs = _fetch(k_idx, k_sign, v_idx, v_sign, t0 + BLOCK_T, end, D, KBITS, VBITS, KSIGN,
                                        VSIGN, BLOCK_T, GRID)
            m_i, l_i, acc = _prefix_block(q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, k_tab, v_tab, k_lay,
                                          v_lay, D, KSIGN, VSIGN, NK, NV, BLOCK_T, KFIXED, VFIXED, ROWS, GRID)
            kw, ks, vw, vs = nkw, nks, nvw, nvs
    else:
        for t0 in range(start, end, BLOCK_T):
            kw, ks, vw, vs = _fetch(k_idx, k_sign, v_idx, v_sign, t0, end, D, KBITS, VBITS, KSIGN, VSIGN, BLOCK_T, GRID)
            m_i, l_i, acc = _prefix_block(q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, k_tab, v_tab, k_lay,
                                          v_lay, D, KSIGN, VSIGN, NK, NV, BLOCK_T, KFIXED, VFIXED, ROWS, GRID)
    acc = tl.sum(acc, axis=0)
    if GRID:
        l_i = tl.sum(l_i, axis=0)
        acc = acc * _grid_factor(v_lay, VFIXED and not VSIGN, GRID)
    return m_i, l_i, acc


@triton.jit
def _prefix_kernel(qt_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr, v_tab_ptr, k_lay_ptr, v_lay_ptr,
                   len_ptr,
                    m_ptr, l_ptr, acc_ptr,
                    H, S, T_CAP, CHUNK, NS,
                    D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, KFIELDS: tl.constexpr,
                    VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_T: tl.constexpr,
                    NK: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
                    ROWS: tl.constexpr, GRID: tl.constexpr, PDL: tl.constexpr):
    """Grid (B·H·S, splits): one query per program, tiles kept as [BLOCK_T, D/8, 8] (no reshapes). ``PDL``
    (launched while the prep kernel runs): the first tile's codes are requested, then the program waits for the
    prep grid before it reads its query."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_bh = pid // S
    qi = pid % S
    _walk_store(qt_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr, v_tab_ptr, k_lay_ptr, v_lay_ptr,
                len_ptr, m_ptr, l_ptr, acc_ptr, pid_bh, qi, split * CHUNK, split * CHUNK + CHUNK,
                (pid_bh * NS + split) * BLOCK_S + qi, H, S, T_CAP, D, KBITS, VBITS, KFIELDS, VFIELDS, KSIGN, VSIGN,
                BLOCK_T, NK, NV, PREFETCH, INTERPRET, ROWS, GRID, PDL)


@triton.jit
def _stream_kernel(qt_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr, v_tab_ptr, k_lay_ptr, v_lay_ptr,
                   len_ptr, m_ptr, l_ptr, acc_ptr, H, S, T_CAP, R, NT, W, NS,
                   D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, KFIELDS: tl.constexpr,
                   VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_T: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr,
                   INTERPRET: tl.constexpr, ROWS: tl.constexpr, GRID: tl.constexpr, PDL: tl.constexpr):
    """``_prefix_kernel`` with the work cut evenly (stream-K): grid (programs,), the B·H·S queries' rows of NT
    tiles each laid end to end and cut in runs of W tiles, one run per program, so every program walks as many
    tiles and the GPU holds one full wave (a grid of (query, split) programs left SMs part-empty: 1280 one-warp
    programs on 132 SMs that hold 12 each). A run that crosses rows writes one partial per row: row r's
    partial k (slot r·NS + k; k below the count the merge derives, NS from :func:`stream_plan`) comes from program
    ⌊r·NT / W⌋ + k."""
    p = tl.program_id(0)
    first = p * W
    for r in range(first // NT, tl.minimum((first + W - 1) // NT, R - 1) + 1):
        pid_bh = r // S
        qi = r % S
        lo = tl.maximum(first, r * NT) - r * NT
        hi = tl.minimum(first + W, r * NT + NT) - r * NT
        k = p - _runs_meeting(r, NT, W)[0]
        _walk_store(qt_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr, v_tab_ptr, k_lay_ptr,
                    v_lay_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, pid_bh, qi, lo * BLOCK_T, hi * BLOCK_T,
                    (pid_bh * NS + k) * BLOCK_S + qi, H, S, T_CAP, D, KBITS, VBITS, KFIELDS, VFIELDS, KSIGN,
                    VSIGN, BLOCK_T, NK, NV, PREFETCH, INTERPRET, ROWS, GRID, PDL)


@triton.jit
def _runs_meeting(row, NT, W):
    """The first and last stream-K runs (W tiles each, cut from rows of NT tiles laid end to end) that meet ``row``:
    its partial k comes from run first + k (``_stream_kernel``), and the merge reads last − first + 1 of them."""
    return (row * NT) // W, ((row + 1) * NT - 1) // W


@triton.jit
def _walk_store(qt_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr, v_tab_ptr, k_lay_ptr, v_lay_ptr,
                len_ptr, m_ptr, l_ptr, acc_ptr, pid_bh, qi, start, stop, part, H, S, T_CAP,
                D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, KFIELDS: tl.constexpr,
                VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_T: tl.constexpr,
                NK: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
                ROWS: tl.constexpr, GRID: tl.constexpr, PDL: tl.constexpr):
    """Query ``qi`` of cache row ``pid_bh`` over its cached rows [start, stop): walked, its (m, l, acc) stored at
    partial ``part``."""
    b = pid_bh // H
    h = pid_bh % H
    start, end, k_idx, k_sign, v_idx, v_sign, kw, ks, vw, vs = _split_codes(
        k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, len_ptr, b, pid_bh, start, stop, T_CAP, D, KBITS, VBITS,
        KSIGN, VSIGN, BLOCK_T, GRID)
    g = tl.arange(0, D // 8)
    r = tl.arange(0, 8)
    chan = g[:, None] * 8 + r[None, :]  # [D8, 8] channel index
    k_lay = _field_layout(k_lay_ptr + h * D, KFIELDS)
    v_lay = _field_layout(v_lay_ptr + h * D, VFIELDS)
    if PDL:
        tl.extra.cuda.gdc_wait()
    q3 = tl.load(qt_ptr + (pid_bh * S + qi) * D + chan) * _LOG2E
    m_i, l_i, acc = _walk(q3, start, end, kw, ks, vw, vs, k_idx, k_sign, v_idx, v_sign, k_tab_ptr + h * NK,
                          v_tab_ptr + h * NV, k_lay, v_lay, D, KBITS, VBITS, KSIGN, VSIGN, NK, NV, BLOCK_T,
                          PREFETCH, INTERPRET, KFIELDS >= 0, VFIELDS >= 0, ROWS, GRID)
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)
    tl.store(acc_ptr + part * D + chan, acc)


@triton.jit
def _rotate_vec(x_ptr, rot_ptr, chan, D: tl.constexpr):
    """One row x [D] (any float dtype) times Πᵀ of one head (Π [D, D] float32), fp32 on the CUDA cores:
    ``z[e] = Σ_d Π[e, d] x[d]`` laid out like ``chan`` [D/8, 8]."""
    offs_d = tl.arange(0, D)
    x = tl.load(x_ptr + offs_d).to(tl.float32)
    rot = tl.load(rot_ptr + chan[:, :, None] * D + offs_d[None, None, :])
    return tl.sum(rot * x[None, None, :], axis=2)


@triton.jit
def _small_kernel(q_ptr, sqb, sqh, k_ptr, skb, skh, v_ptr, svb, svh, valid_ptr,
                  k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr, v_tab_ptr, k_lay_ptr, v_lay_ptr, len_ptr,
                  k_rot, k_offset, k_scale, v_rot, v_offset, v_scale, m_ptr, l_ptr, acc_ptr, count_ptr,
                  out_ptr, H, T_CAP, CHUNK, NS,
                  D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, KFIELDS: tl.constexpr,
                  VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_NS: tl.constexpr, NK: tl.constexpr,
                  NV: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr, ROWS: tl.constexpr,
                  GRID: tl.constexpr):
    """Grid (B·H, splits), one query per sequence (S = 1), the whole step in one launch: each program
    rotates the query itself and walks its split; the last split of a (b, h) to finish (an atomic count,
    ``count_ptr`` zero at launch) merges all splits, rotates the output back, adds the step's own token as
    ``_merge_kernel`` does (unrotated: score ⟨q, k⟩ − c0) and zeroes its count again. For small steps, where the
    prep and merge launches cost more than they save."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    g = tl.arange(0, D // 8)
    r = tl.arange(0, 8)
    chan = g[:, None] * 8 + r[None, :]  # [D8, 8] channel index
    hd = h * D
    if split == 0:  # Πᵥ into L2 for the merge, which reads it only after the arrival count (H100: B=1 T=4K 17.8 →
        # 17.5 µs, T=1K 13.8 → 13.7, results/gpu/decode_session21_h100.txt)
        _prefetch_l2(v_rot + hd * D + tl.arange(0, D * D // 32) * 32)
    # the first tile's codes are requested before the query rotation: their latency overlaps it
    start, end, k_idx, k_sign, v_idx, v_sign, kw, ks, vw, vs = _split_codes(
        k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, len_ptr, b, pid_bh, split * CHUNK, split * CHUNK + CHUNK,
        T_CAP, D, KBITS, VBITS, KSIGN, VSIGN, BLOCK_T, GRID)
    k_off = tl.load(k_offset + hd + chan)
    k_sc = tl.load(k_scale + hd + chan)
    z = _rotate_vec(q_ptr + b.to(tl.int64) * sqb + h * sqh, k_rot + hd * D, chan, D)
    q3 = z * k_sc * _LOG2E
    c0 = tl.sum(tl.sum(z * k_off, axis=1), axis=0)
    k_lay = _field_layout(k_lay_ptr + h * D, KFIELDS)
    v_lay = _field_layout(v_lay_ptr + h * D, VFIELDS)
    m_i, l_i, acc = _walk(q3, start, end, kw, ks, vw, vs, k_idx, k_sign, v_idx, v_sign, k_tab_ptr + h * NK,
                          v_tab_ptr + h * NV, k_lay, v_lay, D, KBITS, VBITS, KSIGN, VSIGN, NK, NV, BLOCK_T,
                          PREFETCH, INTERPRET, KFIELDS >= 0, VFIELDS >= 0, ROWS, GRID)
    part = pid_bh * NS + split
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)
    tl.store(acc_ptr + part * D + chan, acc)
    tl.debug_barrier()  # every thread's stores made before the (one-thread, releasing) count
    if tl.atomic_add(count_ptr + pid_bh, 1, sem="acq_rel") == NS - 1:
        offs_n = tl.arange(0, BLOCK_NS)
        nmask = offs_n < NS
        rows = pid_bh * NS + offs_n
        m = tl.load(m_ptr + rows, mask=nmask, other=float("-inf"), cache_modifier=".cg")
        lp = tl.load(l_ptr + rows, mask=nmask, other=0.0, cache_modifier=".cg")
        accp = tl.load(acc_ptr + rows[:, None, None] * D + chan[None, :, :], mask=nmask[:, None, None], other=0.0,
                       cache_modifier=".cg")
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + offs_d).to(tl.float32)
        k = tl.load(k_ptr + b.to(tl.int64) * skb + h * skh + offs_d).to(tl.float32)
        v = tl.load(v_ptr + b.to(tl.int64) * svb + h * svh + offs_d).to(tl.float32)
        s_new = (tl.sum(q * k, axis=0) - c0) * _LOG2E
        s_new = tl.where(tl.load(valid_ptr + b) != 0, s_new, float("-inf"))
        mx = tl.maximum(tl.max(m, axis=0), s_new)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(m - mx)
        p_new = tl.exp2(s_new - mx)
        l_old = tl.sum(w * lp, axis=0)
        l_tot = l_old + p_new
        o = tl.sum(w[:, None, None] * accp, axis=0) * tl.load(v_scale + hd + chan)
        o += l_old * tl.load(v_offset + hd + chan)
        # back to the value domain: out[d] = Σ_e o[e] Πᵥ[e, d], then the new value
        rot = tl.load(v_rot + hd * D + chan[:, :, None] * D + offs_d[None, None, :])
        out = tl.sum(tl.sum(rot * o[:, :, None], axis=0), axis=0)
        out = (out + p_new * v) / tl.where(l_tot == 0.0, 1.0, l_tot)
        tl.store(out_ptr + pid_bh * D + offs_d, out.to(out_ptr.dtype.element_ty))
        tl.store(count_ptr + pid_bh, 0)  # every split has counted: zero again for the next launch


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, in tests
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


#: the longest walk one split program takes: longer ones leave a ragged last wave of programs (on an H100 six
#: 2-warp programs share an SM; 1280 of them are 1.6 waves) that shorter chunks even out
#: (results/gpu/splits_h100.txt: 650M B=64 T=16K 986 → 931 µs, B=8 T=16K 164 → 144 µs)
MAX_CHUNK = 2048


def plan_splits(programs: int, capacity: int, block_t: int, sms: int, waves: int = 4,
                splits: int | None = None) -> tuple[int, int]:
    """(splits, chunk): enough programs for ``waves`` waves of the GPU and chunks of at most ``MAX_CHUNK``
    tokens (or ``splits`` as asked), chunks a multiple of ``block_t``."""
    blocks = max(1, math.ceil(capacity / block_t))
    if splits is None:
        splits = max(math.ceil(waves * sms / max(programs, 1)), math.ceil(capacity / MAX_CHUNK))
    splits = max(1, min(blocks, splits, 64))
    chunk = math.ceil(blocks / splits) * block_t
    splits = max(1, math.ceil(capacity / chunk))
    return splits, chunk


def stream_plan(rows: int, capacity: int, block_t: int, programs: int) -> tuple[int, int, int, int]:
    """A stream-K cut (``_stream_kernel``) of ``rows`` walks over ``capacity`` cached rows for about ``programs``
    programs: (tiles a row, tiles a program, partial slots a row, programs launched)."""
    nt = max(1, math.ceil(capacity / block_t))
    run = math.ceil(rows * nt / max(programs, 1))
    return nt, run, min(math.ceil(nt / run) + 1, nt), math.ceil(rows * nt / run)


#: the one-launch path (``_small_kernel``) for S = 1, head_dim ≤ 64 and at most this many cached
#: (row, head, position) slots: where it beat the three-launch path on an H100
#: (results/gpu/tune_single_h100.txt; its per-program query rotation is too costly at d = 128)
SMALL_MAX_SLOTS = 1 << 18
#: the same for a grid codec's cache of equal widths (the default), up to this many slots and (row, head) pairs: past
#: them each program's own query rotation and merge cost more than the prep and merge launches they save
#: (results/gpu/decode_session19_h100.txt, H100: 650M-shaped B=16 T=4K 59.9 µs in one launch, 75 in three; B=8 T=16K
#: 101.5 in one, 92.2 in three; B=64 T=1K 71.7 in one, 58.8 in three)
GRID_MAX_SLOTS = 3 << 19
GRID_MAX_ROWS = 640


def one_launch(batch: int, heads: int, s: int, d: int, capacity: int, grid: bool = False) -> bool:
    """Whether a decode step of this shape takes the one-launch path (``grid``: a grid codec's cache of equal
    widths)."""
    if s != 1 or d > 64:
        return False
    if grid:
        return batch * heads * capacity <= GRID_MAX_SLOTS and batch * heads <= GRID_MAX_ROWS
    return batch * heads * capacity <= SMALL_MAX_SLOTS


#: the one-launch path's arrival counts, kept zero between launches, per (device, stream)
_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def split_counters(n: int, device: torch.device) -> torch.Tensor:
    """At least ``n`` int32 arrival counts, all zero, for a ``_small_kernel`` launch, which leaves them zero again
    (the merging program of each (b, h) zeroes its own): one buffer per device and stream, so a decode step needs no
    memset launch (1.4 µs of 17.8 at B=1 T=1K on an H100, results/gpu/decode_session15_h100.txt). Launches on one
    stream run in order and share it safely; a CUDA graph keeps the buffer of the stream it was captured on, so two
    graphs captured on one stream must not be replayed concurrently on different streams. A new buffer found
    missing during a capture is zeroed inside it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:  # graphs captured with it still point at it: never freed
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    return buf


def _attention_small(q, k_new, v_new, new_valid, k_idx, k_sign, v_idx, v_sign, k_tab, v_tab, k_lay, v_lay,
                     lengths, k_rot, k_offset, k_scale, v_rot, v_offset, v_scale, k_bits, v_bits, k_fields, v_fields,
                     grid, cfg) -> torch.Tensor:
    batch, heads, _, d = q.shape
    t_cap = k_idx.shape[2]
    block_t = cfg["block_t"]
    splits, chunk = plan_splits(batch * heads, t_cap, block_t, _num_sms(q.device), cfg["waves"], cfg.get("splits"))
    dev = q.device
    m = torch.empty(batch * heads * splits, device=dev, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(batch * heads * splits, d, device=dev, dtype=torch.float32)
    count = split_counters(batch * heads, dev)
    out = torch.empty(batch, heads, 1, d, device=dev, dtype=q.dtype)
    (q, q_strides), (k_new, k_strides), (v_new, v_strides) = map(token_strides, (q, k_new, v_new))
    _small_kernel[(batch * heads, splits)](
        q, *q_strides[:2], k_new, *k_strides[:2], v_new, *v_strides[:2], new_valid,
        k_idx, part_or(k_sign, k_idx), v_idx, part_or(v_sign, v_idx), k_tab, v_tab,
        part_or(k_lay, k_tab), part_or(v_lay, v_tab), lengths, k_rot, k_offset, k_scale, v_rot, v_offset,
        v_scale, m, l_, acc, count, out, heads, t_cap, chunk, splits,
        D=d, KBITS=k_bits, VBITS=v_bits, KFIELDS=k_fields, VFIELDS=v_fields,
        KSIGN=k_sign.numel() > 0, VSIGN=v_sign.numel() > 0, BLOCK_T=block_t,
        BLOCK_NS=triton.next_power_of_2(splits), NK=k_tab[0].numel(), NV=v_tab[0].numel(),
        PREFETCH=cfg["prefetch"], INTERPRET=chunk // block_t if interpreting() else 0, ROWS=cfg["rows"],
        GRID=grid, num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"], enable_fp_fusion=FP_FUSION)
    return out


def merge_rows(batch: int, heads: int, block_s: int, block_ns: int, d: int, sms: int) -> int:
    """Sequences per merge program (``_merge_kernel``), a power of two: up to 16 while there are at least half as
    many programs as SMs, and fewer where its [splits, sequences, queries, d] partials (or the queries × keys × d
    products of the step's own tokens) would pass 8192 values (64 registers a thread at four warps). H100
    (results/gpu/decode_merge_session18_h100.txt): 650M-shaped B=64 T=1K 16 rows 71.0 µs, 8 rows 75.6, one per
    (b, h) 76.5; B=8 T=16K one 102.3, two 103.9; 15B-shaped B=8 T=16K two to four 340, one 348. One where a row has
    eight partials or more at head_dim ≤ 64, whose Πᵥ is a quarter of d = 128's to read again per program
    (results/gpu/decode_session22_h100.txt: 650M-shaped B=8 T=16K 83.6 µs, two 85.8; B=16 T=16K 142.1, four 146.7;
    15B-shaped B=8 T=16K one 287.6, four 274.0)."""
    if d <= 64 and block_ns >= 8:
        return 1
    cap = 8192 // d
    fill = 1 << max(0, (2 * batch * heads // sms).bit_length() - 1)  # the largest power of two ≤ 2·B·H / SMs
    return max(1, min(16, fill, cap // (block_ns * block_s), cap // (block_s * block_s)))


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


def _fields(fields: int, layout: torch.Tensor, bits: int) -> int:
    """The kernels' ``FIELDS`` constant: as given, or equal ``bits``-bit fields for an empty layout."""
    if fields < 0 and layout.numel() == 0:
        return packed_shifts([bits] * 8)
    return fields


def compressed_attention_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                new_valid: torch.Tensor, k_idx: torch.Tensor, k_sign: torch.Tensor,
                                v_idx: torch.Tensor, v_sign: torch.Tensor, k_tab: torch.Tensor,
                                v_tab: torch.Tensor, k_lay: torch.Tensor, v_lay: torch.Tensor,
                                lengths: torch.Tensor, k_rot: torch.Tensor,
                                k_offset: torch.Tensor, k_scale: torch.Tensor, v_rot: torch.Tensor,
                                v_offset: torch.Tensor, v_scale: torch.Tensor, k_bits: int, v_bits: int,
                                k_fields: int = -1, v_fields: int = -1, grid: int = 0,
                                config: dict | None = None) -> torch.Tensor:
    """Same contract as ``compressed_attention_reference`` (see there for shapes); CUDA tensors.
    ``config`` overrides the launch choice for tuning: ``path`` (auto | one | split), block_t / num_warps /
    waves (or ``splits``: split-K programs per query), ``prefetch`` (request the next tile's codes before computing
    this one), ``rows`` (per-group row addresses for the look-ups), ``maxnreg`` (a register cap or None), and for the
    prep and merge kernels ``prep_block`` (tokens per program), ``prep_cols`` / ``merge_cols`` (output channels per
    rotation dot) and ``merge_rows`` (sequences per program, :func:`merge_rows`)."""
    batch, heads, s, d = q.shape
    t_cap = k_idx.shape[2]
    k_fields, v_fields = _fields(k_fields, k_lay, k_bits), _fields(v_fields, v_lay, v_bits)
    k_tab, v_tab = aligned_table(k_tab), aligned_table(v_tab)
    # tuned on an H100 (results/gpu/tune_decode_h100.txt). At head_dim 128 two warps hold a tile only when keys and
    # values are both one code word wide with no sign plane (3 + sign each, fused): other widths spill their
    # registers there (4 and 2 bits: 255 registers, 4026 µs at 15B B=64 T=4K) and take four warps (1465 µs;
    # results/gpu/threebit_h100.txt). Those four-warp tiles spread a token's channels over threads, so their
    # look-ups OR codes into per-group row addresses (``rows``). The look-ups' OR addressing lets ptxas take up to
    # 255 registers (four two-warp programs per SM instead of six); capped at 168 (no spills) it ran faster for the
    # fused equal widths and at head_dim 128, uncapped for keys-first widths at head_dim 64
    # (results/gpu/or_lookup_h100.txt: 650M B=64 T=16K 925 → 820 µs; keys-first 4+1/2+1 at 15B B=64 T=4K
    # 1698 → 1409 µs)
    k_has_sign, v_has_sign = k_sign.numel() > 0, v_sign.numel() > 0
    lean = k_bits == v_bits and not (k_has_sign or v_has_sign)
    lean_grid = lean and grid > 0  # the default cache
    cfg = (dict(block_t=64, num_warps=2, waves=4) if d <= 64 else
           dict(block_t=32, num_warps=2 if lean else 4, waves=8))
    if lean_grid:  # the default cache: one-warp programs of half the tiles ran 2–8% faster at every split-path size
        cfg.update(block_t=cfg["block_t"] // 2, num_warps=1)  # (results/gpu/decode_session19_h100.txt)
    cfg.update(rows=d > 64 and not lean, maxnreg=168 if lean or d > 64 else None)
    small = one_launch(batch, heads, s, d, t_cap, lean_grid)
    if small:  # results/gpu/tune_single_h100.txt; grid codes: results/gpu/decode_session19_h100.txt
        cfg = (dict(block_t=64, num_warps=2, waves=4, rows=False, maxnreg=168) if lean_grid else
               dict(block_t=32, num_warps=2, waves=4, rows=False, maxnreg=None))
    # prefetch: the next tile's codes requested before this one is computed (results/gpu/tune_prefetch_h100.txt: 5–12%
    # faster from B·T ≈ 8K on; two tiles ahead ran 2–6% slower on grid codes, results/gpu/decode_merge_session18_h100.txt).
    # pdl: the prefix kernel launched while the prep kernel runs (programmatic dependent launch, sm_90 on), on a grid
    # codec's cache: 1.5–2 µs faster at head_dim 64, even at 128 (on LUT codes even at 64, 2% slower at 128); letting the
    # merge kernel launch early too cost up to 7 µs at B=8 (results/gpu/decode_session19_h100.txt), and after the
    # stream-K kernel, Πᵥ prefetched before its wait, 1–9 µs (results/gpu/decode_session21_h100.txt)
    # stream: the default cache's prefix programs cut its tiles evenly (stream-K, ``_stream_kernel``), this many per SM
    # (one-warp programs of ≤ 168 registers: 12 fit) — one full wave where (query, split) programs left SMs part-empty
    # (results/gpu/decode_session20_h100.txt: 650M B=64 T=4K 160.4 → 149.1 µs, 15B B=8 T=16K 310.2 → 282.2)
    cfg.update(path="auto", prefetch=True, pdl=grid > 0, stream=12 if lean_grid else 0)
    # output channels per rotation dot of the prep and merge kernels: a whole Π spilled registers at d = 128 (SASS
    # sm_90: 8.9 KB of stack in the prep, 0.5 KB in the merge); 64 ran fastest in the prep
    # (results/gpu/decode_merge_session18_h100.txt: 15B-shaped B=8 T=4K prep 64 121.0 µs, 32 125.4, 128 130.8) and, by
    # 0–2%, in the merge (results/gpu/decode_session21_h100.txt: 15B B=64 T=1K 163.7 µs, 32 166.0)
    cfg.update(prep_block=16, prep_cols=64, merge_cols=64)
    cfg.update(config or {})
    if cfg["path"] == "one" or (cfg["path"] == "auto" and small):
        if s != 1:
            raise ValueError("the one-launch path takes one query per sequence")
        return _attention_small(q, k_new, v_new, new_valid, k_idx, k_sign, v_idx, v_sign, k_tab, v_tab, k_lay,
                                v_lay, lengths, k_rot, k_offset, k_scale, v_rot, v_offset, v_scale, k_bits, v_bits,
                                k_fields, v_fields, grid, cfg)
    precision = dot_precision(q)
    pdl = bool(cfg["pdl"]) and q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 9
    block_s = max(triton.next_power_of_2(s), 1)
    block_t = cfg["block_t"]
    programs = batch * heads * s
    sms = _num_sms(q.device)
    if cfg["stream"]:
        nt, run, splits, launched = stream_plan(programs, t_cap, block_t, cfg["stream"] * sms)
    else:
        splits, chunk = plan_splits(programs, t_cap, block_t, sms, cfg["waves"], cfg.get("splits"))
        nt = run = 0
    block_ns = triton.next_power_of_2(splits)
    dev = q.device
    qt = torch.empty(batch, heads, s, d, device=dev, dtype=torch.float32)
    c0 = torch.empty(batch, heads, s, device=dev, dtype=torch.float32)
    (q, q_strides), (k_new, k_strides), (v_new, v_strides) = map(token_strides, (q, k_new, v_new))
    _prep_kernel[(heads, triton.cdiv(batch * s, cfg["prep_block"]))](
        q, *q_strides, k_rot, k_offset, k_scale, qt, c0, batch, heads, s, D=d, BLOCK_N=cfg["prep_block"],
        COLS=min(d, cfg["prep_cols"]), PRECISION=precision, SPLIT16=split16(q, precision), PDL=pdl, num_warps=4,
        enable_fp_fusion=FP_FUSION)
    m = torch.empty(batch * heads * splits * block_s, device=dev, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(batch * heads * splits * block_s, d, device=dev, dtype=torch.float32)
    out = torch.empty(batch, heads, s, d, device=dev, dtype=q.dtype)
    codes = (qt, k_idx, part_or(k_sign, k_idx), v_idx, part_or(v_sign, v_idx), k_tab, v_tab, part_or(k_lay, k_tab),
             part_or(v_lay, v_tab), lengths, m, l_, acc, heads, s, t_cap)
    consts = dict(D=d, KBITS=k_bits, VBITS=v_bits, KFIELDS=k_fields, VFIELDS=v_fields, KSIGN=k_has_sign,
                  VSIGN=v_has_sign, BLOCK_S=block_s, BLOCK_T=block_t, NK=k_tab[0].numel(), NV=v_tab[0].numel(),
                  PREFETCH=cfg["prefetch"], ROWS=cfg["rows"], GRID=grid, PDL=pdl, num_warps=cfg["num_warps"],
                  maxnreg=cfg["maxnreg"], launch_pdl=pdl, enable_fp_fusion=FP_FUSION)
    if run:
        _stream_kernel[(launched,)](*codes, programs, nt, run, splits, INTERPRET=run if interpreting() else 0,
                                    **consts)
    else:
        _prefix_kernel[(programs, splits)](*codes, chunk, splits, INTERPRET=chunk // block_t if interpreting() else 0,
                                           **consts)
    block_b = cfg.get("merge_rows") or merge_rows(batch, heads, block_s, block_ns, d, sms)
    _merge_kernel[(heads, triton.cdiv(batch, block_b))](
        c0, q, *q_strides, k_new, *k_strides, v_new, *v_strides, m, l_, acc, new_valid, v_scale, v_offset, v_rot,
        out, batch, heads, s, splits, nt, run,
        D=d, BLOCK_B=block_b, BLOCK_S=block_s, BLOCK_NS=block_ns, COLS=min(d, cfg["merge_cols"]), PRECISION=precision,
        num_warps=4, enable_fp_fusion=FP_FUSION)
    return out
