"""Rotation comparison on planted-outlier keys: which recipe quantizes attention best?

Used by tests/test_rotations.py. Keys [N, d] get a few channels 20–100×
the rest; half of those channels are also used by the queries (they carry score signal), half are
function-preserving (the query's weight there is 1/s). Every recipe is fitted on one half of the
keys and scored on the other half, with one LUT per head and no residual, by relative key MSE and by
attention-score and attention-output error for the queries.
"""

from __future__ import annotations

import torch

from esm_turbo.quant.codec import VectorQuantizer
from esm_turbo.quant.fit import FitOptions, fit_quantizer as fit_codec
from esm_turbo.quant.histogram import HistogramAccumulator
from esm_turbo.quant.rotations import ROTATION_KINDS, CovarianceAccumulator, build_rotation


def planted_outlier_data(n: int = 4096, dim: int = 64, queries: int = 64, seed: int = 0,
                         scales: tuple[float, ...] = (20.0, 40.0, 70.0, 100.0)):
    """keys [n, d], values [n, d], queries [q, d] with planted outlier channels (see module doc)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, dim, generator=g) + 0.5 * torch.randn(1, dim, generator=g)
    q = torch.randn(queries, dim, generator=g)
    chans = torch.randperm(dim, generator=g)[: len(scales)]
    for j, (c, s) in enumerate(zip(chans.tolist(), scales)):
        keys[:, c] *= s
        if j % 2:  # used by the query: carries ~3 units of score signal, consistent in sign
            q[:, c] = 3.0 * dim**0.5 / s * (1 + 0.25 * torch.randn(queries, generator=g))
        else:  # function-preserving: W_q × 1/s
            q[:, c] /= s
    values = torch.randn(n, dim, generator=g)
    return keys, values, q * dim**-0.5


def fit_quantizer(train: torch.Tensor, kind: str, bits: int = 3, bins: int = 4096,
                  queries: torch.Tensor | None = None) -> VectorQuantizer:
    """Calibrate a one-head VectorQuantizer on train [N, d] with the given rotation kind (``svd-query`` also
    reads ``queries`` [M, d])."""
    x = train[None, :, :]  # [H=1, N, d]
    cov = CovarianceAccumulator(1, train.shape[1])
    cov.add(x)
    query_stats = None
    if queries is not None:
        query_stats = CovarianceAccumulator(1, train.shape[1])
        query_stats.add(queries[None])
    affine = build_rotation(kind, 1, train.shape[1], seed=0, stats=cov, queries=query_stats)
    hist = HistogramAccumulator(10 * affine.second_moments(cov).amax(-1).sqrt(), bins)
    hist.add(affine.forward(x).reshape(1, -1))
    return fit_codec(affine, hist.padded(), FitOptions(bits, residual="none"))


def score_recipe(kind: str, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, bits: int = 3) -> dict:
    half = keys.shape[0] // 2
    q = fit_quantizer(keys[:half], kind, bits, queries=queries)
    k = keys[half:][None]
    k_hat = q.decode(q.encode(k))[0]
    k = k[0]
    s, s_hat = queries @ k.T, queries @ k_hat.T
    p, p_hat = torch.softmax(s, -1), torch.softmax(s_hat, -1)
    v = values[half:]
    o, o_hat = p @ v, p_hat @ v
    return {"rotation": kind,
            "key_rel_mse": float(((k - k_hat) ** 2).sum() / (k**2).sum()),
            "score_rel_err": float((s - s_hat).norm() / s.norm()),
            "attn_out_rel_err": float((o - o_hat).norm() / o.norm()),
            "score_kl": float((p * (p.clamp_min(1e-30).log() - p_hat.clamp_min(1e-30).log())).sum(-1).mean())}


def compare_rotations(bits: int = 3, seed: int = 0, **data_kwargs) -> list[dict]:
    keys, values, queries = planted_outlier_data(seed=seed, **data_kwargs)
    return [score_recipe(kind, keys, values, queries, bits) for kind in ROTATION_KINDS]
