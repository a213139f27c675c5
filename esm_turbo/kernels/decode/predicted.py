"""Fused decode attention over a cache whose values are predicted from the keys (``esm_turbo.quant.predict``): two
walks and their merge, whose PyTorch reference is ``esm_turbo.ops.predicted.predicted_attention_reference``.

A cached token's value is r̂ + (f W + b), f [H·d] every head's decoded key turned back before the rotary embedding.
No cached token's prediction is computed: a query of head h needs Σ_t p_{h,t} f_t (then one map by W's columns of
head h). Every query head pools every head's features, so a program that pooled all of them would hold H × 2·H·d
sums (200 K floats at 650M): the features are cut in chunks of FC heads, and the scores, which every chunk needs,
are computed once by a walk of their own and handed over as fp16 weights:

* ``_scores_kernel`` (grid: query, split, group of HG heads): each head's scores from its own keys in its key affine
  domain (``⟨q̃, ŷ⟩``, c0 dropped as in ``walk.py``), an online softmax (log2 units), the coded residual's sums
  Σ p ŷᵥ (mapped back once by the merge); each tile's weights p = 2^(s − m_tile) in fp16 and m_tile are written out
  (2 bytes a cached token and head beside the keys' d·bits/8);
* ``_pool_kernel`` (grid: query, split, chunk of FC feature heads): the weights read back at the split's scale, the
  chunk's keys decoded once, and the pooled features in the keys' code order: the keys' rotation is a permutation π
  of each head's channels, so x̂ = (ŷ ⊙ σ + o) Π is u = ŷ ⊙ σ + o read in another order, and
  f = x̂·cos − rotate_half(x̂)·sin pools as Σ p u⊙cos(tω') and Σ p u⊙sin(tω') (ω' each code channel's frequency;
  the factors read from the rotary embedding's own table, no transcendental in the loop) — two tensor-core products
  [HQ, BT] × [BT, FC·d] in fp16 (P in fp16, as flash attention's P·V), fp32 sums — with π and rotate_half folded
  into the rows of W that the merge applies (``esm_turbo.ops.predicted.walk_tables``);
* ``_predicted_merge_kernel``: the splits combined, the map applied, the step's own tokens added exactly.

Where the map takes each head's values from its own group of the scores walk's heads (``calibrate --predict-group
walk``) and the values are not stored, the scores walk pools its group's features itself (``POOL``, :func:`one_pass`):
one walk and the merge, no weights handed over.

HQ = max(16, the heads rounded up to a power of two) (a dot's rows); 2·FC·d ≤ :data:`POOLED_VALUES` / HQ, so the
pooled sums fit a program's registers. Shapes beyond :func:`fits` (35M's heads of 24) take the PyTorch path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quant.layout import CachedCodes
from ...quant.predict import walk_group
from ..common import FP_FUSION, interpreting, num_sms, part_or, token_strides

LOG2E = tl.constexpr(1.4426950408889634)
#: the most pooled feature sums a program can keep (two [HQ, FC·d]): one head's must fit (``fits``)
POOLED_VALUES = 16384
#: the pooled sums a program keeps where a head's take fewer (feature heads chosen to fit them): half the most, at
#: 4 warps, ran the keys alone 0.65× (650M-shaped) and 0.57× (8M-shaped) the time of the most at 8 warps (H100,
#: ``tools/predicted_tune.py``, ``results/studies/predicted_tune_h100.txt``)
POOLED_SUMS = 8192
#: a Hopper program's most shared memory (bytes)
SM90_SHARED = 232448
#: the tokens of the pooling walk's tile: 16, or 32 where a program pools few features (``pool_tile``)
BLOCK_T = 16
#: warps a program of the scores walk and of the pooling walk (``pool_warps`` says where the pooling walk takes
#: twice as many)
SCORE_WARPS = 4
POOL_WARPS = 4
#: the tokens of the scores walk's tile (its four warps take 16 each); a multiple of the pooling walk's
SCORE_T = 64
#: the one-pass walk's warps and tile (tokens; a divisor of SCORE_T): :func:`one_pass_tile` halves it where it would
#: spill (sm_90 build: 64 tokens in 4 warps spill everywhere)
ONE_PASS_WARPS = 8
ONE_PASS_T = 64


def query_heads(heads: int) -> int:
    """HQ: the heads a program holds, a power of two of at least 16 (the pooled dot's rows)."""
    return max(16, triton.next_power_of_2(heads))


def fits(heads: int, dim: int) -> bool:
    """Whether the fused walks take a layer of ``heads`` heads of ``dim``: a power of two of at least 16, and one
    feature head's two pooled sums for every query head within a program's :data:`POOLED_VALUES` (2·HQ·d ≤ 16K:
    every ESM-2 and ESM C head shape but 35M's heads of 24)."""
    return dim >= 16 and dim & (dim - 1) == 0 and 2 * query_heads(heads) * dim <= POOLED_VALUES


def feature_chunk(heads: int, dim: int) -> tuple[int, int]:
    """(FC, chunks): the feature heads a program of the pooling walk pools (a power of two, as many as their two
    pooled sums for every query head fit :data:`POOLED_SUMS`, at least two where two fit :data:`POOLED_VALUES` — 3B's
    64 query heads of 64: one a program compiles to a third more instructions a cached token, sm_90 —, at least one,
    at most the heads rounded up) and the programs that cover every head."""
    per = 2 * query_heads(heads) * dim
    fc = min(triton.next_power_of_2(heads), max(1, POOLED_SUMS // per, min(2, POOLED_VALUES // per)))
    return fc, math.ceil(heads / fc)


def pool_tile(heads: int, dim: int) -> int:
    """The pooling walk's tile: 32 tokens where its program pools at most 128 features of heads of 64 or more
    (650M-shaped: 0.74× the time of 16-token tiles at two feature heads, H100; at 3B's and 15B's 64 query heads the
    16-token tiles left a tile's fixed work, the weights of every query head and the rotary rows, to few values a
    thread); else 16 (8M-shaped: 0.86× the time of 32-token tiles)."""
    fc, _ = feature_chunk(heads, dim)
    return 2 * BLOCK_T if fc * dim <= 128 and dim >= 64 else BLOCK_T


def pool_warps(heads: int, dim: int, grid: bool) -> int:
    """The pooling walk's warps: :data:`POOL_WARPS`, twice that where a program keeps more than :data:`POOLED_SUMS`
    pooled sums (a head's own exceed it: 15B's 40 heads of 128) or decodes looked-up codes (``grid`` False) in
    32-token tiles, which spill at 4 (sm_90 build: 8–80 bytes of local memory a thread, 255 registers)."""
    fc, _ = feature_chunk(heads, dim)
    big = 2 * query_heads(heads) * fc * dim > POOLED_SUMS or (not grid and pool_tile(heads, dim) > BLOCK_T)
    return POOL_WARPS * (2 if big else 1)


def score_heads(heads: int, dim: int) -> int:
    """HG: the heads a program of the scores walk takes, ``quant.predict.walk_group`` (128 / d of them, at most 8, at
    least 1): the keys of a tile are its product's [HG·d, BT] operand."""
    return walk_group(dim)


def walk_splits(queries: int, heads: int, dim: int, t_cap: int, sms: int, one_pass: bool = False) -> int:
    """The splits of each query's cached tokens the walks take by default: enough pooling programs (queries × splits
    × feature chunks, or for the one-pass walk × groups of score heads) for two of each of ``sms`` multiprocessors,
    at most one a score tile and 64."""
    blocks = max(1, math.ceil(t_cap / SCORE_T))
    per = math.ceil(heads / score_heads(heads, dim)) if one_pass else feature_chunk(heads, dim)[1]
    return max(1, min(blocks, 64, math.ceil(2 * sms / max(1, queries * per))))


def one_pass_tile(dim: int, stored: bool) -> int:
    """The one-pass walk's tile: :data:`ONE_PASS_T` tokens, half that where its program also sums a coded residual
    (``stored``) or decodes heads of 128, which spill at 64 (8–80 bytes of local memory a thread, sm_90 build)."""
    return ONE_PASS_T // 2 if stored or dim >= 128 else ONE_PASS_T


def one_pass(predictor, heads: int, dim: int, stored: bool = False) -> bool:
    """Whether the scores walk pools the features itself (``_scores_kernel``'s ``POOL``; no pooling walk, no weights
    written): ``predictor``'s map takes each head's values from groups of heads that lie within the walk's groups of
    :func:`score_heads` (``ValuePredictor.group`` divides it; ``calibrate --predict-group``), over the keys alone
    (``stored`` False: values not stored). Where a residual is coded too the one pass ran 0.68–1.20× the two walks'
    time (H100, slower at 8M- and 650M-shaped), the keys alone 0.42–0.81× at every shape measured
    (``tools/predicted_speed.py``, ``results/studies/predicted_kernels_h100.txt``)."""
    return not stored and score_heads(heads, dim) % predictor.group == 0


@triton.jit
def _rows_of(b, hh, offs_t, tmask, page_ptr, H, T_CAP, PAGE: tl.constexpr):
    """Row indices [HH, BT] (int64) of heads ``hh`` [HH] at positions ``offs_t`` [BT] of sequence b: ``(b·H + h)·T_CAP
    + t`` in a contiguous cache [B, H, T_CAP, ·], or through the block table (``PAGE`` > 0) ``(slot·H + h)·PAGE +
    t % PAGE`` in a pool [slots, H, PAGE, ·]."""
    if PAGE == 0:
        base = (b * H + hh).to(tl.int64) * T_CAP
        rows = base[:, None] + offs_t[None, :]
    else:
        slot = tl.load(page_ptr + b.to(tl.int64) * (T_CAP // PAGE) + offs_t // PAGE, mask=tmask, other=0)
        rows = (slot.to(tl.int64)[None, :] * H + hh[:, None]) * PAGE + (offs_t % PAGE)[None, :]
    return rows


@triton.jit
def _decode_heads(main_ptr, sign_ptr, tab_ptr, lay, hh, rows, mask, D: tl.constexpr, CB: tl.constexpr,
                  NC: tl.constexpr, SIGN: tl.constexpr, GRID: tl.constexpr):
    """Codes of heads ``hh`` [HH] at ``rows`` [HH, BT] (``mask`` [HH, BT]) → values ŷ [HH, BT, D] float32 (the affine
    domain). Each group of 8 channels is one little-endian word of CB bytes (one aligned load at 2 and 4 bytes);
    channel 8g + r's field lies at ``lay`` = (shift, mask) [HH, 1, D/8, 8]; with a sign plane (``SIGN``) the code is
    ``2·field + bit``. A grid codec's code is its value (``GRID``); else it is looked up in the head's table [D, NC]
    of ``tab_ptr`` [H, D, NC]."""
    D8: tl.constexpr = D // 8
    g = tl.arange(0, D8)[None, None, :]
    r3 = rows[:, :, None]
    m3 = mask[:, :, None]
    if CB == 4:
        word = tl.load(main_ptr.to(tl.pointer_type(tl.int32)) + r3 * D8 + g, mask=m3, other=0)
    elif CB == 2:
        word = tl.load(main_ptr.to(tl.pointer_type(tl.int16)) + r3 * D8 + g, mask=m3, other=0).to(tl.int32) & 0xFFFF
    else:
        word = tl.zeros(r3.shape, tl.int32) + tl.zeros(g.shape, tl.int32)
        for i in tl.static_range(CB):
            byte = tl.load(main_ptr + r3 * (D * CB // 8) + g * CB + i, mask=m3, other=0)
            word = word | (byte.to(tl.int32) << (8 * i))
    code = (word[:, :, :, None] >> lay[0]) & lay[1]  # [HH, BT, D/8, 8]
    if SIGN:
        sb = tl.load(sign_ptr + r3 * D8 + g, mask=m3, other=0).to(tl.int32)
        code = code * 2 + ((sb[:, :, :, None] >> tl.arange(0, 8)[None, None, None, :]) & 1)
    code = tl.reshape(code, (rows.shape[0], rows.shape[1], D))
    if GRID:
        val = code.to(tl.float32)
    else:
        c = tl.arange(0, D)[None, None, :]
        val = tl.load(tab_ptr + (hh[:, None, None] * D + c) * NC + code, mask=m3, other=0.0).to(tl.float32)
    return val


@triton.jit
def _layout_rows(lay_ptr, hh, hmask, D: tl.constexpr):
    """(shift, mask) [HH, 1, D/8, 8] int32 of heads ``hh``'s channels (``lay_ptr`` [H, D]: ``shift | mask << 8``)."""
    at = (hh[:, None, None, None] * D + tl.arange(0, D // 8)[None, None, :, None] * 8
          + tl.arange(0, 8)[None, None, None, :])
    lay = tl.load(lay_ptr + at, mask=hmask[:, None, None, None], other=0)
    return lay & 255, (lay >> 8) & 255


@triton.jit
def _scores_kernel(q_ptr, sqb, sqh, sqs, perm_ptr, ftab_ptr, k_main, k_sign, v_main, v_sign, k_tab, v_tab, k_lay_ptr,
                   v_lay_ptr, len_ptr, page_ptr,
                   m_ptr, l_ptr, acc_ptr, p_ptr, mt_ptr, trig_ptr, pool_ptr, H, S, T_CAP, CHUNK, TILES, NS, NT,
                   D: tl.constexpr, HQ: tl.constexpr, HG: tl.constexpr, BT: tl.constexpr, KCB: tl.constexpr,
                   VCB: tl.constexpr, KNC: tl.constexpr, VNC: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr,
                   KGRID: tl.constexpr, VGRID: tl.constexpr, VSTORED: tl.constexpr, PAGE: tl.constexpr,
                   FT: tl.constexpr, POOL: tl.constexpr):
    """Grid (B·S, NS, ⌈H/HG⌉): query ``qi`` of sequence b over cached rows [split·CHUNK, +CHUNK) ∩ [0, length) in tiles
    of BT, heads [group·HG, +HG) (HG ≤ 8): each head's scores from its own keys (``⟨q̃, ŷ⟩``, c0 dropped, log2 units;
    q̃ = (q Πᵀ) ⊙ σ gathered from ``q_ptr`` [B, H, S, D] (strides sqb, sqh, sqs) at the permutation ``perm_ptr``
    [H, D] and scaled by row 0 of ``ftab_ptr`` [H, FT, D]) and an online softmax. A tile's scores are one
    tensor-core product [16, HG·D] × [HG·D, BT]: the queries laid block-diagonally, each split in two fp16 halves
    (row g its hi half, row 8 + g its lo half: q within 2^−22, fp32 sums), against the decoded keys (exact in fp16:
    grid codes are small integers, tables fp16), so no sum over a head's channels crosses threads and the warps share
    the tokens. Rows are laid out for 8 heads, those ≥ HG unused.
    The coded residual's sums are one more product, the weights (fp16, as flash attention's P·V) against the tile's
    values of the HG heads, of which each head keeps its own columns.
    Writes partial (b·S + qi)·NS + split: m, l [HQ] and (``VSTORED``) Σ p ŷᵥ [HQ, D]; and for the pooling walk each
    tile's weights p = 2^(s − m_tile) in fp16 at ``p_ptr`` [B·S, H, T_CAP] and its running max m_tile at ``mt_ptr``
    [B·S, H, NT] (tile t0 / BT).
    ``POOL`` (one pass, for a predictor whose map takes each head's values from its own group of HG heads alone): no
    weights written; the program pools its group's features itself, as ``_pool_kernel`` does: a tile's features at
    their offsets i in the tile (cos(iω'), sin(iω') read once a program from rows 0…BT−1 of the rotary table
    ``trig_ptr`` [≥ T_CAP, D/2, 2]) in one more product [16, 2·BT] × [2·BT, HG·D] (rows g and 8 + g head g's
    weights against the cos and the sin halves), its sums turned by t0·ω' (the table's row t0) and added to the
    running ones (rescaled with the head's softmax), and writes
    Σ p u⊙cos, Σ p u⊙sin [HG·D] of head g at ``pool_ptr`` [B·S, NS, HQ, 2, HG·D] (its group's features only)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    group = tl.program_id(2)
    b = pid // S
    qi = pid % S
    length = tl.load(len_ptr + b).to(tl.int32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, length)
    hh = group * HG + tl.arange(0, HG)
    hmask = hh < H
    h8 = group * HG + tl.arange(0, 8)  # the rows of a tile's scores
    h8mask = (tl.arange(0, 8) < HG) & (h8 < H)
    cols = tl.arange(0, HG * D)
    hc = cols // D  # each column's head in the group
    # the query in the keys' affine domain, c0 dropped: q gathered at the keys' permutation and scaled by their σ
    head = group * HG + hc
    hcm = head < H
    at = tl.load(perm_ptr + head * D + cols % D, mask=hcm, other=0)
    qv = tl.load(q_ptr + b.to(tl.int64) * sqb + head * sqh + qi * sqs + at, mask=hcm, other=0.0).to(tl.float32)
    qv = qv * tl.load(ftab_ptr + head * (FT * D) + cols % D, mask=hcm, other=0.0) * LOG2E
    q_hi = qv.to(tl.float16)
    q_lo = (qv - q_hi.to(tl.float32)).to(tl.float16)
    jj = tl.arange(0, 16)[:, None]
    qbd = tl.where(jj == hc[None, :], q_hi[None, :], tl.where(jj == hc[None, :] + 8, q_lo[None, :], 0.0))
    qbd = qbd.to(tl.float16)  # [16, HG·D]
    k_lay = _layout_rows(k_lay_ptr, hh, hmask, D)
    v_lay = _layout_rows(v_lay_ptr, hh, hmask, D)
    prow = (pid * H + h8).to(tl.int64)  # [8]: the rows of p and m_tile
    m_i = tl.full((8,), float("-inf"), tl.float32)
    l_i = tl.zeros((8,), tl.float32)
    acc = tl.zeros((16, HG * D), tl.float32)  # row g's columns of head g: its Σ p ŷᵥ (the others unused)
    if POOL:  # row g: head g's pooled features of the whole group, times cos and times sin
        pool_c = tl.zeros((8, HG * D), tl.float32)
        pool_s = tl.zeros((8, HG * D), tl.float32)
        f_at = hh[:, None] * (FT * D) + tl.arange(0, D)[None, :]
        sg = tl.load(ftab_ptr + f_at, mask=hmask[:, None], other=0.0)[:, None, :]  # [HG, 1, D]: σ, o in code order
        of = tl.load(ftab_ptr + f_at + D, mask=hmask[:, None], other=0.0)[:, None, :]
        fidx = tl.load(ftab_ptr + f_at + 2 * D, mask=hmask[:, None], other=0.0).to(tl.int32)[:, None, :]
        fcol = tl.load(ftab_ptr + head * (FT * D) + 2 * D + cols % D, mask=hcm, other=0.0).to(tl.int32)  # [HG·D]
        trig64 = trig_ptr.to(tl.pointer_type(tl.int64))  # a (cos, sin) pair one 8-byte word
        rel = tl.load(trig64 + tl.arange(0, BT)[None, :, None] * (D // 2) + fidx)  # [HG, BT, D]: offsets' iω'
        cos_i = (rel & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        sin_i = (rel >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    for it in range(0, TILES):
        t0 = start + it * BT
        if t0 < end:
            offs_t = t0 + tl.arange(0, BT)
            tmask = offs_t < end
            rows = _rows_of(b, hh, offs_t, tmask, page_ptr, H, T_CAP, PAGE)
            yk = _decode_heads(k_main, k_sign, k_tab, k_lay, hh, rows, hmask[:, None] & tmask[None, :], D, KCB, KNC,
                               KSIGN, KGRID)
            yk = yk.to(tl.float16)  # exact: grid codes are small integers, tables fp16
            s = tl.dot(qbd, tl.reshape(tl.permute(yk, (0, 2, 1)), (HG * D, BT)))
            s = tl.sum(tl.reshape(s, (2, 8, BT)), axis=0)  # [8, BT]: hi + lo
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            if VSTORED:  # one more product: [16, BT] (the weights, 8 rows of zeros below) × [BT, HG·D]
                yv = _decode_heads(v_main, v_sign, v_tab, v_lay, hh, rows, hmask[:, None] & tmask[None, :], D, VCB,
                                   VNC, VSIGN, VGRID)
                yv = tl.reshape(tl.permute(yv, (1, 0, 2)), (BT, HG * D)).to(tl.float16)
                p16 = tl.reshape(tl.permute(tl.join(p, tl.zeros_like(p)), (2, 0, 1)), (16, BT)).to(tl.float16)
                a16 = tl.reshape(tl.permute(tl.join(alpha, tl.full((8,), 1.0, tl.float32)), (1, 0)), (16,))
                acc = tl.dot(p16, yv, acc * a16[:, None])
            if POOL:  # u = ŷ ⊙ σ + o, the keys before Π in code order, times cos and sin of iω' a channel (i the
                # offset in the tile): one product [16, 2·BT] × [2·BT, HG·D], the weights block-diagonal (rows g |
                # 8 + g: cos | sin); then turned by t0·ω' (cos((t0 + i)ω) = cos t0ω cos iω − sin t0ω sin iω)
                u = yk.to(tl.float32) * sg + of  # [HG, BT, D]
                f2 = tl.reshape(tl.permute(tl.join(u * cos_i, u * sin_i), (3, 1, 0, 2)), (2 * BT, HG * D))
                zero = tl.zeros_like(p)
                p2 = tl.join(tl.join(p, zero), tl.join(zero, p))  # [8, BT, 2 (K half), 2 (row half)]
                p2 = tl.reshape(tl.permute(p2, (3, 0, 2, 1)), (16, 2 * BT)).to(tl.float16)
                a_c, a_s = tl.split(tl.permute(tl.reshape(tl.dot(p2, f2.to(tl.float16)), (2, 8, HG * D)), (1, 2, 0)))
                pair = tl.load(trig64 + t0 * (D // 2) + fcol)  # [HG·D]: t0·ω' a column
                c0 = (pair & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)[None, :]
                s0 = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)[None, :]
                pool_c = pool_c * alpha[:, None] + (c0 * a_c - s0 * a_s)
                pool_s = pool_s * alpha[:, None] + (s0 * a_c + c0 * a_s)
            else:
                keep = h8mask[:, None] & tmask[None, :]
                tl.store(p_ptr + prow[:, None] * T_CAP + offs_t[None, :], p.to(tl.float16), mask=keep)
                tl.store(mt_ptr + prow * NT + t0 // BT, m_new, mask=h8mask)
    part = (pid * NS + split).to(tl.int64)
    tl.store(m_ptr + part * HQ + h8, m_i, mask=h8mask)
    tl.store(l_ptr + part * HQ + h8, l_i, mask=h8mask)
    if VSTORED:
        own = tl.sum(tl.where(tl.arange(0, 16)[:, None] == hc[None, :], acc, 0.0), axis=0)  # [HG·D]
        tl.store(acc_ptr + (part * HQ + group * HG + hc) * D + cols % D, own, mask=group * HG + hc < H)
    if POOL:
        g8 = tl.arange(0, 8)[:, None]
        pool_at = pool_ptr + ((part * HQ + group * HG + g8) * 2) * (HG * D) + cols[None, :]
        pm = (g8 < HG) & (group * HG + g8 < H)
        tl.store(pool_at, pool_c, mask=pm)
        tl.store(pool_at + HG * D, pool_s, mask=pm)


@triton.jit
def _pool_kernel(p_ptr, mt_ptr, m_ptr, k_main, k_sign, k_tab, k_lay_ptr, ftab_ptr, trig_ptr, len_ptr, page_ptr,
                 pool_ptr, H, S, T_CAP, CHUNK, TILES, NS, NF, NT,
                 D: tl.constexpr, HQ: tl.constexpr, FC: tl.constexpr, BT: tl.constexpr, BTS: tl.constexpr,
                 KCB: tl.constexpr, KNC: tl.constexpr, KSIGN: tl.constexpr, KGRID: tl.constexpr, PAGE: tl.constexpr,
                 FT: tl.constexpr):
    """Grid (B·S, NS, NF): the pooled features of query ``qi`` of sequence b over the same rows as
    ``_scores_kernel``'s split, feature heads [chunk·FC, +FC), in tiles of BT tokens. Each tile's weights come back
    from the scores walk as p·2^(m_tile − m) (m_tile that of its tile of BTS tokens, m the split's max): the partial
    is at the split's own scale, as the merge takes it, with no rescaling in the loop. The feature heads' keys are
    decoded, u = ŷ ⊙ σ + o, and its factors cos(tω'), sin(tω') made from the rotary table ``trig_ptr``
    [≥ T_CAP, D/2, 2] (the rotary embedding's own cos and sin a position and frequency; each code channel's frequency
    index: row 2 of ``ftab_ptr`` [H, FT, D]) by the angle sum t = t0 + i: the tile's first row [FC, D] read a tile,
    the offsets' rows [FC, BT, D] once a program, four multiply-adds a value and no load (the angle t0·ω' + i·ω' lies
    within 2^−24·tω' of the reference's rounded tω'). Then two tensor-core products [FC·D, BT] × [BT, HQ] (fp16
    inputs, fp32 sums; the features are the rows, so the warps share them and none decodes another's). Writes the
    pooled sums Σ p u⊙cos, Σ p u⊙sin [HQ, FC·D] at columns chunk·FC·D of the two halves of partial
    (b·S + qi)·NS + split [HQ, 2·NF·FC·D]."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    chunk = tl.program_id(2)
    b = pid // S
    length = tl.load(len_ptr + b).to(tl.int32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, length)
    part = (pid * NS + split).to(tl.int64)
    hh = tl.arange(0, HQ)
    hmask = hh < H
    prow = (pid * H + hh).to(tl.int64)
    m_s = tl.load(m_ptr + part * HQ + hh, mask=hmask, other=0.0)  # the split's max a head
    cc = tl.arange(0, D)
    fh = chunk * FC + tl.arange(0, FC)
    fmask = fh < H
    f_at = fh[:, None] * (FT * D) + cc[None, :]
    sg = tl.load(ftab_ptr + f_at, mask=fmask[:, None], other=0.0)
    of = tl.load(ftab_ptr + f_at + D, mask=fmask[:, None], other=0.0)
    fidx = tl.load(ftab_ptr + f_at + 2 * D, mask=fmask[:, None], other=0.0).to(tl.int32)  # [FC, D]
    fk_lay = _layout_rows(k_lay_ptr, fh, fmask, D)
    # cos and sin of i·ω' for a tile's offsets i [FC, BT, D], read once: a tile at t0 takes cos((t0 + i)ω') =
    # cos(t0ω')cos(iω') − sin(t0ω')sin(iω') from its first row's [FC, D]
    at_i = (tl.arange(0, BT)[None, :, None] * (D // 2) + fidx[:, None, :]) * 2
    ci = tl.load(trig_ptr + at_i)
    si = tl.load(trig_ptr + at_i + 1)
    pooled_c = tl.zeros((FC * D, HQ), tl.float32)  # transposed: the warps share the features, not the heads
    pooled_s = tl.zeros((FC * D, HQ), tl.float32)
    for it in range(0, TILES):
        t0 = start + it * BT
        if t0 < end:
            offs_t = t0 + tl.arange(0, BT)
            tmask = offs_t < end
            valid = hmask[:, None] & tmask[None, :]
            p = tl.load(p_ptr + prow[:, None] * T_CAP + offs_t[None, :], mask=valid, other=0.0).to(tl.float32)
            mt = tl.load(mt_ptr + prow * NT + t0 // BTS, mask=hmask, other=0.0)
            w = tl.trans((p * tl.exp2(mt - m_s)[:, None]).to(tl.float16))  # [BT, HQ]
            frows = _rows_of(b, fh, offs_t, tmask, page_ptr, H, T_CAP, PAGE)
            keep = fmask[:, None] & tmask[None, :]
            yf = _decode_heads(k_main, k_sign, k_tab, fk_lay, fh, frows, keep, D, KCB, KNC, KSIGN, KGRID)
            u = yf * sg[:, None, :] + of[:, None, :]  # [FC, BT, D]: the keys before Π, in code order
            at0 = (t0 * (D // 2) + fidx) * 2  # [FC, D]
            c0 = tl.load(trig_ptr + at0)[:, None, :]
            s0 = tl.load(trig_ptr + at0 + 1)[:, None, :]
            fc_ = u * (c0 * ci - s0 * si)
            fs_ = u * (s0 * ci + c0 * si)
            pooled_c = tl.dot(tl.reshape(tl.permute(fc_, (0, 2, 1)), (FC * D, BT)).to(tl.float16), w, pooled_c)
            pooled_s = tl.dot(tl.reshape(tl.permute(fs_, (0, 2, 1)), (FC * D, BT)).to(tl.float16), w, pooled_s)
    half = NF * FC * D
    at = pool_ptr + (part * HQ + hh[None, :]) * (2 * half) + chunk * FC * D + tl.arange(0, FC * D)[:, None]
    tl.store(at, pooled_c)
    tl.store(at + half, pooled_s)


@triton.jit
def _predicted_merge_kernel(q_ptr, sqb, sqh, sqs, kn_ptr, skb, skh, sks, vn_ptr, svb, svh, svs, valid_ptr, ftab_ptr,
                            m_ptr, l_ptr, acc_ptr, pool_ptr, v_scale, v_offset, v_rot, w_ptr, bias_ptr, out_ptr,
                            H, S, NS, HALF, GROUP, D: tl.constexpr, HQ: tl.constexpr, BLOCK_NS: tl.constexpr,
                            BLOCK_J: tl.constexpr, FB: tl.constexpr, NFB: tl.constexpr, VSTORED: tl.constexpr,
                            FT: tl.constexpr):
    """Grid (B·S·H,): query ``qi`` of sequence b, head h. The walks' partials combined (log2 units, the query's c0 —
    q · (o Π), the keys' offsets in the model's channel order: row 3 of ``ftab_ptr`` [H, FT, D] — added back), the
    residual sums mapped back from the value domain ((Σ p ŷ ⊙ σ + (Σ p) o) Π), the two halves of the pooled sums
    (each HALF wide) through head h's columns of their rows of the map (``w_ptr`` [2, H·D, H·D] fp16,
    ``esm_turbo.ops.predicted.walk_tables``; FB rows a step) plus (Σ p)·b, the step's own tokens (q, k, v strided;
    ``valid_ptr`` [B, S] uint8) added exactly; ``out_ptr`` [B, H, S, D] contiguous. A query with no valid key gets
    zeros. ``VSTORED`` False: no residual (values not stored). The pooled sums of a head are the features of its
    group of GROUP heads (the one-pass walk's; H: every head's), the map's rows from the group's first feature."""
    pid = tl.program_id(0)
    h = pid % H
    bs = pid // H
    b = bs // S
    qi = bs % S
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK_J)
    jm = (j < S) & (tl.load(valid_ptr + b * S + j, mask=j < S, other=0) != 0)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + qi * sqs + d).to(tl.float32)
    kn = tl.load(kn_ptr + b.to(tl.int64) * skb + h * skh + j[:, None] * sks + d[None, :], mask=jm[:, None],
                 other=0.0).to(tl.float32)
    sn = tl.where(jm, tl.sum(kn * q[None, :], axis=1) * LOG2E, float("-inf"))  # [BLOCK_J]
    n = tl.arange(0, BLOCK_NS)
    nm = n < NS
    part = bs.to(tl.int64) * NS + n
    c0 = tl.sum(q * tl.load(ftab_ptr + (h * FT + 3) * D + d), axis=0)  # the constant the walk dropped: q · o Π
    m = tl.load(m_ptr + part * HQ + h, mask=nm, other=float("-inf")) + c0 * LOG2E
    l_ = tl.load(l_ptr + part * HQ + h, mask=nm, other=0.0)
    top = tl.maximum(tl.max(m, axis=0), tl.max(sn, axis=0))
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(m - top)  # [BLOCK_NS]: a split that walked nothing has m = −inf, weight 0
    mass = tl.sum(w * l_, axis=0)
    if VSTORED:
        acc = tl.load(acc_ptr + (part[:, None] * HQ + h) * D + d[None, :], mask=nm[:, None], other=0.0)
        y = tl.sum(w[:, None] * acc, axis=0) * tl.load(v_scale + h * D + d) + mass * tl.load(v_offset + h * D + d)
        rot = tl.load(v_rot + (h * D + d[:, None]) * D + d[None, :])  # Π [D, D]
        out = tl.sum(y[:, None] * rot, axis=0)
    else:  # values not stored: the prediction is the value
        out = tl.zeros((D,), tl.float32)
    fd = H * D
    fbase = (h // GROUP) * GROUP * D  # the first feature of the head's group
    for half in tl.static_range(2):
        for fb in range(0, NFB):
            f = fb * FB + tl.arange(0, FB)
            fm = (f < HALF) & (fbase + f < fd)
            pooled = tl.load(pool_ptr + (part[:, None] * HQ + h) * (2 * HALF) + half * HALF + f[None, :],
                             mask=nm[:, None] & fm[None, :], other=0.0)
            pv = tl.sum(w[:, None] * pooled, axis=0)  # [FB]
            wt = tl.load(w_ptr + (half * fd + fbase + f[:, None]) * fd + h * D + d[None, :], mask=fm[:, None],
                         other=0.0).to(tl.float32)
            out += tl.sum(pv[:, None] * wt, axis=0)
    out += mass * tl.load(bias_ptr + h * D + d).to(tl.float32)
    pn = tl.exp2(sn - top)
    vn = tl.load(vn_ptr + b.to(tl.int64) * svb + h * svh + j[:, None] * svs + d[None, :], mask=jm[:, None],
                 other=0.0).to(tl.float32)
    out += tl.sum(pn[:, None] * vn, axis=0)
    total = mass + tl.sum(pn, axis=0)
    out = tl.where(total > 0, out / tl.maximum(total, 1e-30), 0.0)
    tl.store(out_ptr + (bs.to(tl.int64) * H + h) * D + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _features_kernel(k_main, k_sign, k_tab, k_lay_ptr, perm_ptr, ftab_ptr, trig_ptr, pos_ptr, page_ptr, out_ptr, H, S,
                     T_CAP, D: tl.constexpr, HQ: tl.constexpr, KCB: tl.constexpr, KNC: tl.constexpr,
                     KSIGN: tl.constexpr, KGRID: tl.constexpr, PAGE: tl.constexpr, FT: tl.constexpr):
    """Grid (B·S,): token j of sequence b, at position pos[b] + j, as the cache holds its keys: every head's key decoded
    (``_decode_heads``), turned back from the keys' affine domain (x̂ = (ŷ ⊙ σ + o) Π: u scattered to the model's
    channels at the permutation ``perm_ptr`` [H, D]) and from the rotary embedding (f = x̂·cos − rotate_half(x̂)·sin at
    the token's position, cos and sin read from the rotary table ``trig_ptr``), written as f [H·D] float32 at row
    b·S + j of ``out_ptr``: what ``ValuePredictor.features`` gives for the decoded keys, with the same roundings
    (compiled without contraction). x̂ is written first and read back in the model's order (a barrier between)."""
    pid = tl.program_id(0)
    b = pid // S
    t = tl.load(pos_ptr + b).to(tl.int32) + pid % S
    hh = tl.arange(0, HQ)
    hmask = hh < H
    cc = tl.arange(0, D)
    if PAGE == 0:
        rows = (b * H + hh).to(tl.int64) * T_CAP + t
    else:
        slot = tl.load(page_ptr + b.to(tl.int64) * (T_CAP // PAGE) + t // PAGE)
        rows = (slot.to(tl.int64) * H + hh) * PAGE + t % PAGE
    lay = _layout_rows(k_lay_ptr, hh, hmask, D)
    y = _decode_heads(k_main, k_sign, k_tab, lay, hh, rows[:, None], hmask[:, None], D, KCB, KNC, KSIGN, KGRID)
    y = tl.reshape(y, (HQ, D))
    f_at = hh[:, None] * (FT * D) + cc[None, :]
    m2 = hmask[:, None]
    u = y * tl.load(ftab_ptr + f_at, mask=m2, other=0.0) + tl.load(ftab_ptr + f_at + D, mask=m2, other=0.0)
    row = out_ptr + pid.to(tl.int64) * H * D + hh[:, None] * D
    tl.store(row + tl.load(perm_ptr + hh[:, None] * D + cc[None, :], mask=m2, other=0), u, mask=m2)
    tl.debug_barrier()
    x = tl.load(row + cc[None, :], mask=m2, other=0.0)  # x̂ in the model's channel order
    half = cc >= D // 2
    other = tl.load(row + ((cc + D // 2) % D)[None, :], mask=m2, other=0.0)
    rot = tl.where(half[None, :], other, -other)  # rotate_half(x̂) = [−x₂, x₁]
    at = (t * (D // 2) + cc % (D // 2)) * 2
    cos = tl.load(trig_ptr + at)[None, :]
    sin = tl.load(trig_ptr + at + 1)[None, :]
    f = x * cos - rot * sin
    tl.debug_barrier()
    tl.store(row + cc[None, :], f, mask=m2)


def positions_held(keys: CachedCodes, pages: torch.Tensor | None, block_size: int = 0) -> tuple[int, int]:
    """(PAGE, T_CAP) of a layer's packed keys: a paged cache's block (``block_size``, else the pool's own) and the
    positions a row can hold through its block table ``pages`` [B, blocks]; (0, capacity) for a contiguous cache."""
    page = (int(block_size) or keys.main.shape[2]) if pages is not None and pages.numel() else 0
    return page, pages.shape[1] * page if page else keys.main.shape[2]


def _check_rotary(trig: torch.Tensor, t_cap: int, d: int) -> None:
    """A rotary table [≥ t_cap, d/2, 2] (``esm_turbo.ops.predicted.rotary_table``), or a one-line error."""
    if trig.shape[0] < t_cap or tuple(trig.shape[1:]) != (d // 2, 2):
        raise ValueError(f"predicted walk: a rotary table [>= {t_cap}, {d // 2}, 2] is needed, got {list(trig.shape)}")


def predicted_features_triton(keys: CachedCodes, pos: torch.Tensor, s: int, ftab: torch.Tensor, trig: torch.Tensor,
                              pages: torch.Tensor | None = None) -> torch.Tensor:
    """f [B, S, H·d] float32: every head's cached key of the tokens at positions ``pos[b] + j`` (j < s) decoded and
    turned back before the rotary embedding (``ValuePredictor.features`` of the decoded keys, the same roundings),
    one launch: what the cache write predicts the values from. ``keys``: a layer's packed keys (a paged cache's pool,
    with its block table ``pages`` [B, blocks]) whose rotation permutes each head's channels (``keys.perm``);
    ``ftab``, ``trig``: as :func:`predicted_partials_triton` takes them, ``trig`` covering the positions."""
    heads, d = keys.perm.shape
    batch = pos.shape[0]
    page, t_cap = positions_held(keys, pages)
    _check_rotary(trig, t_cap, d)
    out = torch.empty(batch, s, heads * d, device=pos.device)
    _features_kernel[(batch * s,)](
        keys.main, part_or(keys.sign, keys.main), keys.table, full_layout(keys), keys.perm, ftab, trig, pos,
        pages if page else pos, out, heads, s, t_cap, D=d, HQ=triton.next_power_of_2(heads),
        KCB=keys.code.code_bits, KNC=keys.table.shape[-1], KSIGN=keys.code.sign == "plane", KGRID=keys.code.grid,
        PAGE=page, FT=ftab.shape[1], num_warps=1 if interpreting() else 4, enable_fp_fusion=False)
    return out


def full_layout(c: CachedCodes) -> torch.Tensor:
    """One kind's field layout [H, d] int32 (``shift | mask << 8`` a channel), made explicit for equal widths."""
    from ...quant.packing import layout_of
    if c.layout.numel():
        return c.layout
    heads, dim = c.table.shape[:2]
    return layout_of(torch.full((heads, dim), c.code.code_bits, device=c.table.device))


def predicted_partials_triton(q: torch.Tensor, lengths: torch.Tensor, keys: CachedCodes, values: CachedCodes | None,
                              ftab: torch.Tensor, trig: torch.Tensor, pages: torch.Tensor | None = None,
                              block_size: int = 0, splits: int | None = None,
                              grouped: bool = False, launch: dict | None = None) -> tuple[torch.Tensor, ...]:
    """The walks' partials for queries ``q`` [B, H, S, d] (scaled and post-RoPE, any float dtype, a strided view read
    in place) over each row's ``lengths`` cached tokens of ``keys``, whose rotation permutes each head's channels
    (``keys.perm``): the scores walk (the query gathered at the permutation and scaled into the keys' affine domain,
    c0 dropped), then the pooling walk over its weights (two launches). ``values`` None: not stored (the residual
    sums zero). ``ftab`` [H, 4, d] float32: each code channel's σ, o and rotary frequency index, and the offsets in
    the model's channel order; ``trig`` [≥ T_cap, d/2, 2] float32: the rotary embedding's cos and sin a position and
    frequency (``esm_turbo.ops.predicted.walk_tables``, ``rotary_table``); a paged cache: ``pages`` [B, blocks] int32
    and its ``block_size``. Returns (m, l [B, S, NS, HQ], Σ p ŷᵥ [B, S, NS, HQ, d], the pooled sums [B, S, NS, HQ,
    2·NF·FC·d]); a split past a row's length leaves m = −inf and zero sums. Entries of heads ≥ H are not written.
    ``grouped`` (a map within the scores walk's groups, :func:`one_pass`): one launch, the scores walk pooling its
    group's features (sums [B, S, NS, HQ, 2·HG·d]); ``launch``: its ``tile`` and ``warps`` (tuning; default
    :func:`one_pass_tile`, :data:`ONE_PASS_WARPS`)."""
    batch, heads, s, d = q.shape
    page, t_cap = positions_held(keys, pages, block_size)
    _check_rotary(trig, t_cap, d)
    if not page:
        pages = lengths  # never read
    hq = query_heads(heads)
    hg = score_heads(heads, d)
    fc, nf = feature_chunk(heads, d)
    blocks = max(1, math.ceil(t_cap / SCORE_T))  # the scores walk's tiles, each whole tiles of the pooling's
    bt = pool_tile(heads, d)
    if splits is None:
        splits = walk_splits(batch * s, heads, d, t_cap, num_sms(q.device), grouped)
    chunk = math.ceil(blocks / splits) * SCORE_T
    splits = max(1, math.ceil(t_cap / chunk))
    dev = q.device
    m = torch.empty(batch, s, splits, hq, device=dev)  # every head's entry written (a split past a row's end too)
    l_ = torch.empty_like(m)
    acc = torch.empty(batch, s, splits, hq, d, device=dev)
    pooled = torch.empty(batch, s, splits, hq, 2 * (hg if grouped else nf * fc) * d, device=dev)
    if grouped:  # never written
        weights, tile_max = pooled, pooled
    else:
        weights = torch.empty(batch * s, heads, t_cap, device=dev, dtype=torch.float16)
        tile_max = torch.empty(batch * s, heads, blocks, device=dev)
    stored = values is not None
    values = values if stored else keys  # stand-ins, never read
    k_lay, v_lay = full_layout(keys), full_layout(values)
    k_sign = part_or(keys.sign, keys.main)
    codes = dict(D=d, HQ=hq, KCB=keys.code.code_bits, KNC=keys.table.shape[-1], KSIGN=keys.code.sign == "plane",
                 KGRID=keys.code.grid, PAGE=page, FT=ftab.shape[1])
    q, q_st = token_strides(q)
    launch = {"tile": one_pass_tile(d, stored), "warps": ONE_PASS_WARPS, **(launch or {})} if grouped else {}
    bt_s = launch.get("tile", SCORE_T)
    _scores_kernel[(batch * s, splits, math.ceil(heads / hg))](
        q, *q_st, keys.perm, ftab, keys.main, k_sign, values.main, part_or(values.sign, values.main), keys.table,
        values.table, k_lay, v_lay, lengths, pages, m, l_, acc, weights, tile_max, trig, pooled, heads, s, t_cap,
        chunk, chunk // bt_s, splits, blocks, HG=hg, BT=bt_s, VCB=values.code.code_bits, VNC=values.table.shape[-1],
        VSIGN=values.code.sign == "plane", VGRID=values.code.grid, VSTORED=stored, POOL=grouped,
        num_warps=1 if interpreting() else launch.get("warps", SCORE_WARPS), enable_fp_fusion=FP_FUSION, **codes)
    if grouped:
        return m, l_, acc, pooled
    _pool_kernel[(batch * s, splits, nf)](
        weights, tile_max, m, keys.main, k_sign, keys.table, k_lay, ftab, trig, lengths, pages, pooled, heads, s,
        t_cap, chunk, chunk // bt, splits, nf, blocks, FC=fc, BT=bt, BTS=SCORE_T,
        num_warps=1 if interpreting() else pool_warps(heads, d, keys.code.grid), enable_fp_fusion=FP_FUSION, **codes)
    return m, l_, acc, pooled


def predicted_merge_triton(partials: tuple[torch.Tensor, ...], q: torch.Tensor, k_new: torch.Tensor,
                           v_new: torch.Tensor, new_valid: torch.Tensor, ftab: torch.Tensor, values: CachedCodes | None,
                           weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The output [B, H, S, d] (q's dtype) of the walk's ``partials`` (``predicted_partials_triton``) and the step's
    own tokens q, k_new, v_new [B, H, S, d] (strided views read in place; ``new_valid`` [B, S]); ``ftab`` the walks'
    table (its row 3: the keys' offsets in the model's channel order, for the constant the walk dropped); ``values``:
    the residual's constants (None: not stored); ``weight`` [2, H·d, H·d]: the rows of the predictor's map for the two
    halves of the pooled sums (``walk_tables``), ``bias`` [H·d]: its bias. One launch."""
    m, l_, acc, pooled = partials
    batch, heads, s, d = q.shape
    (q, q_st), (k_new, k_st), (v_new, v_st) = map(token_strides, (q, k_new, v_new))
    out = torch.empty(batch, s, heads, d, device=q.device, dtype=q.dtype)
    half = pooled.shape[-1] // 2  # a head's pooled features: every head's, or (one pass) its group's
    group = min(heads, half // d)
    fb = min(128, triton.next_power_of_2(group * d))
    stored = values is not None
    v_scale, v_offset, v_rot = (values.scale, values.offset, values.rot) if stored else (ftab,) * 3  # never read
    _predicted_merge_kernel[(batch * s * heads,)](
        q, *q_st, k_new, *k_st, v_new, *v_st, new_valid.contiguous().view(torch.uint8), ftab, m, l_, acc,
        pooled, v_scale, v_offset, v_rot, weight, bias, out, heads, s, m.shape[2], half, group,
        D=d, HQ=m.shape[3], BLOCK_NS=triton.next_power_of_2(m.shape[2]), BLOCK_J=triton.next_power_of_2(s), FB=fb,
        NFB=triton.cdiv(group * d, fb), VSTORED=stored, FT=ftab.shape[1], num_warps=4, enable_fp_fusion=FP_FUSION)
    return out.transpose(1, 2)
