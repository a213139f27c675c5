"""The walk over a cached prefix: one query's online softmax over its share of the packed rows, and the two
kernels that launch walks (``_prefix_kernel``: a grid of (query, split) programs; ``_stream_kernel``: stream-K, the
queries' tiles cut in equal runs, one full wave of programs). Each writes partials (m, l, Σ p·ŷ) that the merge
(``merge.py``) combines."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import SUB_UP, _decode_codes, _field_layout, _grid_factor, _load_codes, _prefetch_l2
from ..common import group_dot

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _fetch(k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, t0, end, pg_tab, pg_base, pg_stride, D: tl.constexpr,
           KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr,
           BLOCK_T: tl.constexpr, GRID: tl.constexpr, PAGE: tl.constexpr, SLOTS: tl.constexpr):
    """The key and value codes of the tile at ``t0`` (rows ≥ ``end`` masked): fetched together, one memory
    round trip per tile. ``PAGE`` > 0 (a paged cache of blocks of PAGE tokens): token t lies in row
    ``table[t // PAGE] · pg_stride + pg_base + t % PAGE`` of the pool (``_rows``). ``SLOTS``: and each token's
    slot words of either kind [BLOCK_T] (``k_sl`` / ``v_sl``: the row's token parts, one "head"; masked rows read
    the zero word, no correction), else the key words again (never read)."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    tmask = offs_t < end
    rows = _rows(offs_t, t0, end, pg_tab, pg_base, pg_stride, BLOCK_T, PAGE)
    kw, ks = _load_codes(k_idx, k_sign, rows, tmask, D, KCODE_BITS, KSIGN, BLOCK_T, GRID)
    vw, vs = _load_codes(v_idx, v_sign, rows, tmask, D, VCODE_BITS, VSIGN, BLOCK_T, GRID)
    kl = kw
    vl = kw
    if SLOTS:
        srows = _rows(offs_t, t0, end, pg_tab, 0, PAGE, BLOCK_T, PAGE)
        kl = tl.load(k_sl + srows, mask=tmask, other=0)
        vl = tl.load(v_sl + srows, mask=tmask, other=0)
    return kw, ks, vw, vs, kl, vl


@triton.jit
def _ask_tile(k_idx, v_idx, t, end, pg_tab, pg_base, pg_stride, D: tl.constexpr, KCODE_BITS: tl.constexpr,
              VCODE_BITS: tl.constexpr, BLOCK_T: tl.constexpr, PAGE: tl.constexpr):
    """Asks the key and value code words of the tile at ``t`` into L2 when it starts before ``end``: its rows in the
    block that holds its first token (a paged cache's blocks hold whole tiles, or blocks smaller than a tile its
    first block's), one 128-byte line a lane, lanes past them asking the last again (``prefetch.global.L2``;
    nothing under the interpreter). Sign planes are not asked."""
    if t < end:
        row = _rows(t, t, end, pg_tab, pg_base, pg_stride, PAGE, PAGE).to(tl.int64)  # token t's, a block its tile
        if PAGE == 0 or PAGE >= BLOCK_T:
            TOKENS: tl.constexpr = BLOCK_T
        else:
            TOKENS: tl.constexpr = PAGE
        KB: tl.constexpr = D * KCODE_BITS // 8  # a token's bytes of key codes
        VB: tl.constexpr = D * VCODE_BITS // 8
        line = tl.arange(0, 32) * 128
        _prefetch_l2(k_idx + row * KB + tl.minimum(line, TOKENS * KB - 1))
        _prefetch_l2(v_idx + row * VB + tl.minimum(line, TOKENS * VB - 1))


@triton.jit
def _slot_deltas(words, h, D: tl.constexpr):
    """Each token's slot correction δ [BLOCK_T] (``esm_turbo.quant.slots``: fp16 in a word's low half), zero where its
    word's value lies outside head ``h`` (a zero word, as masked rows read, corrects nothing), and its channel in
    the head [BLOCK_T]."""
    index = words.to(tl.uint32, bitcast=True) >> 16  # unsigned: the head and channel by a shift and a mask
    delta = (words & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(index // D == h, delta, 0.0), (index % D).to(tl.int32)


@triton.jit
def _rows(offs_t, t0, end, pg_tab, pg_base, pg_stride, BLOCK_T: tl.constexpr, PAGE: tl.constexpr):
    """Where the tile's tokens ``offs_t`` lie: themselves (a contiguous row, ``PAGE`` = 0), or rows of a paged
    pool [slots, H, PAGE, ·] through the sequence's block table ``pg_tab`` (slot ids): one table entry a tile when
    blocks hold whole tiles (tiles start on multiples of BLOCK_T), else one a token."""
    if PAGE == 0:
        rows = offs_t
    else:
        if PAGE % BLOCK_T == 0:
            slot = tl.load(pg_tab + t0 // PAGE, mask=t0 < end, other=0)
        else:
            slot = tl.load(pg_tab + offs_t // PAGE, mask=offs_t < end, other=0)
        rows = slot.to(tl.int64) * pg_stride + pg_base + (offs_t % PAGE)
    return rows


@triton.jit
def _prefix_block(q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, kl, vl, h, qk, v_inv, k_tab, v_tab, k_lay, v_lay,
                  D: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
                  BLOCK_T: tl.constexpr, KFIXED: tl.constexpr, VFIXED: tl.constexpr, ROWS: tl.constexpr,
                  GRID: tl.constexpr, SLOTS: tl.constexpr, SUBN: tl.constexpr):
    """One BLOCK_T tile (codes from ``_fetch``) of the online softmax for one query, log2 units; ``l_i`` per token
    row [BLOCK_T] with ``GRID`` (see ``_walk``), else a scalar. ``SLOTS``: the tokens' slot words kl, vl of head
    ``h`` corrected for without touching the decoded tiles: a key's δ adds ``qk[c]·δ`` to its score (``qk`` [D]: the
    query unscaled by the grid, gathered at the slot's channel c), a value's δ adds ``p·δ`` at channel c to the
    value sums (as a product of a one-hot over the channel's group of 8 and one over its place, ``v_inv`` [8] undoing
    the grid's scale of that place), one FMA a value and no tile-sized compare (which spilled registers)."""
    tmask = t0 + tl.arange(0, BLOCK_T) < end
    k = _decode_codes(kw, ks, k_tab, k_lay[0], k_lay[1], D, KSIGN, NK, KFIXED, ROWS, GRID, SUBN)
    s = group_dot(k, q3[None, :, :])  # [BLOCK_T]; 2^−SUB of the scores with SUBN
    if SLOTS:
        dk, ck = _slot_deltas(kl, h, D)
        if SUBN:
            dk = dk * (1.0 / SUB_UP)
        s = s + tl.gather(qk, ck, 0) * dk
    s = tl.where(tmask, s, float("-inf"))
    m_tile = tl.max(s, axis=0)
    if SUBN:
        m_tile = m_tile * SUB_UP
    if m_tile > m_i + 8.0:  # rescale only when the running max grows by > 2^8 (exp2 stays < 256 otherwise)
        alpha = tl.exp2(m_i - m_tile)
        acc = acc * alpha
        l_i = l_i * alpha
        m_i = m_tile
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)  # an all-masked tile (interpreter only)
    if SUBN:  # the weights at 2^SUB (so p·v̂ is normal), by a multiply: SUB added to ex2's argument lost its bits
        p = tl.exp2(s * SUB_UP - m_use) * SUB_UP
    else:
        p = tl.exp2(s - m_use)
    if GRID:  # [BLOCK_T]: summed over tokens once, at the end, like acc (one reduction a tile less)
        l_i = l_i + p
    else:
        l_i = l_i + tl.sum(p, axis=0)
    v = _decode_codes(vw, vs, v_tab, v_lay[0], v_lay[1], D, VSIGN, NV, VFIXED, ROWS, GRID, SUBN)
    acc = acc + p[:, None, None] * v  # [BLOCK_T, D/8, 8]: summed over tokens once, at the end
    if SLOTS:
        dv, cv = _slot_deltas(vl, h, D)
        group = tl.where(tl.arange(0, D // 8)[None, :, None] == (cv >> 3)[:, None, None], (p * dv)[:, None, None], 0.0)
        place = tl.where(tl.arange(0, 8)[None, None, :] == (cv & 7)[:, None, None], v_inv[None, None, :], 0.0)
        acc = acc + group * place
    return m_i, l_i, acc


@triton.jit
def _prefetched_block(q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, kl, vl, k_idx, k_sign, v_idx, v_sign, k_sl, v_sl,
                      pg_tab, pg_base, pg_stride, h, qk, v_inv, k_tab, v_tab, k_lay, v_lay, D: tl.constexpr,
                      KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr,
                      NK: tl.constexpr, NV: tl.constexpr, BLOCK_T: tl.constexpr, KFIXED: tl.constexpr,
                      VFIXED: tl.constexpr, ROWS: tl.constexpr, GRID: tl.constexpr, PAGE: tl.constexpr,
                      SLOTS: tl.constexpr, SUBN: tl.constexpr):
    """One tile of ``_walk``'s double buffer: the next tile's codes (and slot words) requested, then this tile's
    (kw … vl) computed (``_prefix_block``). Returns (m, l, acc, the next tile's codes)."""
    nkw, nks, nvw, nvs, nkl, nvl = _fetch(k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, t0 + BLOCK_T, end, pg_tab, pg_base,
                                          pg_stride, D, KCODE_BITS, VCODE_BITS, KSIGN, VSIGN, BLOCK_T, GRID, PAGE,
                                          SLOTS)
    m_i, l_i, acc = _prefix_block(q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, kl, vl, h, qk, v_inv, k_tab, v_tab,
                                  k_lay, v_lay, D, KSIGN, VSIGN, NK, NV, BLOCK_T, KFIXED, VFIXED, ROWS, GRID, SLOTS,
                                  SUBN)
    return m_i, l_i, acc, nkw, nks, nvw, nvs, nkl, nvl


@triton.jit
def _split_codes(k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_sl_ptr, v_sl_ptr, len_ptr, page_ptr, b, pid_bh,
                 start, stop, H, T_CAP, D: tl.constexpr, KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr,
                 KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_T: tl.constexpr, GRID: tl.constexpr,
                 PAGE: tl.constexpr, SLOTS: tl.constexpr):
    """A program's share [start, stop) of cache row ``pid_bh`` (= b·H + h): its rows [start, end) (end: stop or
    the sequence's length), pointers to row 0 of the row in each packed part (``PAGE`` > 0: to the pool, the rows
    found through the block table ``page_ptr`` [B, T_CAP / PAGE] int32, ``_rows``), and its first tile's codes —
    requested here, as early as the program can (``SLOTS``: with the slot words; ``k_sl_ptr`` / ``v_sl_ptr``: the
    token parts [B, 1, T_CAP] or pools [slots, 1, PAGE]). Returns (start, end, (k_idx, k_sign, v_idx, v_sign,
    k_sl, v_sl), (pg_tab, pg_base, pg_stride), codes)."""
    length = tl.load(len_ptr + b).to(tl.int32)
    end = tl.minimum(stop, length)
    if PAGE:
        row0 = pid_bh.to(tl.int64) * 0
        pg_tab = page_ptr + b.to(tl.int64) * (T_CAP // PAGE)
        pg_base = (pid_bh % H) * PAGE
        pg_stride = H * PAGE
    else:
        row0 = pid_bh.to(tl.int64) * T_CAP
        pg_tab = page_ptr
        pg_base = 0
        pg_stride = 0
    k_idx = k_idx_ptr + row0 * (D * KCODE_BITS // 8)
    k_sign = k_sign_ptr + row0 * (D // 8)
    v_idx = v_idx_ptr + row0 * (D * VCODE_BITS // 8)
    v_sign = v_sign_ptr + row0 * (D // 8)
    k_sl = k_sl_ptr
    v_sl = v_sl_ptr
    if not PAGE:
        k_sl += b.to(tl.int64) * T_CAP
        v_sl += b.to(tl.int64) * T_CAP
    kw, ks, vw, vs, kl, vl = _fetch(k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, start, end, pg_tab, pg_base, pg_stride,
                                    D, KCODE_BITS, VCODE_BITS, KSIGN, VSIGN, BLOCK_T, GRID, PAGE, SLOTS)
    return start, end, k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, pg_tab, pg_base, pg_stride, kw, ks, vw, vs, kl, vl


@triton.jit
def _walk(q3, start, end, kw, ks, vw, vs, kl, vl, k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, pg_tab, pg_base, pg_stride,
          k_tab, v_tab, k_lay, v_lay, h, D: tl.constexpr, KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr,
          KSIGN: tl.constexpr, VSIGN: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, BLOCK_T: tl.constexpr,
          PREFETCH: tl.constexpr, INTERPRET: tl.constexpr, KFIXED: tl.constexpr, VFIXED: tl.constexpr,
          ROWS: tl.constexpr, GRID: tl.constexpr, PAGE: tl.constexpr, SLOTS: tl.constexpr, SUBN: tl.constexpr):
    """Online softmax of one query (of head ``h``) over cached rows [start, end): (m, l, Σ p·ŷ as [D/8, 8]), log2
    units. (kw, ks, vw, vs, kl, vl): the first tile's codes (and slot words), ``_fetch``-ed by the caller as early as
    it can. k_lay / v_lay: (shift, mask) of the packed codes' fields (``_field_layout``). ``PREFETCH``: the next
    tile's codes are requested before this tile is computed (a register double buffer); ``PREFETCH`` = n > 1: and the
    codes of the tile n tiles ahead asked into L2 (``_ask_tile``), so more of the walk's bytes are in flight than its
    registers hold. ``INTERPRET`` > 0
    (Triton's interpreter): that many tiles, unrolled (it needs a static loop). ``GRID`` (``_decode_codes``): the
    tiles hold j scaled by a power of two per field, so the query and the value sums are scaled back by its
    inverse (``_grid_factor``, exact); ``SUBN``: as float32 subnormals, the scores then at 2^−SUB and the softmax
    weights at 2^SUB (``SUB_UP``), so every product with a code is normal. ``SLOTS``: each tile's scores and value
    sums corrected for the tokens' slots (``_prefix_block``)."""
    v_inv = tl.full((8,), 1.0, tl.float32)
    qk = tl.reshape(q3, (D,))  # the slots' key corrections gather the query before the grid's scale
    if GRID:
        k_fac = _grid_factor(k_lay, KFIXED and not KSIGN, GRID, SUBN)
        v_fac = _grid_factor(v_lay, VFIXED and not VSIGN, GRID, SUBN)
        q3 = q3 * k_fac
        if SLOTS:  # a value's δ is added at the weights' own scale, undone with the grid's
            v_inv = 1.0 / tl.reshape(v_fac, (8,))
            if SUBN:  # (2^SUB with SUBN)
                v_inv = v_inv * (1.0 / SUB_UP)
    m_i = tl.max(tl.full((2,), float("-inf"), dtype=tl.float32), axis=0)
    if GRID:  # softmax sums per token row, like acc (a LUT walk's registers spilled with them, SASS sm_90)
        l_i = tl.zeros((BLOCK_T,), dtype=tl.float32)
    else:
        l_i = tl.sum(tl.zeros((2,), dtype=tl.float32), axis=0)
    acc = tl.zeros((BLOCK_T, D // 8, 8), dtype=tl.float32)
    if INTERPRET > 0:
        for it in tl.static_range(INTERPRET):
            m_i, l_i, acc, kw, ks, vw, vs, kl, vl = _prefetched_block(
                q3, m_i, l_i, acc, start + it * BLOCK_T, end, kw, ks, vw, vs, kl, vl, k_idx, k_sign, v_idx, v_sign,
                k_sl, v_sl, pg_tab, pg_base, pg_stride, h, qk, v_inv, k_tab, v_tab, k_lay, v_lay, D, KCODE_BITS,
                VCODE_BITS, KSIGN, VSIGN, NK, NV, BLOCK_T, KFIXED, VFIXED, ROWS, GRID, PAGE, SLOTS, SUBN)
    elif PREFETCH:
        for t0 in range(start, end, BLOCK_T):
            if PREFETCH > 1:
                _ask_tile(k_idx, v_idx, t0 + PREFETCH * BLOCK_T, end, pg_tab, pg_base, pg_stride, D, KCODE_BITS,
                          VCODE_BITS, BLOCK_T, PAGE)
            m_i, l_i, acc, kw, ks, vw, vs, kl, vl = _prefetched_block(
                q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, kl, vl, k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, pg_tab,
                pg_base, pg_stride, h, qk, v_inv, k_tab, v_tab, k_lay, v_lay, D, KCODE_BITS, VCODE_BITS, KSIGN,
                VSIGN, NK, NV, BLOCK_T, KFIXED, VFIXED, ROWS, GRID, PAGE, SLOTS, SUBN)
    else:
        for t0 in range(start, end, BLOCK_T):
            kw, ks, vw, vs, kl, vl = _fetch(k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, t0, end, pg_tab, pg_base,
                                            pg_stride, D, KCODE_BITS, VCODE_BITS, KSIGN, VSIGN, BLOCK_T, GRID, PAGE,
                                            SLOTS)
            m_i, l_i, acc = _prefix_block(q3, m_i, l_i, acc, t0, end, kw, ks, vw, vs, kl, vl, h, qk, v_inv, k_tab,
                                          v_tab, k_lay, v_lay, D, KSIGN, VSIGN, NK, NV, BLOCK_T, KFIXED, VFIXED, ROWS,
                                          GRID, SLOTS, SUBN)
    acc = tl.sum(acc, axis=0)
    if GRID:
        l_i = tl.sum(l_i, axis=0)
        if SUBN:
            l_i = l_i * (1.0 / SUB_UP)
        acc = acc * v_fac
    return m_i, l_i, acc


@triton.jit
def _prefix_kernel(qt_ptr, sqb, sqh, sqs, perm_ptr, ksc_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr,
                   v_tab_ptr, k_lay_ptr, v_lay_ptr,
                   len_ptr, page_ptr, k_sl_ptr, v_sl_ptr,
                    m_ptr, l_ptr, acc_ptr,
                    H, S, T_CAP, T0, PS, CHUNK, NS,
                    D: tl.constexpr, KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr, KFIELDS: tl.constexpr,
                    VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_T: tl.constexpr,
                    NK: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
                    ROWS: tl.constexpr, GRID: tl.constexpr, PDL: tl.constexpr, PAGE: tl.constexpr,
                    SLOTS: tl.constexpr, SUBN: tl.constexpr, GATHER: tl.constexpr):
    """Grid (B·H·S, splits): one query per program, tiles kept as [BLOCK_T, D/8, 8] (no reshapes), split k over the
    cached rows [T0 + k·CHUNK, T0 + (k + 1)·CHUNK) stored at partial PS + k of the query's NS (T0, PS: what the shared
    walk took, ``shared.py``; else 0). ``PDL``
    (launched while the kernel before it runs: the prep kernel, or with ``GATHER`` whatever wrote q): the first
    tile's codes are requested, then the program waits for that grid before it reads its query (``_walk_store``)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_bh = pid // S
    qi = pid % S
    _walk_store(qt_ptr, sqb, sqh, sqs, perm_ptr, ksc_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr,
                v_tab_ptr, k_lay_ptr, v_lay_ptr,
                len_ptr, page_ptr, k_sl_ptr, v_sl_ptr, m_ptr, l_ptr, acc_ptr, pid_bh, qi, T0 + split * CHUNK,
                T0 + split * CHUNK + CHUNK, (pid_bh * NS + PS + split) * BLOCK_S + qi, H, S, T_CAP, D, KCODE_BITS,
                VCODE_BITS, KFIELDS, VFIELDS, KSIGN, VSIGN, BLOCK_T, NK, NV, PREFETCH, INTERPRET, ROWS, GRID, PDL, PAGE,
                SLOTS, SUBN, GATHER)


@triton.jit
def _stream_kernel(qt_ptr, sqb, sqh, sqs, perm_ptr, ksc_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr,
                   v_tab_ptr, k_lay_ptr, v_lay_ptr,
                   len_ptr, page_ptr, k_sl_ptr, v_sl_ptr, m_ptr, l_ptr, acc_ptr, H, S, T_CAP, T0, PS, R, NT, W, NS,
                   D: tl.constexpr, KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr, KFIELDS: tl.constexpr,
                   VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_T: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr,
                   INTERPRET: tl.constexpr, ROWS: tl.constexpr, GRID: tl.constexpr, PDL: tl.constexpr,
                   PAGE: tl.constexpr, SLOTS: tl.constexpr, SUBN: tl.constexpr, GATHER: tl.constexpr):
    """``_prefix_kernel`` with the work cut evenly (stream-K): grid (programs,), the B·H·S queries' rows of NT
    tiles each laid end to end and cut in runs of W tiles, one run per program, so every program walks as many
    tiles and the GPU holds one full wave (a grid of (query, split) programs left SMs part-empty: 1280 one-warp
    programs on 132 SMs that hold 12 each). A run that crosses rows writes one partial per row: row r's
    partial k (slot r·NS + PS + k; k below the count the merge derives, NS − PS from :func:`stream_plan`) comes from
    program ⌊r·NT / W⌋ + k. The rows' tiles start at cached row T0 (T0, PS: what the shared walk took, else 0)."""
    p = tl.program_id(0)
    first = p * W
    for r in range(first // NT, tl.minimum((first + W - 1) // NT, R - 1) + 1):
        pid_bh = r // S
        qi = r % S
        lo = tl.maximum(first, r * NT) - r * NT
        hi = tl.minimum(first + W, r * NT + NT) - r * NT
        k = p - _runs_meeting(r, NT, W)[0]
        _walk_store(qt_ptr, sqb, sqh, sqs, perm_ptr, ksc_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr,
                    v_tab_ptr, k_lay_ptr,
                    v_lay_ptr, len_ptr, page_ptr, k_sl_ptr, v_sl_ptr, m_ptr, l_ptr, acc_ptr, pid_bh, qi,
                    T0 + lo * BLOCK_T, T0 + hi * BLOCK_T, (pid_bh * NS + PS + k) * BLOCK_S + qi, H, S, T_CAP, D,
                    KCODE_BITS, VCODE_BITS, KFIELDS, VFIELDS, KSIGN, VSIGN, BLOCK_T, NK, NV, PREFETCH, INTERPRET, ROWS,
                    GRID, PDL, PAGE, SLOTS, SUBN, GATHER)


@triton.jit
def _runs_meeting(row, NT, W):
    """The first and last stream-K runs (W tiles each, cut from rows of NT tiles laid end to end) that meet ``row``:
    its partial k comes from run first + k (``_stream_kernel``), and the merge reads last − first + 1 of them."""
    return (row * NT) // W, ((row + 1) * NT - 1) // W


@triton.jit
def _walk_store(qt_ptr, sqb, sqh, sqs, perm_ptr, ksc_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr,
                v_tab_ptr, k_lay_ptr, v_lay_ptr,
                len_ptr, page_ptr, k_sl_ptr, v_sl_ptr, m_ptr, l_ptr, acc_ptr, pid_bh, qi, start, stop, part, H, S,
                T_CAP, D: tl.constexpr, KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr, KFIELDS: tl.constexpr,
                VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_T: tl.constexpr,
                NK: tl.constexpr, NV: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
                ROWS: tl.constexpr, GRID: tl.constexpr, PDL: tl.constexpr, PAGE: tl.constexpr, SLOTS: tl.constexpr,
                SUBN: tl.constexpr, GATHER: tl.constexpr):
    """Query ``qi`` of cache row ``pid_bh`` over its cached rows [start, stop): walked, its (m, l, acc) stored at
    partial ``part``. The query: the prep kernel's ``qt`` [B·H·S, D] float32, or (``GATHER``: keys whose rotation
    permutes each head's channels, no prep launch) gathered from q itself (``qt_ptr`` → q [B, H, S, D] of strides
    sqb, sqh, sqs) at ``perm_ptr`` [H, D] int32 and scaled by the keys' scale ``ksc_ptr`` [H, D]."""
    b = pid_bh // H
    h = pid_bh % H
    start, end, k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, pg_tab, pg_base, pg_stride, kw, ks, vw, vs, kl, vl = \
        _split_codes(k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_sl_ptr, v_sl_ptr, len_ptr, page_ptr, b, pid_bh,
                     start, stop, H, T_CAP, D, KCODE_BITS, VCODE_BITS, KSIGN, VSIGN, BLOCK_T, GRID, PAGE, SLOTS)
    g = tl.arange(0, D // 8)
    r = tl.arange(0, 8)
    chan = g[:, None] * 8 + r[None, :]  # [D8, 8] channel index
    k_lay = _field_layout(k_lay_ptr + h * D, KFIELDS)
    v_lay = _field_layout(v_lay_ptr + h * D, VFIELDS)
    if GATHER:  # constants: read before the wait
        at = tl.load(perm_ptr + h * D + chan)
        ksc = tl.load(ksc_ptr + h * D + chan).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if GATHER:
        q3 = tl.load(qt_ptr + b.to(tl.int64) * sqb + h * sqh + qi * sqs + at).to(tl.float32) * ksc * LOG2E
    else:
        q3 = tl.load(qt_ptr + (pid_bh * S + qi) * D + chan) * LOG2E
    m_i, l_i, acc = _walk(q3, start, end, kw, ks, vw, vs, kl, vl, k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, pg_tab,
                          pg_base, pg_stride, k_tab_ptr + h * NK, v_tab_ptr + h * NV, k_lay, v_lay, h, D, KCODE_BITS,
                          VCODE_BITS, KSIGN, VSIGN, NK, NV, BLOCK_T, PREFETCH, INTERPRET, KFIELDS >= 0, VFIELDS >= 0,
                          ROWS, GRID, PAGE, SLOTS, SUBN)
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)
    tl.store(acc_ptr + part * D + chan, acc)
