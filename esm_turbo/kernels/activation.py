"""FastEsm's feed-forward nonlinearity and the e4m3 row quantization of an FP8 product's input, in one pass (Triton).

``activation_triton(u, kind, fp8)``: ``kind`` ``"gelu"`` (erf GELU, :func:`~esm_turbo.kernels.common.gelu`;
u [N, F] → [N, F]; ``"gelu_tanh"``: its tanh approximation), ``"swiglu"`` (ESM C: silu(gate) · up of u [N, 2F],
gate first → [N, F]) or ``"none"``; the result rounded to u's dtype, as the reference
(:func:`~esm_turbo.embed.fast_esm.activation`) rounds it. ``fp8``: then quantized to e4m3 with one scale per row
(:func:`~esm_turbo.embed.fp8.quantize_rows` of the reference's result), returned as
:class:`~esm_turbo.embed.fp8.Fp8Rows`. Eagerly that is four passes over the activations for SwiGLU and
five more for the quantization (a float32 copy, abs, max, divide, cast); here one read of u and one write, two reads
of u with FP8 where a row is too wide to hold (the row's maximum first, then the values; the second read mostly from
L2), else one (:data:`HOLD_ROWS`). For GELU the first sweep
evaluates no GELU (:data:`GELU_AMAX_FROM_BOUNDS`): GELU falls to its minimum at :data:`GELU_ARGMIN` and rises on
either side, so a row's largest |GELU| is that of its largest value, of its largest value left of the minimum or of
its smallest value right of it and below zero: three reductions, then GELU of three values a row (erf GELU only;
the tanh form's maxima come from GELU over the row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import GELU_FORM, GELU_FORMS, gelu

KINDS = {"none": 0, "gelu": 1, "gelu_tanh": 1, "swiglu": 2}
#: where x·Φ(x) is least (GELU(x) = −0.16997…): it falls on (−∞, GELU_ARGMIN] and rises after
GELU_ARGMIN = -0.7517915246935645
#: the FP8 GELU launch finds each row's largest |GELU| from the row's three bounding values (one GELU a row, not one a
#: value); False evaluates GELU over the row twice, as before (kept to time the two against each other)
GELU_AMAX_FROM_BOUNDS = True
#: FP8 launches whose rows' maxima are not known hold each row's activations in registers between its maximum and
#: its codes (:func:`_held_rows_kernel`: one read of u), for rows up to HELD_MAX columns. H100, GELU into e4m3 at
#: 16,384 rows (``tools/tune_gemm.py --fp8-gelu-ab``): 141.5 µs against the two sweeps' 181.2 (650M-shaped), 285.0
#: against 371.9 (3B), both at eight warps (:func:`held_warps` since); the FP8 forward 35.74 → 34.83 ms and
#: 116.98 → 111.68 ms. False: the two sweeps
HOLD_ROWS = True
HELD_MAX = 16384


@triton.jit
def e4m3_row_scale(amax):
    """The e4m3 scale of rows whose largest |value| is ``amax`` (float32): amax / 448, at least the smallest normal
    float32, as :func:`~esm_turbo.embed.fp8.quantize_rows` takes it."""
    return tl.maximum(amax / 448.0, 1.1754943508222875e-38)


@triton.jit
def store_e4m3(ptr, x, scale, mask):
    """x / scale [R, C] (float32; scale [R]) rounded to the nearest e4m3 value at ``ptr``."""
    tl.store(ptr, (x / scale[:, None]).to(ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _act(u_ptr, row_at, cols, mask, F: tl.constexpr, KIND: tl.constexpr, GELU: tl.constexpr):
    """The activation of the columns ``cols`` of the rows at ``row_at`` [R, 1] in float32, rounded to u's dtype."""
    u = tl.load(u_ptr + row_at + cols[None, :], mask=mask, other=0.0)
    x = u.to(tl.float32)
    if KIND == 1:
        x = gelu(x, GELU)
    elif KIND == 2:
        up = tl.load(u_ptr + row_at + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = (x / (1.0 + tl.exp(-x))).to(u.dtype, fp_downcast_rounding="rtne").to(tl.float32)  # as F.silu rounds
        x = gate * up
    return x.to(u.dtype, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _act_cols(u_ptr, row_at, row_ok, cols, F: tl.constexpr, KIND: tl.constexpr, GELU: tl.constexpr):
    """(:func:`_act` of the columns ``cols`` of the rows at ``row_at`` [R, 1], 0 outside the rows ``row_ok`` and the
    F columns; that mask [R, C])."""
    mask = row_ok[:, None] & (cols[None, :] < F)
    return tl.where(mask, _act(u_ptr, row_at, cols, mask, F, KIND, GELU), 0.0), mask


@triton.jit
def _rounded_gelu_abs(v, dtype, GELU: tl.constexpr):
    """|GELU(v)| rounded to ``dtype`` as :func:`_act` rounds it, of finite v [R] (float32); 0 where v is not finite
    (a row with no value on that side)."""
    v = tl.where((v == v) & (tl.abs(v) < float("inf")), v, 0.0)
    return tl.abs(gelu(v, GELU).to(dtype, fp_downcast_rounding="rtne").to(tl.float32))


@triton.jit
def _activation_kernel(u_ptr, out_ptr, scale_ptr, amax_ptr, n_rows, u_stride, F: tl.constexpr, BLOCK: tl.constexpr,
                       ROWS: tl.constexpr, KIND: tl.constexpr, FP8: tl.constexpr, KNOWN_AMAX: tl.constexpr,
                       GELU: tl.constexpr, BOUNDS: tl.constexpr, ARGMIN: tl.constexpr):
    """Rows [pid·ROWS, (pid + 1)·ROWS) of u (rows ``u_stride`` apart) → out [N, F] contiguous, in column blocks of
    BLOCK; with ``FP8`` a first sweep finds each row's max |activation| (or, ``KNOWN_AMAX``, reads it at amax_ptr
    [N]; ``BOUNDS``, GELU's, from the row's values bounding GELU's minimum at ``ARGMIN`` and its largest) and the
    second stores e4m3 codes, the row's scale at scale_ptr [N]."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    row_at = rows[:, None].to(tl.int64) * u_stride
    out_at = rows[:, None].to(tl.int64) * F
    scale = tl.full((ROWS,), 1.0, tl.float32)
    if FP8:
        if KNOWN_AMAX:
            amax = tl.load(amax_ptr + rows, mask=row_ok, other=0.0)
        elif BOUNDS:  # GELU: the row's largest value, and its values either side of GELU's minimum nearest to it
            top = tl.full((ROWS,), float("-inf"), tl.float32)
            left = tl.full((ROWS,), float("-inf"), tl.float32)
            right = tl.full((ROWS,), float("inf"), tl.float32)
            for start in range(0, F, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = row_ok[:, None] & (cols[None, :] < F)
                x = tl.load(u_ptr + row_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                top = tl.maximum(top, tl.max(tl.where(mask, x, float("-inf")), axis=1))
                left = tl.maximum(left, tl.max(tl.where(mask & (x <= ARGMIN), x, float("-inf")), axis=1))
                right = tl.minimum(right, tl.min(tl.where(mask & (x > ARGMIN) & (x < 0.0), x, float("inf")), axis=1))
            dtype = u_ptr.dtype.element_ty
            amax = tl.maximum(_rounded_gelu_abs(top, dtype, GELU), tl.maximum(_rounded_gelu_abs(left, dtype, GELU),
                                                                            _rounded_gelu_abs(right, dtype, GELU)))
        else:
            amax = tl.zeros((ROWS,), tl.float32)
            for start in range(0, F, BLOCK):
                x, _ = _act_cols(u_ptr, row_at, row_ok, start + tl.arange(0, BLOCK), F, KIND, GELU)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = e4m3_row_scale(amax)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
    for start in range(0, F, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols[None, :] < F)
        x = _act(u_ptr, row_at, cols, mask, F, KIND, GELU)
        if FP8:
            store_e4m3(out_ptr + out_at + cols[None, :], x, scale, mask)
        else:
            tl.store(out_ptr + out_at + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _held_rows_kernel(u_ptr, out_ptr, scale_ptr, n_rows, u_stride, F: tl.constexpr, HI: tl.constexpr,
                      LO: tl.constexpr, KIND: tl.constexpr, GELU: tl.constexpr):
    """Row pid of u → its e4m3 codes at out [N, F] and its scale at scale_ptr [N], the row's activations (as
    :func:`_act` computes them) held in registers from its maximum to its codes: one read of u. The columns as two
    chunks, [0, HI) and [HI, HI + LO) (HI a power of two, LO that of what remains, or 0), so little is masked."""
    rows = tl.program_id(0) + tl.arange(0, 1)
    row_ok = rows < n_rows
    row_at = rows[:, None].to(tl.int64) * u_stride
    out_at = rows[:, None].to(tl.int64) * F
    hi = tl.arange(0, HI)
    x_hi, hi_ok = _act_cols(u_ptr, row_at, row_ok, hi, F, KIND, GELU)
    amax = tl.max(tl.abs(x_hi), axis=1)
    if LO > 0:
        lo = HI + tl.arange(0, LO)
        x_lo, lo_ok = _act_cols(u_ptr, row_at, row_ok, lo, F, KIND, GELU)
        amax = tl.maximum(amax, tl.max(tl.abs(x_lo), axis=1))
    scale = e4m3_row_scale(amax)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    store_e4m3(out_ptr + out_at + hi[None, :], x_hi, scale, hi_ok)
    if LO > 0:
        store_e4m3(out_ptr + out_at + lo[None, :], x_lo, scale, lo_ok)


def held_warps(f: int) -> int:
    """Warps a program of :func:`_held_rows_kernel` for rows of f columns: one per 1,024 columns (rounded up to a power
    of two), at most four. H100, 16,384 rows, bf16 into e4m3, µs (``results/embed/held_warps_h100.txt``): the
    attention output at 1,280 columns 27.5 against 41.9 at eight warps (and the two sweeps' 32.5), at 640 17.0
    against 34.0; GELU at 5,120 138.8 against 142.8, at 2,560 74.1 against 84.7."""
    return min(4, max(1, triton.next_power_of_2(f) // 1024))


def held_chunks(f: int) -> tuple[int, int]:
    """(HI, LO) of :func:`_held_rows_kernel` for rows of f columns."""
    hi = 1 << (f.bit_length() - 1)
    return hi, (triton.next_power_of_2(f - hi) if f > hi else 0)


def activation_triton(u: torch.Tensor, kind: str, fp8: bool = False, amax: torch.Tensor | None = None):
    """See the module docstring. u: [N, F] (``"swiglu"``: [N, 2F]), columns contiguous. ``amax`` [N] float32 (with
    ``fp8``): each row's largest |activation| when already known (the product before it found it,
    :func:`~esm_turbo.kernels.gemm.gemm` ``row_amax``): then one read of u, not two."""
    if kind not in KINDS:
        raise ValueError(f"activation {kind!r}: one of {list(KINDS)}")
    n, width = u.shape
    if u.stride(1) != 1 or (kind == "swiglu" and width % 2):
        raise ValueError(f"u {tuple(u.shape)} (strides {u.stride()}) does not fit activation {kind!r}")
    if amax is not None and (not fp8 or amax.shape != (n,) or amax.dtype != torch.float32):
        raise ValueError(f"amax {tuple(amax.shape)} {amax.dtype} goes with fp8 and is [{n}] float32")
    f = width // 2 if kind == "swiglu" else width
    form = GELU_FORMS["tanh" if kind == "gelu_tanh" else GELU_FORM]
    out = torch.empty(n, f, device=u.device, dtype=torch.float8_e4m3fn if fp8 else u.dtype)
    scale = torch.empty(n, 1, device=u.device, dtype=torch.float32) if fp8 else out
    hi, lo = held_chunks(f) if fp8 and amax is None and HOLD_ROWS and f else (0, 0)
    if 0 < hi + lo <= HELD_MAX:
        _held_rows_kernel[(n,)](u, out, scale, n, u.stride(0), F=f, HI=hi, LO=lo, KIND=KINDS[kind],
                                GELU=form, num_warps=held_warps(f))
        from ..embed.fp8 import Fp8Rows
        return Fp8Rows(out, scale)
    block = min(1024, triton.next_power_of_2(f))
    rows = max(1, min(16, 4096 // block))
    _activation_kernel[(triton.cdiv(n, rows),)](u, out, scale, scale if amax is None else amax, n, u.stride(0), F=f,
                                                BLOCK=block, ROWS=rows, KIND=KINDS[kind], FP8=fp8,
                                                KNOWN_AMAX=amax is not None, GELU=form,
                                                BOUNDS=kind == "gelu" and GELU_AMAX_FROM_BOUNDS, ARGMIN=GELU_ARGMIN,
                                                num_warps=4)
    if not fp8:
        return out
    from ..embed.fp8 import Fp8Rows
    return Fp8Rows(out, scale)


__all__ = ["GELU_AMAX_FROM_BOUNDS", "GELU_ARGMIN", "HELD_MAX", "HOLD_ROWS", "KINDS", "activation_triton",
           "e4m3_row_scale", "held_chunks", "store_e4m3"]
