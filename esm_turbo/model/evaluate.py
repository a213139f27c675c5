"""Fidelity of a compressed cache against the FP32-cache reference, per sequence and per layer.

For each sequence: prefill the first ``prefix_fraction`` of residues (checked against the unmodified
model), then feed the remaining residues one step at a time (teacher-forced) to a compressed-cache
session and an FP32-cache session side by side, comparing final hidden states (cos), logits
(top-1 agreement, KL(ref‖turbo)) and — isolated per layer, on the same queries — attention outputs
(relative error) and attention-score distributions (KL) of the compressed prefix vs the exact one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..cache import KVCache
from ..fasta import Record
from ..ops.reference import attend
from ..quant.codec import dense_codec
from .alphabet import alphabet, encode
from .engine import TurboEsm


@dataclass
class SequenceResult:
    id: str
    group: str
    length: int
    prefix: int
    prefill_cos: float
    prefill_max_abs_diff: float
    decode_cos_mean: float
    decode_cos_min: float
    top1_agreement: float
    logit_kl: float
    layer_attn_rel_err: list[float] = field(default_factory=list)
    layer_score_kl: list[float] = field(default_factory=list)


class _LayerProbe:
    """Per-layer isolated errors: the compressed prefix vs an exact FP32 mirror, same queries."""

    def __init__(self, session, layers: int):
        self.session = session
        self.shadow: KVCache | None = None
        self.err = [[] for _ in range(layers)]
        self.kl = [[] for _ in range(layers)]

    def record_prefill(self, layer, q, k, v, valid):
        if self.shadow is None:
            cache = self.session.cache
            self.shadow = KVCache([dense_codec(cache.heads, cache.head_dim).to(cache.device)
                                   for _ in range(cache.num_layers)], cache.batch_size, cache.capacity, cache.device)
        self.shadow.write(layer, k, v)

    def __call__(self, layer, q, k, v, out):
        cache = self.session.cache
        valid_new = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
        k_ref, v_ref, pv = self.shadow.dequantize(layer)
        ref, p_ref = attend(q, k_ref, v_ref, pv, k, v, valid_new, return_probs=True)
        k_hat, v_hat, pv_hat = cache.dequantize(layer)
        _, p_hat = attend(q, k_hat, v_hat, pv_hat, k, v, valid_new, return_probs=True)
        self.err[layer].append(float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)))
        kl = (p_ref * (p_ref.clamp_min(1e-30).log() - p_hat.clamp_min(1e-30).log())).sum(-1)
        self.kl[layer].append(float(kl.mean()))
        self.shadow.write(layer, k, v)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


@torch.no_grad()
def evaluate_sequence(engine: TurboEsm, record: Record, cache: str | Callable = "turbo",
                      prefix_fraction: float = 0.5, max_steps: int | None = None,
                      group: str = "") -> SequenceResult:
    seq = record.sequence
    prefix = max(1, min(len(seq) - 1, math.ceil(prefix_fraction * len(seq))))
    tokens, mask = encode([seq[:prefix]], [record.id], add_eos=False)
    tokens, mask = tokens.to(engine.device), mask.to(engine.device)
    with engine.original():
        ref_prefill = engine.model(input_ids=tokens, attention_mask=mask).logits.float()

    turbo = engine.session(cache)
    probe = _LayerProbe(turbo, engine.num_layers)
    out = turbo.start([seq[:prefix]], [record.id], recorder=probe.record_prefill)
    probe.shadow.commit(turbo.cache.lengths)
    turbo.probe = probe
    ref = engine.session("fp32")
    ref.start([seq[:prefix]], [record.id])

    cos, top1, kls = [], [], []
    rest = seq[prefix:][: max_steps] if max_steps else seq[prefix:]
    alpha = alphabet()
    for ch in rest:
        tok = torch.tensor([[alpha.get_idx(ch)]], device=engine.device)
        a = turbo.step(tok)
        probe.shadow.commit(1)
        b = ref.step(tok)
        cos.append(float(_cos(a.hidden, b.hidden).mean()))
        top1.append(float((a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean()))
        lp_ref, lp = F.log_softmax(b.logits, -1), F.log_softmax(a.logits, -1)
        kls.append(float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean()))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return SequenceResult(
        id=record.id, group=group, length=len(seq), prefix=prefix,
        prefill_cos=float(_cos(out.logits[0], ref_prefill[0]).min()),
        prefill_max_abs_diff=float((out.logits - ref_prefill).abs().max()),
        decode_cos_mean=mean(cos), decode_cos_min=min(cos) if cos else float("nan"),
        top1_agreement=mean(top1), logit_kl=mean(kls),
        layer_attn_rel_err=[mean(e) for e in probe.err], layer_score_kl=[mean(k) for k in probe.kl])


def record_group(record: Record) -> str:
    """The ``class=`` tag of a calibration_data header (SCOP class), else ``""``."""
    for tok in record.description.split():
        if tok.startswith("class="):
            return tok[len("class="):]
    return ""


def evaluate(engine: TurboEsm, records: list[Record], cache: str | Callable = "turbo",
             prefix_fraction: float = 0.5, max_steps: int | None = None,
             progress: bool = True) -> dict:
    """Evaluate every record; returns {"sequences": [...], "groups": {...}, "layers": {...}, "memory": {...}}."""
    results = []
    for rec in tqdm(records, desc="evaluate", disable=not progress, unit="seq"):
        results.append(evaluate_sequence(engine, rec, cache, prefix_fraction, max_steps,
                                         record_group(rec)))
    by_group: dict[str, list[SequenceResult]] = defaultdict(list)
    for r in results:
        by_group[r.group or "all"].append(r)
    keys = ("prefill_cos", "decode_cos_mean", "decode_cos_min", "top1_agreement", "logit_kl")

    def summary(rs: list[SequenceResult]) -> dict:
        out = {"n": len(rs)}
        for k in keys:
            vals = [getattr(r, k) for r in rs]
            out[k] = min(vals) if k in ("prefill_cos", "decode_cos_min") else sum(vals) / len(vals)
        out["prefill_max_abs_diff"] = max(r.prefill_max_abs_diff for r in rs)
        return out

    layers = len(results[0].layer_attn_rel_err)
    empty = KVCache(engine.codecs(cache), 1, capacity=1, device=engine.device)  # bytes come from the layout
    return {
        "sequences": [asdict(r) for r in results],
        "groups": {g: summary(rs) for g, rs in sorted(by_group.items())},
        "overall": summary(results),
        "layers": {"attn_rel_err": [sum(r.layer_attn_rel_err[i] for r in results) / len(results) for i in range(layers)],
                   "score_kl": [sum(r.layer_score_kl[i] for r in results) / len(results) for i in range(layers)]},
        "memory": empty.memory_report().to_dict(),
    }


def format_table(report: dict, title: str = "") -> str:
    """A Table-1-like text table: one row per group, then per-layer errors and memory."""
    lines = [title] if title else []
    hdr = f"{'group':<14}{'n':>4}{'prefill cos':>13}{'max|Δ|':>10}{'dec cos':>9}{'min cos':>9}{'top-1':>7}{'KL':>9}"
    lines += [hdr, "-" * len(hdr)]
    rows = list(report["groups"].items()) + [("overall", report["overall"])]
    for g, s in rows:
        lines.append(f"{g:<14}{s['n']:>4}{s['prefill_cos']:>13.6f}{s['prefill_max_abs_diff']:>10.2e}"
                     f"{s['decode_cos_mean']:>9.4f}{s['decode_cos_min']:>9.4f}{s['top1_agreement']:>7.3f}"
                     f"{s['logit_kl']:>9.2e}")
    lines.append("")
    lines.append("layer  attn-out rel err  score KL")
    for i, (e, k) in enumerate(zip(report["layers"]["attn_rel_err"], report["layers"]["score_kl"])):
        lines.append(f"{i:>5}  {e:>16.4f}  {k:>8.2e}")
    m = report["memory"]
    lines.append("")
    lines.append(f"KV cache: {m['bytes_per_token_per_layer']} B/token/layer ({m['bits_per_value']:.3f} bits/value), "
                 f"{m['ratio_vs_fp32']:.2f}× vs FP32, {m['ratio_vs_fp16']:.2f}× vs FP16; "
                 f"codec tables {m['constant_bytes'] / 1e6:.2f} MB")
    return "\n".join(lines)
