"""A block's feed-forward half at a decode step's few rows in one persistent launch (Triton).

At a step's 16–256 rows each of FFN up and FFN down reads its weight once and does little arithmetic a byte, and
cuBLAS takes 1.5–7.6× one read of the weight a launch (``docs/kernels.md``): each launch's fixed cost, its tail and
the gap before the next are paid four times a block (up, GELU, down, the residual add with the LayerNorm after it).
Here one launch of one program a multiprocessor walks all of it in three stages, each program taking the stage's
work items in turn, with a barrier across the grid between stages:

1. f = GELU(x W1ᵀ + b1) [M, F], tiles of BM × BN1 (x [M, D] the FFN's LayerNorm output), stored in the step's dtype;
2. FFN down split along F: program item (i, j, s) multiplies f's rows of tile i by W2's rows of tile j over the s-th
   of ``split`` runs of F into a float32 partial [split, M, D];
3. each row: the partials added in split order (the same sums on every run), the bias, the branch scale and the
   residual h added, rounded once to s [M, D]; and the LayerNorm after the block of s.

W2 is not read before stage 2 needs it, but its bytes do not depend on stage 1: with ``prefetch`` each program asks
its stage-2 share of W2 into L2 at its start (``kernels.prefetch``), so the stage-1 weight stream and W2's overlap
(measured slower at every shape, so off unless asked). The barrier counts arrivals and departures in two words of
:func:`~.common.split_counters` (zero before and after every launch); it needs every program resident at once, so
the grid is at most one program a multiprocessor.

Under Triton's interpreter (CPU, no concurrent programs) and with ``staged`` the three stages run as three launches
over the same code, without the barrier. Returns what :func:`ffn_step_reference` computes, which the tests tie it to.

Measured on an H200 over cold weights (``tools/tune_ffn_step.py``, ``results/gpu/ffn_step_h200.txt``), the best of a
grid of tiles ran slower than cuBLAS's four launches from 48 rows (650M-shaped: 24.6 against 21.8 µs at 48 rows,
43.3 against 26.6 at 195) and as fast at 16 rows (20.1 against 20.5), so the library takes it only where
:data:`FFN_STEP_ROWS` is set (``docs/kernels.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import FP_FUSION, GELU_FORM, GELU_FORMS, gelu, interpreting, num_sms, split_counters
from .gemm import epilogue_reference
from .gemm_split import tile_product
from .norm import add_layer_norm_reference
from .prefetch import prefetch_rows

#: the most rows a block's feed-forward half takes this launch at (``embed.products.ffn_folds``); above it, cuBLAS
#: products with their passes. 0: never (measured slower at a step's rows, ``tools/tune_ffn_step.py``; opt-in)
FFN_STEP_ROWS = 0
#: the activations the kernel computes (ESM-2's GELU, or its tanh approximation where the model asks for it)
ACTIVATIONS = {"gelu": GELU_FORMS[GELU_FORM], "gelu_tanh": GELU_FORMS["tanh"]}


@dataclass(frozen=True)
class FfnPlan:
    """One launch: row tile ``bm``, FFN-up column tile ``bn1``, FFN-down column tile ``bn2``, the K step ``bk``, the
    runs of F FFN down is split into, warps, pipeline stages, whether W2 is asked into L2 at the start, and the
    nanoseconds a program waiting at a grid barrier sleeps between looks at its count."""

    bm: int = 64
    bn1: int = 64
    bn2: int = 64
    bk: int = 64
    split: int = 0  # 0: as many runs as fill the grid (plan())
    warps: int = 4
    stages: int = 4
    prefetch: bool = False
    backoff: int = 0


def plan(m: int, d: int, sms: int, base: FfnPlan | None = None) -> FfnPlan:
    """``base`` (default :class:`FfnPlan`, with 128 × 128 tiles from 128 rows: the grid's best at 195 and 256 rows)
    with the row tile fitted to m rows (16 up) and, where its split is 0, FFN down's F split into the most runs that
    keep its work items within one program a multiprocessor."""
    base = base or (FfnPlan(128, 128, 128) if m >= 128 else FfnPlan())
    bm = min(base.bm, max(16, triton.next_power_of_2(m)))
    split = base.split or max(1, sms // (triton.cdiv(m, bm) * triton.cdiv(d, base.bn2)))
    return FfnPlan(bm, base.bn1, base.bn2, base.bk, split, base.warps, base.stages, base.prefetch, base.backoff)


def ffn_step_reference(h: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                       w2: torch.Tensor, b2: torch.Tensor | None, norm_w: torch.Tensor, norm_b: torch.Tensor | None,
                       eps: float, branch_scale: float = 1.0, act: str = "gelu") -> tuple[torch.Tensor, torch.Tensor]:
    """h, x: [M, D]; w1 [F, D], b1 [F], w2 [D, F], b2 [D], norm [D]. Returns (s, LayerNorm(s)) [M, D] in h's dtype:
    f = GELU(x W1ᵀ + b1) in float32 rounded to the dtype, s = h + (f W2ᵀ + b2) · branch_scale in float32 rounded once
    (``act`` ``"gelu_tanh"``: GELU's tanh approximation)."""
    u = x.float() @ w1.float().t() + (0.0 if b1 is None else b1.float())
    f = epilogue_reference(u, act).to(h.dtype)
    y = f.float() @ w2.float().t() + (0.0 if b2 is None else b2.float())
    return add_layer_norm_reference((h.float() + y * branch_scale).to(h.dtype), None, norm_w, norm_b, eps)


@triton.jit
def _grid_barrier(words, nprog, BACKOFF: tl.constexpr):
    """Every program of the grid waits here until all ``nprog`` have arrived: ``words`` [2] int32, zero on entry
    and left zero (the last program to leave zeroes both), so each barrier of a launch takes words of its own.
    ``BACKOFF``: nanoseconds a waiting program sleeps between looks at the count (0: it looks again at once)."""
    tl.debug_barrier()  # every thread's stores before the (one-thread, releasing) arrival
    tl.atomic_add(words, 1, sem="release")
    while tl.atomic_add(words, 0, sem="acquire") < nprog:
        if BACKOFF > 0:
            tl.inline_asm_elementwise(f"nanosleep.u32 {BACKOFF}; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
    if tl.atomic_add(words + 1, 1, sem="relaxed") == nprog - 1:  # the last to leave: every program saw nprog
        tl.store(words, 0)
        tl.store(words + 1, 0)
    tl.debug_barrier()


@triton.jit
def _up_stage(x_ptr, w1_ptr, b1_ptr, f_ptr, M, D, FD, sxm, pid, nprog, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, HAS_BIAS: tl.constexpr, FORM: tl.constexpr):
    """Tiles (i, j) of f = GELU(x W1ᵀ + b1) [M, FD], items i + j·cdiv(M, BM) taken by program pid in turns of
    nprog (the row tiles of one weight slice run side by side)."""
    mt = tl.cdiv(M, BM)
    for item in range(pid, mt * tl.cdiv(FD, BN), nprog):
        offs_m = (item % mt) * BM + tl.arange(0, BM)
        offs_n = (item // mt) * BN + tl.arange(0, BN)
        acc = tile_product(x_ptr, w1_ptr, offs_m, offs_n, M, FD, D, sxm, D, 0, D, BM, BN, BK, "")
        if HAS_BIAS:
            acc += tl.load(b1_ptr + offs_n, mask=offs_n < FD, other=0.0).to(tl.float32)[None, :]
        mask = (offs_m < M)[:, None] & (offs_n < FD)[None, :]
        tl.store(f_ptr + offs_m.to(tl.int64)[:, None] * FD + offs_n[None, :],
                 gelu(acc, FORM).to(f_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_item(item, M, D, FD, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    """FFN down's work item ``item`` (row tile i fastest, then column tile j, then run s): (i, j, s, the run's first
    and last + 1 column of F: whole BK steps, the last run shorter or empty)."""
    mt = tl.cdiv(M, BM)
    nt = tl.cdiv(D, BN)
    steps = tl.cdiv(tl.cdiv(FD, BK), SPLIT)
    rest = item // mt
    s = rest // nt
    k_lo = s * steps * BK
    return item % mt, rest % nt, s, k_lo, tl.minimum(FD, k_lo + steps * BK)


@triton.jit
def _down_stage(f_ptr, w2_ptr, part_ptr, M, D, FD, pid, nprog, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, SPLIT: tl.constexpr):
    """Items (i, j, s) (:func:`_down_item`): rows of tile i of f times W2's rows of tile j over the s-th of SPLIT
    runs of F into partial s [SPLIT, M, D] float32."""
    for item in range(pid, tl.cdiv(M, BM) * tl.cdiv(D, BN) * SPLIT, nprog):
        i, j, s, k_lo, k_hi = _down_item(item, M, D, FD, BM, BN, BK, SPLIT)
        offs_m = i * BM + tl.arange(0, BM)
        offs_n = j * BN + tl.arange(0, BN)
        # f: other programs' stores in this launch, read past L1
        acc = tile_product(f_ptr, w2_ptr, offs_m, offs_n, M, D, FD, FD, FD, k_lo, k_hi, BM, BN, BK, ".cg")
        mask = (offs_m < M)[:, None] & (offs_n < D)[None, :]
        tl.store(part_ptr + (s * M + offs_m).to(tl.int64)[:, None] * D + offs_n[None, :], acc, mask=mask)


@triton.jit
def _finish_stage(part_ptr, b2_ptr, h_ptr, nw_ptr, nb_ptr, s_ptr, y_ptr, M, D, shm, branch_scale, eps, pid, nprog,
                  BLOCK: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BIAS: tl.constexpr):
    """Rows r = pid, pid + nprog, …: s = h + (Σ_s partial + b2) · branch_scale rounded once, y = LayerNorm(s)
    (float32 statistics, two passes over the registers). Offsets in int32: a step's split × M × D is far below 2³¹."""
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    w = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    nb = tl.load(nb_ptr + cols, mask=ok, other=0.0).to(tl.float32) if NORM_BIAS else tl.zeros((BLOCK,), tl.float32)
    b = tl.load(b2_ptr + cols, mask=ok, other=0.0).to(tl.float32) if HAS_BIAS else tl.zeros((BLOCK,), tl.float32)
    for r in range(pid, M, nprog):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for t in range(SPLIT):
            acc += tl.load(part_ptr + (t * M + r) * D + cols, mask=ok, other=0.0, cache_modifier=".cg")
        h = tl.load(h_ptr + r * shm + cols, mask=ok, other=0.0)
        s = (h.to(tl.float32) + (acc + b) * branch_scale).to(h.dtype)
        tl.store(s_ptr + r * D + cols, s, mask=ok)
        v = s.to(tl.float32)
        mean = tl.sum(v, axis=0) / D
        centred = tl.where(ok, v - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / D + eps)
        tl.store(y_ptr + r * D + cols, (centred * rstd * w + nb).to(h.dtype), mask=ok)


@triton.jit
def _ffn_step_kernel(x_ptr, w1_ptr, b1_ptr, f_ptr, w2_ptr, part_ptr, b2_ptr, h_ptr, nw_ptr, nb_ptr, s_ptr, y_ptr,
                     words, M, D, FD, sxm, shm, branch_scale, eps, BM: tl.constexpr, BN1: tl.constexpr,
                     BN2: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                     STAGE: tl.constexpr, PREFETCH: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,
                     NORM_BIAS: tl.constexpr, FORM: tl.constexpr, BACKOFF: tl.constexpr):
    """Grid (programs,): STAGE 0 all three stages with a grid barrier between them (every program resident), or
    only stage 1, 2 or 3 (three launches, no barrier)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if STAGE == 0 and PREFETCH:  # this program's stage-2 share of W2 (row tile 0's items), asked into L2
        for item in range(pid, tl.cdiv(M, BM) * tl.cdiv(D, BN2) * SPLIT, nprog):
            i, j, s, k_lo, k_hi = _down_item(item, M, D, FD, BM, BN2, BK, SPLIT)
            if i == 0:
                n = j * BN2 + tl.arange(0, BN2)
                prefetch_rows(w2_ptr, n, FD, k_lo, k_hi - k_lo, (n < D) & (k_lo < FD))
    if STAGE == 0 or STAGE == 1:
        _up_stage(x_ptr, w1_ptr, b1_ptr, f_ptr, M, D, FD, sxm, pid, nprog, BM, BN1, BK, HAS_B1, FORM)
    if STAGE == 0:
        _grid_barrier(words, nprog, BACKOFF)
    if STAGE == 0 or STAGE == 2:
        _down_stage(f_ptr, w2_ptr, part_ptr, M, D, FD, pid, nprog, BM, BN2, BK, SPLIT)
    if STAGE == 0:
        _grid_barrier(words + 2, nprog, BACKOFF)
    if STAGE == 0 or STAGE == 3:
        _finish_stage(part_ptr, b2_ptr, h_ptr, nw_ptr, nb_ptr, s_ptr, y_ptr, M, D, shm, branch_scale, eps, pid, nprog,
                      BLOCK, SPLIT, HAS_B2, NORM_BIAS)


def ffn_step(h: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
             b2: torch.Tensor | None, norm_w: torch.Tensor, norm_b: torch.Tensor | None, eps: float,
             branch_scale: float = 1.0, act: str = "gelu", out: tuple | None = None, launch: FfnPlan | None = None,
             staged: bool | None = None, only: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ffn_step_reference` in one launch (CUDA; ``staged`` or under Triton's interpreter, three). h, x [M, D]
    (rows may be strided; last dim contiguous), w1 [F, D] and w2 [D, F] contiguous, one dtype. ``out``: (s, y)
    contiguous [M, D] buffers to write to. ``launch``: tiles (default :func:`plan`'s). ``only`` (1, 2 or 3; staged):
    that stage's launch alone, over whatever its scratch holds (to time the stages)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: the feed-forward kernel computes {sorted(ACTIVATIONS)}")
    m, d = x.shape
    fd = w1.shape[0]
    if h.shape != x.shape or w1.shape != (fd, d) or w2.shape != (d, fd) or x.stride(1) != 1 or h.stride(1) != 1:
        raise ValueError(f"shapes: h {tuple(h.shape)}, x {tuple(x.shape)}, w1 {tuple(w1.shape)}, "
                         f"w2 {tuple(w2.shape)} (h, x [M, D]; w1 [F, D]; w2 [D, F]; last dims contiguous)")
    w1, w2 = w1.contiguous(), w2.contiguous()
    staged = interpreting() if staged is None else staged
    sms = num_sms(x.device)
    p = plan(m, d, sms, launch)
    s, y = out if out is not None else (torch.empty(m, d, device=x.device, dtype=h.dtype),
                                        torch.empty(m, d, device=x.device, dtype=h.dtype))
    f = torch.empty(m, fd, device=x.device, dtype=h.dtype)
    part = torch.empty(p.split, m, d, device=x.device, dtype=torch.float32)
    words = split_counters(4, x.device)
    args = (x, w1, b1 if b1 is not None else w1, f, w2, part, b2 if b2 is not None else w2, h, norm_w,
            norm_b if norm_b is not None else norm_w, s, y, words, m, d, fd, x.stride(0), h.stride(0),
            float(branch_scale), float(eps))
    meta = dict(BM=p.bm, BN1=p.bn1, BN2=p.bn2, BK=p.bk, SPLIT=p.split, BLOCK=triton.next_power_of_2(d),
                PREFETCH=p.prefetch and not staged, HAS_B1=b1 is not None, HAS_B2=b2 is not None,
                NORM_BIAS=norm_b is not None, FORM=ACTIVATIONS[act], BACKOFF=p.backoff, num_warps=p.warps,
                num_stages=p.stages,
                enable_fp_fusion=FP_FUSION)
    if staged:
        mt = triton.cdiv(m, p.bm)
        grids = (mt * triton.cdiv(fd, p.bn1), mt * triton.cdiv(d, p.bn2) * p.split, m)
        for stage, grid in enumerate(grids, start=1):
            if only in (None, stage):
                _ffn_step_kernel[(grid,)](*args, STAGE=stage, **meta)
    else:
        _ffn_step_kernel[(sms,)](*args, STAGE=0, **meta)
    return s, y


__all__ = ["ACTIVATIONS", "FFN_STEP_ROWS", "FfnPlan", "ffn_step", "ffn_step_reference", "plan"]
