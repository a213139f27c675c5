"""Per-layer codecs for each KV-compression method of a sweep (see :class:`.config.QuantConf`)."""

from __future__ import annotations

import functools

import torch

from ..fasta import Record
from ..model.calibrate import _run, token_batches
from ..model.engine import TurboEsm
from ..quant.codec import KVCodec, VectorQuantizer
from ..quant.predict import Unstored
from ..quant.registry import MethodRequest, build_codecs as registry_build
from .config import QuantConf


@torch.no_grad()
def collect_kv(model, records: list[Record], max_tokens: int, queries: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """Post-RoPE keys and values of up to ``max_tokens`` real tokens per layer: [(k [H,N,d], v [H,N,d])], with
    ``queries`` the layer's queries first: [(q, k, v)]."""
    engine = TurboEsm(model)
    store: dict[int, list] = {i: [] for i in range(engine.num_layers)}

    def record(layer, q, k, v, valid):
        store[layer].append([x.float().permute(1, 0, 2, 3)[:, valid].cpu() for x in ((q, k, v) if queries else (k, v))])

    _run(engine, token_batches(records, 8192, max_tokens), record, "collect K/V", progress=False)
    return [tuple(torch.cat(kind, dim=1) for kind in zip(*store[layer])) for layer in range(engine.num_layers)]


def build_codecs(q: QuantConf, model, calibration: list[Record], samples_fn) -> tuple[list[KVCodec], dict]:
    """(codecs per layer, extra info such as calibration seconds) of ``q.method`` from the registry
    (:mod:`esm_turbo.quant.registry`). ``samples_fn()`` gives the collected K/V samples (only called for methods
    that fit on them)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    request = MethodRequest(heads, cfg.hidden_size // heads, cfg.num_hidden_layers, q, samples_fn, model, calibration)
    return registry_build(q.method, request)


def layout_codecs(q: QuantConf, heads: int, dim: int) -> KVCodec:
    """One layer's codec with the right byte layout but unfitted tables (memory accounting only)."""
    fake = torch.randn(heads, 512, dim)
    model_cfg = type("C", (), {"num_hidden_layers": 1, "num_attention_heads": heads,
                               "hidden_size": heads * dim, "model_type": "esm"})
    if q.method == "turboesm":
        cc = q.calibration_config(model_cfg).resolved()
        mk = functools.partial(VectorQuantizer, heads, dim, residual=cc.residual)
        return KVCodec(mk(cc.key_index_bits), mk(cc.value_index_bits) if cc.value_index_bits else Unstored(heads, dim))
    codecs, _ = build_codecs(q, type("M", (), {"config": model_cfg})(), [], lambda: [(fake, fake)])
    return codecs[0]
