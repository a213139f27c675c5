"""Where the register-fed 4-bit kernel's time goes at a decode step's 16 rows (H100): each 3B-shaped product over cold
weights with its default register-fed launch (``kernels.weights.launch_config``'s mma_* keys), then with a stage
left out (``kernels.weights_mma``'s ``PROBE``; results then wrong): the input read once before the walk, the codes
and scales read once (their look-ups then leave the loop too), both; beside each product's launch floor in a step
(a pure read of its bytes as a launch of its own, all in one graph: ``bench.timing.launch_floors_us``).

    python tools/weights_stages.py [--sizes 3B] [--out results/gpu/weights_stages_h100.txt]
"""
from __future__ import annotations

import argparse

import torch

from esm_turbo.bench.timing import launch_floors_us
from esm_turbo.kernels.common import num_sms
from esm_turbo.kernels.weights import launch_config, matmul_triton
from study_common import stream
from tune_split import per_product_us
from tune_weights_step import cold_passes, products

#: the columns: the kernel whole, then with PROBE 1, 2 and 3
STAGES = ("whole", "input once", "codes once", "both once")


def product_row(name: str, m: int, n: int, rows: int, dev: torch.device) -> str:
    """One product's line: µs a product, the floor and each probe."""
    weights, nbytes = cold_passes(m, n, dev)
    x = torch.randn(rows, n, device=dev).half()
    floor = launch_floors_us([nbytes] * len(weights), dev) / len(weights)
    d = launch_config(rows, m, n, num_sms(dev))
    cfg = dict(mma=True, gemv=False, **{k: d[k] for k in ("mma_warps", "mma_words", "mma_split", "mma_ahead")})
    times = []
    for probe in range(len(STAGES)):
        c = dict(cfg, mma_probe=probe)

        def call(w, c=c):
            return matmul_triton(x, *w, config=c, out_dtype=torch.float16)
        call(weights[0])
        times.append(min(per_product_us(call, weights, dev) for _ in range(3)))
    launch = ", ".join(f"{k[4:]} {cfg[k]}" for k in ("mma_warps", "mma_words", "mma_split"))
    return (f"  {name:8} {m:6} {n:6} {floor:6.1f}  " + "  ".join(f"{t:10.1f}" for t in times)
            + f"  {times[0] / floor:11.2f}  {launch}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["3B"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    head = [f"# python tools/weights_stages.py --sizes {' '.join(args.sizes)} --rows {args.rows}",
            f"# {torch.cuda.get_device_name()}: the register-fed 4-bit kernel's default launch, µs a product over "
            "cold weights: whole, the input read once before the walk, the codes and scales read once (their look-ups "
            "leave the loop too), both; the floor: a pure read of the product's bytes as a launch in a step",
            "  product      out     in  floor  " + "  ".join(f"{s:>10}" for s in STAGES) + "  whole/floor  launch"]

    def rows():
        for size in args.sizes:
            yield f"{size}, {args.rows} rows"
            for name, _, m, n in products(size):
                yield product_row(name, m, n, args.rows, dev)
    stream(rows(), args.out, header="\n".join(head) + "\n")


if __name__ == "__main__":
    main()
