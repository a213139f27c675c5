"""Does a calibration choice help beyond the noise of the calibration set — counting tokens by the attention
they receive (``CalibrationConfig.attention_weight``), the key rotation (``--key-rotations``), or a bit moved from
the values to the keys (``--kv-bits``), or uniform grids in place of Lloyd-Max LUTs (``--luts``)? Calibrates a
stress model on the whole calibration set and on four subsets that each leave out a fifth of it (records i with
i % 5 == j), at each weight, key rotation and bit width, and evaluates every calibration on all 29 held-out
sequences (16 decode steps). One JSON row per run; ``--table`` summarises the rows (results/studies/attention_weight.txt, grid.txt, kv_bits.txt).

    python tools/attention_weight_study.py d16 --out rows.jsonl          # ~2 min per model and weight (CPU)
    python tools/attention_weight_study.py d64 --out rows.jsonl          # ~20 min
    python tools/attention_weight_study.py d16 --weights 0.5 --key-rotations svd-scaled svd-query --out k.jsonl
    python tools/attention_weight_study.py d16 --weights 0.5 --kv-bits 3/3 4/2 --out kv.jsonl   # keys-first
    python tools/attention_weight_study.py d16 --weights 0.5 --kv-bits 4/2 --max-channel-bits 4 --out kv.jsonl
    python tools/attention_weight_study.py d16 --weights 0.5 --luts channel grid --out grid.jsonl   # grids
    python tools/attention_weight_study.py --table rows.jsonl
"""

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from esm_turbo.fasta import CALIBRATION_DATA, read_fastas
from esm_turbo.model.calibrate import calibrate
from esm_turbo.model.checkpoint import PRESETS
from esm_turbo.model.engine import TurboEsm
from esm_turbo.model.evaluate import evaluate
from esm_turbo.testing import stress_esm2

MODELS = {"d16": dict(layers=4, hidden=64, heads=4), "d64": dict(layers=6, hidden=256, heads=4)}
RECIPES = {"3+1": "default", "3": "no-residual"}


def run(model_name: str, weights: list[float], drops: list[int], out: str, key_rotations: list[str],
        kv_bits: list[str], max_bits: int | None = None, luts: tuple[str, ...] = ("channel",)) -> None:
    torch.set_num_threads(1)
    model = stress_esm2(seed=0, **MODELS[model_name])
    calib = read_fastas([str(CALIBRATION_DATA / "calibration.fasta")])
    held_out = read_fastas([str(CALIBRATION_DATA / "evaluation.fasta")])
    for drop in drops:
        recs = [r for i, r in enumerate(calib) if i % 5 != drop]  # drop = -1: every record
        for bits, recipe in RECIPES.items():
            for a, rot, split, lut in ((a, rot, split, lut) for a in weights for rot in key_rotations
                                       for split in kv_bits for lut in luts):
                start = time.perf_counter()
                key_bits, value_bits = (int(b) for b in split.split("/"))
                cal = calibrate(model, recs, replace(PRESETS[recipe], attention_weight=a, key_rotation=rot,
                                                     key_index_bits=key_bits, value_index_bits=value_bits,
                                                     max_channel_bits=max_bits, lut=lut), progress=False)
                rep = evaluate(TurboEsm(model), held_out, cache=lambda i, h, d: cal.codecs[i], max_steps=16,
                               progress=False)
                seqs = [s["decode_cos_mean"] for s in rep["sequences"]]
                row = dict(model=model_name, bits=bits, attention_weight=a, key_rotation=rot, kv_bits=split, drop=drop,
                           max_channel_bits=max_bits, lut=lut,
                           mean=sum(seqs) / len(seqs), worst=min(seqs), top1=rep["overall"]["top1_agreement"],
                           attn_err=statistics.mean(rep["layers"]["attn_rel_err"]),
                           score_kl=statistics.mean(rep["layers"]["score_kl"]),
                           attn_err_layers=rep["layers"]["attn_rel_err"], score_kl_layers=rep["layers"]["score_kl"],
                           seconds=time.perf_counter() - start)
                with open(out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def table(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    for r in rows:  # rows written before the key rotation was a study axis used the then default
        r.setdefault("key_rotation", "svd-scaled")
        r.setdefault("kv_bits", "3/3")
        r.setdefault("max_channel_bits", None)
        r.setdefault("lut", "channel")
    lines = ["model  bits  K/V  a     key rotation lut     | calibration sets | worst sequence: full set, mean (min-max) | "
             "mean cos | top-1 | attn err | score KL"]

    def group(r: dict) -> tuple:
        cap = r["max_channel_bits"]
        return (r["model"], r["bits"], r["kv_bits"] + (f"≤{cap}" if cap else ""), r["attention_weight"], r["key_rotation"],
                r["lut"])

    keys = sorted({group(r) for r in rows}, key=lambda k: (k[0], -len(k[1]), k[2], k[3], k[4], k[5]))
    for key in keys:
        model, bits, split, a, rot, lut = key
        rs = [r for r in rows if group(r) == key]
        full = [r for r in rs if r["drop"] == -1]
        worst = [r["worst"] for r in rs]
        avg = {k: statistics.mean(r[k] for r in rs) for k in ("mean", "top1", "attn_err", "score_kl")}
        lines.append(f"{model:5}  {bits:4}  {split:3}  {a:<4}  {rot:12} {lut:7} | {len(rs):>16} | {full[0]['worst'] if full else float('nan'):.4f}, "
                     f"{statistics.mean(worst):.4f} ({min(worst):.4f}-{max(worst):.4f})   | {avg['mean']:.4f}   | "
                     f"{avg['top1']:.3f} | {avg['attn_err']:.4f}   | {avg['score_kl']:.4f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", choices=sorted(MODELS))
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--drops", type=int, nargs="+", default=[-1, 0, 1, 2, 3])
    ap.add_argument("--key-rotations", nargs="+", default=["svd-query"])
    ap.add_argument("--kv-bits", nargs="+", default=["3/3"], metavar="K/V",
                    help="key/value index bits of the 3 (+1) bit recipes, e.g. 3/3 4/2 (the same bytes)")
    ap.add_argument("--max-channel-bits", type=int, default=None,
                    help="widest channel under bit allocation (default: each kind's bits + 1)")
    ap.add_argument("--luts", nargs="+", default=["channel"], choices=["channel", "grid"],
                    help="per-channel tables: Lloyd-Max LUTs (the default) or uniform grids")
    ap.add_argument("--out", default="attention_weight_rows.jsonl")
    ap.add_argument("--table", metavar="ROWS", help="print the summary of a rows file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
    elif args.model:
        run(args.model, args.weights, args.drops, args.out, args.key_rotations, args.kv_bits,
            args.max_channel_bits, tuple(args.luts))
    else:
        ap.error("name a model (d16, d64) or --table ROWS")


if __name__ == "__main__":
    main()
