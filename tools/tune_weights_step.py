"""A decode step's 4-bit products at its few rows, on the GPU, over cold weights: the 4-bit kernel's default launch
(``kernels.weights.launch_config``) against a grid of launches of the register-fed tensor-core kernel
(``kernels.weights_mma``) and of the tensor-core tile kernel (each with the default's programmatic dependent launch
and L2 prefetch; the default launch with each of those on and off), beside fp16 cuBLAS on the same shape, one read
of the 4-bit bytes at a pure read's rate, and each launch's own read floor in a step (a pure read of each product's
bytes as its own launch, all in one graph). Each product runs over enough distinct weights in one CUDA graph that
none is in L2 when it is read (as in a step, where every layer's weights are its own): µs per product = the replay's
time / the weights. Every launch is checked against ``matmul_reference`` first.

    python tools/tune_weights_step.py [--sizes 650M 3B] [--rows 16] [--out results/gpu/weights_step_h200.json]
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from esm_turbo.bench.timing import launch_floors_us
from esm_turbo.bench.weights import random_pass
from esm_turbo.kernels.common import num_sms
from esm_turbo.kernels.weights import launch_config, matmul_reference, matmul_triton
from tune_gemm import log, shapes
from tune_split import measure, per_product_us, save

MMA_GRID = dict(mma_warps=(2, 4, 8), mma_words=(2, 4), mma_split=(1, 2, 4, 8), mma_ahead=(0, 1))
TILE_GRID = dict(block_m=(16, 32, 64), block_k=(128, 256), split=(1, 2, 4, 8))
FLAGS = ((False, False), (True, False), (False, True), (True, True))  # (pdl, prefetch)


def cold_passes(m: int, n: int, dev: torch.device) -> tuple[list, int]:
    """Enough distinct random 4-bit passes of an [m, n] weight (8–96, about 384 MB) that none is in L2 when a graph
    reads them in turn: (the passes, the bytes of one)."""
    first = random_pass(m, n, dev, seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in first)
    count = max(8, min(96, (384 << 20) // nbytes))
    return [first] + [random_pass(m, n, dev, seed=i) for i in range(1, count)], nbytes


def products(size: str) -> list[tuple[str, str, int, int]]:
    """``tune_gemm.shapes(size)`` less the products it lists again with another fp16 epilogue (the rotary one), which
    the 4-bit kernels do not have: (name, epilogue, outputs, inputs)."""
    seen, out = set(), []
    for name, epi, m, n in shapes(size):
        if name not in seen:
            seen.add(name)
            out.append((name, epi, m, n))
    return out


def product_row(size: str, name: str, epi: str, m: int, n: int, rows: int, rate: float, sweep: bool) -> dict:
    dev = torch.device("cuda")
    weights, nbytes = cold_passes(m, n, dev)
    count = len(weights)
    x = torch.randn(rows, n, device=dev).half()
    bias = (0.1 * torch.randn(m, device=dev)).half()
    prev = torch.randn(rows, m, device=dev).half() if epi == "residual" else None
    gelu = epi == "gelu"
    codes, scales, cb = weights[0]
    ref = matmul_reference(x, codes, scales, cb).float() + bias.float()
    ref = ref + prev.float() if prev is not None else ref
    ref = F.gelu(ref) if gelu else ref
    tol = 2e-3 * ref.abs().max().item()
    w16 = [torch.randn(m, n, device=dev).half() for _ in range(max(4, min(64, (256 << 20) // (m * n * 2))))]

    def run(cfg: dict) -> float | None:
        def call(w):
            return matmul_triton(x, *w, config=cfg, bias=bias, prev=prev, gelu=gelu, out_dtype=torch.float16)
        try:
            got = call(weights[0])
        except Exception as e:  # noqa: BLE001 - a launch that does not build is skipped
            log(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
            return None
        if (got.float() - ref).abs().max().item() > tol:
            log(f"  {cfg}: misses the reference")
            return None
        return per_product_us(call, weights, dev)

    default = launch_config(rows, m, n, num_sms(dev))
    flags = [dict(pdl=p, prefetch=f, us=run(dict(pdl=p, prefetch=f))) for p, f in FLAGS]
    row = dict(size=size, product=name, epilogue=epi, rows=rows, m=m, n=n, weights=count, bytes=nbytes,
               read_us=nbytes / (rate * 1e3), launch_floor_us=launch_floors_us([nbytes] * count, dev) / count,
               fp16_us=per_product_us(lambda w: F.linear(x, w, bias), w16, dev),
               default=dict(kernel="mma" if default["mma"] else "gemv" if default["gemv"] else "tile",
                            us=flags[FLAGS.index((default["pdl"], default["prefetch"]))]["us"]),
               flags=flags)
    if sweep:
        grid = []
        for vals in itertools.product(*MMA_GRID.values()):
            cfg = dict(zip(MMA_GRID, vals), mma=True, gemv=False)
            us = run(cfg)
            if us is not None:
                grid.append(dict(kernel="mma", config=cfg, us=us))
        for vals in itertools.product(*TILE_GRID.values()):
            cfg = dict(zip(TILE_GRID, vals), mma=False, gemv=False, block_b=16, num_warps=4, num_stages=3, ahead=1)
            if n % (cfg["block_k"] * cfg["split"]):
                continue
            us = run(cfg)
            if us is not None:
                grid.append(dict(kernel="tile", config=cfg, us=us))
        row.update(grid=grid, best=min(grid, key=lambda r: r["us"]) if grid else None)
    best = row.get("best") or {}
    log("  pdl/prefetch off, pdl, prefetch, both: " + ", ".join(f"{f['us'] or float('nan'):.1f}" for f in row["flags"]))
    log(f"{size} {name:8} rows {rows:3}: read {row['read_us']:5.1f} µs, launch floor {row['launch_floor_us']:5.1f}, "
        f"fp16 {row['fp16_us']:5.1f}, default {row['default']['us'] or float('nan'):5.1f}, "
        f"best {best.get('us') or float('nan'):5.1f} {best.get('kernel', '')} {best.get('config', '')}")
    return row


def main() -> None:
    args, rate, rows, title = measure(__doc__, [16], "the default launch only", product_row, "a step's 4-bit products")
    lines = [title,
             "  size  product   rows  read  launch floor   fp16  default  best  default/best  best launch",
             "       (the default with programmatic dependent launch / L2 prefetch: off/off, on/off, off/on, on/on)"]
    for r in rows:
        best = r.get("best") or {}
        d_us, b_us = r["default"]["us"] or float("nan"), best.get("us") or float("nan")
        cfg = {k: v for k, v in best.get("config", {}).items() if k not in ("mma", "gemv")}
        lines.append(f"  {r['size']:5} {r['product']:8} {r['rows']:5} {r['read_us']:5.1f} {r['launch_floor_us']:8.1f}"
                     f"      {r['fp16_us']:6.1f} {d_us:7.1f} {b_us:6.1f} {d_us / b_us:9.2f}     "
                     f"{best.get('kernel', '')} {cfg}")
        lines.append("        " + " / ".join(f"{f['us'] or float('nan'):.1f}" for f in r["flags"]))
    save(args.out, "\n".join(lines), rate, rows)


if __name__ == "__main__":
    main()
