"""Triton building blocks shared by the quantize-and-pack, decode and weight kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


#: every launch asks for floating-point contraction (a multiply and an add as one FMA) explicitly: the kernels were
#: tuned and validated with it, Triton's default until 3.9, which warns that 3.10 turns it off
FP_FUSION = True


#: the forms of GELU a kernel can compute (:func:`gelu`): ESM-2's erf GELU through libdevice's ``erff``, or through
#: the complementary error function's Chebyshev fit (one reciprocal, one exp2 and nine FMAs; relative error under
#: 1.2e-7 everywhere, so the fp16/bf16 result rounds as the exact GELU's but for the rare value within that of a
#: rounding boundary), or through the normal tail as exp2 of a polynomial of degree 10 (``"exp2poly"``: eleven FMAs,
#: one exp2, no reciprocal; relative error about 5e-6, so 19 of the 63,488 finite fp16 values round one unit in the
#: last place away from the exact GELU under Triton's interpreter, against the erfc form's 6 and libdevice's 328 by
#: up to two: ``tools/gelu_fit.py``); or GELU's tanh approximation (``F.gelu(approximate="tanh")``: one exp2, one
#: division and four multiplies or FMAs), a different function within 4.8e-4 of erf GELU (the largest difference
#: near x = 2.7); on the trained testbeds in float32 it moves the masked-LM perplexity by under 0.01%
#: (``tools/gelu_forms_fidelity.py``)
GELU_FORMS = {"erf": 0, "erfc": 1, "tanh": 2, "exp2poly": 3}
#: the form the kernels use unless a measured tile says otherwise (``kernels.gemm.TILES``; ``tools/tune_gemm.py
#: --gelu-forms`` times each in the FFN-up product)
GELU_FORM = "erfc"


@triton.jit
def gelu(x, FORM: tl.constexpr):
    """x·Φ(x) of float32 x (any shape), Φ the standard normal CDF: ``FORM`` 0 through libdevice's erf, 1 through
    Φ(-|x|) = erfc(|x|/√2)/2 = t·exp(-z² + P(t))/2 with z = |x|/√2, t = 1/(1 + z/2) and P of degree 9 (Numerical
    Recipes' ``erfcc``), whose error is relative in the tails too; 2: GELU's tanh approximation instead,
    x·(1 + tanh(u))/2 = x / (1 + exp(-2u)) with u = √(2/π)·(x + 0.044715·x³); 3: max(x, 0) − a·Φ(−a) with a = |x|
    and Φ(−a) = 2^P(2a/6 − 1) below a = 6 (0 from there: under fp16's smallest step), P of degree 10 fitted to
    log2 Φ(−a) (``tools/gelu_fit.py``), whose error is relative in the tails too."""
    if FORM == 0:
        y = x * 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif FORM == 2:  # -2u·log2(e) = -2√(2/π)·log2(e) · x·(1 + 0.044715·x²); x / inf = -0 far below zero
        y = tl.math.fdiv(x, 1.0 + tl.exp2(x * -2.302208198144325 * (1.0 + 0.044715 * x * x)))
    elif FORM == 3:
        a = tl.abs(x)
        u = a * 0.3333333333333333 - 1.0
        p = -0.0007272332441061735 * u + 0.0008886408759281039
        p = p * u + 0.0017659366130828857
        p = p * u - 0.006132118869572878
        p = p * u + 0.015279926359653473
        p = p * u - 0.03926163911819458
        p = p * u + 0.09225447475910187
        p = p * u - 0.20438537001609802
        p = p * u - 6.034056186676025
        p = p * u - 14.209527015686035
        p = p * u - 9.532934188842773
        y = tl.maximum(x, 0.0) - a * tl.where(a < 6.0, tl.exp2(p), 0.0)
    else:
        z = tl.abs(x) * 0.7071067811865476
        t = tl.math.fdiv(1.0, 1.0 + 0.5 * z)
        p = 0.17087277 * t - 0.82215223
        p = p * t + 1.48851587
        p = p * t - 1.13520398
        p = p * t + 0.27886807
        p = p * t - 0.18628806
        p = p * t + 0.09678418
        p = p * t + 0.37409196
        p = p * t + 1.00002368
        p = p * t - 1.26551223
        tail = 0.5 * t * tl.exp2((p - z * z) * 1.4426950408889634)
        y = x * tl.where(x >= 0, 1.0 - tail, tail)
    return y


@triton.constexpr_function
def field_shift(fields, j):
    """Where field j (0…8; 8: the word's width) starts in a group word of the boundaries ``fields``
    (``esm_turbo.quant.packing.packed_shifts``), read at compile time: a constexpr inside a kernel."""
    return (fields >> (6 * j)) & 63


@triton.constexpr_function
def field_width(fields, j):
    """The width in bits of field j (0…7) of a group word of the boundaries ``fields``: a constexpr inside a
    kernel, so it can size a comparison loop or a mask."""
    return field_shift(fields, j + 1) - field_shift(fields, j)


@triton.jit
def token_offsets(h, offs_n, S, stride_b, stride_h, stride_s):
    """Element offsets (int64) of tokens ``offs_n`` (running over (b, s) of a [B, S] batch) of head ``h``
    in a [B, H, S, *] tensor with strides (stride_b, stride_h, stride_s) and a contiguous last dim."""
    b = (offs_n // S).to(tl.int64)
    return b * stride_b + h.to(tl.int64) * stride_h + (offs_n % S).to(tl.int64) * stride_s


@triton.jit
def split8(y):
    """y [N, G, 2, 2, 2] (channel 8g + 4a + 2b + c at [n, g, a, b, c]) → the 8 tensors [N, G] of channels
    8g + j, j = 0..7."""
    c0, c1 = tl.split(y)
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    y0, y4 = tl.split(c0b0)
    y2, y6 = tl.split(c0b1)
    y1, y5 = tl.split(c1b0)
    y3, y7 = tl.split(c1b1)
    return y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def group_dot(x, y):
    """Σ over the last two dims of x · y, x [N, G, 8] and y [1, G, 8] (or [N, G, 8]) → [N]: each group's eight
    products added in one chain (a multiply and seven multiply-adds), then the groups. ``tl.sum`` adds a thread's
    values in a tree, whose pairs cost an add for every second product (SASS sm_90)."""
    n: tl.constexpr = x.shape[0]
    g: tl.constexpr = x.shape[1]
    p0, p1, p2, p3, p4, p5, p6, p7 = split8(tl.reshape(x * y, (n, g, 2, 2, 2)))
    return tl.sum(((((((p0 + p1) + p2) + p3) + p4) + p5) + p6) + p7, axis=1)


@triton.jit
def load_rows(x_ptr, offs, nmask, D: tl.constexpr):
    """Rows of x at element offsets ``offs`` [BLOCK_N] (a contiguous last dim of D): [BLOCK_N, D] in x's dtype,
    zeros where ``nmask`` is False."""
    offs_d = tl.arange(0, D)
    return tl.load(x_ptr + offs[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)


@triton.jit
def rotate(x, rot_ptr, rows, D: tl.constexpr, PRECISION: tl.constexpr, SPLIT16: tl.constexpr):
    """x [BLOCK_N, D] (any float dtype) times rows ``rows`` [E] of Π of one head: x Π[rows]ᵀ [BLOCK_N, E]
    float32 on tensor cores (BLOCK_N ≥ 16). ``rot_ptr`` → Π [D, D] float32, or with ``SPLIT16 == 2`` its fp16
    halves [2, D, D] (``esm_turbo.ops.compressed.split_rotation``).

    ``SPLIT16`` (fp16 x, which fp16 holds exactly): Π = Π_hi + Π_lo / 2048 in two fp16 halves, two fp16
    dots with fp32 accumulation — as accurate as fp32 and cheaper than tf32x3; 1: split here, 2: read split."""
    at = rows[:, None] * D + tl.arange(0, D)[None, :]  # Π[e, d]
    if SPLIT16 == 2:
        hi = tl.load(rot_ptr + at)
        lo = tl.load(rot_ptr + D * D + at)
    elif SPLIT16:
        rot = tl.load(rot_ptr + at)
        hi = rot.to(tl.float16)
        lo = ((rot - hi.to(tl.float32)) * 2048.0).to(tl.float16)
    if SPLIT16:
        y = tl.dot(x, tl.trans(lo)) * (1.0 / 2048.0)
        y = tl.dot(x, tl.trans(hi), y)
    else:
        y = tl.dot(x.to(tl.float32), tl.trans(tl.load(rot_ptr + at)), input_precision=PRECISION)
    return y


def token_strides(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A [B, H, S, d] tensor whose last dim is contiguous (copied only if it is not) and its
    (b, h, s) strides — post-RoPE keys and values are transposed views the kernels read in place."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, (t.stride(0), t.stride(1), t.stride(2))


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``: CPU tensors, no PTX)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _device_properties(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def _cuda_properties(index: int | None) -> tuple[int, int]:
    """(major compute capability, multiprocessors) of CUDA device ``index`` (None: the current one), asked once a
    device: the query costs microseconds a launch."""
    return _device_properties(torch.cuda.current_device() if index is None else index)


def sm90(device: torch.device) -> bool:
    """Whether kernels on ``device`` are compiled for compute capability 9.0 or later (CUDA, not Triton's
    interpreter): tensor descriptors (TMA), programmatic dependent launch, bulk prefetches."""
    return device.type == "cuda" and not interpreting() and _cuda_properties(device.index)[0] >= 9


def num_sms(device: torch.device) -> int:
    """The device's multiprocessors (a few on CPU: Triton's interpreter, in tests)."""
    if device.type != "cuda":
        return 4
    return _cuda_properties(device.index)[1]


def dot_precision(t: torch.Tensor) -> str:
    """fp32-accurate dots: tf32x3 on tensor cores on CUDA; ieee under Triton's interpreter (CPU tensors,
    in tests), which has no tf32x3."""
    return "tf32x3" if t.device.type == "cuda" else "ieee"


def part_or(part: torch.Tensor, stand_in: torch.Tensor) -> torch.Tensor:
    """A kernel's pointer to an optional part (separate sign bits, a field layout): the part, or when it is
    empty — the kernel is then compiled not to read it — any tensor standing in (e.g. the main part)."""
    return part if part.numel() > 0 else stand_in


def kernel_slots(k_slots: torch.Tensor | None, v_slots: torch.Tensor | None) -> bool:
    """Whether the fused kernels read or write slots (``esm_turbo.quant.slots``): both kinds' slot parts given (one
    slot a token, contiguous: [B, 1, T_cap, 1] or a paged pool's [slots, 1, block, 1]), or neither (None or empty)."""
    given = [t is not None and t.numel() > 0 for t in (k_slots, v_slots)]
    if not any(given):
        return False
    if not all(given) or any(t.shape[-1] != 1 or not t.is_contiguous() for t in (k_slots, v_slots)):
        raise ValueError("the fused kernels take one slot a token and kind, of keys and values both, contiguous")
    return True


def split16(x: torch.Tensor, precision: str) -> bool:
    return x.dtype == torch.float16 and precision != "ieee"


#: arrival counts of the launches that merge in their last program, kept zero between launches, per (device, stream)
_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def split_counters(n: int, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """At least ``n`` arrival counts (int32; or ``dtype``: a launch's zeroed scratch), all zero, for a launch whose last
    program to finish a unit of work merges it and zeroes its count again (``decode.small._small_kernel``, a split
    ``weights.matmul._dequant_matmul_kernel``, the quantize kernel's slots): one buffer per device, stream and dtype,
    so a step needs no memset launch (a tenth of the smallest step's time). Launches on one stream run in order and
    share it safely; a CUDA graph keeps the buffer of the stream it was captured on, so two graphs captured on one
    stream must not be replayed concurrently on different streams. A new buffer found missing during a capture is
    zeroed inside it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, dtype)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:  # graphs captured with it still point at it: never freed
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), device=device, dtype=dtype)
    return buf
