"""Grid codes decoded as float32 subnormals against decoded through 1.0's exponent (``launch_config``'s
``subnormal``), timed in one run on the GPU: the fused decode attention per layer call at 650M- and 15B-shaped
steps on caches of the default recipe at 4.0 and 3.0 bits all-in (random codes, widths allocated as on a trained
model), each against a pure read of its own bytes and checked bit for bit between the two; then a captured
650M-shaped decode step on the compressed cache both ways, against its floor.

    python tools/subnormal_codes.py --out results/gpu/subnormal_codes_h100.txt
"""
from __future__ import annotations

import argparse
import itertools

import torch

import esm_turbo.kernels.decode.plan as plan
from esm_turbo.bench.decode import time_fused
from esm_turbo.bench.step import read_rate_gbs, step_report
from esm_turbo.bench.synthetic import default_recipe_caches, layer_codec, stand_in_model, synthetic_session
from esm_turbo.bench.timing import time_eager
from esm_turbo.model.alphabet import alphabet
from esm_turbo.model.engine import TurboEsm
from esm_turbo.ops.compressed import attend_compressed

#: (heads, head_dim, batch, context) of the attention rows
SHAPES = ((20, 64, 64, 16384), (20, 64, 195, 1024), (20, 64, 64, 1024), (20, 64, 8, 16384), (40, 128, 64, 1024))


def attention_rows(dev: torch.device, rounds: int = 3):
    """Each of SHAPES at 4.0 and 3.0 bits: the best of ``rounds`` alternating timings either way."""
    for label, cache, inputs, read in default_recipe_caches(SHAPES, dev):
        times, outs = {False: [], True: []}, {}
        for _ in range(rounds):
            for sub in (False, True):
                plan.SUBNORMAL_CODES = sub
                times[sub].append(time_fused(cache, *inputs)[:2])
                outs[sub] = attend_compressed(cache.codecs[0], cache.parts[0], cache.lengths, *inputs)
        old, new = (min(t[0] for t in times[s]) for s in (False, True))
        old_step, new_step = (min(t[1] for t in times[s]) for s in (False, True))
        yield (f"H={cache.heads} d={cache.head_dim} B={cache.batch_size} T={int(cache.lengths.max())} {label} bits "
               f"({cache.memory_report().bits_per_value:.2f} bits): read {read:.1f} us | exponent {old:.1f} us "
               f"({read / old:.0%}), in a step {old_step:.1f} | subnormal {new:.1f} us ({read / new:.0%}), in a step "
               f"{new_step:.1f} | x{old / new:.3f} | bit for bit {torch.equal(outs[False], outs[True])}")


@torch.no_grad()
def step_rows(dev: torch.device, batches=(195, 64), rounds: int = 2):
    """The captured 650M-shaped step on the compressed cache (1,024 cached tokens a row) either way."""
    rate = read_rate_gbs(dev)
    engine = TurboEsm(stand_in_model("650M", dev, torch.float16))
    token = alphabet().get_idx("A")
    for batch in batches:
        for _ in range(rounds):
            for sub in (False, True):
                plan.SUBNORMAL_CODES = sub
                session = synthetic_session(engine, layer_codec, batch, 1024, 8)
                step = session.capture_step(torch.full((batch, 1), token, device=dev))
                ms = time_eager(step.replay, dev, reps=30) * 1e3
                rep = step_report(session, ms, rate)
                yield (f"650M step, compressed, {batch} rows x 1024: {'subnormal' if sub else 'exponent '} "
                       f"{ms:.3f} ms, floor {rep['floor_ms']:.3f} ({rep['of_floor']:.1%})")
                del session, step
                torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    default = plan.SUBNORMAL_CODES
    lines = [f"grid codes as subnormals or through 1.0's exponent ({torch.cuda.get_device_name()}); attention µs per "
             "layer call as one graph (cold L2) and per call in a step's graph; % of a pure read of its bytes"]
    print(lines[0], flush=True)
    try:
        for line in itertools.chain(attention_rows(dev), step_rows(dev)):
            print(line, flush=True)
            lines.append(line)
    finally:
        plan.SUBNORMAL_CODES = default
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
