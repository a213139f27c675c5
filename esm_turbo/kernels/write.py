"""An uncompressed cache's write of a step's new keys and values, both in one launch (Triton). Reference:
``esm_turbo.ops.scatter_rows`` per buffer, whose index arithmetic and indexed copy are about eight small launches a
layer for the keys and values together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_rows_kernel(k_ptr, v_ptr, kb_ptr, vb_ptr, pos_ptr, S, H, skb, skh, sks, svb, svh, svs, sbb, sbh, sbt,
                       scb, sch, sct, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr):
    """Grid (B·S, cdiv(H, BH)). Program (t, j): token t = (b, s), heads [j·BH, (j + 1)·BH): k[b, h, s] → kb[b, h,
    pos[b] + s] and v[b, h, s] → vb[b, h, pos[b] + s] (strides as named, channels contiguous), cast to the buffers'
    dtype."""
    t = tl.program_id(0)
    b, s = t // S, t % S
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, DP)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    at = tl.load(pos_ptr + b).to(tl.int64) + s
    b64, s64, h64 = b.to(tl.int64), s.to(tl.int64), offs_h[:, None].to(tl.int64)
    k = tl.load(k_ptr + b64 * skb + h64 * skh + s64 * sks + offs_d[None, :], mask=mask)
    tl.store(kb_ptr + b64 * sbb + h64 * sbh + at * sbt + offs_d[None, :], k.to(kb_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + b64 * svb + h64 * svh + s64 * svs + offs_d[None, :], mask=mask)
    tl.store(vb_ptr + b64 * scb + h64 * sch + at * sct + offs_d[None, :], v.to(vb_ptr.dtype.element_ty), mask=mask)


def write_rows_triton(k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      pos: torch.Tensor) -> None:
    """k_buf, v_buf [B, H, T_cap, d] ← k, v [B, H, S, d] at rows ``pos[b] + j`` of each sequence (pos [B] integer,
    every ``pos[b] + S <= T_cap``), in one launch (CUDA, or CPU under Triton's interpreter). k and v may be strided
    views (a [B, S, H, d] buffer transposed); channels must be contiguous in all four."""
    b, h, s, d = k.shape
    if v.shape != k.shape or k_buf.shape[:2] != (b, h) or k_buf.shape[3] != d or v_buf.shape != k_buf.shape:
        raise ValueError(f"k, v {tuple(k.shape)}, {tuple(v.shape)} do not fit the buffers {tuple(k_buf.shape)}, "
                         f"{tuple(v_buf.shape)}")
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("the cache buffers' channels must be contiguous")
    dp = triton.next_power_of_2(d)
    bh = min(triton.next_power_of_2(h), max(1, 1024 // dp))
    _write_rows_kernel[(b * s, triton.cdiv(h, bh))](
        k, v, k_buf, v_buf, pos, s, h, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_buf.stride(0), k_buf.stride(1), k_buf.stride(2), v_buf.stride(0), v_buf.stride(1), v_buf.stride(2),
        D=d, DP=dp, BH=bh, num_warps=4)


__all__ = ["write_rows_triton"]
