"""The decode walk asking the codes of a tile n tiles ahead into L2 beside its register double buffer
(``kernels.decode.plan.L2_AHEAD``; 0: none), timed in one run on the GPU at 650M- and 15B-shaped steps on caches of
the default recipe at 4.0 and 3.0 bits all-in (random codes, widths allocated as on a trained model), each against a
pure read of its own bytes. Every width takes the look-ahead here (the default takes it below
``plan.L2_AHEAD_BELOW`` code bits a channel). Timed as ``esm-turbo bench`` times it: one call as a CUDA graph (cold
L2) and per call inside a step's graph, the best of three rounds taken in turn.

    python tools/l2_ahead.py --out results/gpu/l2_ahead_h100.txt
"""
from __future__ import annotations

import argparse

import torch

import esm_turbo.kernels.decode.plan as plan
from esm_turbo.bench.decode import time_fused
from esm_turbo.bench.synthetic import default_recipe_caches

#: (heads, head_dim, batch, context)
SHAPES = ((20, 64, 64, 16384), (20, 64, 195, 1024), (20, 64, 8, 16384), (40, 128, 64, 1024))


def rows(dev: torch.device, aheads: list[int], rounds: int = 3):
    """A line for each shape, bit budget and look-ahead."""
    torch.manual_seed(0)
    for label, cache, inputs, read in default_recipe_caches(SHAPES, dev):
        times = {a: [] for a in aheads}
        for _ in range(rounds):
            for a in aheads:
                plan.L2_AHEAD = a
                times[a].append(time_fused(cache, *inputs)[:2])
        for a in aheads:
            one, step = (min(t[i] for t in times[a]) for i in (0, 1))
            yield (f"ahead{a} H={cache.heads} d={cache.head_dim} B={cache.batch_size} T={int(cache.lengths.max())} "
                   f"{label} bits: read {read:.1f} one {one:.1f} ({read / one:.0%}) step {step:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aheads", nargs="+", type=int, default=[0, 2, 3])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    saved = plan.L2_AHEAD, plan.L2_AHEAD_BELOW
    plan.L2_AHEAD_BELOW = 1 << 8  # every width
    lines = [f"# python tools/l2_ahead.py ({torch.cuda.get_device_name()}); µs a layer call: one call as a CUDA graph "
             "(cold L2), and per call in a step's graph; % of a pure read of its bytes"]
    print(lines[0], flush=True)
    try:
        for line in rows(dev, args.aheads):
            print(line, flush=True)
            lines.append(line)
    finally:
        plan.L2_AHEAD, plan.L2_AHEAD_BELOW = saved
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
