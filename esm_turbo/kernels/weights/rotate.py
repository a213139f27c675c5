"""The rotation of a 4-bit linear's input, per group of channels (Triton): one small dot per group with the layer's
Hadamard matrix (±1 entries), in a launch of its own or after the LayerNorm that makes the input
(:func:`norm_rotate_triton`). Reference: ``QuantizedLinear.rotate_input``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP_FUSION, interpreting, sm90

#: programmatic dependent launch of the rotations (sm_90; 0, off, by default): 1 lets a dependent launch after a
#: rotation (the 4-bit product it feeds, ``launch_config``'s ``pdl``) start at once, so the product requests its codes
#: while the rotation runs; 2 also launches the rotation itself as a dependent (it waits for the kernel before it
#: before it reads), so a chain of products and rotations each start while the one before runs
EARLY_DEPENDENTS = 0


@triton.jit
def _turn(t, sign_ptr, rot_scale, ROWS: tl.constexpr, COLS: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr):
    """t [ROWS, COLS] with each group of D columns times ``sign`` [D, D] (a Hadamard rotation's ±1 entries, exact in
    any float type), then ``rot_scale``: float32 [ROWS, COLS]. A float32 t is split into fp16 halves for the tensor
    cores (fp32 accuracy), unless PRECISION is ``ieee``."""
    offs = tl.arange(0, D)
    sign = tl.load(sign_ptr + offs[:, None] * D + offs[None, :])
    rows = tl.reshape(t, (ROWS * (COLS // D), D))
    if t.dtype == tl.float32 and PRECISION != "ieee":
        hi = rows.to(tl.float16)
        lo = (rows - hi.to(tl.float32)).to(tl.float16)
        sign = sign.to(tl.float16)
        turned = tl.dot(lo, sign, tl.dot(hi, sign))
    else:
        turned = tl.dot(rows, sign.to(t.dtype), input_precision=PRECISION)
    return tl.reshape(turned, (ROWS, COLS)) * rot_scale


@triton.jit
def _rotate_kernel(x_ptr, sign_ptr, rot_scale, out_ptr, w_ptr, b_ptr, y_ptr, eps, B, N, sxb, BLOCK_B: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr,
                   EARLY: tl.constexpr = False, DEPENDENT: tl.constexpr = False):
    """Grid (cdiv(B, BLOCK_B), N / BLOCK_K, P). out [P, B, N] (contiguous, its dtype): part p = each group of GROUP
    channels of x [B, N] (rows strided by sxb) times sign[p] ([P, GROUP, GROUP]) · rot_scale. With ``NORM`` (= N, a
    multiple of BLOCK_K; 0: off) x is first layer-normalized (weight w [N], bias b [N], ``eps``; each row's statistics
    in float32 from one unrolled pass of sums shifted by its first value) and rounded to y's dtype, the values
    rotated; part 0's programs also store them to y [B, N] (contiguous). ``EARLY``: a programmatic dependent launch
    after this one may start at once (it waits for this one's results itself). ``DEPENDENT`` (launched as a
    programmatic dependent launch): waits for the kernel before it to finish before it reads."""
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
    sign_ptr += tl.program_id(2) * GROUP * GROUP
    out_ptr += tl.program_id(2).to(tl.int64) * B * N
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    bmask = offs_b[:, None] < B
    rows = x_ptr + offs_b[:, None].to(tl.int64) * sxb
    x = tl.load(rows + offs_k[None, :], mask=bmask, other=0.0)
    if NORM:
        shift = tl.load(rows, mask=bmask, other=0.0).to(tl.float32)  # [BLOCK_B, 1]
        total = tl.zeros((BLOCK_B,), tl.float32)
        squares = tl.zeros((BLOCK_B,), tl.float32)
        for k0 in tl.static_range(0, NORM, BLOCK_K):
            c = tl.load(rows + k0 + tl.arange(0, BLOCK_K)[None, :], mask=bmask, other=0.0).to(tl.float32) - shift
            total += tl.sum(c, axis=1)
            squares += tl.sum(c * c, axis=1)
        centred = total / NORM
        mean = shift + centred[:, None]
        rstd = 1.0 / tl.sqrt(tl.maximum(squares / NORM - centred * centred, 0.0) + eps)
        w = tl.load(w_ptr + offs_k).to(tl.float32)[None, :]
        b = tl.load(b_ptr + offs_k).to(tl.float32)[None, :]
        x = ((x.to(tl.float32) - mean) * rstd[:, None] * w + b).to(y_ptr.dtype.element_ty)
        if tl.program_id(2) == 0:
            tl.store(y_ptr + offs_b[:, None].to(tl.int64) * N + offs_k[None, :], x, mask=bmask)
    y = _turn(x, sign_ptr, rot_scale, BLOCK_B, BLOCK_K, GROUP, PRECISION)
    tl.store(out_ptr + offs_b[:, None].to(tl.int64) * N + offs_k[None, :], y.to(out_ptr.dtype.element_ty), mask=bmask)


def sign_matrix(rot: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(S, c) with rot = c·S, S [d, d] float32 of ±1 on rot's device: how the kernels take a Hadamard rotation (made
    once per layer; refused for another matrix)."""
    host = rot.detach().float().cpu()
    c = float(host[0, 0].abs())
    sign = host / c
    if not torch.equal(sign.abs(), torch.ones_like(sign)):
        raise ValueError("the weight kernels rotate by Hadamard matrices (entries ±c) only")
    return sign.contiguous().to(rot.device), c


#: at 16 rows of 1,280–5,120 channels on an H100, 4 took 0.69–0.76× the time of 16 (2 and 8 in between)
NORM_ROWS = 4


def rotate_triton(x: torch.Tensor, rotation: tuple[torch.Tensor, float]) -> torch.Tensor:
    """x [B, N] with each group of d channels times c·S (``rotation`` = :func:`sign_matrix` of Πᵀ: x_rot = x_g Πᵀ),
    in x's dtype, one launch. Reference: ``QuantizedLinear.rotate_input``. With S [P, d, d] (P rotations of one
    scale c, as :func:`matmul_triton`'s parts take them): → [P, B, N]."""
    return _launch_rotate(x, rotation)[1]


def norm_rotate_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       rotation: tuple[torch.Tensor, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """y = layer_norm(x [B, N]; weight, bias, eps) in x's dtype, and y rotated as :func:`rotate_triton` rotates
    (→ [B, N] or [P, B, N]), in one launch. Reference: ``torch.nn.functional.layer_norm`` then
    :func:`rotate_triton`."""
    return _launch_rotate(x, rotation, (weight, bias, eps))


def _launch_rotate(x: torch.Tensor, rotation: tuple[torch.Tensor, float],
                   norm: tuple | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One :func:`_rotate_kernel` launch: (the normalized x or None, the rotation(s))."""
    b, n = x.shape
    sign = rotation[0]
    parts = sign.shape[0] if sign.dim() == 3 else 1
    group = sign.shape[-1]
    block_k = 256  # the largest power of two up to 256 dividing n
    while n % block_k:
        block_k //= 2
    if block_k < group:
        raise ValueError(f"input width {n} is not a multiple of the rotation group {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(*([parts] if sign.dim() == 3 else []), b, n, device=x.device, dtype=x.dtype)
    y = torch.empty(b, n, device=x.device, dtype=x.dtype) if norm is not None else None
    w, bias, eps = norm if norm is not None else (x, x, 0.0)
    block_b = NORM_ROWS if norm is not None else 16
    early = EARLY_DEPENDENTS if sm90(x.device) else 0
    _rotate_kernel[(triton.cdiv(b, block_b), n // block_k, parts)](x, sign, rotation[1], out, w, bias,
                                                                   out if y is None else y, eps, b, n, x.stride(0),
                                                                   BLOCK_B=block_b, BLOCK_K=block_k, GROUP=group,
                                                                   PRECISION=_precision(x), NORM=0 if y is None else n,
                                                                   EARLY=early > 0, DEPENDENT=early > 1,
                                                                   launch_pdl=early > 1, num_warps=4,
                                                                   enable_fp_fusion=FP_FUSION)
    return y, out


def _precision(t: torch.Tensor) -> str:
    """A dot's input precision for ``t``'s dtype: fp32 inputs in full (as the interpreter has only that)."""
    return "ieee" if interpreting() or t.dtype == torch.float32 else "tf32"
