"""The one-launch path for small steps (one query per sequence, few cached slots): split-K programs that rotate the
query themselves, and the last split of each (b, h) to finish merges — where the prep and merge launches would cost
more than they save."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant.layout import CachedCodes, decode_grid
from ..common import FP_FUSION, interpreting, num_sms, part_or, split_counters, token_strides
from .codes import _field_layout, _prefetch_l2, slot_parts
from .plan import plan_splits
from .walk import LOG2E, _split_codes, _walk


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
                  page_ptr, k_sl_ptr, v_sl_ptr, k_rot, k_offset, k_scale, v_rot, v_offset, v_scale, m_ptr, l_ptr,
                  acc_ptr, count_ptr, out_ptr, H, T_CAP, CHUNK, NS,
                  D: tl.constexpr, KCODE_BITS: tl.constexpr, VCODE_BITS: tl.constexpr, KFIELDS: tl.constexpr,
                  VFIELDS: tl.constexpr, KSIGN: tl.constexpr, VSIGN: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_NS: tl.constexpr, NK: tl.constexpr,
                  NV: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr, ROWS: tl.constexpr,
                  GRID: tl.constexpr, PAGE: tl.constexpr, SLOTS: tl.constexpr, SUBN: tl.constexpr):
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
    if split == 0:  # Πᵥ into L2 for the merge, which reads it only after the arrival count
        _prefetch_l2(v_rot + hd * D + tl.arange(0, D * D // 32) * 32)
    # the first tile's codes are requested before the query rotation: their latency overlaps it
    start, end, k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, pg_tab, pg_base, pg_stride, kw, ks, vw, vs, kl, vl = \
        _split_codes(k_idx_ptr, k_sign_ptr, v_idx_ptr, v_sign_ptr, k_sl_ptr, v_sl_ptr, len_ptr, page_ptr, b, pid_bh,
                     split * CHUNK, split * CHUNK + CHUNK, H, T_CAP, D, KCODE_BITS, VCODE_BITS, KSIGN, VSIGN, BLOCK_T,
                     GRID, PAGE, SLOTS)
    k_off = tl.load(k_offset + hd + chan)
    k_sc = tl.load(k_scale + hd + chan)
    z = _rotate_vec(q_ptr + b.to(tl.int64) * sqb + h * sqh, k_rot + hd * D, chan, D)
    q3 = z * k_sc * LOG2E
    c0 = tl.sum(tl.sum(z * k_off, axis=1), axis=0)
    k_lay = _field_layout(k_lay_ptr + h * D, KFIELDS)
    v_lay = _field_layout(v_lay_ptr + h * D, VFIELDS)
    m_i, l_i, acc = _walk(q3, start, end, kw, ks, vw, vs, kl, vl, k_idx, k_sign, v_idx, v_sign, k_sl, v_sl, pg_tab,
                          pg_base, pg_stride, k_tab_ptr + h * NK, v_tab_ptr + h * NV, k_lay, v_lay, h, D, KCODE_BITS,
                          VCODE_BITS, KSIGN, VSIGN, NK, NV, BLOCK_T, PREFETCH, INTERPRET, KFIELDS >= 0, VFIELDS >= 0,
                          ROWS, GRID, PAGE, SLOTS, SUBN)
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
        s_new = (tl.sum(q * k, axis=0) - c0) * LOG2E
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



def attention_one_launch(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
                         lengths: torch.Tensor, keys: CachedCodes, values: CachedCodes, cfg: dict,
                         pages: torch.Tensor, page: int, t_cap: int) -> torch.Tensor:
    """A decode step of one query per sequence in one launch (``_small_kernel``); arguments as
    ``compressed_attention_triton`` takes them (tables aligned; ``pages`` read only if ``page`` > 0; ``t_cap``
    positions a row may hold), ``cfg`` its launch configuration."""
    batch, heads, _, d = q.shape
    block_t = cfg["block_t"]
    splits, chunk = plan_splits(batch * heads, t_cap, block_t, num_sms(q.device), cfg["waves"], cfg.get("splits"))
    dev = q.device
    m = torch.empty(batch * heads * splits, device=dev, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(batch * heads * splits, d, device=dev, dtype=torch.float32)
    count = split_counters(batch * heads, dev)
    out = torch.empty(batch, heads, 1, d, device=dev, dtype=q.dtype)
    (q, q_strides), (k_new, k_strides), (v_new, v_strides) = map(token_strides, (q, k_new, v_new))
    _small_kernel[(batch * heads, splits)](
        q, *q_strides[:2], k_new, *k_strides[:2], v_new, *v_strides[:2], new_valid,
        keys.main, part_or(keys.sign, keys.main), values.main, part_or(values.sign, values.main), keys.table,
        values.table, part_or(keys.layout, keys.table), part_or(values.layout, values.table), lengths, pages,
        *slot_parts(keys, values, lengths), keys.rot,
        keys.offset, keys.scale, values.rot, values.offset, values.scale, m, l_, acc, count, out, heads, t_cap,
        chunk, splits, D=d, KCODE_BITS=keys.code.code_bits, VCODE_BITS=values.code.code_bits,
        KFIELDS=keys.code.kernel_fields(), VFIELDS=values.code.kernel_fields(), KSIGN=keys.code.sign == "plane",
        VSIGN=values.code.sign == "plane", BLOCK_T=block_t, BLOCK_NS=triton.next_power_of_2(splits),
        NK=keys.table[0].numel(), NV=values.table[0].numel(), PREFETCH=cfg["prefetch"],
        INTERPRET=chunk // block_t if interpreting() else 0, ROWS=cfg["rows"], GRID=decode_grid(keys.code, values.code),
        PAGE=page, SLOTS=keys.has_slots(), SUBN=cfg["subnormal"] and decode_grid(keys.code, values.code) > 0,
        num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"], enable_fp_fusion=FP_FUSION)
    return out
