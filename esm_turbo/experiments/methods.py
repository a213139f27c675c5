"""Per-layer codecs for each KV-compression method of a sweep (see :class:`.config.QuantConf`)."""

from __future__ import annotations

import functools

import torch

from ..fasta import Record
from ..model.calibrate import _run, calibrate, token_batches
from ..model.engine import TurboEsm
from ..quant.codec import KVCodec, VectorQuantizer, dense_codec
from ..quant.fit import oblivious_codec
from ..quant.methods import AffineIntQuantizer, Fp8Quantizer, OutlierSplitQuantizer, RVQQuantizer
from ..schema import dtype_of
from .config import QuantConf

CALIBRATED = ("int", "turboesm", "outlier", "rvq")


@torch.no_grad()
def collect_kv(model, records: list[Record], max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE keys and values of up to ``max_tokens`` real tokens per layer: [(k [H,N,d], v [H,N,d])]."""
    engine = TurboEsm(model)
    store: dict[int, list] = {i: [] for i in range(engine.num_layers)}

    def record(layer, q, k, v, valid):
        for kind_i, x in enumerate((k, v)):
            rows = x.float().permute(1, 0, 2, 3)[:, valid]  # [H, N, d]
            store[layer].append((kind_i, rows.cpu()))

    _run(engine, token_batches(records, 8192, max_tokens), record, "collect K/V", progress=False)
    out = []
    for layer in range(engine.num_layers):
        k = torch.cat([t for i, t in store[layer] if i == 0], dim=1)
        v = torch.cat([t for i, t in store[layer] if i == 1], dim=1)
        out.append((k, v))
    return out


def _per_layer(samples, make_key, make_value, window: int = 0) -> list[KVCodec]:
    return [KVCodec(make_key(k), make_value(v), window=window) for k, v in samples]


def build_codecs(q: QuantConf, model, calibration: list[Record], samples_fn) -> tuple[list[KVCodec], dict]:
    """(codecs per layer, extra info such as calibration seconds). ``samples_fn()`` gives the collected
    K/V samples (only called for methods that fit on them)."""
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    dim = cfg.hidden_size // heads
    info: dict = {}
    if q.method == "dense":
        dtype = dtype_of(q.dtype)
        return [dense_codec(heads, dim, dtype) for _ in range(layers)], info
    if q.method == "fp8":
        return [KVCodec(Fp8Quantizer(heads, dim), Fp8Quantizer(heads, dim)) for _ in range(layers)], info
    if q.method == "turboquant":
        bits = q.bits or 3
        return [oblivious_codec(heads, dim, bits, "hadamard", q.residual or "none", seed=i)
                for i in range(layers)], info
    if q.method == "turboesm":
        cal = calibrate(model, calibration, q.calibration_config(), progress=False)
        info["calibration_seconds"] = cal.seconds
        return list(cal.codecs), info
    samples = samples_fn()
    if q.method == "int":
        return _per_layer(samples, lambda k: AffineIntQuantizer.fit(k, q.bits, "channel"),
                          lambda v: AffineIntQuantizer(heads, dim, q.bits, "token"), q.window), info
    if q.method == "outlier":
        n_out = max(1, round(q.outlier_frac * dim))
        return _per_layer(samples, lambda k: OutlierSplitQuantizer.fit(k, q.bits, q.outlier_bits, n_out),
                          lambda v: OutlierSplitQuantizer.fit(v, q.bits, q.outlier_bits, n_out)), info
    if q.method == "rvq":
        return _per_layer(samples, lambda k: RVQQuantizer.fit(k, q.depth, q.group, contiguous=False),
                          lambda v: RVQQuantizer.fit(v, q.depth, q.group, contiguous=True)), info
    raise ValueError(f"unknown method {q.method!r}")


def layout_codecs(q: QuantConf, heads: int, dim: int) -> KVCodec:
    """One layer's codec with the right byte layout but unfitted tables (memory accounting only)."""
    fake = torch.randn(heads, 512, dim)
    model_cfg = type("C", (), {"num_hidden_layers": 1, "num_attention_heads": heads,
                               "hidden_size": heads * dim})
    if q.method == "turboesm":
        cc = q.calibration_config().resolved()
        mk = functools.partial(VectorQuantizer, heads, dim, residual=cc.residual)
        return KVCodec(mk(cc.key_index_bits), mk(cc.value_index_bits))
    codecs, _ = build_codecs(q, type("M", (), {"config": model_cfg})(), [], lambda: [(fake, fake)])
    return codecs[0]
