"""Study: the library's 4.0-bit recipe with slots in one command, ``calibrate --slots 1 --narrow-layers 1`` (the
layer whose decode fidelity on the calibration set drops least one index bit narrower pays for a slot a token and
kind), measured on held-out sequences as the other studies measure (PyTorch path, CPU).

    python tools/narrow_layers_study.py ../shared/testbed/esm2_8M_trained --out R.txt
    python tools/narrow_layers_study.py ../shared/testbed/esm2_8M_trained --planted --rank relative \\
        --calibration calibration_data/calibration_alt1.fasta --out R.txt
"""

from __future__ import annotations

import argparse

from study_common import data_flags, measure, parse, stream

from esm_turbo import TurboEsm, calibrate
from esm_turbo.model.recipe import recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--narrow-layers", type=int, default=1)
    ap.add_argument("--rank", choices=["absolute", "relative"], default="absolute", help="--slot-rank")
    args, model, cal_records, eval_records = parse(ap)
    cal = calibrate(model, cal_records, recipe("default", slots=args.slots, narrow_layers=args.narrow_layers,
                                               slot_rank=args.rank), progress=False)
    row = measure(TurboEsm(model, cal), eval_records, cal.codecs)
    bits = " ".join(f"{k}+{v}" for k, v in cal.meta["layer_index_bits"])
    flags = f" --slots {args.slots} --narrow-layers {args.narrow_layers}" + (
        f" --rank {args.rank}" if args.rank != "absolute" else "")
    lines = [f"# python tools/narrow_layers_study.py {args.model}{flags}{data_flags(args)}",
             f"# calibrate(recipe('default', slots={args.slots}, narrow_layers={args.narrow_layers}, "
             f"slot_rank='{args.rank}')); {len(eval_records)} held-out sequences, half prefilled exactly, the rest "
             "decoded; PyTorch path, CPU. Sensitivity on the calibration set (mean decode cos lost one index bit "
             "narrower): " + ", ".join(f"layer {i} {s:.5f}" for i, s in enumerate(cal.meta["layer_sensitivity"])),
             f"narrowed layers {cal.meta['narrowed_layers']}; key+value index bits a layer: {bits}",
             "all-in  mean cos  worst seq  worst tok  <0.95",
             f"{row['bits']:.3f}   {row['mean']:.4f}    {row['worst']:.4f}     {row['token']:.3f}  {row['tail']:.2%}"]
    stream(lines, args.out)


if __name__ == "__main__":
    main()
