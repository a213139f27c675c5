"""Products whose epilogue runs in warps of its own, beside the next tile's products (Hopper, Gluon).

``y = epilogue(x wᵀ + b)`` for x [M, K], w [N, K] (K contiguous), as :func:`~esm_turbo.kernels.gemm.gemm` computes
it and rounds it: fp16/bf16 inputs summed in fp32 from the bias and rounded to x's dtype; e4m3 inputs (row scales
[M], column scales [N]) summed in fp32, then (Σ · x_scale) · w_scale + b rounded to bf16. Then ``"gelu"`` (ESM-2's
erf GELU, :func:`~esm_turbo.kernels.common.gelu`) rounded once, with each row's largest |value| if asked (the next
product's e4m3 input then takes one read), or ``"rope"`` (the q/k/v projection: the queries scaled by d^-1/2, queries
and keys rotated, :func:`~esm_turbo.kernels.rope.rope_packed_reference`), or nothing (``"bias"``).

In :mod:`~esm_turbo.kernels.gemm` a tile's epilogue runs after the tile's products and before the next tile's, in
the same warps, so its arithmetic adds to the tensor cores' time (FFN-up with GELU takes about 1.3× the same product
with the bias only, and the rotary epilogue what a separate launch takes). Here one persistent program a
multiprocessor splits its warps three ways (``gl.warp_specialize``):

- a loader (one warp): TMA copies of x's and w's tiles into a ring of ``STAGES`` shared-memory slots;
- the products (the default partition, ``warps`` warps: bm / 16 of 16 rows each): each tile's wgmma over K, handed to
  the epilogue through one shared-memory tile (fp16/bf16: the rounded sums; e4m3: the float32 sums);
- the epilogue (two partitions of ``epi_warps`` and ``epi_warps2`` warps, a partition's warps a power of two): the
  handed tile in chunks of epi_m × epi_n (a loop over row chunks, so its code stays in the instruction cache), the
  chunks shared between the two in proportion to their warps, stored to y.

Barriers: ``ready[s]`` (the loader's copies into slot s landed), ``empty[s]`` (the products are done with slot s),
``full`` (a tile is handed over), ``free`` (both epilogue partitions have read it); each waits on the parity of its
use count. While the epilogue works through tile i the products run tile i + 1, so the epilogue costs nothing while
it takes less time than a tile's products (a 128 × 256 tile of FFN-up at K = 1,280: about 11 µs of products on an
H100 multiprocessor at peak). The register budget (the products' 128 accumulators a thread) leaves room for three
epilogue warps beside two warp groups of products and the loader (twelve warps: 168 registers a thread at launch,
176 for the products after the hand-over, 152 for the loader's and epilogue's warp group); four would make sixteen
warps, whose 128 registers at launch are too few to compile the products'.

Compute capability 9.0 only (wgmma, TMA, register reallocation) and Triton ≥ 3.6's Gluon; :func:`available` says
whether this process can run it. Reference: :func:`~esm_turbo.kernels.gemm.gemm_reference`."""

from __future__ import annotations

import torch
import triton

try:  # Gluon is experimental: its module names move between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # 3.9 renamed these two
    _sync = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - an older or a reorganised Triton
    GLUON = False

from .common import FP_FUSION, GELU_FORMS, gelu
from .gemm import WsTile, _tile_coords, check_rope, tma_aligned  # _tile_coords: the tile order (Gluon calls it)

#: the epilogues this kernel folds
EPILOGUES = {"bias": 0, "gelu": 1, "rope": 2}


#: the plan for e4m3 inputs: their float32 sums are handed over (64 KiB for 128 × 128), the ring's slots 128 wide in
#: K (128 bytes a row); 192 KiB of shared memory
WS_FP8 = WsTile(bn=128, bk=128, stages=4)


def available(device: torch.device | str | None = None) -> bool:
    """Whether this process can run the kernel on ``device`` (default: the current CUDA device): CUDA, compute
    capability 9.0, Gluon importable, not under Triton's interpreter."""
    import os
    if not GLUON or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    device = torch.device("cuda") if device is None else torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


if GLUON:
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # 3.6: private name

    @gluon.jit
    def _row_chunks(hand, CHUNK: gl.constexpr):
        """The shared [R, C] tile ``hand`` as [R / CHUNK, CHUNK, C], a chunk of CHUNK rows an index (CHUNK a multiple
        of the layout's swizzle period, so each chunk keeps the tile's layout at its offset)."""
        shape: gl.constexpr = [hand.shape[0] // CHUNK, CHUNK, hand.shape[1]]
        if _PUBLIC_REINTERPRET:
            return hand.reinterpret(hand.dtype, shape, hand.layout)
        else:
            return hand._reinterpret(hand.dtype, shape, hand.layout)

    @gluon.constexpr_function
    def _chunk_layout(rows, cols, warps):
        """A blocked layout that covers a [rows, cols] chunk once with ``warps`` warps: each thread a run of up to 8
        contiguous columns (16-byte stores of fp16), no element held twice."""
        vec = max(1, min(8, rows * cols // (32 * warps)))
        along = min(32, cols // vec)
        return gl.BlockedLayout([1, vec], [32 // along, along], [warps, 1], [1, 0])

    @gluon.jit
    def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_SMS: gl.constexpr,
                        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                        GROUP_M: gl.constexpr):
        """The loader: every tile's K steps, in the products' order, into the ring (waits for a slot's release)."""
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        k_steps = gl.cdiv(K, BK)
        nbytes: gl.constexpr = (BM + BN) * BK * a_desc.dtype.primitive_bitwidth // 8
        it = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            for kk in range(k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh slot passes at once
                mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [pid_m * BM, kk * BK], ready.index(s), a_bufs.index(s))
                _tma_load(b_desc, [pid_n * BN, kk * BK], ready.index(s), b_bufs.index(s))
                it += 1

    @gluon.jit
    def _mma_partition(a_bufs, b_bufs, ready, empty, hand, full, free, bias_ptr, M, N, K, NUM_SMS: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, FP8: gl.constexpr, num_warps: gl.constexpr):
        """The products: each tile's wgmma over K from the ring (one product in flight while the next slot's wait
        runs), then the hand-over to the epilogue: fp16/bf16 inputs' sums started at the bias and rounded to the
        output dtype; e4m3 inputs' float32 sums as they are (their scales and bias are the epilogue's)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 32 if FP8 else 16])
        out_dtype: gl.constexpr = hand.dtype
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        k_steps = gl.cdiv(K, BK)
        it = 0
        n_tile = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            if HAS_BIAS and not FP8:  # the sum starts at the bias (registers for an add after it would spill)
                cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
                bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
                acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout) + gl.expand_dims(bias, 0)
            else:
                acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
            for kk in range(k_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                # the product before this one is done: its slot goes back to the loader
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                _sync()  # both warp groups' products from the slot before
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)
                it += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            _sync()
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            y = acc.to(out_dtype)
            mbarrier.wait(free, (n_tile & 1) ^ 1)  # the epilogue has read the tile before
            hand.store(y)
            fence_async_shared()
            _sync()  # every warp's part of the tile is stored
            mbarrier.arrive(full)
            n_tile += 1

    @gluon.jit
    def _piece(sub, col0, width: gl.constexpr, layout: gl.constexpr, xs, pid_n_col, bias_ptr, ws_ptr, N,
               HAS_BIAS: gl.constexpr, FP8: gl.constexpr, out_dtype: gl.constexpr):
        """Columns [col0, col0 + width) of a handed row chunk ``sub`` as the product alone returns them, in
        ``layout``, and their global columns: fp16/bf16 as handed over; e4m3 inputs' float32 sums as gemm_reference
        takes them, (Σ · x_scale) · w_scale + bias rounded to bf16 (``xs``: the rows' scales)."""
        y = sub.slice(col0, width, dim=1).load(layout)
        cols = pid_n_col + col0 + gl.arange(0, width, layout=gl.SliceLayout(0, layout))
        if FP8:
            wsc = gl.load(ws_ptr + cols, mask=cols < N, other=0.0)
            y = y * gl.expand_dims(xs, 1) * gl.expand_dims(wsc, 0)
            if HAS_BIAS:
                y = y + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
            y = y.to(out_dtype)
        return y, cols

    @gluon.jit
    def _epilogue_partition(hand, full, free, c_ptr, bias_ptr, xs_ptr, ws_ptr, amax_ptr, cos_ptr, sin_ptr, M, N,
                            stride_c, stride_amax, stride_cos, q_cols, q_scale, NUM_SMS: gl.constexpr,
                            BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, EPI: gl.constexpr,
                            GELU: gl.constexpr, HAS_BIAS: gl.constexpr, FP8: gl.constexpr, AMAX: gl.constexpr,
                            EPI_M: gl.constexpr, EPI_N: gl.constexpr, EPI_WARPS: gl.constexpr,
                            CHUNK_LO: gl.constexpr, CHUNK_HI: gl.constexpr):
        """The epilogue: each handed tile in chunks of EPI_M × EPI_N (e4m3 inputs: :func:`_piece`'s scaling),
        then ``EPI`` 1: GELU rounded once; 2 (each chunk one head of EPI_N channels): columns < ``q_cols``
        (queries) times ``q_scale`` rounded, columns < 2 · q_cols (queries and keys) rotated, x · cos +
        rotate_half(x) · sin in float32 with cos, sin [M, EPI_N] float32 (rows ``stride_cos`` apart; compiled without
        fused multiply-adds, as the rotary kernel runs), rounded once; stored to y. With ``AMAX`` each row's largest
        |y| over the chunk's columns at amax [M, column chunks]. This partition (EPI_WARPS warps) takes the row
        chunks [CHUNK_LO, CHUNK_HI) of each tile and releases the tile once it has read them."""
        layout: gl.constexpr = _chunk_layout(EPI_M, EPI_N, EPI_WARPS)
        HALF: gl.constexpr = EPI_N // 2
        half_layout: gl.constexpr = _chunk_layout(EPI_M, HALF, EPI_WARPS)
        out_dtype: gl.constexpr = c_ptr.dtype.element_ty
        # the handed tile as EPI_M-row chunks, one index each: its swizzle repeats every 8 rows, so a chunk of a
        # multiple of 8 rows is the same layout at the chunk's offset
        rows_of = _row_chunks(hand, EPI_M)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        n_tile = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            mbarrier.wait(full, n_tile & 1)
            for i in range(CHUNK_LO, CHUNK_HI):  # a loop, not unrolled: the chunks' code stays in the instruction cache
                sub = rows_of.index(i)
                if EPI == 2:
                    rows = pid_m * BM + i * EPI_M + gl.arange(0, EPI_M, layout=gl.SliceLayout(1, half_layout))
                else:
                    rows = pid_m * BM + i * EPI_M + gl.arange(0, EPI_M, layout=gl.SliceLayout(1, layout))
                row_ok = gl.expand_dims(rows < M, 1)
                xs = gl.load(xs_ptr + rows, mask=rows < M, other=0.0) if FP8 else rows
                for j in gl.static_range(BN // EPI_N):
                    if EPI == 2:
                        y1, cols = _piece(sub, j * EPI_N, HALF, half_layout, xs, pid_n * BN, bias_ptr, ws_ptr,
                                          N, HAS_BIAS, FP8, out_dtype)
                        y2, _ = _piece(sub, j * EPI_N + HALF, HALF, half_layout, xs, pid_n * BN, bias_ptr,
                                       ws_ptr, N, HAS_BIAS, FP8, out_dtype)
                        head = pid_n * BN + j * EPI_N
                        if head < 2 * q_cols:  # a query's or a key's head: rotated
                            x1 = y1.to(gl.float32)
                            x2 = y2.to(gl.float32)
                            if head < q_cols:
                                x1 = (x1 * q_scale).to(out_dtype).to(gl.float32)
                                x2 = (x2 * q_scale).to(out_dtype).to(gl.float32)
                            at = gl.expand_dims(rows.to(gl.int64) * stride_cos, 1) + gl.expand_dims(
                                gl.arange(0, HALF, layout=gl.SliceLayout(0, half_layout)), 0)
                            c1 = gl.load(cos_ptr + at, mask=row_ok, other=0.0)
                            s1 = gl.load(sin_ptr + at, mask=row_ok, other=0.0)
                            c2 = gl.load(cos_ptr + at + HALF, mask=row_ok, other=0.0)
                            s2 = gl.load(sin_ptr + at + HALF, mask=row_ok, other=0.0)
                            y1 = (x1 * c1 - x2 * s1).to(out_dtype)
                            y2 = (x2 * c2 + x1 * s2).to(out_dtype)
                        ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64) * stride_c, 1) + gl.expand_dims(cols, 0)
                        mask = row_ok & gl.expand_dims(cols < N, 0)
                        gl.store(ptrs, y1, mask=mask)
                        gl.store(ptrs + HALF, y2, mask=row_ok & gl.expand_dims(cols + HALF < N, 0))
                    else:
                        y, cols = _piece(sub, j * EPI_N, EPI_N, layout, xs, pid_n * BN, bias_ptr, ws_ptr, N,
                                         HAS_BIAS, FP8, out_dtype)
                        if EPI == 1:
                            y = gelu(y.to(gl.float32), GELU).to(out_dtype)
                        if AMAX:
                            seen = gl.where(gl.expand_dims(cols < N, 0), y.to(gl.float32), 0.0)
                            part = gl.max(gl.abs(seen), axis=1)
                            gl.store(amax_ptr + rows.to(gl.int64) * stride_amax + pid_n * (BN // EPI_N) + j, part,
                                     mask=rows < M)
                        ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64) * stride_c, 1) + gl.expand_dims(cols, 0)
                        gl.store(ptrs, y, mask=row_ok & gl.expand_dims(cols < N, 0))
            _sync()  # every warp of the partition has read its chunks
            mbarrier.arrive(free)
            n_tile += 1

    @gluon.jit
    def _ws_gemm_kernel(a_desc, b_desc, c_ptr, bias_ptr, xs_ptr, ws_ptr, amax_ptr, cos_ptr, sin_ptr, M, N, K,
                        stride_c, stride_amax, stride_cos, q_cols, q_scale, NUM_SMS: gl.constexpr, BM: gl.constexpr,
                        BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                        EPI: gl.constexpr, GELU: gl.constexpr, HAS_BIAS: gl.constexpr, FP8: gl.constexpr,
                        AMAX: gl.constexpr, EPI_M: gl.constexpr, EPI_N: gl.constexpr, EPI_WARPS: gl.constexpr,
                        LOAD_REGS: gl.constexpr, EPI_REGS: gl.constexpr, EPI_WARPS2: gl.constexpr,
                        SPLIT: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = a_desc.dtype
        hand_dtype: gl.constexpr = gl.float32 if FP8 else dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], b_desc.layout)
        # rows of 16-byte runs swizzled by the row's index mod 8 (the products' stores and the epilogue's 16-byte
        # loads without bank conflicts)
        hand_layout: gl.constexpr = gl.SwizzledSharedLayout(128 // hand_dtype.primitive_bitwidth, 1, 8, [1, 0])
        hand = gl.allocate_shared_memory(hand_dtype, [BM, BN], hand_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(full, count=1)
        mbarrier.init(free, count=2)  # each epilogue partition releases the tile
        gl.warp_specialize([
            (_mma_partition, (a_bufs, b_bufs, ready, empty, hand, full, free, bias_ptr, M, N, K, NUM_SMS, BM, BN, BK,
                              STAGES, GROUP_M, HAS_BIAS, FP8, num_warps)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_SMS, BM, BN, BK, STAGES,
                               GROUP_M)),
            (_epilogue_partition, (hand, full, free, c_ptr, bias_ptr, xs_ptr, ws_ptr, amax_ptr, cos_ptr, sin_ptr, M, N,
                                   stride_c, stride_amax, stride_cos, q_cols, q_scale, NUM_SMS, BM, BN, GROUP_M, EPI,
                                   GELU, HAS_BIAS, FP8, AMAX, EPI_M, EPI_N, EPI_WARPS, 0, SPLIT)),
            (_epilogue_partition, (hand, full, free, c_ptr, bias_ptr, xs_ptr, ws_ptr, amax_ptr, cos_ptr, sin_ptr, M, N,
                                   stride_c, stride_amax, stride_cos, q_cols, q_scale, NUM_SMS, BM, BN, GROUP_M, EPI,
                                   GELU, HAS_BIAS, FP8, AMAX, EPI_M, EPI_N, EPI_WARPS2, SPLIT, BM // EPI_M)),
        ], [1, EPI_WARPS, EPI_WARPS2], [LOAD_REGS, EPI_REGS, EPI_REGS])


def ws_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, epilogue: str = "gelu",
            tile: WsTile | None = None, x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
            row_amax: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """x [M, K] times w [N, K]ᵀ plus the bias [N], then ``epilogue`` (``"gelu"``, ``"bias"``, or ``"rope"`` with
    rope = (cos, sin) [M, d] float32: the q/k/v projection's queries scaled and queries and keys rotated, d the
    tile's ``epi_n``): [M, N] in x's dtype (fp16 or bf16; bf16 for e4m3 inputs, with x_scale [M] or [M, 1] and
    w_scale [N] float32), and with ``row_amax`` also each row's largest |value| [M] float32: what
    :func:`~esm_turbo.kernels.gemm.gemm` computes. Needs :func:`available`."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r}: one of {list(EPILOGUES)}")
    if (epilogue == "rope") != (rope is not None) or (row_amax and epilogue == "rope"):
        raise ValueError("rope's (cos, sin) go with epilogue='rope', and only with it (and no row maxima)")
    if not available(x.device):
        raise RuntimeError("ws_gemm runs on a compute-capability 9.0 GPU with Triton's Gluon")
    m, k = x.shape
    n = w.shape[0]
    fp8 = x.dtype == torch.float8_e4m3fn
    if (x.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn) or w.dtype != x.dtype
            or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} (fp16/bf16/e4m3, K "
                         "contiguous) do not make a product")
    if not tma_aligned(x, w):
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: rows of {k * x.element_size()} bytes (or a start)"
                         " not 16-byte aligned, as the kernel's TMA copies take; gemm() runs such products")
    if fp8 != (x_scale is not None and w_scale is not None):
        raise ValueError("e4m3 inputs need x_scale and w_scale, and only they take them")
    tile = tile or WsTile()
    if rope is not None:
        check_rope(rope, m, n, tile)
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16 if fp8 else x.dtype)
    cos, sin = rope if rope is not None else (out, out)  # unread but for the rotary epilogue
    chunks = triton.cdiv(n, tile.bn) * (tile.bn // tile.epi_n)
    amax = torch.empty(m, chunks, device=x.device, dtype=torch.float32) if row_amax else out
    if m == 0:
        return (out, amax[:, 0]) if row_amax else out
    lay_a, lay_b = operand_layouts(tile, {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
                                          torch.float8_e4m3fn: gl.float8e4nv}[x.dtype])
    a_desc = TensorDescriptor.from_tensor(x, [tile.bm, tile.bk], lay_a)
    b_desc = TensorDescriptor.from_tensor(w, [tile.bn, tile.bk], lay_b)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = min(sms, triton.cdiv(m, tile.bm) * triton.cdiv(n, tile.bn))
    xs = x_scale.reshape(-1).contiguous() if fp8 else out
    _ws_gemm_kernel[(grid,)](a_desc, b_desc, out, bias if bias is not None else out, xs,
                             w_scale if fp8 else out, amax, cos, sin, m, n, k, out.stride(0), amax.stride(0),
                             cos.stride(0) if rope is not None else 0, n // 3, tile.epi_n ** -0.5,
                             **launch_constants(tile, EPILOGUES[epilogue], bias is not None, fp8, row_amax, grid),
                             enable_fp_fusion=FP_FUSION and rope is None)
    return (out, amax.amax(1)) if row_amax else out


def operand_layouts(tile: WsTile, dtype) -> tuple:
    """The shared layouts of x's [bm, bk] and w's [bn, bk] tiles in Gluon dtype ``dtype``: what their TMA
    descriptors and the ring's slots take."""
    return (gl.NVMMASharedLayout.get_default_for([tile.bm, tile.bk], dtype),
            gl.NVMMASharedLayout.get_default_for([tile.bn, tile.bk], dtype))


def launch_constants(tile: WsTile, epi: int, has_bias: bool, fp8: bool, row_amax: bool, programs: int) -> dict:
    """The kernel's constexprs (and its warps) for ``tile``, epilogue code ``epi``, e4m3 inputs or not, the rows'
    maxima or not and ``programs`` persistent programs: what :func:`ws_gemm` launches and what
    tests/compile_sm90.py compiles."""
    return dict(NUM_SMS=programs, BM=tile.bm, BN=tile.bn, BK=tile.bk, STAGES=tile.stages, GROUP_M=tile.group_m,
                EPI=epi, GELU=GELU_FORMS[tile.gelu], HAS_BIAS=has_bias, FP8=fp8, AMAX=row_amax, EPI_M=tile.epi_m,
                EPI_N=tile.epi_n, EPI_WARPS=tile.epi_warps, LOAD_REGS=tile.load_regs, EPI_REGS=tile.epi_regs,
                EPI_WARPS2=tile.epi_warps2, SPLIT=tile.chunk_split(), num_warps=tile.warps)


__all__ = ["EPILOGUES", "GLUON", "WS_FP8", "WsTile", "available", "launch_constants", "operand_layouts", "ws_gemm"]
