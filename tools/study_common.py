"""What the fidelity study tools share: one evaluation of a cache's codecs on held-out sequences, summarised, and the
report written."""

from __future__ import annotations

import argparse
from pathlib import Path

from esm_turbo import load_esm, read_fasta
from esm_turbo.model.evaluate import evaluate


#: the calibration set a study fits on, and the held-out set it measures on, unless told
CALIBRATION = "calibration_data/calibration.fasta"
EVALUATION = "calibration_data/evaluation.fasta"


def parse(ap: argparse.ArgumentParser):
    """``ap``'s arguments plus the ones every study takes (the model, its calibration and evaluation sets, ``--out``);
    returns (args, model, calibration records, evaluation records)."""
    ap.add_argument("model")
    ap.add_argument("--calibration", default=CALIBRATION)
    ap.add_argument("--evaluation", default=EVALUATION)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--planted", action="store_true",
                    help="with function-preserving K/V outliers planted first (esm_turbo.testing.plant_outliers)")
    args = ap.parse_args()
    model = load_esm(args.model)
    if args.planted:
        from esm_turbo.testing import plant_outliers
        plant_outliers(model)
    return args, model, read_fasta(args.calibration)[0], read_fasta(args.evaluation)[0]


def data_flags(args) -> str:
    """The ``--calibration`` / ``--evaluation`` flags of a study's command line, where they are not the defaults, and
    ``--planted`` (for the report's header)."""
    return "".join(f" --{name} {value}" for name, value, default in (("calibration", args.calibration, CALIBRATION),
                                                                     ("evaluation", args.evaluation, EVALUATION))
                   if value != default) + (" --planted" if args.planted else "")


def measure(engine, records, codecs) -> dict:
    """Decode fidelity of ``engine`` with layer l's cache coded by ``codecs[l]`` over ``records`` (half of each
    prefilled exactly, the rest decoded; PyTorch path): all-in ``bits`` and the mean, worst-sequence and worst-token
    cos and the share of tokens under 0.95."""
    report = evaluate(engine, records, cache=lambda layer, h, d: codecs[layer], progress=False)
    o = report["overall"]
    return dict(bits=report["memory"]["bits_per_value"], mean=o["decode_cos_mean"], worst=o["decode_cos_worst_seq"],
                token=o["decode_cos_min"], tail=o["decode_tail_share"])


def stream(lines, out: str | Path | None, header: str = "") -> list[str]:
    """Print each line of the iterable ``lines`` as it comes (a long GPU run shows its progress), then write them all
    to ``out`` if given, after ``header`` (the command that regenerates them); returns them."""
    done = []
    for line in lines:
        print(line, flush=True)
        done.append(line)
    if out:
        Path(out).write_text(header + "\n".join(done) + "\n")
    return done
