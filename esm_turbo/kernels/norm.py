"""A residual add and the LayerNorm after it in one pass over the rows (Triton): FastEsm's seam between blocks.

``add_layer_norm_triton(h, y, weight, bias, eps)`` returns ``(h + y, layer_norm(h + y))``: the block's new residual
stream, rounded to its dtype as transformers' ``h + y`` is, and the next LayerNorm's output (statistics in float32,
as ``torch.nn.functional.layer_norm`` keeps them). With ``y`` None it is the LayerNorm alone. ``y_scale`` multiplies
the branch first (ESM C divides each residual branch by sqrt(layers / 36)). Reference:
:func:`add_layer_norm_reference`, which the tests tie it to.

One program normalises ``ROWS`` rows of up to ``BLOCK`` channels held in registers: a read of h and y and a write of
the two outputs, nothing else, where ``h + y`` and the LayerNorm are two passes (three reads, two writes) eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import e4m3_row_scale, store_e4m3


def add_layer_norm_reference(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                             eps: float, y_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """h, y: [N, D] (y may be None); weight, bias: [D]. Returns (s, layer_norm(s)) with s = h + y · y_scale (the sum
    in float32 when scaled, rounded once), both [N, D] in h's dtype."""
    s = h if y is None else residual_sum(h, y, y_scale)
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


def residual_sum(h: torch.Tensor, y: torch.Tensor, y_scale: float = 1.0) -> torch.Tensor:
    """h + y · y_scale [N, D] in h's dtype: the plain sum, or when scaled the float32 sum rounded once."""
    return h + y if y_scale == 1.0 else (h.float() + y.float() * y_scale).to(h.dtype)


@triton.jit
def _add_ln_kernel(h_ptr, y_ptr, w_ptr, b_ptr, s_ptr, x_ptr, xs_ptr, n_rows, eps, y_scale, h_stride, x_stride,
                   D: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, ADD: tl.constexpr, SCALED: tl.constexpr,
                   BIAS: tl.constexpr, FP8: tl.constexpr):
    """Rows [pid·ROWS, (pid + 1)·ROWS) of [N, D] tensors (h and x rows ``h_stride`` / ``x_stride`` apart, y and s
    contiguous): s = h (+ y · y_scale, rounded to h's dtype), x = layer_norm(s) with weight [D] and (``BIAS``) bias
    [D]; float32 statistics (two-pass variance over the registers). ``FP8``: x rounded to s's dtype, then stored in
    e4m3 with one float32 scale per row (max |x| / 448) at xs_ptr [N]."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    at = rows[:, None].to(tl.int64) * D + cols[None, :]
    s = tl.load(h_ptr + rows[:, None].to(tl.int64) * h_stride + cols[None, :], mask=mask, other=0.0)
    if ADD:
        y = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            y = y * y_scale
        s = (s.to(tl.float32) + y).to(s.dtype)
        tl.store(s_ptr + at, s, mask=mask)
    v = s.to(tl.float32)
    mean = tl.sum(v, axis=1) / D
    centred = tl.where(mask, v - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    x = centred * rstd[:, None] * w[None, :]
    if BIAS:
        x += tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    x_at = x_ptr + rows[:, None].to(tl.int64) * x_stride + cols[None, :]
    if FP8:
        x = tl.where(mask, x.to(s.dtype).to(tl.float32), 0.0)
        scale = e4m3_row_scale(tl.max(tl.abs(x), axis=1))
        store_e4m3(x_at, x, scale, mask)
        tl.store(xs_ptr + rows, scale, mask=rows < n_rows)
    else:
        tl.store(x_at, x.to(x_ptr.dtype.element_ty), mask=mask)


def _launch(h, y, weight, bias, s, x, xs, eps: float, y_scale: float) -> None:
    n, d = h.shape
    block = triton.next_power_of_2(d)
    rows = max(1, min(16, 2048 // block))
    warps = 4 if block <= 2048 else 8
    _add_ln_kernel[(triton.cdiv(n, rows),)](h, h if y is None else y, weight, weight if bias is None else bias, s, x,
                                            x if xs is None else xs, n, eps, float(y_scale), h.stride(0), x.stride(0),
                                            D=d, BLOCK=block, ROWS=rows, ADD=y is not None, SCALED=y_scale != 1.0,
                                            BIAS=bias is not None, FP8=xs is not None, num_warps=warps)


def add_layer_norm_triton(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                          eps: float, y_scale: float = 1.0, fp8: bool = False, out: tuple | None = None):
    """:func:`add_layer_norm_reference` in one launch (CUDA, or CPU under Triton's interpreter). h, y: [N, D]
    contiguous, one dtype. ``fp8``: the LayerNorm's output comes as :class:`~esm_turbo.embed.fp8.Fp8Rows` (what
    :func:`~esm_turbo.embed.fp8.quantize_rows` makes of the reference's output), ready for an FP8 product. ``out``:
    (s, x) contiguous buffers of those shapes to write the sum and the LayerNorm to (neither h nor y; without y the
    sum is h itself, so s must be h)."""
    if y is not None and (y.shape != h.shape or y.dtype != h.dtype):
        raise ValueError(f"h {tuple(h.shape)} {h.dtype} and y {tuple(y.shape)} {y.dtype} differ")
    h = h.contiguous()
    y = None if y is None else y.contiguous()
    if out is not None and (out[0] is y or (y is not None and out[0] is h) or (y is None and out[0] is not h)):
        raise ValueError("out's sum must be a buffer of its own (h itself when there is no y)")
    s = h if y is None else (out[0] if out is not None else torch.empty_like(h))
    if not fp8:
        x = out[1] if out is not None else torch.empty_like(h)
        _launch(h, y, weight, bias, s, x, None, eps, y_scale)
        return s, x
    from ..embed.fp8 import Fp8Rows
    if out is not None:
        x, xs = out[1]
    else:
        x = torch.empty(h.shape, device=h.device, dtype=torch.float8_e4m3fn)
        xs = torch.empty(h.shape[0], 1, device=h.device, dtype=torch.float32)
    _launch(h, y, weight, bias, s, x, xs, eps, y_scale)
    return s, Fp8Rows(x, xs)


def layer_norm_columns_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A bias-free LayerNorm over every row of ``x`` [N, D], in place; the rows may be strided (a column slice of a
    wider tensor: ESM C's query and key inside the fused projection's output). Returns x."""
    if x.stride(1) != 1:
        raise ValueError("the columns must be contiguous")
    _launch(x, None, weight, None, x, x, None, eps, 1.0)
    return x


__all__ = ["add_layer_norm_reference", "add_layer_norm_triton", "layer_norm_columns_", "residual_sum"]
