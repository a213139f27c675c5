"""Calibration: stream post-RoPE K and V of ESM-2 over FASTA sets and fit the TurboESM tables.

Two passes over the sequences, never holding activations:

1. per (layer, head): XᵀX, Σx, count for K and for V → rotations Π (svd / svd-scaled / seeded);
2. per (layer, head): a 4096-bin histogram with exact per-bin sums of the rotated (and centred and
   scaled) values → weighted Lloyd-Max LUTs and sign-residual magnitudes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import __version__
from ..fasta import Record, records_hash
from ..quant.codec import KVCodec, VectorQuantizer
from ..quant.histogram import HistogramAccumulator
from ..quant.rotations import AffineStats, CovarianceAccumulator, build_rotation
from .alphabet import encode
from .attention import RunContext
from .checkpoint import Calibration, CalibrationConfig, quantizer_seed
from .engine import TurboEsm
from .loading import model_fingerprint

log = logging.getLogger(__name__)


def token_batches(records: list[Record], batch_tokens: int, max_tokens: int | None = None) -> list[list[Record]]:
    """Length-sorted batches of at most ``batch_tokens`` padded tokens (deterministic order)."""
    ordered = sorted(records, key=lambda r: (len(r.sequence), r.id))
    batches: list[list[Record]] = []
    cur: list[Record] = []
    seen = 0
    for rec in ordered:
        n = len(rec.sequence) + 2
        if max_tokens is not None and seen + n > max_tokens and (batches or cur):
            break
        if cur and (len(cur) + 1) * n > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(rec)
        seen += n
    if cur:
        batches.append(cur)
    return batches


def _run(engine: TurboEsm, batches: list[list[Record]], recorder, desc: str, progress: bool) -> int:
    tokens_seen = 0
    for batch in tqdm(batches, desc=desc, disable=not progress, unit="batch"):
        tokens, mask = encode([r.sequence for r in batch], [r.id for r in batch])
        tokens, mask = tokens.to(engine.device), mask.to(engine.device)
        with engine.context(RunContext(mode="prefill", recorder=recorder, valid=mask.bool())), torch.no_grad():
            engine.esm(input_ids=tokens, attention_mask=mask)
        tokens_seen += int(mask.sum())
    return tokens_seen


def _valid_values(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """y [B, H, S, d], valid [B, S] → [H, N·d] values of real tokens."""
    return y.permute(1, 0, 2, 3)[:, valid].reshape(y.shape[1], -1)


@torch.no_grad()
def calibrate(model, records: list[Record], config: CalibrationConfig = CalibrationConfig(),
              progress: bool = True, model_name: str = "") -> Calibration:
    """Fit per-layer TurboESM codecs for ``model`` (EsmForMaskedLM) on ``records``."""
    if not records:
        raise ValueError("calibration needs at least one sequence")
    engine = TurboEsm(model)
    layers, heads, dim = engine.num_layers, engine.heads, engine.head_dim
    batches = token_batches(records, config.batch_tokens, config.max_tokens)
    used = [r for b in batches for r in b]
    start = time.perf_counter()

    cov = {kind: [CovarianceAccumulator(heads, dim) for _ in range(layers)] for kind in "kv"}

    def record_cov(layer, k, v, valid):
        cov["k"][layer].add(k, valid)
        cov["v"][layer].add(v, valid)

    n_tokens = _run(engine, batches, record_cov, "calibrate 1/2 (rotations)", progress)

    rotation = {"k": config.key_rotation, "v": config.value_rotation}
    affine: dict[str, list[AffineStats]] = {
        kind: [build_rotation(rotation[kind], heads, dim, quantizer_seed(config, li, kind), cov[kind][li])
               for li in range(layers)] for kind in "kv"}
    hist = {kind: [HistogramAccumulator(10 * affine[kind][li].second_moments(cov[kind][li]).amax(-1).sqrt(),
                                        config.bins) for li in range(layers)] for kind in "kv"}

    def record_hist(layer, k, v, valid):
        for kind, x in (("k", k), ("v", v)):
            hist[kind][layer].add(_valid_values(affine[kind][layer].forward(x), valid))

    _run(engine, batches, record_hist, "calibrate 2/2 (LUTs)", progress)

    bits = {"k": config.key_bits, "v": config.value_bits}
    codecs = []
    for li in range(layers):
        points = {kind: [hist[kind][li].points(h) for h in range(heads)] for kind in "kv"}
        shared = None
        if config.shared_lut:  # ablation: one LUT per head fitted on K and V together
            shared = [tuple(np.concatenate(pair) for pair in zip(pk, pv))
                      for pk, pv in zip(points["k"], points["v"])]
        pair = [VectorQuantizer.from_calibration(affine[kind][li], points[kind], bits[kind], config.residual,
                                                 config.sign_mode, quantizer_seed(config, li, kind), shared)
                for kind in "kv"]
        codecs.append(KVCodec(*pair).to(engine.device))
    elapsed = time.perf_counter() - start
    log.info("calibrated %d layers × %d heads on %d tokens in %.1f s", layers, heads, n_tokens, elapsed)
    meta = dict(layers=layers, heads=heads, head_dim=dim, model_fingerprint=model_fingerprint(model),
                model_name=str(model_name), calibration_set_sha256=records_hash(used),
                calibration_sequences=len(used), calibration_tokens=n_tokens, esm_turbo_version=__version__)
    cal = Calibration(codecs, replace(config), meta)
    cal.seconds = elapsed
    return cal
