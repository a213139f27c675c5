"""Measured codec quality on random unit vectors next to TurboQuant's bounds (``esm-turbo validate-codec``)."""

from __future__ import annotations

import math

import torch

from .fit import oblivious_quantizer


def validate_codec(bits: int, head_dim: int, n: int = 8192, seed: int = 0, rotation: str = "hadamard") -> dict:
    """MSE E‖x - x̂‖² over ``n`` random unit vectors (data-oblivious codec, no residual), the bounds
    4^-b ≤ MSE ≤ √3·π/2·4^-b, and the inner-product bias ⟨x, x̂⟩ - ⟨x, x⟩ (query = the vector
    itself, the case where an MSE quantizer's shrinkage shows) without and with QJL."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, head_dim, generator=gen)
    x = x / x.norm(dim=-1, keepdim=True)
    row = {"bits": bits, "head_dim": head_dim, "vectors": n,
           "mse_lower_bound": 4.0**-bits, "mse_upper_bound": math.sqrt(3) * math.pi / 2 * 4.0**-bits}
    for residual in ("none", "qjl"):
        q = oblivious_quantizer(1, head_dim, bits, rotation, residual, seed)
        xh = q.decode(q.encode(x))
        err = ((x - xh) ** 2).sum(-1)
        ip = (x * xh).sum(-1) - 1.0
        key = "" if residual == "none" else "_qjl"
        row[f"mse{key}"] = float(err.mean())
        row[f"ip_bias{key}"] = float(ip.mean())
        row[f"ip_bias_stderr{key}"] = float(ip.std() / math.sqrt(n))
        row[f"bytes_per_vector{key}"] = int(round(q.bits_per_value() * head_dim / 8))
    row["within_bounds"] = row["mse_lower_bound"] <= row["mse"] <= row["mse_upper_bound"]
    return row
