"""Calibration time and checkpoint size on a 650M-shaped stress model (random weights with planted
outliers: pretrained weights cannot be downloaded here): the default recipe, plain PCA keys (pca-keys), equal
widths (uniform-bits) and one LUT per head (head-lut). Prints a table. Run on a GPU:

    python scripts/calibration_cost.py OUT_DIR [--size 650M] [--device cuda]
"""

import argparse
import os
import time
import torch

from esm_turbo.fasta import CALIBRATION_DATA, read_fastas
from esm_turbo.model.calibrate import calibrate
from esm_turbo.model.checkpoint import PRESETS
from esm_turbo.testing import stress_esm2


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--size", default="650M")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    model = stress_esm2(size=args.size, seed=0).to(device)
    records = read_fastas([str(CALIBRATION_DATA / "calibration.fasta")])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    for preset in ("default", "pca-keys", "uniform-bits", "head-lut"):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        cal = calibrate(model, records, PRESETS[preset], progress=False)
        path = cal.save(os.path.join(args.out, f"calibration_{preset}.safetensors"))
        seconds = time.perf_counter() - start
        print(f"{args.size}-shaped stress model (random weights + planted outliers), {preset}: "
              f"{cal.meta['calibration_sequences']} sequences, {cal.meta['calibration_tokens']} tokens, "
              f"calibrate + save {seconds:.1f} s, checkpoint {os.path.getsize(path) / 1e6:.2f} MB, {name}", flush=True)
        os.remove(path)


if __name__ == "__main__":
    main()
