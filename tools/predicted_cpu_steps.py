"""CPU decode-step latency on the PyTorch path of a session over the shared heads-of-16 ESM-2, 8 rows on a 500-token
scaffold: the recipe at 3.0 bits all-in, values predicted with their residual coded (3.0 bits), and the keys alone
(values not stored, 2.0 bits). Median of 7 steps after 2 warm ones, each step uncommitted.

    python tools/predicted_cpu_steps.py ../shared/testbed/esm2_8M_trained --out results/studies/predicted_cpu_steps.txt
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from esm_turbo import TurboEsm, calibrate, load_esm
from esm_turbo.fasta import read_fasta
from esm_turbo.model.alphabet import alphabet
from esm_turbo.model.recipe import recipe

RECIPES = (("recipe, 3.0 bits", dict(index_bits=2)),
           ("values predicted, residual coded, 3.0 bits", dict(index_bits=2, predict_values=True)),
           ("the keys alone, 2.0 bits", dict(predict_values=True, key_index_bits=3, value_index_bits=0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # the PyTorch path's notices
    model = load_esm(args.model)
    records = read_fasta("calibration_data/calibration.fasta")[0]
    scaffold = "".join(r.sequence for r in records)[:args.context]
    token = torch.full((args.rows, 1), alphabet().mask_idx)
    lines = [f"# python tools/predicted_cpu_steps.py {args.model} --rows {args.rows} --context {args.context}",
             f"# CPU, {torch.get_num_threads()} threads, PyTorch path; median ms of 7 uncommitted steps after 2"]
    for label, fields in RECIPES:
        session = TurboEsm(model, calibrate(model, records, recipe("default", **fields), progress=False)).session(
            "turbo", capacity=args.context + 16)
        session.start([scaffold] * args.rows)
        times = []
        for i in range(9):
            start = time.perf_counter()
            session.step(token, commit=False)
            if i >= 2:
                times.append(time.perf_counter() - start)
        lines.append(f"{label:44} {sorted(times)[3] * 1e3:6.1f} ms a step")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
