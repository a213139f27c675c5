"""The three-launch path's first and last kernels: ``_prep_kernel`` turns the queries into the keys' affine domain
(``qt``, ``c0``), ``_merge_kernel`` merges the walks' partials with log-sum-exp, maps the output back to the value
domain, adds the step's own tokens (full precision) and casts to the query's dtype."""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import load_rows, rotate, token_offsets
from .walk import LOG2E, _runs_meeting


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
                  valid_ptr, v_scale_ptr, v_offset_ptr, v_rot_ptr, perm_ptr, k_offset_ptr, out_ptr, B, H, S, NS, NT, W,
                  PS,
                  D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_NS: tl.constexpr,
                  COLS: tl.constexpr, PRECISION: tl.constexpr, GATHER: tl.constexpr):
    """Grid (H, cdiv(B, BLOCK_B)): the S queries of BLOCK_B sequences of head h per program, so the head's Πᵥ is
    read once for all of them (one read per (b, h) cost more than the merge itself at head_dim 128). Tensors
    [BLOCK_B, BLOCK_S, …]: partials over the splits' axis first; a query's first PS partials are the shared walk's
    (``shared.py``), then its own walk's (NS in all).

    The step's own tokens (q, k, v strided, any float dtype) stay in the value domain, unrotated: a key's score
    is ``⟨q, k⟩ − c0`` (``= ⟨q̃, y⟩``, the affine domain's score less the c0 its cached keys drop; Π orthogonal)
    and a value is added after the partials' sum ``Σ p ŷ ⊙ scale + (Σ p) offset`` is rotated back by Πᵥ.
    ``GATHER`` (keys whose rotation permutes each head's channels; no prep launch): c0 = ⟨q[perm], offsetₖ⟩ from q
    gathered at ``perm_ptr`` [H, D] int32 (``k_offset_ptr`` [H, D]), not read from ``c0_ptr``."""
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
    if GATHER:
        at = tl.load(perm_ptr + h * D + offs_d)[None, None, :]
        qg = tl.load(q_ptr + b3 * sqb + h * sqh + s3 * sqs + at, mask=m3, other=0.0).to(tl.float32)
        c0 = tl.sum(qg * tl.load(k_offset_ptr + h * D + offs_d).to(tl.float32)[None, None, :], axis=2)
    else:
        c0 = tl.load(c0_ptr + row, mask=rmask, other=0.0)
    s_new = (tl.sum(q[:, :, None, :] * k[:, None, :, :], axis=3) - c0[:, :, None]) * LOG2E  # [B_, queries, keys]
    kmask = rmask & (tl.load(valid_ptr + offs_b[:, None] * S + offs_s[None, :], mask=rmask, other=0) != 0)
    s_new = tl.where(kmask[:, None, :], s_new, float("-inf"))

    # partials of padded queries (s ≥ S) or rows (b ≥ B) are never written: masked at the load
    part = (((offs_b[:, None] * H + h) * NS)[None, :, :] + offs_n[:, None, None]) * BLOCK_S  # [BLOCK_NS, BLOCK_B, 1]
    part = part + offs_s[None, None, :]
    if W > 0:  # stream-K partials (``_stream_kernel``): as many as programs whose runs meet the query's row
        first, last = _runs_meeting(row, NT, W)
        count = PS + last - first + 1  # after the shared walk's PS (``shared.py``; else 0)
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
        # values' next chunk requested before this chunk's store (its latency hidden behind the dot)
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


