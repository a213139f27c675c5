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
from ..ops.reference import attend, teacher_forced_attention
from ..quant.codec import dense_codec
from .alphabet import alphabet, encode
from .attention import RunContext
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
    decode_cos_min: float  # the sequence's worst decode token
    top1_agreement: float
    logit_kl: float
    decode_tokens: int = 0
    decode_tail_share: float = 0.0  # share of its decode tokens with cos < TAIL_COS
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


#: a decode token whose final hidden state has cos under this against the reference is counted as a tail token
TAIL_COS = 0.95


@dataclass
class _Steps:
    """Per decode step: final hidden states and logits of both runs [N, D] / [N, V], and per layer the
    isolated attention-output error and score KL of each step ([L][N])."""

    hidden: torch.Tensor
    logits: torch.Tensor
    ref_hidden: torch.Tensor
    ref_logits: torch.Tensor
    layer_err: list[list[float]]
    layer_kl: list[list[float]]


def _kl_rows(p_ref: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(p_ref ‖ p) over the last dim, averaged over heads: [B, H, S, T] → [S] (B = 1)."""
    kl = (p_ref * (p_ref.clamp_min(1e-30).log() - p.clamp_min(1e-30).log())).sum(-1)
    return kl.mean(dim=(0, 1))


@torch.no_grad()
def _session_steps(engine: TurboEsm, seq: str, name: str, prefix: int, cache) -> _Steps:
    """The teacher-forced decode through :class:`DecodeSession`, one token a step (any codec)."""
    turbo = engine.session(cache)
    probe = _LayerProbe(turbo, engine.num_layers)
    turbo.start([seq[:prefix]], [name], recorder=probe.record_prefill)
    probe.shadow.commit(turbo.cache.lengths)
    turbo.probe = probe
    ref = engine.session("fp32")
    ref.start([seq[:prefix]], [name])
    alpha = alphabet()
    outs, refs = [], []
    for ch in seq[prefix:]:
        tok = torch.tensor([[alpha.get_idx(ch)]], device=engine.device)
        outs.append(turbo.step(tok))
        probe.shadow.commit(1)
        refs.append(ref.step(tok))
    cat = lambda xs, name: torch.cat([getattr(x, name)[0] for x in xs])  # noqa: E731
    return _Steps(cat(outs, "hidden"), cat(outs, "logits"), cat(refs, "hidden"), cat(refs, "logits"),
                  probe.err, probe.kl)


@torch.no_grad()
def _parallel_steps(engine: TurboEsm, seq: str, name: str, prefix: int, codecs: list) -> _Steps:
    """The same teacher-forced decode in two forward passes (compressed cache, then FP32 cache): each decode
    position attends to the tokens before it as the cache holds them and to itself exactly
    (:func:`~esm_turbo.ops.reference.teacher_forced_attention`). Per-layer errors as :class:`_LayerProbe`
    measures them: the compressed run's queries against its own exact K/V."""
    tokens, _ = encode([seq], [name], add_eos=False)
    tokens = tokens.to(engine.device)
    start = prefix + 1  # <cls> + the prefix residues are the prefill
    errs: list[list[float]] = [[] for _ in range(engine.num_layers)]
    kls: list[list[float]] = [[] for _ in range(engine.num_layers)]

    def run(layer_codecs, probe: bool):
        def attend(layer, q, k, v):
            codec = layer_codecs[layer]
            k_c, v_c = codec.decode(codec.encode(k, v))
            window = getattr(codec, "window", 0)
            out, p = teacher_forced_attention(q, k, v, k_c, v_c, start, window, k.half(), v.half(),
                                              return_probs=True)
            if probe:
                ref, p_ref = teacher_forced_attention(q, k, v, k, v, start, return_probs=True)
                d_out, d_ref = out[..., start:, :], ref[..., start:, :]
                err = (d_out - d_ref).pow(2).sum(dim=(0, 1, 3)).sqrt() / d_ref.pow(2).sum(dim=(0, 1, 3)).sqrt()
                errs[layer] += err.clamp_min(0).tolist()
                kls[layer] += _kl_rows(p_ref[..., start:, :], p[..., start:, :]).tolist()
            return out

        with engine.context(RunContext(mode="custom", attend=attend)):
            hidden = engine.base(input_ids=tokens).last_hidden_state[0, start:]
        return hidden.float(), engine.model.lm_head(hidden).float()

    hidden, logits = run(codecs, True)
    ref_hidden, ref_logits = run(engine.codecs("fp32"), False)
    return _Steps(hidden, logits, ref_hidden, ref_logits, errs, kls)


@torch.no_grad()
def evaluate_sequence(engine: TurboEsm, record: Record, cache: str | Callable = "turbo",
                      prefix_fraction: float = 0.5, max_steps: int | None = None,
                      group: str = "", parallel: bool = True) -> SequenceResult:
    """Prefill the first ``prefix_fraction`` of ``record`` exactly, decode the rest (at most ``max_steps``) one
    token a step, teacher-forced, from a compressed and an FP32 cache side by side. ``parallel`` computes every
    step at once (the same numbers, tested; much faster); a sequence holding ``<mask>`` tokens (token dropout
    rescales by the mask share so far) always goes through the session."""
    seq = record.sequence
    prefix = max(1, min(len(seq) - 1, math.ceil(prefix_fraction * len(seq))))
    seq = seq[: prefix + max_steps] if max_steps else seq
    tokens, mask = encode([seq[:prefix]], [record.id], add_eos=False)
    tokens, mask = tokens.to(engine.device), mask.to(engine.device)
    with engine.original():
        ref_prefill = engine.model(input_ids=tokens, attention_mask=mask).logits.float()
    codecs = engine.codecs(cache)
    turbo_start = engine.session(cache)
    out = turbo_start.start([seq[:prefix]], [record.id])
    if parallel and alphabet().mask_idx not in encode([seq], [record.id])[0]:
        steps = _parallel_steps(engine, seq, record.id, prefix, codecs)
    else:
        steps = _session_steps(engine, seq, record.id, prefix, cache)
    cos = _cos(steps.hidden, steps.ref_hidden)
    if not cos.numel():
        raise ValueError(f"{record.id}: nothing to decode (max_steps {max_steps})")
    top1 = (steps.logits.argmax(-1) == steps.ref_logits.argmax(-1)).float()
    lp_ref, lp = F.log_softmax(steps.ref_logits, -1), F.log_softmax(steps.logits, -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return SequenceResult(
        id=record.id, group=group, length=len(record.sequence), prefix=prefix,
        prefill_cos=float(_cos(out.logits[0], ref_prefill[0]).min()),
        prefill_max_abs_diff=float((out.logits - ref_prefill).abs().max()),
        decode_cos_mean=float(cos.mean()), decode_cos_min=float(cos.min()),
        top1_agreement=float(top1.mean()), logit_kl=float(kl.mean()),
        decode_tokens=int(cos.numel()), decode_tail_share=float((cos < TAIL_COS).float().mean()),
        layer_attn_rel_err=[mean(e) for e in steps.layer_err], layer_score_kl=[mean(k) for k in steps.layer_kl])


def record_group(record: Record) -> str:
    """The ``class=`` tag of a calibration_data header (SCOP class), else ``""``."""
    for tok in record.description.split():
        if tok.startswith("class="):
            return tok[len("class="):]
    return ""


def evaluate(engine: TurboEsm, records: list[Record], cache: str | Callable = "turbo",
             prefix_fraction: float = 0.5, max_steps: int | None = None,
             progress: bool = True, parallel: bool = True) -> dict:
    """Evaluate every record (:func:`evaluate_sequence`); returns {"sequences": [...], "groups": {...},
    "overall": {...}, "layers": {...}, "memory": {...}}."""
    results = []
    for rec in tqdm(records, desc="evaluate", disable=not progress, unit="seq"):
        results.append(evaluate_sequence(engine, rec, cache, prefix_fraction, max_steps,
                                         record_group(rec), parallel))
    by_group: dict[str, list[SequenceResult]] = defaultdict(list)
    for r in results:
        by_group[r.group or "all"].append(r)
    def summary(rs: list[SequenceResult]) -> dict:
        tokens = sum(r.decode_tokens for r in rs)
        return {"n": len(rs), "prefill_cos": min(r.prefill_cos for r in rs),
                "prefill_max_abs_diff": max(r.prefill_max_abs_diff for r in rs),
                "decode_cos_mean": sum(r.decode_cos_mean for r in rs) / len(rs),
                "decode_cos_worst_seq": min(r.decode_cos_mean for r in rs),
                "decode_cos_min": min(r.decode_cos_min for r in rs),
                "decode_tail_share": sum(r.decode_tail_share * r.decode_tokens for r in rs) / max(1, tokens),
                "decode_tokens": tokens,
                "top1_agreement": sum(r.top1_agreement for r in rs) / len(rs),
                "logit_kl": sum(r.logit_kl for r in rs) / len(rs)}

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
    hdr = (f"{'group':<14}{'n':>4}{'prefill cos':>13}{'max|Δ|':>10}{'dec cos':>9}{'worst seq':>10}{'worst tok':>10}"
           f"{'<' + str(TAIL_COS):>7}{'top-1':>7}{'KL':>9}")
    lines += [hdr, "-" * len(hdr)]
    rows = list(report["groups"].items()) + [("overall", report["overall"])]
    for g, s in rows:
        lines.append(f"{g:<14}{s['n']:>4}{s['prefill_cos']:>13.6f}{s['prefill_max_abs_diff']:>10.2e}"
                     f"{s['decode_cos_mean']:>9.4f}{s['decode_cos_worst_seq']:>10.4f}{s['decode_cos_min']:>10.4f}"
                     f"{s['decode_tail_share']:>7.2%}{s['top1_agreement']:>7.3f}"
                     f"{s['logit_kl']:>9.2e}")
    lines.append(f"dec cos: mean over sequences of the decode tokens' final-state cos; worst seq: the lowest sequence "
                 f"mean; worst tok: the lowest token; <{TAIL_COS}: share of decode tokens under {TAIL_COS}")
    lines.append("")
    lines.append("layer  attn-out rel err  score KL")
    for i, (e, k) in enumerate(zip(report["layers"]["attn_rel_err"], report["layers"]["score_kl"])):
        lines.append(f"{i:>5}  {e:>16.4f}  {k:>8.2e}")
    m = report["memory"]
    lines.append("")
    lines.append(f"KV cache: {m['bytes_per_token_per_layer']:g} B/token/layer ({m['bits_per_value']:.3f} bits/value), "
                 f"{m['ratio_vs_fp32']:.2f}× vs FP32, {m['ratio_vs_fp16']:.2f}× vs FP16; "
                 f"codec tables {m['constant_bytes'] / 1e6:.2f} MB")
    return "\n".join(lines)
