"""Embedding extraction end to end on 1, 2, 4, … GPUs of one host (``esm-turbo embed --gpus N``, one process per
GPU; ``--torchrun``: each multi-GPU run also under torchrun), same FASTA.

    python scripts/bench_embed_multigpu.py --gpus 1,2,4 --tokens 50e6 --out results/gpu/embed_multigpu.json
    python scripts/bench_embed_multigpu.py --plot results/gpu/embed_multigpu.json   # the plot beside it (.png)

Builds a random-weight 650M-shaped checkpoint (speed does not depend on the weights) and a FASTA of real
protein sequences (``--fasta``: a FASTA's records; ``--tsv``: shared/protein_data's table; else calibration_data/)
repeated under new ids until it holds ``--tokens`` tokens. A small warm-up job (2,000 of the records) first fills
Triton's on-disk kernel cache, so every timed run starts as a user's second job does (the warm-up's time is
reported as the cold start). Each run is
`esm-turbo embed … --format h5 --include mean` from process start to the merged HDF5 file; "outside the
forward" is that time less the slowest rank's embedding loop; each rank's summary line splits it (start-up:
imports, FASTA, model load; first batch: compilation; the merge left after the last batch). Results are saved
after every run.
"""

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LOOP = re.compile(r"(\d+) tokens in ([\d.]+) s")
PHASE = re.compile(r"(start-up|first batch|waiting on writes|final merge) ([\d.]+) s")


def sequences(tsv: str | None, fasta: str | None = None) -> list[tuple[str, str]]:
    if fasta:
        from esm_turbo.fasta import read_fasta
        return [(r.id, r.sequence) for r in read_fasta(fasta)[0]]
    if tsv and Path(tsv).is_file():
        with open(tsv) as fh:
            return [(r["id"], r["sequence"]) for r in csv.DictReader(fh, delimiter="\t")]
    from esm_turbo.fasta import read_fastas
    return [(r.id, r.sequence) for r in read_fastas(["calibration_data/calibration.fasta",
                                                     "calibration_data/evaluation.fasta"])]


def embed(n: int, model: Path, fasta: Path, out: Path, launcher: str = "gpus") -> dict:
    """One run on ``n`` GPUs: ``esm-turbo embed --gpus n`` (``launcher`` "gpus") or under torchrun ("torchrun")."""
    if n > 1 and launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "-m", "esm_turbo.cli",
               "embed"]
    else:
        cmd = [sys.executable, "-m", "esm_turbo.main", "embed", "--gpus", str(n)]
    cmd += [ "--model", str(model), str(fasta), "-o", str(out), "--format", "h5", "--include", "mean",
            "--toks-per-batch", "16384", "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    sec = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stderr[-3000:])
        raise SystemExit(proc.returncode)
    # one summary line per rank (ranks' stderr may interleave on one line)
    log = ["esm-turbo embed" + c.split("\n")[0] for c in proc.stderr.split("esm-turbo embed")[1:]]
    ranks = [dict(tokens=int(m.group(1)), loop_s=float(m.group(2)),
                  **{k.replace(" ", "_").replace("-", "") + "_s": float(v) for k, v in PHASE.findall(line)})
             for line in log if (m := LOOP.search(line))]
    out.unlink()
    slowest = max(r["loop_s"] for r in ranks)
    tokens = sum(r["tokens"] for r in ranks)
    return {"seconds": sec, "tokens": tokens, "tokens_per_s": tokens / sec, "slowest_rank_loop_s": slowest,
            "outside_forward_s": sec - slowest, "ranks": ranks, "log": log}


def plot(result: dict, path: Path) -> None:
    """Tokens/s against GPUs (measured, and n x the one-GPU run), and each run's seconds split into the slowest
    rank's embedding loop and the time outside it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = sorted((int(n), r) for n, r in result["runs"].items())
    gpus = [n for n, _ in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(gpus, [r["tokens_per_s"] / 1e3 for _, r in runs], "o-", label="end to end")
    one = result["runs"]["1"]["tokens_per_s"] / 1e3
    left.plot(gpus, [n * one for n in gpus], "--", color="grey", label="n x one GPU")
    for n, r in runs:
        left.annotate(f"{r['scaling_efficiency']:.0%}", (n, r["tokens_per_s"] / 1e3), textcoords="offset points",
                      xytext=(6, -12))
    left.set(xlabel="GPUs", ylabel="thousand tokens/s", xticks=gpus, title="throughput (efficiency annotated)")
    left.legend()
    loop = [r["slowest_rank_loop_s"] for _, r in runs]
    right.bar([str(n) for n in gpus], loop, label="embedding loop (slowest rank)")
    right.bar([str(n) for n in gpus], [r["outside_forward_s"] for _, r in runs], bottom=loop,
              label="outside it: start-up, merge, launcher")
    right.set(xlabel="GPUs", ylabel="seconds, end to end", title=f"{result['tokens'] / 1e6:.1f}M tokens")
    right.legend()
    fig.suptitle(f"esm-turbo embed, {result['model']}, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", metavar="JSON", default=None, help="only draw JSON's runs (a .png beside it)")
    ap.add_argument("--gpus", default=",".join(str(n) for n in sorted({1, max(torch.cuda.device_count(), 1)})),
                    help="comma-separated process counts, e.g. 1,2,4")
    ap.add_argument("--tokens", type=float, default=50e6, help="at least this many tokens in the FASTA")
    ap.add_argument("--size", default="650M")
    ap.add_argument("--tsv", default=str(Path(__file__).resolve().parents[2] / "shared/protein_data/real_proteins.tsv"))
    ap.add_argument("--fasta", default=None, help="repeat this FASTA's records instead (e.g. the testbed corpus)")
    ap.add_argument("--torchrun", action="store_true", help="also time each multi-GPU run under torchrun")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    from transformers import EsmForMaskedLM

    from esm_turbo.fasta import write_fasta
    from esm_turbo.model.sizes import esm2_config
    work = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    EsmForMaskedLM(esm2_config(args.size)).half().save_pretrained(work / "model")
    base = sequences(args.tsv, args.fasta)
    per_copy = sum(min(len(s), 1022) + 2 for _, s in base)  # the default truncation at 1022 residues
    repeat = -(-int(args.tokens) // per_copy)
    write_fasta(work / "in.fasta", [(f"{rid}#{k}", seq) for k in range(repeat) for rid, seq in base])
    write_fasta(work / "warm.fasta", base[:2000])
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "gpus_on_host": torch.cuda.device_count(),
              "model": f"{args.size}-shaped, random weights, fp16", "records": repeat * len(base),
              "tokens": repeat * per_copy, "source": f"{len(base)} real sequences x {repeat}", "runs": {}}
    t0 = time.perf_counter()
    embed(1, work / "model", work / "warm.fasta", work / "warm.h5")
    result["cold_start_s"] = time.perf_counter() - t0
    print(f"warm-up ({min(len(base), 2000)} records, empty compile cache): {result['cold_start_s']:.1f} s", flush=True)
    for n in [int(x) for x in args.gpus.split(",")]:
        run = embed(n, work / "model", work / "in.fasta", work / f"out{n}.h5")
        result["runs"][str(n)] = run
        one = result["runs"].get("1")
        for k, r in result["runs"].items():  # tokens/s against k x the one-GPU run's
            if one:
                r["scaling_efficiency"] = r["tokens_per_s"] / (int(k) * one["tokens_per_s"])
        print(f"{n} GPU(s): {run['seconds']:.1f} s end to end, {run['tokens_per_s']:.0f} tokens/s, "
              f"{run['outside_forward_s']:.1f} s outside the forward"
              + (f", scaling efficiency {run['scaling_efficiency']:.1%}" if one else ""), flush=True)
        if args.torchrun and n > 1:
            run = embed(n, work / "model", work / "in.fasta", work / f"out{n}.h5", launcher="torchrun")
            result.setdefault("torchrun", {})[str(n)] = run
            print(f"{n} GPU(s) under torchrun: {run['seconds']:.1f} s end to end, {run['tokens_per_s']:.0f} tokens/s",
                  flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    if args.out and "1" in result["runs"]:
        try:
            plot(result, Path(args.out).with_suffix(".png"))
        except ImportError:
            print(f"matplotlib missing here: draw it later with --plot {args.out}")


if __name__ == "__main__":
    main()
