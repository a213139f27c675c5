"""Study: values coded as what their own key does not predict (AQUA-KV's idea, the cheap predictor), at the same
bits all-in, PyTorch path, CPU.

Per layer and head an affine map fitted by least squares on the calibration set predicts a token's value from its
decoded key, v ≈ k̂ W + b (k̂: the recipe's key codec, so encode and decode see the same key); the value codec is then
calibrated on the residuals v − (k̂ W + b) (the calibration's own passes, their values replaced), and decode adds the
prediction back. W and b are constants of the layer, not bytes a token: the all-in bits are the recipe's. Measured
as the other studies measure, beside the recipe itself at each ``--index-bits``.

    python tools/predicted_values_study.py ../shared/testbed/esm2_d64_trained --index-bits 1 2 --out R.txt
"""

from __future__ import annotations

import argparse
import time

import torch
from study_common import data_flags, finish, measure, parse

import esm_turbo.model.calibrate as calibration
from esm_turbo import TurboEsm, calibrate
from esm_turbo.model.recipe import recipe
from esm_turbo.quant.codec import KVCodec


class PredictedValues(KVCodec):
    """A codec whose value parts hold v − (k̂ W + b): ``base``'s quantizers, W [H, d, d] and b [H, d] of the layer."""

    def __init__(self, base: KVCodec, w: torch.Tensor, b: torch.Tensor):
        super().__init__(base.key, base.value)
        self.register_buffer("w", w)
        self.register_buffer("b", b)

    def predict(self, k_hat: torch.Tensor) -> torch.Tensor:
        """k̂ [..., H, T, d] → the predicted values [..., H, T, d]."""
        return torch.einsum("...htd,hde->...hte", k_hat.float(), self.w) + self.b[:, None, :]

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = {f"k.{n}": t for n, t in self.key.encode(k).items()}
        k_hat = self.key.decode(self._sub(parts, "k."))
        parts.update({f"v.{n}": t for n, t in self.value.encode(v.float() - self.predict(k_hat)).items()})
        return parts

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k_hat = self.key.decode(self._sub(parts, "k."))
        return k_hat, self.predict(k_hat) + self.value.decode(self._sub(parts, "v."))


def fit_predictors(model, records, cal) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (W [H, d, d], b [H, d]): least squares of each head's values on its decoded keys (``cal``'s key
    codec) over ``records``."""
    stats: dict[int, list] = {}

    def record(layer, q, k, v, valid):
        key = cal.codecs[layer].key
        k_hat = key.decode(key.encode(k))
        stats.setdefault(layer, []).append((k_hat.permute(1, 0, 2, 3)[:, valid].float(),
                                            v.permute(1, 0, 2, 3)[:, valid].float()))

    calibration._run(TurboEsm(model), calibration.token_batches(records, 4096), record, "fit", False)
    out = []
    for layer in sorted(stats):
        x = torch.cat([a for a, _ in stats[layer]], 1)
        y = torch.cat([b for _, b in stats[layer]], 1)
        xa = torch.cat([x, torch.ones_like(x[..., :1])], -1)
        sol = torch.linalg.lstsq(xa, y).solution  # [H, d + 1, d]
        out.append((sol[:, :-1].contiguous(), sol[:, -1].contiguous()))
    return out


def calibrate_residuals(model, records, cfg, cal, predictors):
    """``calibrate`` with every recorded value replaced by its residual v − (k̂ W + b)."""
    plain_run = calibration._run

    def run(engine, batches, recorder, desc, progress):
        def residual(layer, q, k, v, valid):
            key = cal.codecs[layer].key
            w, b = predictors[layer]
            k_hat = key.decode(key.encode(k))
            pred = torch.einsum("bhsd,hde->bhse", k_hat.float(), w) + b[None, :, None, :]
            return recorder(layer, q, k, (v.float() - pred).to(v.dtype), valid)
        return plain_run(engine, batches, residual, desc, progress)

    calibration._run = run
    try:
        return calibrate(model, records, cfg, progress=False)
    finally:
        calibration._run = plain_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index-bits", type=int, nargs="+", default=[1, 2])
    args, model, cal_records, eval_records = parse(ap)
    t0 = time.time()
    rows = []
    for bits in args.index_bits:
        cfg = recipe("default", index_bits=bits)
        cal = calibrate(model, cal_records, cfg, progress=False)
        engine = TurboEsm(model, cal)
        rows.append((f"recipe, {bits} index bits", measure(engine, eval_records, cal.codecs)))
        predictors = fit_predictors(model, cal_records, cal)
        res = calibrate_residuals(model, cal_records, cfg, cal, predictors)
        codecs = [PredictedValues(c, w, b) for c, (w, b) in zip(res.codecs, predictors)]
        rows.append((f"values from k̂, {bits} index bits", measure(engine, eval_records, codecs)))
        for label, r in rows[-2:]:
            print(f"{label:30} {r['bits']:.3f} {r['mean']:.4f} {r['worst']:.4f} {r['token']:.3f} {r['tail']:.2%} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    lines = [f"# python tools/predicted_values_study.py {args.model} --index-bits "
             f"{' '.join(map(str, args.index_bits))}{data_flags(args)}",
             f"# {len(eval_records)} held-out sequences, half prefilled exactly, the rest decoded; PyTorch path, CPU. "
             "values from k̂: each value coded as its residual after v ≈ k̂ W + b (per layer and head, least squares "
             "on the calibration set), the value codec calibrated on those residuals",
             f"{'codec':30} all-in  mean cos  worst seq  worst tok  <0.95"]
    for label, r in rows:
        lines.append(f"{label:30} {r['bits']:.3f}   {r['mean']:.4f}    {r['worst']:.4f}     {r['token']:.3f}  "
                     f"{r['tail']:.2%}")
    finish(lines, args.out)


if __name__ == "__main__":
    main()
