"""Peak GPU memory of embedding with a 4-bit ESMC-6B-shaped model (random codes: memory does not depend on the
values), against the fp16 model's weight bytes: the model is built straight into its quantized form on the GPU
(:func:`esm_turbo.weights.random_model`, no fp16 copy at any point), then ``esm-turbo embed``'s engine runs the
calibration sequences, mean of the last layer, at a few token budgets.

    python scripts/esmc_6b_4bit_memory.py --out results/esmc/memory_6b_4bit_h100.json   (GPU)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from esm_turbo.embed.benchmark import _NullWriter
from esm_turbo.embed.extract import EmbedConfig, Embedder
from esm_turbo.fasta import read_fastas
from esm_turbo.model.sizes import esmc_config
from esm_turbo.weights import WeightQuantConfig, weight_memory
from esm_turbo.weights.model import random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="ESMC-6B")
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--fasta", default="calibration_data/calibration.fasta")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = esmc_config(args.size)
    cfg._attn_implementation = "sdpa"
    model = random_model(cfg, device, WeightQuantConfig(bits=4, group=32))
    mem = weight_memory(model)
    records = read_fastas([args.fasta])
    rows = []
    for budget in args.budgets:
        embedder = Embedder(model, EmbedConfig(include=["mean"], toks_per_batch=budget, dtype="fp16"), device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        embedder.run(records, _NullWriter(), progress=False)
        rows.append(dict(toks_per_batch=budget, peak_gib=torch.cuda.max_memory_allocated() / 2**30))
        print(rows[-1], flush=True)
        del embedder
        torch.cuda.empty_cache()
    result = dict(command="python scripts/esmc_6b_4bit_memory.py --out results/esmc/memory_6b_4bit_h100.json",
                  device=torch.cuda.get_device_name(device), size=args.size, weights_gib=mem["total_bytes"] / 2**30,
                  fp16_weights_gib=mem["fp16_bytes"] / 2**30, ratio_vs_fp16=mem["ratio_vs_fp16"], rows=rows)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
