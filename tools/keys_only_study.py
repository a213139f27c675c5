"""Study: a keys-only cache for ESM-2. Keys and values of a layer are both linear in the same normalised hidden state
(k = h·Wkᵀ + bk, v = h·Wvᵀ + bv, Wk square), so v = (k − bk)·M + bv with M = Wk⁻ᵀ·Wvᵀ: the values need not be stored.
The cache keeps the keys only, at more bits, and decodes each value from its decoded key (RoPE undone at the key's
position). Attention is linear in the values, so a kernel could apply M once per query to the attention-weighted
keys; here the PyTorch path decodes the values outright (the same numbers up to rounding).

The map from the weights fails: Wk is ill-conditioned (cond 10³–10⁴), so the keys' coding error comes back
amplified in the values. What works is the library's own: ``calibrate --predict-values`` with ``value_index_bits 0``
(``esm_turbo.quant.predict.Unstored``), a map fitted by least squares on the *decoded* keys of the calibration set —
it learns to read through their coding error. ``--fitted`` measures that alone (``--key-bits``: the keys' index bits,
+ a sign bit).

Measured against the default recipe at the same all-in bits (PyTorch path, CPU):

    python tools/keys_only_study.py ../shared/testbed/esm2_d64_trained --out R.txt
    python tools/keys_only_study.py ../shared/testbed/esm2_8M_trained --fitted --key-bits 3 4 --out R.txt
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from esm_turbo import TurboEsm, calibrate
from esm_turbo.model.recipe import recipe
from esm_turbo.quant.codec import KVCodec, dense_codec
from study_common import data_flags, measure, parse, stream


class _Nothing(nn.Module):
    """A value quantizer that stores nothing (the values come from the keys)."""

    def __init__(self, heads: int, dim: int):
        super().__init__()
        self.heads, self.dim = heads, dim

    def part_specs(self) -> dict:
        return {}

    def encode(self, x: torch.Tensor) -> dict:
        return {}


def _unrotate(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """ESM-2's rotary embedding undone: x [B, H, T, d] post-RoPE at positions 0..T-1 → pre-RoPE, with the model's own
    inverse frequencies (a checkpoint's stored buffer, which may differ from 10000^(−2i/d) in its last digits)."""
    d, t = x.shape[-1], x.shape[-2]
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq.double())
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos - torch.cat([-x2, x1], -1) * sin


class KeysOnlyCodec(KVCodec):
    """``inner``'s key codes only; values decoded as (k̂_pre − bk)·M + bv (module docstring)."""

    def __init__(self, inner: KVCodec, m: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor, inv_freq: torch.Tensor):
        super().__init__(inner.key, _Nothing(inner.key.heads, inner.key.dim))
        self.m, self.bk, self.bv, self.inv_freq = m, bk, bv, inv_freq

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k_hat = self.key.decode({n[2:]: t for n, t in parts.items() if n.startswith("k.")})
        b, h, t, d = k_hat.shape
        pre = _unrotate(k_hat.double(), self.inv_freq).permute(0, 2, 1, 3).reshape(b, t, h * d)
        v = (pre - self.bk) @ self.m + self.bv  # [B, T, H·d]
        return k_hat, v.reshape(b, t, h, d).permute(0, 2, 1, 3).to(k_hat.dtype)


def value_maps(model) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (M, bk, bv, inv_freq), M, bk, bv in float64: v = (k_pre − bk)·M + bv."""
    out = []
    for layer in model.esm.encoder.layer:
        attn = layer.attention.self
        wk, wv = attn.key.weight.detach().double(), attn.value.weight.detach().double()
        m = torch.linalg.solve(wk.T, wv.T)  # Wk⁻ᵀ·Wvᵀ
        out.append((m, attn.key.bias.detach().double(), attn.value.bias.detach().double(),
                    model.esm.rotary_embeddings.inv_freq.detach()))
    return out


def fitted(args, model, cal_records, eval_records) -> None:
    """The library's keys-alone caches (values not stored, a map fitted on decoded keys) at ``--key-bits``."""
    t0 = time.time()
    group = "" if args.predict_group == "all" else f" --predict-group {args.predict_group}"
    lines = [f"# python tools/keys_only_study.py {args.model} --fitted --key-bits "
             f"{' '.join(map(str, args.key_bits))}{group}{data_flags(args)}",
             f"# {len(eval_records)} held-out sequences, half prefilled exactly, the rest decoded; PyTorch path, CPU. "
             "Values not stored: calibrate --predict-values with value_index_bits 0 (a map a layer fitted by least "
             "squares on the calibration set's decoded keys, before RoPE); explained: the share of the values' "
             "variance the map predicts, per layer",
             f"{'cache':34} {'all-in':>6} {'mean cos':>9} {'worst seq':>9} {'worst tok':>9} {'<0.95':>6}  explained"]
    for kb in args.key_bits:
        cal = calibrate(model, cal_records, recipe("default", predict_values=True, key_index_bits=kb,
                                                   value_index_bits=0, predict_group=args.predict_group),
                        progress=False)
        r = measure(TurboEsm(model, cal), eval_records, cal.codecs)
        explained = ", ".join(f"{e:.4f}" for e in cal.meta["value_prediction_explained"])
        lines.append(f"{f'keys only, keys at {kb}+1, map fitted':34} {r['bits']:>6.3f} {r['mean']:>9.4f} "
                     f"{r['worst']:>9.4f} {r['token']:>9.4f} {r['tail']:>6.2%}  {explained}")
        print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
    stream(lines, args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fitted", action="store_true", help="only the library's keys-alone caches (a fitted map)")
    ap.add_argument("--key-bits", type=int, nargs="+", default=[3, 4], help="with --fitted: the keys' index bits")
    ap.add_argument("--predict-group", default="all", help="with --fitted: calibrate --predict-group (all, walk, N)")
    args, model, cal_records, eval_records = parse(ap)
    if args.fitted:
        fitted(args, model, cal_records, eval_records)
        return
    maps = value_maps(model)
    conds = [float(torch.linalg.cond(layer.attention.self.key.weight.detach().double()))
             for layer in model.esm.encoder.layer]
    t0 = time.time()
    lines = [f"# python tools/keys_only_study.py {args.model}",
             f"# {len(eval_records)} held-out sequences, half prefilled exactly, the rest decoded; PyTorch path, CPU. "
             "cond(Wk) per layer: " + ", ".join(f"{c:.0f}" for c in conds),
             f"{'cache':34} {'all-in':>6} {'mean cos':>9} {'worst seq':>9} {'worst tok':>9} {'<0.95':>6}"]
    runs = [("default, keys and values", recipe("default", index_bits=b), False) for b in (1, 2, 3)]
    runs += [(f"keys only, keys at {kb}+1", recipe("default", key_index_bits=kb, value_index_bits=1,
                                                  split="as-given"), True) for kb in (2, 3, 4)]
    runs.append(("keys only, keys exact (fp32)", None, True))  # what the map alone loses
    heads = model.config.num_attention_heads
    for label, cfg, keys_only in runs:
        cal = calibrate(model, cal_records, cfg, progress=False) if cfg is not None else None
        inner = cal.codecs if cal is not None else [dense_codec(heads, model.config.hidden_size // heads)] * len(maps)
        codecs = [KeysOnlyCodec(c, *mp) for c, mp in zip(inner, maps)] if keys_only else inner
        engine = TurboEsm(model, cal) if cal is not None else TurboEsm(model)
        r = measure(engine, eval_records, codecs)
        lines.append(f"{label:34} {r['bits']:>6.3f} {r['mean']:>9.4f} {r['worst']:>9.4f} {r['token']:>9.4f} "
                     f"{r['tail']:>6.2%}")
        print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
    stream(lines, args.out)


if __name__ == "__main__":
    main()
