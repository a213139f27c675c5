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


def add_layer_norm_reference(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                             eps: float, y_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """h, y: [N, D] (y may be None); weight, bias: [D]. Returns (s, layer_norm(s)) with s = h + y · y_scale (the sum
    in float32 when scaled, rounded once), both [N, D] in h's dtype."""
    if y is None:
        s = h
    elif y_scale == 1.0:
        s = h + y
    else:
        s = (h.float() + y.float() * y_scale).to(h.dtype)
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


@triton.jit
def _add_ln_kernel(h_ptr, y_ptr, w_ptr, b_ptr, s_ptr, x_ptr, n_rows, eps, y_scale, D: tl.constexpr,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr, ADD: tl.constexpr, SCALED: tl.constexpr):
    """Rows [pid·ROWS, (pid + 1)·ROWS) of contiguous [N, D] tensors: s = h (+ y · y_scale, rounded to h's dtype), x =
    layer_norm(s) with weight/bias [D]; float32 statistics (two-pass variance over the registers)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    at = rows[:, None].to(tl.int64) * D + cols[None, :]
    s = tl.load(h_ptr + at, mask=mask, other=0.0)
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
    b = tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    x = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(x_ptr + at, x.to(x_ptr.dtype.element_ty), mask=mask)


def add_layer_norm_triton(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                          eps: float, y_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_layer_norm_reference` in one launch (CUDA, or CPU under Triton's interpreter). h, y: [N, D]
    contiguous, one dtype."""
    n, d = h.shape
    if y is not None and (y.shape != h.shape or y.dtype != h.dtype):
        raise ValueError(f"h {tuple(h.shape)} {h.dtype} and y {tuple(y.shape)} {y.dtype} differ")
    h = h.contiguous()
    y = None if y is None else y.contiguous()
    s = h if y is None else torch.empty_like(h)
    x = torch.empty_like(h)
    block = triton.next_power_of_2(d)
    rows = max(1, min(16, 2048 // block))
    warps = 4 if block <= 2048 else 8
    _add_ln_kernel[(triton.cdiv(n, rows),)](h, h if y is None else y, weight, bias, s, x, n, eps, float(y_scale),
                                            D=d, BLOCK=block, ROWS=rows, ADD=y is not None, SCALED=y_scale != 1.0,
                                            num_warps=warps)
    return s, x


__all__ = ["add_layer_norm_reference", "add_layer_norm_triton"]
