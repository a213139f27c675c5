"""The register-fed 4-bit kernel with a register cap (``mma_maxnreg``: with more room than its own choice of 68 a
thread, ptxas issues a step's input loads and the next step's code loads at the step's start) against its default
launch, each product over cold weights at a decode step's rows, on the GPU: µs a product, the best of three
interleaved runs, every launch checked against ``matmul_reference`` first. ``--design``: then the 3B-shaped design
step (``bench.weights.decode_step``) with each cap as ``matmul.MMA_MAXNREG`` (0: none).

    python tools/mma_regs_speed.py [--sizes 3B 15B 650M] [--rows 16 8] [--caps 96 128] [--design 0 96] [--out FILE]
"""
from __future__ import annotations

import argparse

import torch

from esm_turbo.bench.timing import launch_floors_us
from esm_turbo.kernels.common import num_sms
from esm_turbo.kernels.weights import launch_config, matmul_reference, matmul_triton
from study_common import stream
from tune_split import per_product_us
from tune_weights_step import cold_passes, products


def product_line(size: str, name: str, m: int, n: int, rows: int, caps: list[int], dev: torch.device) -> str:
    """One product's line: its launch floor, the default launch's µs and each cap's (its speed against the default)."""
    weights, nbytes = cold_passes(m, n, dev)
    first, count = weights[0], len(weights)
    x = torch.randn(rows, n, device=dev).half()
    ref = matmul_reference(x, *first).float()
    base = dict(launch_config(rows, m, n, num_sms(dev)), mma=True, gemv=False, mma_maxnreg=None)
    cfgs = [base] + [dict(base, mma_maxnreg=c) for c in caps]
    times: list[list[float]] = [[] for _ in cfgs]
    for _ in range(3):
        for i, cfg in enumerate(cfgs):
            def call(w, cfg=cfg):
                return matmul_triton(x, *w, config=cfg, out_dtype=torch.float16)
            err = (call(first).float() - ref).abs().max().item() / ref.abs().max().item()
            assert err < 2e-3, (cfg, err)
            times[i].append(per_product_us(call, weights, dev))
    best = [min(t) for t in times]
    floor = launch_floors_us([nbytes] * count, dev) / count
    return (f"  {size:5} {name:8} {rows:4} {floor:6.1f} {best[0]:8.1f}  "
            + "  ".join(f"{b:6.1f} ({best[0] / b:4.2f}×)" for b in best[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["3B", "15B", "650M"])
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 8])
    ap.add_argument("--caps", nargs="+", type=int, default=[96, 128])
    ap.add_argument("--design", type=int, nargs="*", default=[],
                    help="then the 3B design step with each of these as matmul.MMA_MAXNREG (0: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    head = [f"# python tools/mma_regs_speed.py --sizes {' '.join(args.sizes)} --rows "
            f"{' '.join(map(str, args.rows))} --caps {' '.join(map(str, args.caps))}",
            f"# {torch.cuda.get_device_name()}: µs a product over cold weights; the default register-fed launch, then "
            "with a register cap (its speed against the default's)",
            "  size  product  rows  floor  default  " + "  ".join(f"cap {c:<10}" for c in args.caps)]
    stream((product_line(size, name, m, n, rows, args.caps, dev) for size in args.sizes
            for name, _, m, n in products(size) for rows in args.rows), args.out, header="\n".join(head) + "\n")
    from esm_turbo.bench.weights import decode_step
    from esm_turbo.kernels.weights import matmul
    for cap in args.design:
        matmul.MMA_MAXNREG = cap or None
        step = decode_step("3B", dev)
        print(f"design step, mma_maxnreg {cap or 'none'}: fp16 weights {step['fp16_ms']:.3f} ms, 4-bit "
              f"{step['4-bit_ms']:.3f} ({step['fp16_ms'] / step['4-bit_ms']:.2f}×), products free {step['free_ms']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
