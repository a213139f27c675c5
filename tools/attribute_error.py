"""Where decode error comes from: the default 3+1-bit recipe with both K and V quantized, keys only
(values stored exactly) and values only, on a stress model (every third held-out sequence, 16 steps).

    python tools/attribute_error.py 256 6   # stress-6L-d64 (hidden 256, 4 heads)
    python tools/attribute_error.py 64 4    # stress-4L-d16
"""

import argparse

import torch

from esm_turbo.fasta import CALIBRATION_DATA, read_fastas
from esm_turbo.model.calibrate import calibrate
from esm_turbo.model.checkpoint import CalibrationConfig
from esm_turbo.model.engine import TurboEsm
from esm_turbo.model.evaluate import evaluate
from esm_turbo.quant.codec import DenseQuantizer, KVCodec
from esm_turbo.testing import stress_esm2


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hidden", type=int)
    ap.add_argument("layers", type=int)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--residual", default="sign")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = stress_esm2(layers=args.layers, hidden=args.hidden, heads=4, seed=0)
    cal = read_fastas([str(CALIBRATION_DATA / "calibration.fasta")])
    held_out = read_fastas([str(CALIBRATION_DATA / "evaluation.fasta")])[::3]
    c = calibrate(model, cal, CalibrationConfig(key_index_bits=args.bits, value_index_bits=args.bits, residual=args.residual),
                  progress=False)
    engine = TurboEsm(model)
    variants = {
        "both": lambda i, h, d: c.codecs[i],
        "K only": lambda i, h, d: KVCodec(c.codecs[i].key, DenseQuantizer(h, d)),
        "V only": lambda i, h, d: KVCodec(DenseQuantizer(h, d), c.codecs[i].value),
    }
    for name, factory in variants.items():
        r = evaluate(engine, held_out, cache=factory, max_steps=16, progress=False)
        cos = [s["decode_cos_mean"] for s in r["sequences"]]
        print(f"{name:8s} cos mean {sum(cos) / len(cos):.4f} worst {min(cos):.4f}"
              f" attn {[round(x, 3) for x in r['layers']['attn_rel_err']]}"
              f" kl {[round(x, 3) for x in r['layers']['score_kl']]}", flush=True)


if __name__ == "__main__":
    main()
