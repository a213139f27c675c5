"""Study: values coded as what their keys do not predict (AQUA-KV's idea), at the same bits all-in, PyTorch path,
CPU.

Per layer and head an affine map fitted by least squares on the calibration set predicts a token's value from its
decoded key, v ≈ k̂ W + b (k̂: the recipe's key codec, so encode and decode see the same key; ``--predictor all``:
from the token's decoded keys of every head); the value codec is then calibrated on the residuals v − (k̂ W + b)
(the calibration's own passes, their values replaced), and decode adds the prediction back. W and b are constants of
the layer, not bytes a token: the all-in bits are the recipe's. ``--predictor all-pre-rope`` (every head's keys
turned back before the rotary embedding) is the library's own ``calibrate --predict-values``
(``esm_turbo.quant.predict``), measured as a user calibrates it. Measured as the other studies measure, beside the
recipe itself at each ``--index-bits``.

    python tools/predicted_values_study.py ../shared/testbed/esm2_d64_trained --index-bits 1 2 --out R.txt
    python tools/predicted_values_study.py ../shared/testbed/esm2_8M_trained --index-bits 2 --predictor all-pre-rope
    python tools/predicted_values_study.py ../shared/testbed/esm2_8M_trained --index-bits 2 --groups 1 8

``--groups G``: the library's fit restricted to groups of G consecutive heads (``calibrate --predict-group G``: each
head's values from its group's keys before RoPE alone, W block-diagonal), as the one-pass walk pools them; with
``--keys-alone`` no value bytes, the keys at the same all-in bits (``--bits B --predict-values``' split).
"""

from __future__ import annotations

import argparse
import time

import torch
from study_common import data_flags, measure, parse, stream

import esm_turbo.model.calibrate as calibration
from esm_turbo import TurboEsm, calibrate
from esm_turbo.model.recipe import recipe
from esm_turbo.quant.codec import KVCodec


def features(k_hat: torch.Tensor, every_head: bool) -> torch.Tensor:
    """What predicts a head's values: its decoded keys k̂ [..., H, T, d], or (``every_head``) every head's keys of the
    token, [..., H, T, H·d] (the same for each head)."""
    if not every_head:
        return k_hat.float()
    heads = k_hat.shape[-3]
    flat = k_hat.float().transpose(-3, -2).flatten(-2)  # [..., T, H·d]
    return flat.unsqueeze(-3).expand(*flat.shape[:-2], heads, *flat.shape[-2:])


class PredictedValues(KVCodec):
    """A codec whose value parts hold v − (f(k̂) W + b): ``base``'s quantizers, W [H, e, d] and b [H, d] of the layer
    (e = d, or H·d from every head's keys)."""

    def __init__(self, base: KVCodec, w: torch.Tensor, b: torch.Tensor):
        super().__init__(base.key, base.value)
        self.register_buffer("w", w)
        self.register_buffer("b", b)

    def predict(self, k_hat: torch.Tensor) -> torch.Tensor:
        """k̂ [..., H, T, d] → the predicted values [..., H, T, d]."""
        x = features(k_hat, self.w.shape[1] != self.w.shape[2])
        return torch.einsum("...hte,hed->...htd", x, self.w) + self.b[:, None, :]

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = {f"k.{n}": t for n, t in self.key.encode(k).items()}
        k_hat = self.key.decode(self._sub(parts, "k."))
        parts.update({f"v.{n}": t for n, t in self.value.encode(v.float() - self.predict(k_hat)).items()})
        return parts

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k_hat = self.key.decode(self._sub(parts, "k."))
        return k_hat, self.predict(k_hat) + self.value.decode(self._sub(parts, "v."))


def affine_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least squares per head of y [H, N, d] ≈ x [H, N, e] W + b: (W [H, e, d], b [H, d])."""
    sol = torch.linalg.lstsq(torch.cat([x, torch.ones_like(x[..., :1])], -1), y).solution  # [H, e + 1, d]
    return sol[:, :-1].contiguous(), sol[:, -1].contiguous()


def fit_predictors(model, records, cal, every_head: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (W [H, e, d], b [H, d]): least squares of each head's values on its :func:`features` of the decoded
    keys (``cal``'s key codec) over ``records``."""
    stats: dict[int, list] = {}

    def record(layer, q, k, v, valid):
        key = cal.codecs[layer].key
        x = features(key.decode(key.encode(k)), every_head)
        stats.setdefault(layer, []).append((x.permute(1, 0, 2, 3)[:, valid], v.permute(1, 0, 2, 3)[:, valid].float()))

    calibration._run(TurboEsm(model), calibration.token_batches(records, 4096), record, "fit", False)
    out = []
    for layer in sorted(stats):
        x = torch.cat([a for a, _ in stats[layer]], 1)
        y = torch.cat([b for _, b in stats[layer]], 1)
        out.append(affine_fit(x, y))
    return out


def calibrate_residuals(model, records, cfg, cal, predictors):
    """``calibrate`` with every recorded value replaced by its residual v − (k̂ W + b)."""
    plain_run = calibration._run

    def run(engine, batches, recorder, desc, progress, values=None):
        def residual(layer, q, k, v, valid):
            key = cal.codecs[layer].key
            w, b = predictors[layer]
            x = features(key.decode(key.encode(k)), w.shape[1] != w.shape[2])
            pred = torch.einsum("bhse,hed->bhsd", x, w) + b[None, :, None, :]
            return recorder(layer, q, k, (v.float() - pred).to(v.dtype), valid)
        return plain_run(engine, batches, residual, desc, progress, values)

    calibration._run = run
    try:
        return calibrate(model, records, cfg, progress=False)
    finally:
        calibration._run = plain_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index-bits", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--predictor", choices=["own", "all", "all-pre-rope"], default="own",
                    help="values predicted from their own head's key, from every head's key of the token, or from "
                         "every head's key turned back before the rotary embedding")
    ap.add_argument("--groups", type=int, nargs="*", default=[],
                    help="instead of --predictor: each head's values from the keys of its group of G consecutive "
                         "heads alone (before RoPE), for each G given")
    ap.add_argument("--keys-alone", action="store_true",
                    help="with --groups: no value bytes (the prediction is the value), the keys at the same all-in "
                         "bits")
    ap.add_argument("--skip-recipe", action="store_true", help="with --groups: not the recipe's row beside them")
    args, model, cal_records, eval_records = parse(ap)
    if args.skip_recipe and not args.groups:
        ap.error("--skip-recipe: only with --groups")
    t0 = time.time()
    rows = []

    def show(row) -> None:
        label, r = row
        print(f"{label:40} {r['bits']:.3f} {r['mean']:.4f} {r['worst']:.4f} {r['token']:.3f} {r['tail']:.2%} "
              f"({time.time() - t0:.0f} s)", flush=True)
    for bits in args.index_bits:
        cfg = recipe("default", index_bits=bits)
        if not args.skip_recipe:
            cal = calibrate(model, cal_records, cfg, progress=False)
            engine = TurboEsm(model, cal)
            rows.append((f"recipe, {bits} index bits", measure(engine, eval_records, cal.codecs)))
            show(rows[-1])
        source = {"own": "k̂", "all": "every head's k̂", "all-pre-rope": "every head's k̂ before RoPE"}[args.predictor]
        for group in args.groups:  # the library's calibrate --predict-values --predict-group G
            split = dict(key_index_bits=2 * bits + 1, value_index_bits=0) if args.keys_alone else {}
            grouped = calibrate(model, cal_records, recipe("default", index_bits=None if split else bits,
                                                           predict_values=True, predict_group=str(group), **split),
                                progress=False)
            rows.append((f"values from groups of {group} heads' k̂ before RoPE, {bits} index bits"
                         + (" (keys alone)" if args.keys_alone else ""),
                         measure(TurboEsm(model, grouped), eval_records, grouped.codecs)))
            show(rows[-1])
        if args.groups:
            continue
        if args.predictor == "all-pre-rope":  # the library's calibrate --predict-values
            predicted = calibrate(model, cal_records, recipe("default", index_bits=bits, predict_values=True),
                                  progress=False)
            codecs = predicted.codecs
        else:
            predictors = fit_predictors(model, cal_records, cal, args.predictor == "all")
            res = calibrate_residuals(model, cal_records, cfg, cal, predictors)
            codecs = [PredictedValues(c, w, b) for c, (w, b) in zip(res.codecs, predictors)]
        rows.append((f"values from {source}, {bits} index bits", measure(engine, eval_records, codecs)))
        show(rows[-1])
    lines = [f"# python tools/predicted_values_study.py {args.model} --index-bits "
             f"{' '.join(map(str, args.index_bits))}"
             + (f" --predictor {args.predictor}" if args.predictor != "own" else "")
             + (f" --groups {' '.join(map(str, args.groups))}" if args.groups else "")
             + (" --keys-alone" if args.keys_alone else "") + (" --skip-recipe" if args.skip_recipe else "")
             + data_flags(args),
             f"# {len(eval_records)} held-out sequences, half prefilled exactly, the rest decoded; PyTorch path, CPU. "
             "values from k̂: each value coded as its residual after v ≈ k̂ W + b (per layer and head, least squares "
             "on the calibration set), the value codec calibrated on those residuals",
             f"{'codec':40} all-in  mean cos  worst seq  worst tok  <0.95"]
    for label, r in rows:
        lines.append(f"{label:40} {r['bits']:.3f}   {r['mean']:.4f}    {r['worst']:.4f}     {r['token']:.3f}  "
                     f"{r['tail']:.2%}")
    stream(lines, args.out)


if __name__ == "__main__":
    main()
