"""A decode step's matrix products at its few rows, on the GPU: cuBLAS (``F.linear``, then the epilogue's pass)
against the split-K kernel (esm_turbo.kernels.gemm_split) with the launch plan() picks and over a grid of launches,
beside one read of the weight at a pure read's rate measured in the same run. Each product runs over enough distinct
weights in one CUDA graph that none is in L2 when it is read (as in a step, where every layer's weights are its own):
µs per product = the replay's time / the weights.

    python tools/tune_split.py [--sizes 650M 3B] [--rows 16 48 195 256] [--out results/gpu/split_h200.json]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from esm_turbo.bench.step import read_rate_gbs
from esm_turbo.bench.timing import time_graph
from esm_turbo.kernels import gemm as G
from esm_turbo.kernels.common import num_sms
from esm_turbo.kernels.gemm_split import SplitTile, plan
from esm_turbo.model.sizes import esm2_config
from tune_gemm import log as _log, rope_tables, shapes, unfused

GRID = dict(bn=(64, 128), bk=(64, 128), split=(1, 2, 4, 8, 16), stages=(4,))


def per_product_us(fn, weights: list, dev: torch.device) -> float:
    """fn(w) over every weight in one captured graph: µs per call (the replay's median)."""
    return time_graph(lambda: [fn(w) for w in weights], dev) * 1e6 / len(weights)


def packed(out, y: torch.Tensor) -> torch.Tensor:
    """``unfused``'s output as the product's [M, N]: the rotary pass's (q, k) written over a copy of y's q and k."""
    if not isinstance(out, tuple):
        return out
    y, dim = y.clone(), y.shape[1] // 3
    y[:, :dim], y[:, dim: 2 * dim] = out[0].flatten(1), out[1].flatten(1)
    return y


def product_row(size: str, name: str, epi: str, n: int, k: int, m: int, rate: float, sweep: bool) -> dict:
    dev = torch.device("cuda")
    count = max(4, min(64, (256 << 20) // (n * k * 2)))
    weights = [(torch.randn(n, k, device=dev) / k ** 0.5).half() for _ in range(count)]
    b = (0.1 * torch.randn(n, device=dev)).half()
    x = torch.randn(m, k, device=dev).half()
    h = torch.randn(m, n, device=dev).half() if epi == "residual" else None
    cfg = esm2_config(size)
    rope = rope_tables(m, cfg.hidden_size // cfg.num_attention_heads, dev) if epi == "rope" else None
    ref = G.gemm_reference(x, weights[0], b, epi, h, rope=rope).double()
    base = packed(unfused(x, weights[0], b, epi, h, rope=rope), F.linear(x, weights[0], b))
    err_base = (base.double() - ref).abs().max().item()
    eps = torch.finfo(torch.float16).eps * ref.abs().max().item()
    row = dict(size=size, product=name, epilogue=epi, rows=m, n=n, k=k, weights=count,
               read_us=n * k * 2 / (rate * 1e9) * 1e6,
               cublas_us=per_product_us(lambda w: F.linear(x, w, b), weights, dev),
               cublas_pass_us=per_product_us(lambda w: unfused(x, w, b, epi, h, rope=rope), weights, dev))
    chosen = plan(m, n, k, num_sms(dev))

    def split_us(tile: SplitTile, epilogue: str) -> float | None:
        res = h if epilogue == "residual" else None
        try:
            got = G.gemm(x, weights[0], b, epilogue, res, split=tile, rope=rope if epilogue == "rope" else None)
        except Exception as e:  # noqa: BLE001 - a launch that does not build (shared memory) is skipped
            _log(f"  {tile}: {type(e).__name__}: {str(e)[:120]}")
            return None
        if epilogue == epi and (got.double() - ref).abs().max().item() > 2 * err_base + eps:
            _log(f"  {tile}: misses the reference")
            return None
        return per_product_us(lambda w: G.gemm(x, w, b, epilogue, res, split=tile,
                                               rope=rope if epilogue == "rope" else None), weights, dev)

    row["plan"] = dict(tile=chosen.__dict__, us=split_us(chosen, epi))
    if sweep:
        grid = []
        for bn, bk, split, stages in itertools.product(*GRID.values()):
            if split > 1 and -(-k // bk) < 2 * split:
                continue
            tile = SplitTile(chosen.bm, bn, bk, split, stages, 4)
            us = split_us(tile, "bias")
            if us is not None:
                grid.append(dict(tile=tile.__dict__, bias_us=us))
        best = min(grid, key=lambda r: r["bias_us"]) if grid else None
        if best:
            best["us"] = split_us(SplitTile(**best["tile"]), epi)
        row.update(grid=grid, best=best)
    best = row.get("best") or {}
    _log(f"{size} {name:8} rows {m:4}: read {row['read_us']:6.1f} µs, cuBLAS {row['cublas_us']:6.1f} "
         f"(+ pass {row['cublas_pass_us']:6.1f}), split plan {row['plan']['us'] or float('nan'):6.1f}"
         f", best {best.get('us') or float('nan'):6.1f} {best.get('tile', '')}")
    return row


def save(out: str | None, text: str, rate: float, rows: list[dict]) -> None:
    """Print the table; with ``out``, the rows as JSON there and the table beside it (.txt)."""
    print(text)
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), read_gbs=rate, rows=rows), f, indent=1)
        with open(out.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write(text + "\n")


def measure(doc: str, rows: list[int], no_sweep: str, row_fn, what: str) -> tuple:
    """A step-products tool's run: its command line (--sizes, --rows, --no-sweep with help ``no_sweep``, --out), the
    pure read's rate, ``row_fn(size, name, epilogue, out, in, rows, rate, sweep)`` for each product and row count, and
    the table's first line (``what``, the GPU and the rate) → (args, rate, rows, title)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["650M", "3B"])
    ap.add_argument("--rows", nargs="+", type=int, default=rows)
    ap.add_argument("--no-sweep", action="store_true", help=no_sweep)
    ap.add_argument("--out", default=None, help="JSON here (and the table beside it, .txt)")
    args = ap.parse_args()
    rate = read_rate_gbs(torch.device("cuda"))
    out = [row_fn(size, name, epi, n, k, m, rate, not args.no_sweep)
           for size in args.sizes for name, epi, n, k in shapes(size) for m in args.rows]
    return args, rate, out, (f"{what}, µs a product over cold weights ({torch.cuda.get_device_name()}; one read at "
                             f"{rate:.0f} GB/s, measured here)")


def main() -> None:
    args, rate, rows, title = measure(__doc__, [16, 48, 195, 256], "plan()'s launch only", product_row,
                                      "a step's products, fp16")
    lines = [title,
             "  size  product   rows  read  cuBLAS  +pass   plan  best  plan/(cuBLAS+pass)  best launch"]
    for r in rows:
        best = r.get("best") or {}
        t = best.get("tile", {})
        launch = f"{t['bm']}x{t['bn']}x{t['bk']} split {t['split']} s{t['stages']}" if t else ""
        plan_us, best_us = r["plan"]["us"] or float("nan"), best.get("us") or float("nan")
        name = r["product"] + (":rope" if r["epilogue"] == "rope" else "")
        lines.append(f"  {r['size']:5} {name:8} {r['rows']:5} {r['read_us']:5.1f} {r['cublas_us']:7.1f} "
                     f"{r['cublas_pass_us']:6.1f} {plan_us:6.1f} {best_us:5.1f} {plan_us / r['cublas_pass_us']:10.2f}"
                     f"          {launch}")
    save(args.out, "\n".join(lines), rate, rows)


if __name__ == "__main__":
    main()
