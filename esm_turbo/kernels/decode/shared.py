"""The walk over a prefix that the rows of a paged step hold in the same blocks as their lead row (forks of a
scaffold): each tile of it decoded once for a group of queries, not once a query.

A paged session's forks share their scaffold's blocks, and the per-query walks (``walk.py``) read those blocks once
for every row: 256 forks of a 1,024-token scaffold read it 256 times a layer. ``_shared_kernel`` (grid: head, split
of the shared prefix, group of ``BLOCK_G`` queries) reads a tile of the shared prefix through the block table of a
lead row (``DecodeCache.shared_prefix``; one pass a lead among the group's queries), decodes its keys and values
once, and runs the group's online softmax over it with two products on tensor cores, scores [G, T] = Q̃ Ŷₖᵀ and
sums [G, d] += P Ŷᵥ (fp32 accuracy: ``dot_precision``). It writes one partial (m, l,
Σ p·ŷ; log2 units, the value sums in the codes' domain, as a walk writes them) per query and split, in the first
slots of each query's partials; the walks then cover each row's own tokens past the shared prefix in the slots after
them, and the merge (``merge.py``) combines them all. The PyTorch reference is the unshared one
(``esm_turbo.ops.compressed.compressed_attention_reference``): the same sums, grouped differently.

Codecs with slots (sparse exact corrections) keep the per-query walks (``shared_span`` returns 0 for them).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .codes import _decode_codes, _field_layout, _grid_factor
from .walk import LOG2E, _fetch

#: tokens of the shared walk's tile
BLOCK_T = 32
#: the shortest shared prefix (tokens) worth a launch of its own: below it the per-query walks read it
MIN_SHARED = 256
#: the fewest queries a step needs for the shared walk: with fewer, each tile is decoded for too few of them
MIN_QUERIES = 8


def shared_tiles(d: int) -> tuple[int, int]:
    """(queries a program, warps) of the shared walk at head_dim ``d``: the largest group (a product's rows, at least
    16) whose program spills no registers in the sm_90 build (4 warps spilled 24 bytes a thread at d = 64 with
    looked-up codes; 32 queries at d = 128 spilled in 8 warps too)."""
    if d <= 32:
        return 32, 4
    return (32, 8) if d <= 64 else (16, 8)


def shared_span(shared: int, queries: int, block_t: int, paged: bool, slots: bool) -> int:
    """Tokens of the shared prefix the shared walk takes: ``shared`` (what every row holds in the same blocks,
    ``DecodeCache.shared_prefix``) rounded down to whole tiles of both walks, or 0 where it does not pay
    (a contiguous cache, codes with slots, too short a prefix, too few queries)."""
    tile = math.lcm(BLOCK_T, block_t)
    span = int(shared) // tile * tile
    if not paged or slots or span < MIN_SHARED or queries < MIN_QUERIES:
        return 0
    return span


@triton.jit
def _shared_kernel(qt_ptr, sqb, sqh, sqs, perm_ptr, ksc_ptr, k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_tab_ptr,
                   v_tab_ptr, k_lay_ptr, v_lay_ptr, page_ptr, lead_ptr, m_ptr, l_ptr, acc_ptr, H, S, N, SPAN, CHUNK,
                   NS, TABLE_W,
                   D: tl.constexpr, KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr, KFIELDS: tl.constexpr,
                   VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
                   ROWS: tl.constexpr, GRID: tl.constexpr, PAGE: tl.constexpr, GATHER: tl.constexpr,
                   LEADS: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (H, splits, cdiv(N, BLOCK_G)), N = B·S queries: head h's queries n = b·S + s of one group over the
    shared prefix's tokens [split·CHUNK, min(split·CHUNK + CHUNK, SPAN)), read through the block table of the row's
    lead (``page_ptr`` [B, TABLE_W] int32; ``LEADS``: ``lead_ptr`` [B] int32, the first row holding the same first
    SPAN / PAGE blocks as row b; else row 0 for every row): a group's queries of one lead in one pass over the
    prefix, so a group of forks of one scaffold takes one pass, and one that spans two scaffolds two. The queries as the
    walks take them (``walk._walk_store``): the prep kernel's ``qt`` [B·H·S, D] float32, or (``GATHER``) q [B, H,
    S, D] of strides sqb, sqh, sqs gathered at ``perm_ptr`` and scaled by ``ksc_ptr``. Partial (m, l, acc [D]) of
    query n stored at slot ``split`` of its NS (``m_ptr`` [B·H·NS·BLOCK_S], ``acc_ptr`` [·, D])."""
    h = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)
    nmask = offs_n < N
    b = offs_n // S
    qi = offs_n % S
    chan = tl.arange(0, D)
    if GATHER:
        at = tl.load(perm_ptr + h * D + chan)
        ksc = tl.load(ksc_ptr + h * D + chan).to(tl.float32)
        q = tl.load(qt_ptr + b.to(tl.int64)[:, None] * sqb + h * sqh + qi[:, None] * sqs + at[None, :],
                    mask=nmask[:, None], other=0.0).to(tl.float32) * ksc[None, :]
    else:
        q = tl.load(qt_ptr + ((b * H + h) * S + qi)[:, None] * D + chan[None, :], mask=nmask[:, None], other=0.0)
    q = q * LOG2E  # [BLOCK_G, D], log2 units
    k_lay = _field_layout(k_lay_ptr + h * D, KFIELDS)
    v_lay = _field_layout(v_lay_ptr + h * D, VFIELDS)
    if GRID:  # the decoded tiles hold j scaled by a power of two a field: the query and the sums scaled back
        k_fac = tl.reshape(tl.broadcast_to(_grid_factor(k_lay, KFIELDS >= 0 and not KSIGN, GRID, False), (D // 8, 8)),
                           (D,))
        v_fac = tl.reshape(tl.broadcast_to(_grid_factor(v_lay, VFIELDS >= 0 and not VSIGN, GRID, False), (D // 8, 8)),
                           (D,))
        q = q * k_fac[None, :]
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, SPAN)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    k_tab = k_tab_ptr + h * NK
    v_tab = v_tab_ptr + h * NV
    NONE: tl.constexpr = 1 << 30  # the lead of a query past N: never walked
    if LEADS:
        lead = tl.load(lead_ptr + b, mask=nmask, other=NONE)
    else:
        lead = tl.where(nmask, 0, NONE)
    cur = tl.min(lead, axis=0)
    while cur < NONE:  # one pass a lead among the group's queries
        mine = lead == cur
        table = page_ptr + cur.to(tl.int64) * TABLE_W
        for t0 in range(start, end, BLOCK_T):  # whole tiles: SPAN and CHUNK are multiples of BLOCK_T
            kw, ks, vw, vs, kl, vl = _fetch(k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_idx_ptr, k_idx_ptr, t0,
                                            end, table, h * PAGE, H * PAGE, D, KCODE_BITS, VCODE_BITS, KSIGN, VSIGN,
                                            BLOCK_T, GRID, PAGE, False)
            k = tl.reshape(_decode_codes(kw, ks, k_tab, k_lay[0], k_lay[1], D, KSIGN, NK, KFIELDS >= 0, ROWS, GRID,
                                         False), (BLOCK_T, D))
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_G, BLOCK_T]
            s = tl.where(mine[:, None], s, float("-inf"))  # other leads' queries keep their sums as they are
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(tl.where(mine, m_i, 0.0) - tl.where(mine, m_new, 0.0))  # 1 for other leads' queries
            p = tl.exp2(s - tl.where(mine, m_new, 0.0)[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.reshape(_decode_codes(vw, vs, v_tab, v_lay[0], v_lay[1], D, VSIGN, NV, VFIELDS >= 0, ROWS, GRID,
                                         False), (BLOCK_T, D))
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        cur = tl.min(tl.where(lead > cur, lead, NONE), axis=0)
    if GRID:
        acc = acc * v_fac[None, :]
    part = ((b * H + h) * NS + split) * BLOCK_S + qi
    tl.store(m_ptr + part, m_i, mask=nmask)
    tl.store(l_ptr + part, l_i, mask=nmask)
    tl.store(acc_ptr + part[:, None] * D + chan[None, :], acc, mask=nmask[:, None])
