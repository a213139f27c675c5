"""FastEsm's matrix products with their pointwise work folded into the epilogue (Triton, tensor cores).

``gemm(x, w, bias, epilogue=..., residual=..., residual_scale=...)`` computes ``y = x wᵀ + b`` [M, N] from x [M, K]
and w [N, K] (fp16 or bf16; or e4m3 with one float32 scale per row of x and per row of w, see
:mod:`esm_turbo.embed.fp8`) and finishes it in registers before the one store:

* ``"bias"``: y, rounded to the output dtype (what ``F.linear`` returns);
* ``"gelu"``: erf GELU of the rounded y (:func:`~esm_turbo.kernels.common.gelu`), rounded again
  (``F.gelu(F.linear(x, w, b))``: ESM-2's FFN-up); ``"gelu_tanh"``: GELU's tanh approximation instead
  (``F.gelu(..., approximate="tanh")``, the tile's GELU form set to ``"tanh"``: FastEsm's ``gelu="tanh"``);
* ``"residual"``: ``h + y`` (h [M, N] the residual stream), or with ``residual_scale`` s ≠ 1 ``h + y · s`` summed
  in float32 and rounded once (the output projections: ``add_layer_norm_reference``'s sum). The LayerNorm after it
  then reads one tensor, not two;
* ``"rope"`` (the QKV projection, ``rope=(cos, sin)`` [M, d] float32 of each row's position): the query columns (the
  first N / 3) scaled by d ** -0.5 and rounded, then queries and keys (the first 2N / 3) rotated by the rotary
  embedding, head by head, as :func:`~esm_turbo.kernels.rope.rope_packed_triton` computes it (float32, no fused
  multiply-add); the values as they are. Each part of a tile the epilogue works on must hold whole heads.

Each rounding sits where the PyTorch reference (:func:`gemm_reference`) rounds, so the two differ only in the order
of the float32 sums. With FP8 inputs the float32 product is scaled by both scales before the bias (what
``torch._scaled_mm`` computes) and the output is bf16; ``row_amax`` then also returns each row's largest |output|
(each column tile's maxima written side by side, then reduced: no atomics, the same result on every run), so the
next product's per-row e4m3 scale needs no second read of the activation.

The kernel is persistent (one program per multiprocessor walks the output tiles, grouped along M so that a group's
weight columns stay in L2) and reads its tiles through tensor descriptors (TMA on Hopper) or, under Triton's
interpreter, on GPUs without TMA and for inputs whose rows are not 16-byte aligned, through masked pointer loads.
Tile shapes come from :data:`TILES` per product shape, dtype and epilogue (measured on the device,
``tools/tune_gemm.py``), else from :func:`default_tile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .common import GELU_FORM, GELU_FORMS, gelu, num_sms, sm90

if TYPE_CHECKING:
    from .gemm_split import SplitTile

#: epilogue → the kernel's code ("gelu_tanh" is the GELU code with the tile's form set to "tanh")
EPILOGUES = {"bias": 0, "gelu": 1, "gelu_tanh": 1, "residual": 2, "rope": 3}


@dataclass(frozen=True)
class TilePlan:
    """What every product kernel's launch plan sets: the output tile (bm × bn), the K step, how many K steps are in
    flight (stages), the warps and the M-group of the tile order; and, by keyword only, the form of GELU
    (:data:`~esm_turbo.kernels.common.GELU_FORMS`) a ``"gelu"`` epilogue computes."""

    bm: int = 128
    bn: int = 256
    bk: int = 64
    stages: int = 3
    warps: int = 8
    group_m: int = 8
    gelu: str = field(default=GELU_FORM, kw_only=True)

    def __post_init__(self):
        if self.gelu not in GELU_FORMS:
            raise ValueError(f"GELU form {self.gelu!r}: one of {list(GELU_FORMS)}")


@dataclass(frozen=True)
class Tile(TilePlan):
    """One launch plan of this module's kernel: :class:`TilePlan`'s fields, then the epilogue's column parts
    (``subtile``: 1, 2 or 4 parts of bn / parts columns, less register pressure; True is 2, False 1), whether the
    tile loop is warp-specialized (loads, products and the epilogue in warps of their own, where Triton offers it),
    the persistent programs a multiprocessor runs (``programs``: with 2, one program's epilogue can run beside the
    other's products where both fit) and a cap on registers a thread (``maxnreg``, None: the compiler's choice)."""

    subtile: int = 2
    ws: bool = False
    programs: int = 1
    maxnreg: int | None = None

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "subtile", 2 if self.subtile is True else 1 if self.subtile is False else self.subtile)
        if self.subtile not in (1, 2, 4) or self.bn % self.subtile:
            raise ValueError(f"a tile's epilogue parts (subtile) are 1, 2 or 4 dividing bn, not {self.subtile}")


@dataclass(frozen=True)
class WsTile(TilePlan):
    """One launch plan of :func:`~esm_turbo.kernels.gemm_ws.ws_gemm`: :class:`TilePlan`'s fields (the products in
    ``warps`` warps: bm / 16 warps of 16 rows; ``stages``: the ring's slots), then the epilogue's warps and its row
    and column chunk, the registers the loader and the epilogue keep (the products take the rest). The epilogue runs
    in two partitions of ``epi_warps`` and ``epi_warps2`` warps, the second taking the tile's last row chunks
    (:meth:`chunk_split`): so three epilogue warps can run beside two warp groups of products, where a partition's
    warps come in powers of two. Two and one by default: on an H100 FFN-up with GELU at 650M-shaped took 733 µs in
    partitions of one warp and one, 449 in one partition of two, 397 in two and one
    (``results/embed/ws_ffn_up_h100.txt``, ``ws_three_warps_h100.txt``)."""

    epi_warps: int = 2
    epi_m: int = 8
    epi_n: int = 64
    load_regs: int = 24
    epi_regs: int = 152
    epi_warps2: int = 1

    def __post_init__(self):
        super().__post_init__()
        if min(self.epi_warps, self.epi_warps2) < 1:
            raise ValueError("each of the two epilogue partitions takes at least one warp")
        if self.epi_m % 8 or self.bm % self.epi_m or self.bn % self.epi_n:
            raise ValueError(f"an epilogue chunk of {self.epi_m} x {self.epi_n} does not tile {self.bm} x {self.bn} "
                             "in rows of a multiple of 8")

    def chunk_split(self) -> int:
        """The first of the bm / epi_m row chunks that the second epilogue partition takes: the chunks shared in
        proportion to the two partitions' warps."""
        return round(self.bm // self.epi_m * self.epi_warps / (self.epi_warps + self.epi_warps2))

    def shared_bytes(self, elem: int = 2) -> int:
        """Shared memory the plan takes for inputs of ``elem`` bytes (2: fp16/bf16, 1: e4m3, whose sums are handed
        over in float32): the ring's slots and the handed tile (barriers aside)."""
        return self.stages * (self.bm + self.bn) * self.bk * elem + self.bm * self.bn * (2 if elem == 2 else 4)


#: the products where the kernel, its epilogue folded in, measured faster than cuBLAS followed by the separate pass
#: (a :class:`~esm_turbo.kernels.gemm_ws.WsTile` runs the epilogue in warps of its own where that kernel runs)
#: (``tools/tune_gemm.py`` on an H200, 16,384 rows, each against ``F.linear`` / ``torch._scaled_mm`` and the pointwise
#: kernel it replaces, timed in the same run), and the tile that won: (N, K, input dtype, epilogue) → Tile. Products
#: not listed run in cuBLAS (:mod:`esm_turbo.embed.products`).
TILES: dict[tuple[int, int, str, str], Tile | WsTile] = {
    # fp16 FFN-up with GELU in its exp2poly form (``tune_gemm.py --gelu-forms``, H100,
    # ``results/embed/gelu_exp2poly_h100.txt``): 650M 388 µs against 423 for the erfc form in the tile before (128 ×
    # 256, the epilogue in two parts), cuBLAS 312 + F.gelu's 130; the forward 45.34 → 44.14 ms. 150M: 120.5 against
    # 136.2 for the erfc form in two programs a multiprocessor (cuBLAS 94.6); the forward 15.07 → 14.57 ms,
    # ``Embedder.run`` 999K → 1,026K tokens/s
    (5120, 1280, "float16", "gelu"): Tile(128, 256, 64, 3, 8, 8, False, gelu="exp2poly"),
    (2560, 640, "float16", "gelu"): Tile(128, 256, 64, 3, 8, 8, False, gelu="exp2poly"),
    # 3B (H200, before the exp2poly form): 1,511 µs against 1,289 + 227 (erfc: 1,538)
    (10240, 2560, "float16", "gelu"): Tile(128, 256, 64, 3, 8, 8, True, gelu="erf"),
    # fp16 FFN-up with GELU's tanh approximation (FastEsm ``gelu="tanh"``), the epilogue in warps of its own
    # (``tune_gemm.py --gelu-forms``, H100, ``results/embed/gelu_tanh_h100.txt``): 650M 340 µs against 371 for the
    # tanh form in this kernel and 419 for the erfc row above (cuBLAS 306); 150M 102 against 114 and 134 (cuBLAS 93);
    # 3B 1,324 against 1,414 and 1,489 (cuBLAS 1,163)
    (5120, 1280, "float16", "gelu_tanh"): WsTile(group_m=16, gelu="tanh"),
    (2560, 640, "float16", "gelu_tanh"): WsTile(gelu="tanh"),
    (10240, 2560, "float16", "gelu_tanh"): WsTile(group_m=16, gelu="tanh"),
    # e4m3, the QKV projections (bias only): 151 µs against torch._scaled_mm's 162 (650M); 556 against 578 (3B)
    (3840, 1280, "float8_e4m3fn", "bias"): Tile(128, 256, 128, 4, 8, 8, True),
    (7680, 2560, "float8_e4m3fn", "bias"): Tile(256, 128, 128, 3, 8, 8, False),
    # e4m3, FFN-down with the residual add: 177 µs against 181 + the add (650M); 685 against 694 + the add (3B)
    (1280, 5120, "float8_e4m3fn", "residual"): Tile(128, 256, 128, 4, 8, 8, True),
    (2560, 10240, "float8_e4m3fn", "residual"): Tile(128, 256, 128, 4, 8, 8, True),
}


def default_tile(n: int, k: int, dtype: torch.dtype) -> Tile:
    """A tile for products with no measured entry: 128 × 256 (× 128 wide in K for e4m3, whose values are half the
    bytes), three stages; narrower for small N."""
    bk = 128 if dtype == torch.float8_e4m3fn else 64
    bn = 256 if n >= 1024 else 128
    return Tile(128, bn, bk, 3, 8, 8, bn >= 256)


#: the fewest rows at which the products in :data:`TILES` run folded: they were measured faster at 16,384 rows (an
#: embedding batch) and slower than cuBLAS followed by the pass at a decode step's rows (a 650M-shaped step of 195
#: rows on an H200: 5.34 ms with FFN-up folded, 4.75 ms in cuBLAS and the pass). Each product alone in a CUDA graph
#: (``tools/step_paths.py``, ``results/gpu/step_paths_h200.txt``): 0.74–0.93× cuBLAS + the pass at 1,024–2,048 rows,
#: 0.89–1.06× from 4,096
FOLD_MIN_ROWS = 4096


def measured(n: int, k: int, dtype: torch.dtype, epilogue: str, rows: int = FOLD_MIN_ROWS) -> bool:
    """Whether the folded product [rows, K] × [N, K]ᵀ with ``epilogue`` measured faster here than cuBLAS and its
    pass (:data:`TILES`, from :data:`FOLD_MIN_ROWS` rows)."""
    return rows >= FOLD_MIN_ROWS and (n, k, str(dtype).removeprefix("torch."), epilogue) in TILES


def tile_for(n: int, k: int, dtype: torch.dtype, epilogue: str = "bias") -> Tile:
    return TILES.get((n, k, str(dtype).removeprefix("torch."), epilogue), default_tile(n, k, dtype))


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index → (pid_m, pid_n), GROUP_M row tiles walked together along N."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m


@triton.jit
def _rounded(acc, offs_m, offs_n, M, N, c_ptr, bias_ptr, sa_ptr, sw_ptr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr):
    """A part of the accumulator as the product alone returns it: scaled (FP8), the bias added, rounded to c's dtype
    (returned in float32)."""
    y = acc
    if FP8:
        sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
        sw = tl.load(sw_ptr + offs_n, mask=offs_n < N, other=0.0)
        y = y * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return y.to(c_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _finish_rope(acc, offs_m, offs_n, M, N, c_ptr, stride_cm, bias_ptr, sa_ptr, sw_ptr, cos_ptr, sin_ptr, stride_cos,
                 q_cols, q_scale, HAS_BIAS: tl.constexpr, FP8: tl.constexpr, BM: tl.constexpr, BNP: tl.constexpr,
                 HD: tl.constexpr):
    """The ``"rope"`` epilogue of one [BM, BNP] part (BNP whole heads of HD channels): the product's rounded value;
    columns < ``q_cols`` (queries) times ``q_scale``, rounded; columns < 2 · q_cols (queries and keys) rotated,
    ``x · cos + rotate_half(x) · sin`` with cos, sin [M, HD] float32 (rows ``stride_cos`` apart) in float32 (the launch
    takes no fused multiply-add, as the rotary kernel's); one store."""
    out_ty = c_ptr.dtype.element_ty
    row_ok = offs_m < M
    y = _rounded(acc, offs_m, offs_n, M, N, c_ptr, bias_ptr, sa_ptr, sw_ptr, HAS_BIAS, FP8)
    y = tl.where((offs_n < q_cols)[None, :], (y * q_scale).to(out_ty, fp_downcast_rounding="rtne").to(tl.float32), y)
    G: tl.constexpr = BNP // HD
    HALF: tl.constexpr = HD // 2
    x1, x2 = tl.split(tl.permute(tl.reshape(y, (BM, G, 2, HALF)), (0, 1, 3, 2)))  # each head's halves [BM, G, HALF]
    at = offs_m[:, None].to(tl.int64) * stride_cos + tl.arange(0, HALF)[None, :]
    c1 = tl.load(cos_ptr + at, mask=row_ok[:, None], other=0.0)[:, None, :]
    s1 = tl.load(sin_ptr + at, mask=row_ok[:, None], other=0.0)[:, None, :]
    c2 = tl.load(cos_ptr + at + HALF, mask=row_ok[:, None], other=0.0)[:, None, :]
    s2 = tl.load(sin_ptr + at + HALF, mask=row_ok[:, None], other=0.0)[:, None, :]
    rotated = tl.join(x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)  # [BM, G, HALF, 2]
    rotated = tl.reshape(tl.permute(rotated, (0, 1, 3, 2)), (BM, BNP))
    y = tl.where((offs_n < 2 * q_cols)[None, :], rotated, y).to(out_ty, fp_downcast_rounding="rtne")
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], y, mask=mask)


@triton.jit
def _part(acc, offs_m, offs_n, M, N, c_ptr, stride_cm, bias_ptr, res_ptr, stride_rm, res_scale, sa_ptr, sw_ptr,
          amax_ptr, part, parts, cos_ptr, sin_ptr, stride_cos, q_cols, q_scale, EPI: tl.constexpr,
          HAS_BIAS: tl.constexpr, FP8: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr, GELU: tl.constexpr,
          BM: tl.constexpr, BNP: tl.constexpr, HD: tl.constexpr):
    """One part's epilogue: :func:`_finish_rope` for ``"rope"``, else :func:`_finish`."""
    if EPI == 3:
        _finish_rope(acc, offs_m, offs_n, M, N, c_ptr, stride_cm, bias_ptr, sa_ptr, sw_ptr, cos_ptr, sin_ptr,
                     stride_cos, q_cols, q_scale, HAS_BIAS, FP8, BM, BNP, HD)
    else:
        _finish(acc, offs_m, offs_n, M, N, c_ptr, stride_cm, bias_ptr, res_ptr, stride_rm, res_scale, sa_ptr, sw_ptr,
                amax_ptr, part, parts, EPI, HAS_BIAS, FP8, SCALED, AMAX, GELU)


@triton.jit
def _finish(acc, offs_m, offs_n, M, N, c_ptr, stride_cm, bias_ptr, res_ptr, stride_rm, res_scale, sa_ptr, sw_ptr,
            amax_ptr, part, parts, EPI: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
            SCALED: tl.constexpr, AMAX: tl.constexpr, GELU: tl.constexpr):
    """The epilogue of one [BM, BN'] part of the accumulator (float32) at rows offs_m, columns offs_n: scales (FP8),
    bias, the rounding to c's dtype, then GELU or the residual add, each rounded as the reference rounds; one store.
    ``AMAX``: the rows' largest |value| of this part at column ``part`` of amax [M, parts]."""
    out_ty = c_ptr.dtype.element_ty
    row_ok = offs_m < M
    col_ok = offs_n < N
    mask = row_ok[:, None] & col_ok[None, :]
    y = _rounded(acc, offs_m, offs_n, M, N, c_ptr, bias_ptr, sa_ptr, sw_ptr, HAS_BIAS, FP8)
    if EPI == 1:
        y = gelu(y, GELU).to(out_ty, fp_downcast_rounding="rtne")
    elif EPI == 2:
        h = tl.load(res_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        if SCALED:
            y = h + y * res_scale
        else:
            y = h + y
        y = y.to(out_ty, fp_downcast_rounding="rtne")
    else:
        y = y.to(out_ty, fp_downcast_rounding="rtne")
    if AMAX:
        tl.store(amax_ptr + offs_m.to(tl.int64) * parts + part,
                 tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=1), mask=row_ok)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], y, mask=mask)


@triton.jit
def _column_part(acc, j: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PARTS: tl.constexpr):
    """Columns [j · BN / PARTS, (j + 1) · BN / PARTS) of acc [BM, BN] (PARTS 1, 2 or 4), by halving splits."""
    if PARTS == 1:
        part = acc
    else:
        h0, h1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        part = h0 if j // (PARTS // 2) == 0 else h1
        if PARTS == 4:
            q0, q1 = tl.split(tl.permute(tl.reshape(part, (BM, 2, BN // 4)), (0, 2, 1)))
            part = q0 if j % 2 == 0 else q1
    return part


@triton.jit
def _gemm_kernel(a_ptr, a_desc, w_ptr, w_desc, c_ptr, bias_ptr, res_ptr, sa_ptr, sw_ptr, amax_ptr, cos_ptr, sin_ptr,
                 M, N, K, stride_am, stride_wn, stride_cm, stride_rm, stride_cos, q_cols, res_scale, q_scale,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                 TMA: tl.constexpr, SUBTILE: tl.constexpr, EPI: tl.constexpr, HAS_BIAS: tl.constexpr,
                 FP8: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr, WS: tl.constexpr, GELU: tl.constexpr,
                 HD: tl.constexpr):
    """Persistent: program p computes output tiles p, p + NUM_SMS, … of the [M, N] output (c = x wᵀ, x [M, K] rows
    ``stride_am`` apart, w [N, K] rows ``stride_wn`` apart, both with contiguous K), then each part's epilogue
    (:func:`_part`)."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BK)
    tile_c = start - NUM_SMS  # the epilogue's own count: the loop's is pipelined ahead of it
    offs_k = tl.arange(0, BK)
    parts = num_pid_n * SUBTILE
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=True, warp_specialize=WS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if TMA:
            for ki in range(k_tiles):
                a = a_desc.load([pid_m * BM, ki * BK])
                w = w_desc.load([pid_n * BN, ki * BK])
                acc = tl.dot(a, w.T, acc)
        else:
            rows = pid_m * BM + tl.arange(0, BM)
            cols = pid_n * BN + tl.arange(0, BN)
            a_at = a_ptr + tl.where(rows < M, rows, 0).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
            w_at = w_ptr + tl.where(cols < N, cols, 0).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
            for ki in range(k_tiles):
                k_ok = offs_k[None, :] < K - ki * BK
                a = tl.load(a_at, mask=k_ok, other=0.0)
                w = tl.load(w_at, mask=k_ok, other=0.0)
                acc = tl.dot(a, w.T, acc)
                a_at += BK
                w_at += BK
        tile_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        W: tl.constexpr = BN // SUBTILE
        for j in tl.static_range(SUBTILE):
            _part(_column_part(acc, j, BM, BN, SUBTILE), offs_m, pid_n * BN + j * W + tl.arange(0, W), M, N, c_ptr,
                  stride_cm, bias_ptr, res_ptr, stride_rm, res_scale, sa_ptr, sw_ptr, amax_ptr, SUBTILE * pid_n + j,
                  parts, cos_ptr, sin_ptr, stride_cos, q_cols, q_scale, EPI, HAS_BIAS, FP8, SCALED, AMAX, GELU, BM, W,
                  HD)


def tma_supported(device: torch.device) -> bool:
    """Whether tiles are read through tensor descriptors: CUDA with TMA (compute capability 9.0 or later)."""
    return sm90(device)


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def tma_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every 2-D tensor's start and row stride are 16-byte aligned: what a TMA descriptor takes."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, epilogue: str = "bias",
         residual: torch.Tensor | None = None, residual_scale: float = 1.0, x_scale: torch.Tensor | None = None,
         w_scale: torch.Tensor | None = None, row_amax: bool = False, tile: Tile | None = None,
         tma: bool | None = None, split: "SplitTile | None" = None,
         rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """See the module docstring. x [M, K], w [N, K] (K contiguous in both; e4m3 with x_scale [M] or [M, 1] and
    w_scale [N] float32), bias [N] or None, residual [M, N] (``epilogue="residual"``), rope (cos, sin) [M, d] float32
    (``epilogue="rope"``). Returns [M, N] in x's dtype (bf16 for e4m3), and with ``row_amax`` also the rows' largest
    |value| [M] float32. With ``split`` (a
    :class:`~esm_turbo.kernels.gemm_split.SplitTile`; fp16/bf16) the product runs split along K instead
    (:mod:`esm_turbo.kernels.gemm_split`: its earlier form measured slower than cuBLAS at a step's rows, so never
    by default). A
    ``tile`` that is a :class:`~esm_turbo.kernels.gemm_ws.WsTile` runs the product in
    :func:`~esm_turbo.kernels.gemm_ws.ws_gemm` (its epilogue in warps of its own) where that kernel runs and takes
    the epilogue, else in this kernel's default tile."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r}: one of {list(EPILOGUES)}")
    m, k = x.shape
    n = w.shape[0]
    fp8 = x.dtype == torch.float8_e4m3fn
    if w.shape[1] != k or w.dtype != x.dtype or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} (K contiguous) do not "
                         "make a product")
    if x.is_cuda and x.dtype == torch.float32:
        raise ValueError("float32 products run in cuBLAS on the GPU (the kernel's dots there are tf32)")
    if fp8 and (x_scale is None or w_scale is None):
        raise ValueError("e4m3 inputs need x_scale and w_scale")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("a residual goes with epilogue='residual', and only with it")
    out_dtype = torch.bfloat16 if fp8 else x.dtype
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != out_dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} is not the [{m}, {n}] {out_dtype} output")
    tile = tile or tile_for(n, k, x.dtype, epilogue)
    if epilogue == "gelu_tanh":  # GELU's tanh form, whatever tile computes it
        tile, epilogue = replace(tile, gelu="tanh"), "gelu"
    if not isinstance(tile, Tile):  # a WsTile: the epilogue in warps of its own (kernels.gemm_ws), where it runs
        from .gemm_ws import EPILOGUES as WS_EPILOGUES, available, ws_gemm
        if (epilogue in WS_EPILOGUES and split is None and m and tma is not False and available(x.device)
                and tma_aligned(x, w)):
            return ws_gemm(x, w, bias, epilogue, tile, x_scale, w_scale, row_amax, rope)
        tile = replace(default_tile(n, k, x.dtype), gelu=tile.gelu)
    if (epilogue == "rope") != (rope is not None):
        raise ValueError("rope's (cos, sin) go with epilogue='rope', and only with it")
    head_dim = check_rope(rope, m, n, split or tile) if rope is not None else 2
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if split is not None and m:
        if fp8 or row_amax:
            raise ValueError("a split product takes fp16/bf16 inputs and returns no row maxima")
        from .gemm_split import split_gemm
        return split_gemm(x, w, bias, out, epilogue, residual, residual_scale, GELU_FORMS[tile.gelu], split, rope,
                          head_dim)
    if tma is None:  # a descriptor needs 16-byte aligned rows
        tma = tma_supported(x.device) and tma_aligned(x, w)
    parts = triton.cdiv(n, tile.bn) * tile.subtile
    amax = torch.empty(m, parts, device=x.device, dtype=torch.float32) if row_amax else out
    if m == 0:
        return (out, amax[:, 0]) if row_amax else out
    sms = num_sms(x.device) * tile.programs
    tiles = triton.cdiv(m, tile.bm) * triton.cdiv(n, tile.bn)
    a_desc = _descriptor(x, [tile.bm, tile.bk]) if tma else x
    w_desc = _descriptor(w, [tile.bn, tile.bk]) if tma else w
    cos, sin = rope if rope is not None else (out, out)
    _gemm_kernel[(min(sms, tiles),)](
        x, a_desc, w, w_desc, out, bias if bias is not None else out, residual if residual is not None else out,
        x_scale if fp8 else out, w_scale if fp8 else out, amax, cos, sin, m, n, k, x.stride(0), w.stride(0),
        out.stride(0), residual.stride(0) if residual is not None else 0, cos.stride(0) if rope is not None else 0,
        n // 3, float(residual_scale), head_dim ** -0.5, BM=tile.bm, BN=tile.bn, BK=tile.bk, GROUP_M=tile.group_m,
        NUM_SMS=sms, TMA=tma, SUBTILE=tile.subtile, EPI=EPILOGUES[epilogue], HAS_BIAS=bias is not None, FP8=fp8,
        SCALED=residual_scale != 1.0, AMAX=row_amax, WS=tile.ws, GELU=GELU_FORMS[tile.gelu], HD=head_dim,
        num_warps=tile.warps, num_stages=tile.stages, enable_fp_fusion=rope is None,
        **({} if tile.maxnreg is None else dict(maxnreg=tile.maxnreg)))
    return (out, amax.amax(1)) if row_amax else out


def check_rope(rope: tuple[torch.Tensor, torch.Tensor], m: int, n: int, tile: Tile) -> int:
    """The head width of a ``"rope"`` product [M, N] (N = 3 × the heads' width) with ``rope`` = (cos, sin), after
    checking them and that each part of ``tile`` the epilogue works on holds whole heads."""
    cos, sin = rope
    d = cos.shape[-1] if cos.dim() == 2 else 0
    if (cos.shape != (m, d) or sin.shape != cos.shape or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or cos.stride(1) != 1 or sin.stride() != cos.stride() or d % 2 or n % 3 or d == 0 or (n // 3) % d):
        raise ValueError(f"rope's cos, sin {tuple(cos.shape)}, {tuple(sin.shape)} (float32, rows alike) are not the "
                         f"[{m}, d] tables of a [{m}, {n}] q/k/v product's heads")
    if not rope_fits(tile, d):
        parts = tile.bn // _part_width(tile)
        raise ValueError(f"tile {tile.bn} columns wide (in {parts} parts) does not hold whole {d}-wide heads a part")
    return d


def rope_fits(tile, head_dim: int) -> bool:
    """Whether every part of ``tile``'s columns the epilogue works on holds whole heads of ``head_dim`` (a
    :class:`~esm_turbo.kernels.gemm_ws.WsTile`: its epilogue's column chunk is one head)."""
    if isinstance(tile, WsTile):
        return head_dim == tile.epi_n and tile.bn % head_dim == 0 and head_dim in (32, 64, 128)
    return head_dim >= 2 and _part_width(tile) % head_dim == 0 and head_dim & (head_dim - 1) == 0


def _part_width(tile) -> int:
    """The columns of one part of ``tile`` an epilogue works on: a :class:`Tile`'s subtile, a
    :class:`~esm_turbo.kernels.gemm_ws.WsTile`'s epilogue chunk, a split tile's whole width."""
    if isinstance(tile, Tile):
        return tile.bn // tile.subtile
    return tile.epi_n if isinstance(tile, WsTile) else tile.bn


def gemm_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, epilogue: str = "bias",
                   residual: torch.Tensor | None = None, residual_scale: float = 1.0,
                   x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """What :func:`gemm` computes, in PyTorch: the product in float32 (e4m3 inputs scaled), the bias, a rounding to
    the output dtype, then the epilogue's op rounded once."""
    fp8 = x.dtype == torch.float8_e4m3fn
    out_dtype = torch.bfloat16 if fp8 else x.dtype
    y = x.float() @ w.float().t()
    if fp8:
        y = y * x_scale.reshape(-1, 1).float() * w_scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return epilogue_reference(y.to(out_dtype), epilogue, residual, residual_scale, rope)


def epilogue_reference(y: torch.Tensor, epilogue: str, residual: torch.Tensor | None = None,
                       residual_scale: float = 1.0, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """An epilogue's op on a product's rounded output y [M, N], rounded once: ``F.gelu`` (``"gelu_tanh"``: its tanh
    approximation), or the residual sum
    (:func:`~esm_turbo.kernels.norm.residual_sum`), or the rotary embedding of the queries and keys
    (:func:`~esm_turbo.kernels.rope.rope_packed_reference` written over them; ``rope`` = (cos, sin)), or nothing for
    ``"bias"``."""
    if epilogue == "rope":
        from .rope import rope_packed_reference
        cos, sin = rope
        dim = y.shape[1] // 3
        q, k = rope_packed_reference(y, cos, sin, dim // cos.shape[1])
        out = y.clone()
        out[:, :dim], out[:, dim: 2 * dim] = q.flatten(1), k.flatten(1)
        return out
    if epilogue in ("gelu", "gelu_tanh"):
        import torch.nn.functional as F
        return F.gelu(y, approximate="tanh" if epilogue == "gelu_tanh" else "none")
    if epilogue == "residual":
        from .norm import residual_sum
        return residual_sum(residual, y, residual_scale)
    return y


__all__ = ["EPILOGUES", "TILES", "Tile", "TilePlan", "WsTile", "check_rope", "default_tile", "epilogue_reference",
           "gemm", "gemm_reference", "measured", "rope_fits", "tile_for", "tma_aligned", "tma_supported"]
