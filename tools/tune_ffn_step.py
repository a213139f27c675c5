"""A block's feed-forward half at a decode step's few rows, on the GPU: what the step ran before (cuBLAS FFN up,
GELU, cuBLAS FFN down, the residual add with the LayerNorm after it: four launches) against the one persistent
launch (esm_turbo.kernels.ffn_step) with plan()'s tiles and over a grid of launches, beside one read of the two
weights at a pure read's rate measured in the same run. Each runs over enough distinct layers' weights in one CUDA
graph that none is in L2 when it is read (as in a step): µs per block = the replay's time / the layers.

    python tools/tune_ffn_step.py [--sizes 650M 3B] [--rows 16 48 195 256] [--out results/gpu/ffn_step_h100.json]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from esm_turbo.bench.step import read_rate_gbs
from esm_turbo.kernels.ffn_step import FfnPlan, ffn_step, ffn_step_reference, plan
from esm_turbo.kernels.common import num_sms
from esm_turbo.kernels.norm import add_layer_norm_triton
from esm_turbo.model.sizes import esm2_config
from tune_gemm import log
from tune_split import per_product_us, save

GRID = dict(bm=(64, 128), bn1=(64, 128), bn2=(64, 128), bk=(64,), split=(0,), warps=(4,), stages=(3, 4),
            prefetch=(False, True))


def four_launches(h, x, lay, eps):
    """The step's feed-forward half before: cuBLAS up, F.gelu, cuBLAS down, the add and LayerNorm in one launch."""
    w1, b1, w2, b2, nw, nb = lay
    return add_layer_norm_triton(h, F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), nw, nb, eps)


def block_row(size: str, m: int, rate: float, sweep: bool, parts: list | None = None) -> dict:
    dev = torch.device("cuda")
    cfg = esm2_config(size)
    d, fd = cfg.hidden_size, cfg.intermediate_size
    count = max(4, min(48, (512 << 20) // (4 * d * fd)))
    layers = [((torch.randn(fd, d, device=dev) / d ** 0.5).half(), (0.1 * torch.randn(fd, device=dev)).half(),
               (torch.randn(d, fd, device=dev) / fd ** 0.5).half(), (0.1 * torch.randn(d, device=dev)).half(),
               (1 + 0.1 * torch.randn(d, device=dev)).half(), (0.1 * torch.randn(d, device=dev)).half())
              for _ in range(count)]
    x = torch.randn(m, d, device=dev).half()
    h = torch.randn(m, d, device=dev).half()
    eps = 1e-5
    want = ffn_step_reference(h, x, *layers[0][:4], *layers[0][4:], eps)
    base = four_launches(h, x, layers[0], eps)
    err_base = max((a.float() - b.float()).abs().max().item() for a, b in zip(base, want))
    row = dict(size=size, rows=m, d=d, f=fd, layers=count, read_us=4 * d * fd / (rate * 1e9) * 1e6,
               four_launches_us=per_product_us(lambda lay: four_launches(h, x, lay, eps), layers, dev))
    chosen = plan(m, d, num_sms(dev))

    def kernel_us(launch: FfnPlan) -> float | None:
        try:
            got = ffn_step(h, x, *layers[0][:4], *layers[0][4:], eps, launch=launch)
        except Exception as e:  # noqa: BLE001 - a launch that does not build (shared memory) is skipped
            log(f"  {launch}: {type(e).__name__}: {str(e)[:120]}")
            return None
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
        if err > 2 * err_base + 1e-2:
            log(f"  {launch}: misses the reference by {err:.3g} (cuBLAS's path {err_base:.3g})")
            return None
        return per_product_us(lambda lay: ffn_step(h, x, *lay[:4], *lay[4:], eps, launch=launch), layers, dev)

    row["plan"] = dict(launch=chosen.__dict__, us=kernel_us(chosen))
    if parts is not None:  # each launch of the four alone, and each stage of the kernel alone (three launches)
        w1, b1, w2, b2, nw, nb = layers[0]
        f = F.gelu(F.linear(x, w1, b1))
        y = F.linear(f, w2, b2)
        row["four"] = {name: per_product_us(fn, layers, dev) for name, fn in (
            ("up", lambda lay: F.linear(x, lay[0], lay[1])), ("gelu", lambda lay: F.gelu(f)),
            ("down", lambda lay: F.linear(f, lay[2], lay[3])),
            ("add_ln", lambda lay: add_layer_norm_triton(h, y, lay[4], lay[5], eps)))}
        for launch in parts:
            launch = plan(m, d, num_sms(dev), launch)
            one = kernel_us(launch)
            if one is None:
                continue
            stages = [per_product_us(lambda lay, i=i: ffn_step(h, x, *lay[:4], *lay[4:], eps, launch=launch,
                                                             staged=True, only=i), layers, dev) for i in (1, 2, 3)]
            row.setdefault("stages", []).append(dict(launch=launch.__dict__, stages_us=stages, one_us=one))
            log(f"  {launch}: stages {[round(t, 1) for t in stages]} µs, one launch {one or float('nan'):.1f}"
                f"; four launches {[round(t, 1) for t in row['four'].values()]}")
    if sweep:
        grid, seen = [], set()
        for values in itertools.product(*GRID.values()):
            launch = plan(m, d, num_sms(dev), FfnPlan(*values))
            if launch in seen:
                continue
            seen.add(launch)
            us = kernel_us(launch)
            if us is not None:
                grid.append(dict(launch=launch.__dict__, us=us))
        row.update(grid=grid, best=min(grid, key=lambda r: r["us"]) if grid else None)
    best = row.get("best") or {}
    log(f"{size} rows {m:4}: read {row['read_us']:6.1f} µs, four launches {row['four_launches_us']:6.1f}, "
        f"plan {row['plan']['us'] or float('nan'):6.1f}, best {best.get('us') or float('nan'):6.1f} "
        f"{best.get('launch', '')}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["650M", "3B"])
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 48, 64, 195, 256])
    ap.add_argument("--no-sweep", action="store_true", help="plan()'s launch only")
    ap.add_argument("--out", default=None, help="JSON here (and the table beside it, .txt)")
    ap.add_argument("--stages", action="store_true", help="also each stage alone and each of the four launches alone, "
                    "for row tiles of 64 and 128, K steps of 64 to 256, deeper pipelines and a "
                    "barrier that sleeps between looks")
    args = ap.parse_args()
    parts = [FfnPlan(bm, bn, bn, bk, 0, 4, st, False, backoff) for bm, bn, bk, st, backoff in
             ((64, 64, 64, 4, 0), (64, 64, 64, 4, 200), (64, 64, 128, 4, 0), (64, 64, 128, 6, 0),
              (64, 64, 256, 4, 0), (128, 128, 64, 4, 0))] if args.stages else None
    dev = torch.device("cuda")
    rate = read_rate_gbs(dev)
    rows = [block_row(size, m, rate, not args.no_sweep, parts) for size in args.sizes for m in args.rows]
    lines = [f"a block's feed-forward half (up, GELU, down, add + LayerNorm), fp16, µs a block over cold weights "
             f"({torch.cuda.get_device_name()}; one read at {rate:.0f} GB/s, measured here)",
             "  size  rows   read  four launches   one launch (plan)  best  four/best  best launch"]
    for r in rows:
        best = r.get("best") or {}
        plan_us = r["plan"]["us"] or float("nan")
        best_us = best.get("us") or plan_us
        lines.append(f"  {r['size']:5} {r['rows']:4} {r['read_us']:6.1f} {r['four_launches_us']:10.1f} "
                     f"{plan_us:14.1f} {best_us:12.1f} {r['four_launches_us'] / best_us:7.2f}   "
                     f"{best.get('launch', '')}")
    save(args.out, "\n".join(lines), rate, rows)


if __name__ == "__main__":
    main()
