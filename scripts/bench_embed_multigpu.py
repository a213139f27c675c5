"""Embedding extraction on 1 GPU vs N GPUs (torchrun, one process per GPU) over the same FASTA.

    python scripts/bench_embed_multigpu.py --gpus 2 --out results/gpu/embed_multigpu.json

Builds a random-weight 650M-shaped checkpoint (speed does not depend on the weights) and a FASTA of
the calibration_data sequences repeated, then times `esm-turbo embed` end to end (model load, FASTA
parsing, HDF5 writing and the merge included) for 1 and for N processes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--repeat", type=int, default=24)
    ap.add_argument("--size", default="650M")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import EsmForMaskedLM
    from esm_turbo.fasta import read_fastas, write_fasta
    from esm_turbo.model.sizes import esm2_config
    work = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    EsmForMaskedLM(esm2_config(args.size)).half().save_pretrained(work / "model")
    base = read_fastas(["calibration_data/calibration.fasta", "calibration_data/evaluation.fasta"])
    write_fasta(work / "in.fasta", [(f"{r.id}#{k}", r.sequence) for k in range(args.repeat) for r in base])
    tokens = args.repeat * sum(len(r.sequence) + 2 for r in base)
    result = {"device": torch.cuda.get_device_name(0), "gpus": args.gpus, "tokens": tokens, "runs": {}}
    for n in sorted({1, args.gpus}):
        out = work / f"out{n}.h5"
        cmd = ([sys.executable, "-m", "esm_turbo.cli"] if n == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "-m", "esm_turbo.cli"])
        cmd += ["embed", "--model", str(work / "model"), str(work / "in.fasta"), "-o", str(out), "--format", "h5",
                "--include", "mean", "--toks-per-batch", "16384", "--quiet"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        sec = time.perf_counter() - t0
        if proc.returncode:
            print(proc.stderr[-3000:])
            raise SystemExit(proc.returncode)
        result["runs"][n] = {"seconds": sec, "tokens_per_s": tokens / sec, "log": proc.stderr.strip().splitlines()[-n:]}
        print(f"{n} GPU(s): {sec:.1f} s end to end, {tokens / sec:.0f} tokens/s")
    if args.gpus > 1:
        result["scaling"] = result["runs"][args.gpus]["tokens_per_s"] / result["runs"][1]["tokens_per_s"]
        print(f"scaling {args.gpus} GPUs / 1 GPU: {result['scaling']:.2f}×")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
