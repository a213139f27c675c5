"""One experiment run → one result row (JSON, written atomically under ``out/<sweep>/<model>/<quant>.json``).

Within one process (Hydra's basic launcher runs a multirun's jobs in turn) the model and its K/V
samples are built once and shared by every method of the sweep.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from ..fasta import read_fastas
from ..io import atomic_write_text
from ..model.engine import TurboEsm
from ..model.evaluate import evaluate
from .config import ExperimentConf, ModelConf
from .methods import build_codecs, collect_kv


@functools.lru_cache(maxsize=4)
def _model(kind: str, path: str, layers: int, hidden: int, heads: int, seed: int, outliers: float = 0.0,
           outlier_seed: int = 0):
    from ..testing import plant_outliers, stress_esm2
    if kind == "stress":
        model = stress_esm2(layers=layers, hidden=hidden, heads=heads, seed=seed)
    else:
        from ..model.loading import load_esm
        model = load_esm(path)
    return plant_outliers(model, outliers, outlier_seed) if outliers else model


def _model_key(m: ModelConf) -> tuple:
    return (m.kind, m.path, m.layers, m.hidden, m.heads, m.seed, m.outliers, m.outlier_seed)


def load_model(m: ModelConf):
    return _model(*_model_key(m))


def row_path(out: str | Path, sweep: str, model: str, quant: str, data: str = "default") -> Path:
    """Where a run's row is written: ``out/<sweep>/<model>/<quant>.json`` (``<quant>@<data>.json`` for a
    calibration set other than the default)."""
    return Path(out) / sweep / model / (f"{quant}.json" if data == "default" else f"{quant}@{data}.json")


@functools.lru_cache(maxsize=4)
def _samples(model_key: tuple, files: tuple, tokens: int):
    model = _model(*model_key)
    return collect_kv(model, read_fastas(list(files)), tokens)


def run_experiment(cfg: ExperimentConf, write: bool = True) -> dict:
    from ..bench.timing import device_name
    torch.set_num_threads(cfg.hardware.threads)
    m = cfg.model
    model = load_model(m).to(cfg.hardware.device)
    cal = read_fastas(list(cfg.data.calibration))
    ev = read_fastas(list(cfg.data.evaluation))[:: cfg.data.eval_every]
    key = _model_key(m)
    start = time.perf_counter()
    codecs, info = build_codecs(cfg.quant, model, cal,
                                lambda: _samples(key, tuple(cfg.data.calibration), cfg.data.calibration_samples))
    fit_seconds = time.perf_counter() - start
    engine = TurboEsm(model)
    codecs = [c.to(cfg.hardware.device) for c in codecs]
    report = evaluate(engine, ev, cache=lambda i, h, d: codecs[i], prefix_fraction=cfg.eval.prefix_fraction,
                      max_steps=cfg.eval.max_steps, progress=False)
    mem = report["memory"]
    # all-in bits: per-token bytes plus any fixed per-sequence window, amortised over the mean held-out length
    context = sum(len(r.sequence) + 1 for r in ev) / len(ev)
    values = context * mem["layers"] * 2 * mem["heads"] * mem["head_dim"]
    all_in = 8 * (context * mem["bytes_per_token"] + mem["window_bytes"]) / values
    overall = report["overall"]
    row = dict(sweep=cfg.sweep, model=m.name, quant=cfg.quant.name, method=cfg.quant.method, data=cfg.data.name,
               head_dim=mem["head_dim"],
               bits_per_value=all_in, bits_per_value_per_token=mem["bits_per_value"], mean_context=context,
               bytes_per_token_per_layer=report["memory"]["bytes_per_token_per_layer"],
               decode_cos_mean=overall["decode_cos_mean"], decode_cos_worst_seq=overall["decode_cos_worst_seq"],
               decode_cos_min=overall["decode_cos_min"], decode_tail_share=overall["decode_tail_share"],
               top1_agreement=overall["top1_agreement"], logit_kl=overall["logit_kl"],
               attn_rel_err_mean=sum(report["layers"]["attn_rel_err"]) / len(report["layers"]["attn_rel_err"]),
               score_kl_mean=sum(report["layers"]["score_kl"]) / len(report["layers"]["score_kl"]),
               layers=report["layers"], groups=report["groups"], memory=report["memory"],
               fit_seconds=fit_seconds, device=device_name(cfg.hardware.device), **info)
    if write:
        path = row_path(cfg.out, cfg.sweep, m.name, cfg.quant.name, cfg.data.name)
        atomic_write_text(path, json.dumps(row, indent=1, sort_keys=True, default=float))
    return row
