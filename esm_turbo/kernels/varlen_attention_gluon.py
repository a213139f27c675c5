"""The packed attention of :mod:`~esm_turbo.kernels.varlen_attention` with each key tile's scores computed under the
previous tile's softmax (Hopper, Gluon).

The Triton kernel runs a key tile's work in order: the scores' product, then the softmax's exponentials, then the
values' product. Triton waits for the scores' product at once (``wgmma.wait_group 0`` before the exponentials), so
the tensor cores idle while the special-function units work and the other way round. Here the products are
asynchronous and waited for by count, in the order FlashAttention-3 uses within one warp group:

- tile j + 1's scores are issued before tile j's softmax, and waited for at tile j + 1;
- tile j's values' product is issued after its softmax and waited for at tile j + 1, before the sum is rescaled;
- keys and values arrive by TMA into a ring of ``STAGES`` shared-memory slots, a slot refilled once the values'
  product that read it is done;
- two tiles a loop trip, their scores in two register sets taken in turn, so no in-flight product's registers are
  copied from one trip to the next (a copy makes ptxas wait for every product at once: its C7514 "wgmma serialized").

Compiled for sm_90, ptxas places the wait for tile j - 1's values' product before tile j's exponentials (it may
move a wait earlier), so the exponentials run under tile j + 1's scores' product.

One program of one warp group per (query block of 64 tokens of one sequence, head), from the same host-side table
(:func:`~esm_turbo.kernels.varlen_attention.query_blocks`); the online softmax in float32 (exp2, the scale inside the
exponent's FMA), the sequence's last key tile masked, the output rounded once. Keys past a sequence's end in its last
tile are the next sequence's tokens (or TMA's zeros past the batch), masked before the softmax.

Compute capability 9.0 and Triton ≥ 3.6's Gluon only (:func:`usable`). Measured against the Triton kernel's tiles
on the bench's ten real 16K-token batches (``tools/tune_attention.py --gluon``,
``results/embed/attention_gluon_h100.txt``, H100): at heads of 64 a ring of four slots is 11-13% faster than three
and the kernel beats the Triton plan on every batch but the longest (1,269 µs against 1,364 over the ten); at heads of
32 it is slower on every batch. In the whole 650M-shaped forward its launches are up to 2.4% faster than the Triton
kernel's, and the forward is 2.8% slower (the products beside it slow down: 46.2 against 44.9 ms on an H200, twice,
``results/embed/attention_gluon_ab_h200.txt``), so FastEsm takes it only when asked (``FastEsm.attention_kernel =
"gluon"``). ``tests/test_varlen_attention.py`` ties it to the reference on CUDA.
Reference: ``esm_turbo.embed.varlen.varlen_attention_reference``.
"""

from __future__ import annotations

import torch
import triton

from .gemm_ws import GLUON, available

if GLUON:  # Gluon's names, and the two that Triton 3.9 renamed, as the warp-specialized GEMM imports them
    from .gemm_ws import (TensorDescriptor, _sync, _tma_load, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma,
                          warpgroup_mma_wait)

#: query rows a program (one warp group's wgmma height)
BM = 64
_BM = gl.constexpr(BM) if GLUON else BM


if GLUON:
    @gluon.jit
    def _softmax(s, m_i, l_i, start, s1, scale_log2e, MASK: gl.constexpr, BN: gl.constexpr,
                 s_layout: gl.constexpr):
        """Tile [start, start + BN)'s scores ``s`` [BM, BN] (keys from s1 on left out where ``MASK``) into the online
        softmax: (p, alpha, m_new, l_new)."""
        if MASK:
            keys = start + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(keys < s1, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2e)
        p = gl.exp2(s * scale_log2e - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _values(p, alpha, acc, v_buf, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """The sum rescaled and tile's values' product issued into it (asynchronous; handed back as a tensor)."""
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(v_buf.dtype), p_layout), v_buf, acc, is_async=True)
        return warpgroup_mma_wait(2, deps=(acc, ))

    @gluon.jit
    def _refill(k_desc, v_desc, k_bufs, v_bufs, ready, t, n, s0, h, D: gl.constexpr, BN: gl.constexpr,
                STAGES: gl.constexpr):
        """Tile t's keys and values by TMA into slot t % STAGES, where tile t exists."""
        if t < n:
            slot = t % STAGES
            mbarrier.expect(ready.index(slot), 2 * BN * D * k_desc.dtype.primitive_bitwidth // 8)
            _tma_load(k_desc, [s0 + t * BN, h * D], ready.index(slot), k_bufs.index(slot))
            _tma_load(v_desc, [s0 + t * BN, h * D], ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def _step(s, m_i, l_i, acc, j, n, q_smem, k_desc, v_desc, k_bufs, v_bufs, ready, zero_s, s0, s1, h, scale_log2e,
              D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, p_layout: gl.constexpr):
        """Full key tile j (j + 1 < n): tile j + 1's scores issued, then tile j's softmax (its scores ``s`` waited
        for: in flight before, in issue order, tile j's scores and tile j - 1's values' product), tile j - 1's values'
        product waited for, slot j - 1 refilled, tile j's values' product issued. Returns (tile j + 1's scores, in
        flight, m_i, l_i, acc in flight)."""
        nxt = (j + 1) % STAGES
        mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
        ahead = warpgroup_mma(q_smem, k_bufs.index(nxt).permute((1, 0)), zero_s, is_async=True)
        ahead = warpgroup_mma_wait(3, deps=(ahead, ))  # handed over as a tensor; nothing waited for
        s = warpgroup_mma_wait(2, deps=(s, ))  # tile j's scores; the two later products run on
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, s0 + j * BN, s1, scale_log2e, False, BN, s_layout)
        acc = warpgroup_mma_wait(1, deps=(acc, ))  # tile j - 1's values' product; tile j + 1's scores run on
        _sync()  # every warp is past the product that read slot j - 1
        _refill(k_desc, v_desc, k_bufs, v_bufs, ready, j + STAGES - 1, n, s0, h, D, BN, STAGES)
        acc = _values(p, alpha, acc, v_bufs.index(j % STAGES), o_layout, p_layout)
        return ahead, m_i, l_i, acc

    @gluon.jit
    def _last(s, m_i, l_i, acc, j, v_bufs, s1, s0, scale_log2e, BN: gl.constexpr, STAGES: gl.constexpr,
              s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """The last key tile j, masked, nothing issued ahead; every product waited for. Returns (l_i, acc)."""
        s = warpgroup_mma_wait(1, deps=(s, ))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, s0 + j * BN, s1, scale_log2e, True, BN, s_layout)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        acc = _values(p, alpha, acc, v_bufs.index(j % STAGES), o_layout, p_layout)
        return l_i, warpgroup_mma_wait(0, deps=(acc, ))

    @gluon.jit
    def _attention_kernel(q_ptr, k_desc, v_desc, o_ptr, blocks_ptr, n_blocks, sq, so, scale_log2e,
                          D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Program (b, h): query block b of the table at blocks_ptr [3, n_blocks], head h. q, o: [N, H, d] (token
        strides sq, so; heads and channels contiguous); k_desc, v_desc: TMA descriptors over [N, H·d] with [BN, d]
        boxes."""
        b = gl.program_id(0)
        h = gl.program_id(1)
        q0 = gl.load(blocks_ptr + b)
        s0 = gl.load(blocks_ptr + n_blocks + b)
        s1 = gl.load(blocks_ptr + 2 * n_blocks + b)
        dtype: gl.constexpr = k_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [num_warps, 1], [1, 0])
        rows = q0 + gl.arange(0, _BM, layout=gl.SliceLayout(1, io_layout))
        dims = gl.arange(0, D, layout=gl.SliceLayout(0, io_layout))
        row_ok = gl.expand_dims(rows < s1, 1)
        q = gl.load(q_ptr + gl.expand_dims(rows.to(gl.int64) * sq, 1) + h * D + gl.expand_dims(dims, 0), mask=row_ok,
                    other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [_BM, D], gl.NVMMASharedLayout.get_default_for([_BM, D], dtype), q)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, D], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, D], v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()  # q and the barriers, before the async proxy (TMA, wgmma) reads them
        _sync()  # every warp's rows of q stored
        n = gl.cdiv(s1 - s0, BN)  # key tiles, the last one partial where BN does not divide the length
        for i in gl.static_range(STAGES - 1):  # the first STAGES - 1 tiles in flight
            _refill(k_desc, v_desc, k_bufs, v_bufs, ready, i, n, s0, h, D, BN, STAGES)
        m_i = gl.full([_BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_BM], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([_BM, D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([_BM, BN], gl.float32, layout=s_layout)
        mbarrier.wait(ready.index(0), 0)
        sa = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, is_async=True)
        sa = warpgroup_mma_wait(0, deps=(sa, ))
        # Two tiles a trip, their scores in two register sets taken in turn: a trip hands the set it issued last to
        # the next trip as it stands, so no in-flight product's registers are copied (which would make ptxas wait for
        # every product at once). The last one or two tiles after the loop.
        for jj in range((n - 1) // 2):
            sb, m_i, l_i, acc = _step(sa, m_i, l_i, acc, 2 * jj, n, q_smem, k_desc, v_desc, k_bufs, v_bufs, ready,
                                      zero_s, s0, s1, h, scale_log2e, D, BN, STAGES, s_layout, o_layout, p_layout)
            sa, m_i, l_i, acc = _step(sb, m_i, l_i, acc, 2 * jj + 1, n, q_smem, k_desc, v_desc, k_bufs, v_bufs,
                                      ready, zero_s, s0, s1, h, scale_log2e, D, BN, STAGES, s_layout, o_layout,
                                      p_layout)
        if n % 2 == 0:  # tiles n - 2 and n - 1 left
            sb, m_i, l_i, acc = _step(sa, m_i, l_i, acc, n - 2, n, q_smem, k_desc, v_desc, k_bufs, v_bufs, ready,
                                      zero_s, s0, s1, h, scale_log2e, D, BN, STAGES, s_layout, o_layout, p_layout)
            l_i, acc = _last(sb, m_i, l_i, acc, n - 1, v_bufs, s1, s0, scale_log2e, BN, STAGES, s_layout, o_layout,
                             p_layout)
        else:
            l_i, acc = _last(sa, m_i, l_i, acc, n - 1, v_bufs, s1, s0, scale_log2e, BN, STAGES, s_layout, o_layout,
                             p_layout)
        out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        out = gl.convert_layout(out.to(o_ptr.dtype.element_ty), io_layout)
        gl.store(o_ptr + gl.expand_dims(rows.to(gl.int64) * so, 1) + h * D + gl.expand_dims(dims, 0), out,
                 mask=row_ok)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


def kv_layout(bn: int, d: int, dtype: torch.dtype):
    """The shared layout of a [bn, d] key or value tile (its TMA descriptor's and the ring's)."""
    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([bn, d], gl_dtype)


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`varlen_attention_gluon` runs heads of ``head_dim`` in ``dtype`` on ``device``."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim in (32, 64) and available(device)


#: key and value slots in the TMA ring of :func:`varlen_attention_gluon_plan`'s launches (four measured 11-13% faster
#: than three at heads of 64 on an H100)
RING = 4


def varlen_attention_gluon_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan,
                                scale: float | None = None) -> torch.Tensor:
    """Every launch of an :class:`~esm_turbo.kernels.varlen_attention.AttentionPlan` of 64-token query blocks in
    :func:`varlen_attention_gluon`, at its tile's key tile and a ring of :data:`RING` slots, into one output."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for table, tile in plan.launches:
        varlen_attention_gluon(q, k, v, table, scale, tile.bn, RING, out=out)
    return out


def varlen_attention_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                           scale: float | None = None, bn: int = 64, stages: int = 3,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~esm_turbo.kernels.varlen_attention.varlen_attention_triton` for one :func:`query_blocks` table of
    64-token blocks, key tiles of ``bn`` tokens in a ring of ``stages`` (at least 3): q, k, v [N, H, d] fp16/bf16
    (any token stride, heads and channels contiguous, d of 32 or 64, rows 16-byte aligned). Returns [N, H, d] in q's
    dtype (written into ``out``, contiguous, where given: the table's rows only)."""
    n, heads, d = q.shape
    if not available(q.device):
        raise RuntimeError("varlen_attention_gluon runs on a compute-capability 9.0 GPU with Triton's Gluon")
    if d not in (32, 64) or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"heads of {d} in {q.dtype}: the Gluon attention takes heads of 32 or 64 in fp16 or bf16")
    if stages < 3 or bn not in (32, 64):
        raise ValueError(f"key tiles of {bn} in a ring of {stages}: tiles of 32 or 64, three slots or more (the tile "
                         "after the next is loaded while the next one's scores are computed)")
    for t in (q, k, v):
        if (t.shape != q.shape or t.dtype != q.dtype or t.stride(2) != 1 or t.stride(1) != d
                or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16):
            raise ValueError(f"q, k, v {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} must be [N, H, d] of one "
                             "dtype, heads and channels contiguous, rows 16-byte aligned")
    scale = d ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty(n, heads, d, device=q.device, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be contiguous and as q {tuple(q.shape)} {q.dtype}")
    nb = table.shape[1]
    if nb == 0 or n == 0:
        return out
    layout = kv_layout(bn, d, q.dtype)
    k_desc, v_desc = (TensorDescriptor(t, [n, heads * d], [t.stride(0), 1], [bn, d], layout) for t in (k, v))
    _attention_kernel[(nb, heads)](q, k_desc, v_desc, out, table, nb, q.stride(0), out.stride(0),
                                   scale * 1.4426950408889634, D=d, BN=bn, STAGES=stages, num_warps=4)
    return out


__all__ = ["BM", "RING", "kv_layout", "usable", "varlen_attention_gluon", "varlen_attention_gluon_plan"]
