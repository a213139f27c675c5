"""Fused decode attention over a cache whose values are predicted from the keys (``esm_turbo.quant.predict``): a walk
and its merge, whose PyTorch reference is ``esm_turbo.ops.predicted.predicted_attention_reference``.

A cached token's value is r̂ + (f W + b), f [H·d] every head's decoded key turned back before the rotary embedding.
No cached token's prediction is computed: a query of head h needs Σ_t p_{h,t} f_t (then one map by W's columns of
head h), so one program walks one query token of a row for *all* heads at once — every head's keys are read once
a tile and serve every head's scores and features:

* scores [HQ, BT] in each head's key affine domain (``⟨q̃, ŷ⟩``, c0 dropped as in ``walk.py``), an online softmax per
  head (log2 units);
* Σ p ŷᵥ [HQ, d]: the coded residual values, in the value affine domain (mapped back once by the merge);
* the pooled features, in the keys' code order: the keys' rotation is a permutation π of each head's channels, so
  x̂ = (ŷ ⊙ σ + o) Π is u = ŷ ⊙ σ + o read in another order, and f = x̂·cos − rotate_half(x̂)·sin pools as
  Σ p u⊙cos(tω') and Σ p u⊙sin(tω') (ω' each code channel's frequency) — two tensor-core products
  [HQ, BT] × [BT, FC·d] in fp16 (P in fp16, as flash attention's P·V), fp32 sums — with π and rotate_half folded into
  the rows of W that the merge applies (``esm_turbo.ops.predicted.walk_tables``). No per-token product but these.

Grid (B·S, splits, feature chunks): the programs of one (query, split) share its scores; the first chunk's also
writes the residual sums. HQ = max(16, the heads rounded up to a power of two) (a dot's rows); 2·FC·d ≤
:data:`POOLED_VALUES` / HQ, so the pooled sums fit a program's registers. Shapes beyond :func:`fits` take the
PyTorch path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quant.layout import CachedCodes
from ..common import FP_FUSION, interpreting, num_sms, part_or, token_strides

LOG2E = tl.constexpr(1.4426950408889634)
#: the widest key tile a program holds ([HQ, BT, d] floats over HQ·d)
MAX_HEAD_WIDTH = 2048
#: the most pooled feature sums a program keeps (two [HQ, FC·d])
POOLED_VALUES = 16384
#: a Hopper program's most shared memory (bytes)
SM90_SHARED = 232448
BLOCK_T = 16


def query_heads(heads: int) -> int:
    """HQ: the heads a program holds, a power of two of at least 16 (the pooled dot's rows)."""
    return max(16, triton.next_power_of_2(heads))


def fits(heads: int, dim: int) -> bool:
    """Whether the fused walk takes a layer of ``heads`` heads of ``dim`` (a power of two of at least 16, and HQ·d ≤
    :data:`MAX_HEAD_WIDTH`: ESM-2 8M's 20 heads of 16, 150M's of 32, 650M's of 64; not 35M's heads of 24 nor 3B's 40
    heads)."""
    return dim >= 16 and dim & (dim - 1) == 0 and query_heads(heads) * dim <= MAX_HEAD_WIDTH


def feature_chunk(heads: int, dim: int) -> tuple[int, int]:
    """(FC, chunks): feature heads a program pools (a power of two) and the programs that cover every head. All HQ
    heads where their two sums fit (the key tile then serves the features as it is: no second decode), else
    chunks."""
    hq = query_heads(heads)
    if 2 * hq * hq * dim <= POOLED_VALUES:
        return hq, 1
    fc = min(triton.next_power_of_2(heads), max(1, POOLED_VALUES // (2 * hq * dim)))
    return fc, math.ceil(heads / fc)


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
def _predicted_kernel(qt_ptr, k_main, k_sign, v_main, v_sign, k_tab, v_tab, k_lay_ptr, v_lay_ptr, ftab_ptr,
                      len_ptr, page_ptr, m_ptr, l_ptr, acc_ptr, pool_ptr,
                      H, S, T_CAP, CHUNK, TILES, NS, NF,
                      D: tl.constexpr, HQ: tl.constexpr, FC: tl.constexpr, BT: tl.constexpr,
                      KCB: tl.constexpr, VCB: tl.constexpr, KNC: tl.constexpr, VNC: tl.constexpr,
                      KSIGN: tl.constexpr, VSIGN: tl.constexpr, KGRID: tl.constexpr, VGRID: tl.constexpr,
                      VSTORED: tl.constexpr, PAGE: tl.constexpr):
    """Grid (B·S, NS, NF): query ``qi`` of sequence b over cached rows [split·CHUNK, +CHUNK) ∩ [0, length), feature
    heads [chunk·FC, +FC) (all HQ in one chunk where they fit); ``ftab_ptr`` [H, 3, D]: each code channel's σ, o
    and rotary frequency. Writes partial (b·S + qi)·NS + split: m, l [HQ], (chunk 0) Σ p ŷᵥ [HQ, D], and its pooled
    sums Σ p u⊙cos, Σ p u⊙sin [HQ, FC·D] at columns chunk·FC·D of the two halves of [HQ, 2·NF·FC·D].
    ``VSTORED`` False (values not stored): no value codes are read and the residual sums stay zero."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    chunk = tl.program_id(2)
    b = pid // S
    qi = pid % S
    length = tl.load(len_ptr + b).to(tl.int32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, length)
    hh = tl.arange(0, HQ)
    hmask = hh < H
    cc = tl.arange(0, D)
    q = tl.load(qt_ptr + ((b * H + hh[:, None]) * S + qi) * D + cc[None, :], mask=hmask[:, None], other=0.0)
    q = q * LOG2E  # [HQ, D]
    k_lay = _layout_rows(k_lay_ptr, hh, hmask, D)
    v_lay = _layout_rows(v_lay_ptr, hh, hmask, D)
    # the feature heads of this chunk: each code channel's σ, o and frequency [FC, D]
    fh = chunk * FC + tl.arange(0, FC)
    fmask = fh < H
    f_at = fh[:, None] * (3 * D) + cc[None, :]
    sg = tl.load(ftab_ptr + f_at, mask=fmask[:, None], other=0.0)
    of = tl.load(ftab_ptr + f_at + D, mask=fmask[:, None], other=0.0)
    fq = tl.load(ftab_ptr + f_at + 2 * D, mask=fmask[:, None], other=0.0)
    fk_lay = _layout_rows(k_lay_ptr, fh, fmask, D)
    m_i = tl.full((HQ,), float("-inf"), tl.float32)
    l_i = tl.zeros((HQ,), tl.float32)
    acc = tl.zeros((HQ, D), tl.float32)
    pooled_c = tl.zeros((HQ, FC * D), tl.float32)
    pooled_s = tl.zeros((HQ, FC * D), tl.float32)
    for it in range(0, TILES):
        t0 = start + it * BT
        if t0 < end:
            offs_t = t0 + tl.arange(0, BT)
            tmask = offs_t < end
            rows = _rows_of(b, hh, offs_t, tmask, page_ptr, H, T_CAP, PAGE)
            valid = hmask[:, None] & tmask[None, :]
            yk = _decode_heads(k_main, k_sign, k_tab, k_lay, hh, rows, valid, D, KCB, KNC, KSIGN, KGRID)
            s = tl.sum(yk * q[:, None, :], axis=2)  # [HQ, BT]
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            if VSTORED:
                if chunk == 0:
                    yv = _decode_heads(v_main, v_sign, v_tab, v_lay, hh, rows, valid, D, VCB, VNC, VSIGN, VGRID)
                    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * yv, axis=1)
            if FC == HQ:  # every head's features: the key tile as it is
                yf = yk
            else:
                frows = _rows_of(b, fh, offs_t, tmask, page_ptr, H, T_CAP, PAGE)
                yf = _decode_heads(k_main, k_sign, k_tab, fk_lay, fh, frows, fmask[:, None] & tmask[None, :], D,
                                   KCB, KNC, KSIGN, KGRID)  # [FC, BT, D]
            u = yf * sg[:, None, :] + of[:, None, :]  # [FC, BT, D]: the keys before Π, in code order
            angle = offs_t.to(tl.float32)[None, :, None] * fq[:, None, :]
            keep = fmask[:, None, None] & tmask[None, :, None]
            fc_ = tl.where(keep, u * tl.cos(angle), 0.0)
            fs_ = tl.where(keep, u * tl.sin(angle), 0.0)
            p16 = p.to(tl.float16)
            pooled_c = tl.dot(p16, tl.reshape(tl.permute(fc_, (1, 0, 2)), (BT, FC * D)).to(tl.float16),
                              pooled_c * alpha[:, None])
            pooled_s = tl.dot(p16, tl.reshape(tl.permute(fs_, (1, 0, 2)), (BT, FC * D)).to(tl.float16),
                              pooled_s * alpha[:, None])
    part = (pid * NS + split).to(tl.int64)
    half = NF * FC * D
    at = pool_ptr + (part * HQ + hh[:, None]) * (2 * half) + chunk * FC * D + tl.arange(0, FC * D)[None, :]
    tl.store(at, pooled_c)
    tl.store(at + half, pooled_s)
    if chunk == 0:
        tl.store(m_ptr + part * HQ + hh, m_i)
        tl.store(l_ptr + part * HQ + hh, l_i)
        tl.store(acc_ptr + (part * HQ + hh[:, None]) * D + cc[None, :], acc)


@triton.jit
def _predicted_merge_kernel(q_ptr, sqb, sqh, sqs, kn_ptr, skb, skh, sks, vn_ptr, svb, svh, svs, valid_ptr, c0_ptr,
                            m_ptr, l_ptr, acc_ptr, pool_ptr, v_scale, v_offset, v_rot, w_ptr, bias_ptr, out_ptr,
                            H, S, NS, HALF, D: tl.constexpr, HQ: tl.constexpr, BLOCK_NS: tl.constexpr,
                            BLOCK_J: tl.constexpr, FB: tl.constexpr, NFB: tl.constexpr, VSTORED: tl.constexpr):
    """Grid (B·S·H,): query ``qi`` of sequence b, head h. The walks' partials combined (log2 units, c0 [B, H, S] added
    back), the residual sums mapped back from the value domain ((Σ p ŷ ⊙ σ + (Σ p) o) Π), the two halves of the pooled
    sums (each HALF wide) through head h's columns of their rows of the map (``w_ptr`` [2, H·D, H·D] fp16,
    ``esm_turbo.ops.predicted.walk_tables``; FB rows a step) plus (Σ p)·b, the step's own tokens (q, k, v strided;
    ``valid_ptr`` [B, S] uint8) added exactly; ``out_ptr`` [B, H, S, D] contiguous. A query with no valid key gets
    zeros. ``VSTORED`` False: no residual (values not stored)."""
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
    c0 = tl.load(c0_ptr + (b * H + h) * S + qi)
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
    for half in tl.static_range(2):
        for fb in range(0, NFB):
            f = fb * FB + tl.arange(0, FB)
            fm = f < fd
            pooled = tl.load(pool_ptr + (part[:, None] * HQ + h) * (2 * HALF) + half * HALF + f[None, :],
                             mask=nm[:, None] & fm[None, :], other=0.0)
            pv = tl.sum(w[:, None] * pooled, axis=0)  # [FB]
            wt = tl.load(w_ptr + (half * fd + f[:, None]) * fd + h * D + d[None, :], mask=fm[:, None],
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


def full_layout(c: CachedCodes) -> torch.Tensor:
    """One kind's field layout [H, d] int32 (``shift | mask << 8`` a channel), made explicit for equal widths."""
    from ...quant.packing import layout_of
    if c.layout.numel():
        return c.layout
    heads, dim = c.table.shape[:2]
    return layout_of(torch.full((heads, dim), c.code.code_bits, device=c.table.device))


def predicted_partials_triton(qt: torch.Tensor, lengths: torch.Tensor, keys: CachedCodes, values: CachedCodes | None,
                              ftab: torch.Tensor, pages: torch.Tensor | None = None, block_size: int = 0,
                              splits: int | None = None) -> tuple[torch.Tensor, ...]:
    """The walk's partials for queries ``qt`` [B, H, S, d] float32 (in the keys' affine domain, c0 dropped: ``q̃``
    of ``esm_turbo.ops.compressed.compressed_attention_reference``) over each row's ``lengths`` cached tokens.
    ``values`` None: not stored (the residual sums zero). ``ftab`` [H, 3, d] float32: each code channel's σ, o and
    rotary frequency (``esm_turbo.ops.predicted.walk_tables``); a paged cache: ``pages`` [B, blocks] int32 and its
    ``block_size``. Returns (m, l [B, S, NS, HQ], Σ p ŷᵥ [B, S, NS, HQ, d], the pooled sums [B, S, NS, HQ,
    2·NF·FC·d]); a split past a row's length leaves m = −inf and zero sums."""
    batch, heads, s, d = qt.shape
    page = int(block_size) if pages is not None and pages.numel() else 0
    t_cap = pages.shape[1] * page if page else keys.main.shape[2]
    if not page:
        pages = lengths  # never read
    hq = query_heads(heads)
    fc, nf = feature_chunk(heads, d)
    blocks = max(1, math.ceil(t_cap / BLOCK_T))
    if splits is None:
        splits = max(1, min(blocks, 64, math.ceil(2 * num_sms(qt.device) / max(1, batch * s * nf))))
    chunk = math.ceil(blocks / splits) * BLOCK_T
    splits = max(1, math.ceil(t_cap / chunk))
    dev = qt.device
    m = torch.empty(batch, s, splits, hq, device=dev)  # every entry written (a split past a row's end too)
    l_ = torch.empty_like(m)
    acc = torch.empty(batch, s, splits, hq, d, device=dev)
    pooled = torch.empty(batch, s, splits, hq, 2 * nf * fc * d, device=dev)
    stored = values is not None
    values = values if stored else keys  # stand-ins, never read
    k_lay, v_lay = full_layout(keys), full_layout(values)
    _predicted_kernel[(batch * s, splits, nf)](
        qt.contiguous(), keys.main, part_or(keys.sign, keys.main), values.main, part_or(values.sign, values.main),
        keys.table, values.table, k_lay, v_lay, ftab, lengths, pages, m, l_,
        acc, pooled, heads, s, t_cap, chunk, chunk // BLOCK_T, splits, nf,
        D=d, HQ=hq, FC=fc, BT=BLOCK_T, KCB=keys.code.code_bits, VCB=values.code.code_bits,
        KNC=keys.table.shape[-1], VNC=values.table.shape[-1], KSIGN=keys.code.sign == "plane",
        VSIGN=values.code.sign == "plane", KGRID=keys.code.grid, VGRID=values.code.grid, VSTORED=stored, PAGE=page,
        num_warps=1 if interpreting() else 8, enable_fp_fusion=FP_FUSION)
    return m, l_, acc, pooled


def predicted_merge_triton(partials: tuple[torch.Tensor, ...], q: torch.Tensor, k_new: torch.Tensor,
                           v_new: torch.Tensor, new_valid: torch.Tensor, c0: torch.Tensor, values: CachedCodes | None,
                           weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The output [B, H, S, d] (q's dtype) of the walk's ``partials`` (``predicted_partials_triton``) and the step's
    own tokens q, k_new, v_new [B, H, S, d] (strided views read in place; ``new_valid`` [B, S]), ``c0`` [B, H, S]
    the queries' constant the walk dropped; ``values``: the residual's constants (None: not stored); ``weight``
    [2, H·d, H·d]: the rows of the predictor's map for the two halves of the pooled sums (``walk_tables``), ``bias``
    [H·d]: its bias. One launch."""
    m, l_, acc, pooled = partials
    batch, heads, s, d = q.shape
    (q, q_st), (k_new, k_st), (v_new, v_st) = map(token_strides, (q, k_new, v_new))
    out = torch.empty(batch, s, heads, d, device=q.device, dtype=q.dtype)
    fb = min(128, triton.next_power_of_2(heads * d))
    stored = values is not None
    v_scale, v_offset, v_rot = (values.scale, values.offset, values.rot) if stored else (c0, c0, c0)  # never read
    _predicted_merge_kernel[(batch * s * heads,)](
        q, *q_st, k_new, *k_st, v_new, *v_st, new_valid.contiguous().view(torch.uint8), c0.contiguous(), m, l_, acc,
        pooled, v_scale, v_offset, v_rot, weight, bias, out, heads, s, m.shape[2], pooled.shape[-1] // 2,
        D=d, HQ=m.shape[3], BLOCK_NS=triton.next_power_of_2(m.shape[2]), BLOCK_J=triton.next_power_of_2(s), FB=fb,
        NFB=triton.cdiv(heads * d, fb), VSTORED=stored, num_warps=4, enable_fp_fusion=FP_FUSION)
    return out.transpose(1, 2)
