"""How many one-warp programs a multiprocessor the pure-read floor (``bench.read.read_words``) should run, by size:
one CUDA graph of launches of the same size, each over a buffer of its own (so none is in L2), µs a launch at each
count of programs an SM. ``bench.timing.READ_PROGRAMS_PER_SM`` holds the counts a floor takes the fastest of.

    python tools/read_floor_programs.py --out results/gpu/read_floor_h100.txt
"""
from __future__ import annotations

import argparse

import torch

from esm_turbo.bench.timing import READ_PROGRAMS_PER_SM, launches_us, step_launches
from esm_turbo.kernels.common import num_sms
from study_common import stream

#: megabytes a launch: a small rotation's or LayerNorm's, a 650M and a 3B linear's 4-bit weight, a 3B fp16 linear's,
#: a decode walk's
SIZES_MB = (0.9, 3.6, 11.0, 14.5, 52.0, 512.0)
PER_SM = (1, 2, 4, 8, 12, 16, 24, 32)


@torch.no_grad()
def rows(sizes=SIZES_MB, per_sm=PER_SM, budget: float = 1.5e9):
    """The report's lines (CUDA): for each size in MB, µs a launch at each count of ``per_sm`` programs an SM, over
    about ``budget`` bytes of buffers, and the floor's read rate (the fastest of its counts)."""
    dev = torch.device("cuda")
    sms = num_sms(dev)
    yield (f"{torch.cuda.get_device_name()}, {sms} SMs: µs a launch of read_words in one graph of launches, each over "
           f"its own buffer; the floor takes the fastest of {READ_PROGRAMS_PER_SM} programs an SM")
    yield "  MB      launches  " + "".join(f"{p:>8}/SM" for p in per_sm) + "   best GB/s"
    for mb in sizes:
        n = int(mb * 1e6)
        count = max(2, min(200, int(budget // n)))
        bufs = step_launches([n] * count, dev)
        us = [launches_us(bufs, sms * p, dev) / count for p in per_sm]
        best = min(us[per_sm.index(p)] for p in READ_PROGRAMS_PER_SM)
        yield f"  {mb:6.1f}  {count:8}  " + "".join(f"{u:11.2f}" for u in us) + f"   {n / best / 1e3:9.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    stream(rows(), ap.parse_args().out)


if __name__ == "__main__":
    main()
