"""Where a recipe's worst decode tokens come from: swap one layer (then one head, keys or values) of recipe A's
codecs for recipe B's and see which swap lifts A's worst tokens.

    python tools/attribute_tail.py MODEL [--outliers 200 --outlier-seed 0] [--a default --b no-rotation]

Calibrates A and B (on calibration_data/calibration.fasta unless --calibration), evaluates A on the held-out set, takes the sequences
holding A's worst tokens, and for each layer (and each head of the worst layer, keys and values apart) re-evaluates
them with that part taken from B. Prints the worst token and the share under cos 0.95 of each variant.
"""

from __future__ import annotations

import argparse

import torch

from esm_turbo.fasta import CALIBRATION_DATA, read_fastas
from esm_turbo.model.calibrate import calibrate, combine_heads
from esm_turbo.model.checkpoint import PRESETS
from esm_turbo.model.engine import TurboEsm
from esm_turbo.model.evaluate import evaluate
from esm_turbo.model.loading import load_esm
from esm_turbo.quant.codec import KVCodec
from esm_turbo.testing import plant_outliers


def _tail(engine: TurboEsm, records, codecs) -> tuple[float, float, list[dict]]:
    rep = evaluate(engine, records, cache=lambda i, h, d: codecs[i], progress=False)
    return rep["overall"]["decode_cos_min"], rep["overall"]["decode_tail_share"], rep["sequences"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--outliers", type=float, default=0.0)
    ap.add_argument("--outlier-seed", type=int, default=0)
    ap.add_argument("--a", default="default")
    ap.add_argument("--b", default="no-rotation")
    ap.add_argument("--worst", type=int, default=3, help="sequences with the lowest worst token to study")
    ap.add_argument("--calibration", default=str(CALIBRATION_DATA / "calibration.fasta"))
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model = load_esm(args.model, torch.float32, args.device)
    if args.outliers:
        plant_outliers(model, args.outliers, args.outlier_seed)
    cal = read_fastas([args.calibration])
    held_out = read_fastas([str(CALIBRATION_DATA / "evaluation.fasta")])
    a = calibrate(model, cal, PRESETS[args.a], progress=False).codecs
    b = calibrate(model, cal, PRESETS[args.b], progress=False).codecs
    engine = TurboEsm(model)
    for name, codecs in ((args.a, a), (args.b, b)):
        worst, share, _ = _tail(engine, held_out, codecs)
        print(f"{name:>14}: all held-out: worst token {worst:.4f}, share under 0.95 {share:.4%}")
    _, _, seqs = _tail(engine, held_out, a)
    ids = {s["id"] for s in sorted(seqs, key=lambda s: s["decode_cos_min"])[: args.worst]}
    study = [r for r in held_out if r.id in ids]
    base, base_share, _ = _tail(engine, study, a)
    print(f"\n{len(study)} sequences with {args.a}'s worst tokens ({', '.join(sorted(ids))}): "
          f"worst {base:.4f}, share under 0.95 {base_share:.4%}")
    gains = []
    for layer in range(len(a)):
        for part in ("key", "value", "both"):
            mixed = list(a)
            if part == "both":
                mixed[layer] = b[layer]
            else:
                mixed[layer] = KVCodec(b[layer].key if part == "key" else a[layer].key,
                                       b[layer].value if part == "value" else a[layer].value)
            worst, share, _ = _tail(engine, study, mixed)
            gains.append((worst - base, layer, part))
            print(f"layer {layer} {part:>5} from {args.b}: worst {worst:.4f}  share {share:.4%}")
    _, layer, part = max(gains)
    part = "key" if part == "both" else part
    print(f"\nlayer {layer} {part}s, one head at a time from {args.b}:")
    qa, qb = getattr(a[layer], part), getattr(b[layer], part)
    for head in range(engine.heads):
        choice = torch.zeros(engine.heads, dtype=torch.long)
        choice[head] = 1
        try:
            q = combine_heads((qa, qb), choice)
        except ValueError as err:
            print(f"cannot mix heads: {err}")
            break
        mixed = list(a)
        mixed[layer] = KVCodec(q if part == "key" else a[layer].key, q if part == "value" else a[layer].value)
        worst, share, _ = _tail(engine, study, mixed)
        print(f"  head {head:>2}: worst {worst:.4f}  share {share:.4%}")


if __name__ == "__main__":
    main()
