"""Build calibration_data/ from ../shared/protein_data/real_proteins.tsv (real sequences only).

SCOP-balanced: per class, sequences are drawn round-robin over its families with a seeded shuffle;
the calibration set takes up to CAL_PER_CLASS per class and the held-out evaluation set up to
EVAL_PER_CLASS (a quarter of a small class) of the *remaining* sequences, so the two share no sequence. ``calibration_alt1.fasta`` and ``calibration_alt2.fasta`` are two more calibration sets of
the same size drawn (seeded, round-robin over families) from what neither took: three disjoint calibration sets,
for the spread of a recipe's fidelity across calibration sets. Sequences longer than ESM-2's 1022 residues are left
out of all.

    python scripts/build_calibration_data.py [--tsv PATH] [--out calibration_data]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from collections import defaultdict
from pathlib import Path

from esm_turbo.fasta import write_fasta

CAL_PER_CLASS = 24
EVAL_PER_CLASS = 6
ALTERNATES = 2
MAX_RESIDUES = 1022


def round_robin(rows: list[dict], rng: random.Random) -> list[dict]:
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_family[r["family"]].append(r)
    queues = [rng.sample(v, len(v)) for _, v in sorted(by_family.items())]
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tsv", default=str(Path(__file__).resolve().parents[1].parent / "shared/protein_data/real_proteins.tsv"))
    ap.add_argument("--out", default="calibration_data")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with open(args.tsv) as fh:
        rows = [r for r in csv.DictReader(fh, delimiter="\t") if int(r["length"]) <= MAX_RESIDUES]
    by_class: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_class[r["scop_class"]].append(r)
    rng = random.Random(args.seed)
    cal, ev, summary = [], [], {}
    for cls in sorted(by_class):
        order = round_robin(by_class[cls], rng)
        n_eval = min(EVAL_PER_CLASS, max(1, len(order) // 4)) if len(order) > 1 else 0
        n_cal = min(CAL_PER_CLASS, len(order) - n_eval)
        c, e = order[:n_cal], order[n_cal:n_cal + n_eval]
        cal += c
        ev += e
        summary[cls] = {"calibration": len(c), "evaluation": len(e)}
    assert not {r["sequence"] for r in cal} & {r["sequence"] for r in ev}, "sets overlap"
    taken = {r["sequence"] for r in cal + ev}
    rest = round_robin([r for r in rows if r["sequence"] not in taken], random.Random(args.seed + 1))
    alternates = [rest[i * len(cal):(i + 1) * len(cal)] for i in range(ALTERNATES)]
    assert all(len(a) == len(cal) for a in alternates), "too few sequences for the alternate calibration sets"
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    fmt = lambda r: (f"{r['id']} class={r['scop_class']} family={r['family'].replace(' ', '_')} source={r['source']}", r["sequence"])  # noqa: E731
    write_fasta(out / "calibration.fasta", [fmt(r) for r in cal])
    write_fasta(out / "evaluation.fasta", [fmt(r) for r in ev])
    for i, alt in enumerate(alternates, 1):
        write_fasta(out / f"calibration_alt{i}.fasta", [fmt(r) for r in alt])
        summary[f"calibration_alt{i}"] = len(alt)
    (out / "sets.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
