"""Study: how much of a layer's cached values (and keys) a linear map of other cached tensors explains — the room
AQUA-KV's idea (code only what a predictor misses) would have. CPU, no codec involved.

Post-RoPE K and V as the cache stores them, recorded over calibration sequences; each predictor an affine least-squares
fit per head on the first half of the tokens, scored on the second half as the share of the target's variance it
explains (R², 1 = all). Predictors: the same token's key of the same head (what the decode walk already reads), the
same head's key and value one layer below (a second read of that layer's codes), and every head's key in the same
layer (a read of the whole layer's keys per head), also turned back before the rotary embedding (ESM-2's keys of
every head are one square projection of the layer input, so its values are an affine map of them). The bits a value
saved at equal error would be about ½·log2(1 / (1 − R²)).

    python tools/value_prediction_study.py ../shared/testbed/esm2_8M_trained --groups 1 2 4 8 --out R.txt

``--groups G``: also each head's values from the keys before RoPE of its group of G consecutive heads alone.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from esm_turbo import load_esm, read_fasta
from esm_turbo.model.calibrate import _run, token_batches
from esm_turbo.model.engine import TurboEsm
from esm_turbo.quant.predict import unrope
from predicted_values_study import affine_fit


def explained(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per head, R² on the second half of the tokens of y [H, N, d] ≈ x [H, N, e] W + b fitted on the first half."""
    half = x.shape[1] // 2
    w, b = affine_fit(x[:, :half], y[:, :half])
    res = y[:, half:] - (x[:, half:] @ w + b[:, None, :])
    centred = y[:, half:] - y[:, half:].mean(1, keepdim=True)
    return 1 - res.pow(2).sum((1, 2)) / centred.pow(2).sum((1, 2))


def grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [H, N, d] → [H, N, group·d]: each head's row the keys of its group of ``group`` consecutive heads (the last
    group takes what is left, padded with zeros)."""
    heads, n, d = x.shape
    out = x.new_zeros(heads, n, group * d)
    for h in range(heads):
        first = h // group * group
        members = x[first:min(first + group, heads)]
        out[h, :, :members.shape[0] * d] = members.permute(1, 0, 2).reshape(n, -1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--calibration", default="calibration_data/calibration.fasta")
    ap.add_argument("--sequences", type=int, default=40)
    ap.add_argument("--groups", type=int, nargs="*", default=[],
                    help="also: V from the pre-RoPE keys of its group of G consecutive heads, for each G given")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = load_esm(args.model)
    records = read_fasta(args.calibration)[0][:args.sequences]
    store: dict[int, list] = {}

    def record(layer, q, k, v, valid):  # batches padded at the end: token s of every row sits at position s
        flat = [t.permute(1, 0, 2, 3)[:, valid].float() for t in (k, v, unrope(k.float(), None, inv_freq))]
        store.setdefault(layer, []).append(flat)

    engine = TurboEsm(model)
    inv_freq = engine.rotary.inv_freq
    _run(engine, token_batches(records, 4096), record, "record", False)
    tokens = sum(t[0].shape[1] for t in store[0])
    lines = [f"# python tools/value_prediction_study.py {args.model} (first {len(records)} sequences of "
             f"{args.calibration}: {tokens} tokens, fitted on the first half, scored on the second)",
             "# R² per head (mean, min over heads); bits: ½·log2(1 / (1 − mean R²)) a value at equal error",
             "layer  V from own K      V from K,V below  K from K,V below  V from every head's K  (before RoPE)"
             + "".join(f"  group of {g:<2} (before)" for g in args.groups)]
    prev = None

    def cell(r2: torch.Tensor) -> str:
        mean = float(r2.mean())
        bits = 0.5 * math.log2(1 / (1 - mean)) if 0 < mean < 1 else 0.0
        return f"{mean:.3f} ({float(r2.min()):.3f}) {bits:.2f}b"

    for layer in sorted(store):
        k, v, unrotated = (torch.cat([t[i] for t in store[layer]], 1) for i in range(3))
        heads = k.shape[0]
        every_key = k.permute(1, 0, 2).reshape(1, k.shape[1], -1).expand(heads, -1, -1)
        every_unrotated = unrotated.permute(1, 0, 2).reshape(1, k.shape[1], -1).expand(heads, -1, -1)
        below = ("-", "-") if prev is None else tuple(cell(explained(torch.cat(prev, -1), y)) for y in (v, k))
        lines.append(f"{layer:>5}  {cell(explained(k, v)):<16}  {below[0]:<16}  {below[1]:<16}  "
                     f"{cell(explained(every_key, v)):<22} {cell(explained(every_unrotated, v)):<22}"
                     + "".join(f"  {cell(explained(grouped(unrotated, g), v)):<22}" for g in args.groups))
        prev = (k, v)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
