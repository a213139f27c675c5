"""Study: widths per layer from a measured sensitivity, at a mean of 3.0 bits all-in, on a trained testbed (PyTorch
path, CPU).

Each layer's sensitivity is the drop in mean decode cos when that layer alone goes from 4.0 to 2.0 bits all-in (the
others at 4.0). The most sensitive k layers then take 4.0 bits and the least sensitive k take 2.0, the rest 3.0: the
same mean as the uniform 3.0-bit default, every byte counted by the cache's memory report. The k = 2 allocation the
other way round is the control. With ``--sparse F`` the best allocation also keeps the values whose coding error
passes a per-layer threshold fitted at the fraction F (dense-and-sparse, ``tools/exact_study.py --fitted``).

With ``--at-four K [K ...]`` it measures dense-and-sparse inside 4.0 bits all-in instead: the K least sensitive
layers at 3.0 bits (the rest at 4.0) pay for a side list fitted at each ``--fractions`` F in every layer, and a row
counts only where its all-in bits come to 4.0 or less (the codes' widths come in whole index bits a layer). ``--rank``
says how the side list ranks the values (each error, each over its channel's spread, or either).

    python tools/layer_bits_study.py ../shared/testbed/esm2_d64_trained --sparse 0.0025 --out R.txt
    python tools/layer_bits_study.py ../shared/testbed/esm2_8M_trained --at-four 1 --fractions 0.0025 0.004 --out R
"""

from __future__ import annotations

import argparse
import math
import time

from exact_study import ExactCodec, _coding_errors
from study_common import data_flags, measure, parse, stream

from esm_turbo import TurboEsm, calibrate
from esm_turbo.quant.codec import KVCodec
from esm_turbo.model.recipe import recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="layers moved up and down a bit")
    ap.add_argument("--sparse", type=float, default=0.0, help="with the best allocation, dense-and-sparse at F")
    ap.add_argument("--at-four", type=int, nargs="+", default=[],
                    help="inside 4.0 bits all-in: these many least sensitive layers at 3.0 pay for a side list")
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.0025], help="--at-four: side-list fractions")
    ap.add_argument("--slots", type=int, nargs="+", default=[],
                    help="--at-four: also a side list of fixed size, these many slots a token and kind (each token's "
                         "largest errors, ranked as --rank absolute or relative)")
    ap.add_argument("--rank", choices=["absolute", "relative", "both"], default="absolute",
                    help="the side list ranks each value's error (absolute), its error over its channel's spread "
                         "(relative), or keeps what passes either, each fitted at half the fraction (both)")
    ap.add_argument("--relative", dest="rank", action="store_const", const="relative", help="--rank relative")
    ap.add_argument("--slot-domain", choices=["original", "affine"], default="original",
                    help="--slots: pick and keep them in the values' own domain, or in the codes' affine domain "
                         "(where the fused decode kernel reads; --rank relative there: each error in its channel's "
                         "scale)")
    args, model, cal_records, eval_records = parse(ap)
    t0 = time.time()
    cals = {bits: calibrate(model, cal_records, recipe("default", index_bits=bits - 1), progress=False)
            for bits in (2, 3, 4)}
    engine = TurboEsm(model, cals[3])
    layers = len(cals[3].codecs)
    heads, dim = cals[3].codecs[0].key.heads, cals[3].codecs[0].key.dim

    def run(widths: list[int], codecs=None) -> dict:
        codecs = codecs or [cals[w].codecs[i] for i, w in enumerate(widths)]
        return dict(widths=widths, **measure(engine, eval_records, codecs))

    rows = []

    def add(label: str, row: dict) -> dict:
        row["label"] = label
        rows.append(row)
        print(f"{label:28} {' '.join(map(str, row['widths']))}  {row['bits']:.3f}  {row['mean']:.4f}  "
              f"{row['worst']:.4f}  {row['token']:.3f}  {row['tail']:.2%}  ({time.time() - t0:.0f} s)", flush=True)
        return row

    def sparse_row(label: str, widths: list[int], fraction: float) -> dict:
        """``widths`` with every layer's values past a threshold fitted at ``fraction`` kept exact."""
        codecs = []
        share = fraction / 2 if args.rank == "both" else fraction
        for i, w in enumerate(widths):
            rules = [(tuple(float(e.quantile(1 - share)) for e in errs), spreads)
                     for errs, spreads in (errors(w, relative)[i] for relative in relatives)]
            codecs.append(ExactCodec(cals[w].codecs[i], 0, fraction, *rules[0], also=rules[1] if rules[1:] else None))
        row = run(widths, codecs)
        kept = sum(c.kept[0] for c in codecs) / max(1, sum(c.kept[1] for c in codecs))
        row["bits"] += kept * (16 + math.log2(dim)) + 16 / (heads * dim)  # value, index, a count per token
        return add(f"{label} + sparse {kept:.2%}", row)

    def slots_row(label: str, widths: list[int], slots: int) -> dict:
        """``widths`` with each token's ``slots`` worst-coded values of each kind kept exact."""
        relative = args.rank == "relative"
        if args.slot_domain == "affine":  # the library's slots: the memory report counts their 32-bit words
            codecs = [KVCodec(cals[w].codecs[i].key, cals[w].codecs[i].value, slots=slots, relative_slots=relative)
                      for i, w in enumerate(widths)]
            row = run(widths, codecs)
        else:  # an fp16 value and its index among the token's values, packed
            codecs = [ExactCodec(cals[w].codecs[i], scales=errors(w, True)[i][1] if relative else None, slots=slots)
                      for i, w in enumerate(widths)]
            row = run(widths, codecs)
            row["bits"] += slots * (16 + math.ceil(math.log2(heads * dim))) / (heads * dim)
        return add(f"{label} + {slots} slot{'s' if slots > 1 else ''}", row)

    seen_errors: dict = {}
    relatives = {"absolute": (False,), "relative": (True,), "both": (False, True)}[args.rank]

    def errors(width: int, relative: bool):
        if (width, relative) not in seen_errors:
            seen_errors[width, relative] = _coding_errors(model, cals[width].codecs, cal_records[:32], relative)
        return seen_errors[width, relative]

    uniform3 = add("uniform 3.0", run([3] * layers))
    uniform4 = add("uniform 4.0", run([4] * layers))
    drops = []
    for layer in range(layers):
        row = add(f"layer {layer} at 2.0, rest 4.0", run([2 if i == layer else 4 for i in range(layers)]))
        drops.append(uniform4["mean"] - row["mean"])
    order = sorted(range(layers), key=lambda i: -drops[i])  # most sensitive first
    for k in args.at_four:
        widths = [3 if i in order[-k:] else 4 for i in range(layers)]
        add(f"{k} least sensitive at 3.0", run(widths))
        for fraction in args.fractions:
            sparse_row(f"{k} least at 3.0", widths, fraction)
        for slots in args.slots:
            slots_row(f"{k} least at 3.0", widths, slots)
    if args.at_four:
        args.ks = []
    best = uniform3
    for k in args.ks:
        if 2 * k > layers:
            continue
        widths = [3] * layers
        for i in order[:k]:
            widths[i] = 4
        for i in order[-k:]:
            widths[i] = 2
        row = add(f"sensitive k={k} up, k down", run(widths))
        best = max(best, row, key=lambda r: (r["worst"], r["mean"]))
    if layers >= 4 and not args.at_four:
        widths = [3] * layers
        for i in order[:2]:
            widths[i] = 2
        for i in order[-2:]:
            widths[i] = 4
        add("control: k=2 the other way", run(widths))
    if args.sparse and not args.at_four:
        sparse_row("best", best["widths"], args.sparse)
    if args.at_four:
        flags = (f" --at-four {' '.join(map(str, args.at_four))}"
                 + (f" --fractions {' '.join(map(str, args.fractions))}" if args.fractions else " --fractions")
                 + (f" --slots {' '.join(map(str, args.slots))}" if args.slots else "")
                 + (f" --rank {args.rank}" if args.rank != "absolute" else "")
                 + (f" --slot-domain {args.slot_domain}" if args.slot_domain != "original" else ""))
    else:
        flags = f" --ks {' '.join(map(str, args.ks))}" + (f" --sparse {args.sparse}" if args.sparse else "")
    lines = [f"# python tools/layer_bits_study.py {args.model}{flags}{data_flags(args)}",
             f"# {len(eval_records)} held-out sequences, half prefilled exactly, the rest decoded; PyTorch path, CPU. "
             "Sensitivity: mean decode cos lost when one layer goes 4.0 -> 2.0 bits all-in, the rest at 4.0: "
             + ", ".join(f"layer {i} {d:.4f}" for i, d in enumerate(drops)),
             f"{'allocation':28} {'bits a layer':>12}  all-in  mean cos  worst seq  worst tok  <0.95"]
    for r in rows:
        lines.append(f"{r['label']:28} {' '.join(map(str, r['widths'])):>12}  {r['bits']:.3f}   {r['mean']:.4f}    "
                     f"{r['worst']:.4f}     {r['token']:.3f}  {r['tail']:.2%}")
    stream(lines, args.out)


if __name__ == "__main__":
    main()
