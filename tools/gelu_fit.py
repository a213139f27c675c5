"""The coefficients of the kernels' "exp2poly" form of GELU (``esm_turbo.kernels.common.GELU_FORMS``), and how it
rounds against the exact GELU over every finite fp16 and bf16 value beside the other forms.

The form: for a = |x| < A, the normal tail Φ(−a) = 2^P(u) with u = 2a/A − 1 ∈ [−1, 1) and P a polynomial of degree
``--degree`` fitted to log2 Φ(−a) (near-minimax: a Chebyshev least-squares fit reweighted towards its largest
errors); Φ(−a) = 0 from A on (at A = 6 it is 1e-9, so x·Φ(x) is below fp16's smallest step for every fp16 x there).
Then GELU(x) = max(x, 0) − a·Φ(−a), one FMA. The error is relative in the tails, as the erfc form's is:

    python tools/gelu_fit.py [--degree 10] [--limit 6]

prints P's coefficients (lowest power first, as float32) and, for the fitted P and each form the kernels compute, how
many fp16 and bf16 values round differently from the float64 GELU and by how many units in the last place at most
(the fitted P emulated in float32 with single-rounding FMAs, exp2 exact; the kernels' forms through their own code,
``kernels.activation.activation_triton``, under Triton's interpreter without a GPU).
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch

if not torch.cuda.is_available():  # the kernels' own forms run under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
from numpy.polynomial import chebyshev
from scipy.special import log_ndtr

F32 = np.float32


def fit(degree: int, limit: float) -> np.ndarray:
    """P's coefficients in u = 2a/limit − 1, lowest power first, float32."""
    a = np.linspace(0.0, limit, 200_001)
    target = log_ndtr(-a) / math.log(2)
    basis = chebyshev.chebvander(a * 2 / limit - 1, degree)
    weight = np.ones_like(a)
    for _ in range(60):
        coef, *_ = np.linalg.lstsq(basis * weight[:, None], target * weight, rcond=None)
        err = np.abs(basis @ coef - target)
        weight *= 1 + err / err.max()
        weight /= weight.mean()
    return chebyshev.cheb2poly(coef).astype(F32)


def _fma(a: np.ndarray, b, c) -> np.ndarray:
    """float32 a·b + c rounded once."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (a.astype(np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F32)


def exp2poly(x: np.ndarray, coef: np.ndarray, limit: float) -> np.ndarray:
    """GELU of float32 x in the exp2poly form, float32."""
    a = np.abs(x)
    u = _fma(a, F32(2 / limit), F32(-1))
    r = np.full_like(u, coef[-1])
    for c in coef[-2::-1]:
        r = _fma(r, u, c)
    with np.errstate(over="ignore"):
        tail = np.where(a < F32(limit), np.exp2(r.astype(np.float64)).astype(F32), F32(0))
    return _fma(-a, tail, np.maximum(x, F32(0)))


def kernel_form(form: str):
    """The kernels' GELU in ``form`` (``kernels.common.GELU_FORMS``) as the activation kernel computes it: a tensor of
    fp16/bf16 values → their GELU rounded to the same dtype."""
    from esm_turbo.kernels import activation

    def run(u: torch.Tensor) -> torch.Tensor:
        kept, activation.GELU_FORM = activation.GELU_FORM, form
        try:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            return activation.activation_triton(u.reshape(1, -1).to(dev), "gelu").reshape(-1).cpu()
        finally:
            activation.GELU_FORM = kept
    return run


def rounding(fn, dtype: torch.dtype) -> tuple[int, int, float, float]:
    """For ``fn`` taking a tensor of ``dtype`` values to their GELU in ``dtype``: (values that round differently
    from the float64 GELU, values, the largest difference in units in the last place, the largest |difference|) over
    every finite value of ``dtype`` (bf16: those under 10⁴ in magnitude)."""
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    u = bits[torch.isfinite(bits)]
    if dtype == torch.bfloat16:
        u = u[u.float().abs() < 1e4]
    got = fn(u)
    want = (u.double() * 0.5 * (1 + torch.erf(u.double() / math.sqrt(2)))).to(dtype)
    ulp = torch.nextafter(want.abs(), torch.tensor(math.inf, dtype=dtype)).float() - want.float().abs()
    diff = (got.float() - want.float()).abs()
    return int((got != want).sum()), len(u), float((diff / ulp).max()), float(diff.max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=10)
    ap.add_argument("--limit", type=float, default=6.0)
    args = ap.parse_args()
    coef = fit(args.degree, args.limit)
    print(f"degree {args.degree}, limit {args.limit}: coefficients (u^0 first)")
    print(", ".join(repr(float(c)) for c in coef))
    fitted = lambda u: torch.from_numpy(exp2poly(u.float().numpy(), coef, args.limit)).to(u.dtype)  # noqa: E731
    forms = {"fitted": fitted, **{f"kernel {f}": kernel_form(f) for f in ("exp2poly", "erfc", "erf")}}
    for name, fn in forms.items():
        for dtype in (torch.float16, torch.bfloat16):
            differ, n, worst, largest = rounding(fn, dtype)
            print(f"{name:15} {str(dtype).removeprefix('torch.'):9} differ on {differ:4} of {n} values, "
                  f"at most {worst:.3g} ulp, |difference| at most {largest:.2g}")


if __name__ == "__main__":
    main()
