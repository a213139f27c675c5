"""The predicted-values walks' launch choices, on the GPU: each kernel's time at the default launch (profiled), then
the walks and their merge (the keys alone, ``--bits 2 --predict-values``) over a grid of launches — feature heads a
pooling program (through the pooled sums it may hold), its tile and warps, the scores walk's warps, the splits of
each row — each checked against the default's output and timed as ``esm-turbo bench`` times (a CUDA graph replayed
after an L2 flush, median µs), beside the plain 3.0-bit walk in the same run. The occupancy each choice compiles to
is static: ``python tools/sass_mix.py --predicted``. Last, the launches ranked for every shape at once.

    python tools/predicted_tune.py [--shapes 650M 8M] [--out R.txt]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from contextlib import contextmanager

import torch

from esm_turbo.bench.step import profile_step
from esm_turbo.bench.synthetic import fill_synthetic, step_args
from esm_turbo.bench.timing import time_graph
from esm_turbo.cache import KVCache
from esm_turbo.kernels.decode import compressed_attention_triton
from esm_turbo.kernels.decode import predicted as walks
from esm_turbo.ops.predicted import codec_walk_tables, predicted_attention_triton
from predicted_speed import codecs

#: name → (heads, head_dim, batch, cached tokens a row)
SHAPES = {"8M": (20, 16, 64, 4096), "150M": (20, 32, 64, 4096), "650M": (20, 64, 64, 4096), "3B": (40, 64, 64, 4096)}
#: the grid: pooled sums a program holds (fixes its feature heads), pooling tile, pooling warps, scores warps, splits
GRID = dict(pooled=(4096, 8192, 16384), tile=(16, 32), pool_warps=(4, 8), score_warps=(4, 8), splits=(None, 2, 4))
#: rows printed a shape, fastest first
TOP = 12


@contextmanager
def launch(pooled: int, tile: int, pool_warps: int, score_warps: int):
    """The walks' module constants and tile rule set to one launch choice for the block's calls."""
    saved = walks.POOLED_SUMS, walks.pool_tile, walks.POOL_WARPS, walks.SCORE_WARPS
    walks.POOLED_SUMS, walks.POOL_WARPS, walks.SCORE_WARPS = pooled, pool_warps, score_warps
    walks.pool_tile = lambda heads, dim: tile
    try:
        yield
    finally:
        walks.POOLED_SUMS, walks.pool_tile, walks.POOL_WARPS, walks.SCORE_WARPS = saved


def shape_rows(name: str, log, dev: torch.device = torch.device("cuda")) -> tuple[float, list[tuple]]:
    """The lines of one shape of :data:`SHAPES` (on ``dev``: CUDA, or a CPU under Triton's interpreter to try it);
    returns the default launch's µs and every launch's row (µs, pooled, tile, pooling warps, scores warps, splits,
    error or the failure's name, …), fastest first."""
    heads, d, batch, t = SHAPES[name]
    plain, pred, _ = codecs(heads, d, dev)
    cache = KVCache([plain], batch, capacity=t, device=dev)
    fill_synthetic(cache, t, torch.Generator(device=dev).manual_seed(0))
    q, k_new, v_new, valid, lengths, keys, values = step_args(cache)
    tables = codec_walk_tables(pred)

    def run(splits=None):
        return predicted_attention_triton(q, k_new, v_new, valid, lengths, keys, None, pred.predictor, tables=tables,
                                          splits=splits)

    ref = run().float()
    t_plain = time_graph(lambda: compressed_attention_triton(q, k_new, v_new, valid, lengths, keys, values), dev) * 1e6
    t_default = time_graph(run, dev) * 1e6
    kernels = profile_step(run, dev)["top"] if dev.type == "cuda" else []
    parts = ", ".join(f"{k['name'].split('(')[0][:28]} {k['ms'] * 1e3:.1f}" for k in kernels)
    log(f"{name} B={batch} T={t}: plain 3.0-bit walk {t_plain:.1f} µs, keys alone {t_default:.1f} µs at the default "
        f"launch ({parts})")
    rows = []
    for pooled, tile, pw, sw, splits in itertools.product(*GRID.values()):
        if not 2 * walks.query_heads(heads) * d <= pooled:
            continue
        with launch(pooled, tile, pw, sw):
            try:
                err = ((run(splits).float() - ref).abs().max() / ref.abs().max()).item()
                us = time_graph(lambda: run(splits), dev) * 1e6
            except Exception as exc:  # a launch out of resources: reported, not fatal
                rows.append((float("inf"), pooled, tile, pw, sw, splits, type(exc).__name__))
                continue
            fc = walks.feature_chunk(heads, d)[0]
        rows.append((us, pooled, tile, pw, sw, splits, f"{err:.0e}", fc))
    rows.sort(key=lambda r: r[0])
    for us, pooled, tile, pw, sw, splits, note, *fc in rows[:TOP]:
        log(f"  {us:8.1f} µs ({us / t_default:.2f}× default)  feature heads {fc[0] if fc else '-'} (pooled {pooled}), "
            f"tile {tile}, pooling warps {pw}, scores warps {sw}, splits {splits or 'default'}; error {note}")
    del cache, keys, values
    torch.cuda.empty_cache()
    return t_default, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["650M", "8M"], choices=sorted(SHAPES))
    parser.add_argument("--out", help="also write the lines here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("predicted_tune: needs a CUDA GPU")
    out = open(args.out, "w") if args.out else None

    def log(line: str) -> None:
        print(line, flush=True)
        if out:
            print(line, file=out, flush=True)

    log(f"# {torch.cuda.get_device_name()}: the predicted walks' launches, keys alone (µs, graph after an L2 flush); "
        "the 12 fastest of each shape")
    per: dict[tuple, dict[str, float]] = {}  # launch → shape → time over the default's
    for name in args.shapes:
        t_default, rows = shape_rows(name, log)
        for us, *launch_, note in (r[:7] for r in rows):
            if us != float("inf") and float(note) < 1e-2:  # a launch that ran and gave the default's output
                per.setdefault(tuple(launch_), {})[name] = us / t_default
    ranked = sorted((math.exp(sum(map(math.log, v.values())) / len(v)), k, v) for k, v in per.items()
                    if len(v) == len(args.shapes))
    log("## one launch for every shape: the geometric mean of its time over the default's")
    for mean, (pooled, tile, pw, sw, splits), v in ranked[:TOP]:
        log(f"  {mean:.3f}  pooled {pooled}, tile {tile}, pooling warps {pw}, scores warps {sw}, splits "
            f"{splits or 'default'}  (" + ", ".join(f"{n} {x:.3f}" for n, x in v.items()) + ")")
    if out:
        out.close()


if __name__ == "__main__":
    main()
