"""A decode step's matrix products at its few rows in cuBLAS, laid out every way the step could hold them (GPU): the
same product y = x Wᵀ + b [M, N] over cold weights, each way beside one read of the weight at a pure read's rate
measured in the same run, and the largest difference from the first way's output (the ways differ only in cuBLAS's
choice of kernel, so in rounding).

Ways: ``linear`` F.linear(x, W, b) with W [N, K] (the step today); ``nn`` addmm(b, x, Wᵀ) with Wᵀ stored [K, N];
``swapped`` addmm(b, W, xᵀ) → yᵀ [N, M] (the rows as the product's narrow side); ``reduced`` ``linear`` with fp16
reductions allowed (cuBLAS may then split K and add the parts in fp16); ``lt`` ``linear`` with cuBLASLt preferred.
Each product runs over enough distinct weights in one CUDA graph that none is in L2 when it is read: µs a product =
the replay's time / the weights.

    python tools/product_layouts.py [--sizes 650M 3B] [--rows 16 48 64 195 256] [--out results/gpu/layouts.txt]
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from esm_turbo.bench.step import read_rate_gbs
from esm_turbo.bench.timing import time_graph
from esm_turbo.model.sizes import esm2_config
from study_common import stream

WAYS = ("linear", "nn", "swapped", "reduced", "lt")


@contextlib.contextmanager
def _flags(way: str):
    """cuBLAS's global switches for ``way``, put back afterwards."""
    reduced = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    lib = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = way == "reduced"
        if way == "lt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced
        torch.backends.cuda.preferred_blas_library(lib)


def product(way: str, x: torch.Tensor, xt: torch.Tensor, w: torch.Tensor, wt: torch.Tensor, b: torch.Tensor):
    """y [M, N] (``swapped``: yᵀ [N, M]) of x [M, K] (xt = xᵀ), W [N, K] (wt = Wᵀ stored [K, N]) and b [N]."""
    if way == "nn":
        return torch.addmm(b, x, wt)
    if way == "swapped":
        return torch.addmm(b[:, None], w, xt)
    return F.linear(x, w, b)


def shapes(size: str) -> list[tuple[str, int, int]]:
    """(product, N, K) of a block's four products at model ``size``."""
    cfg = esm2_config(size)
    d, f = cfg.hidden_size, cfg.intermediate_size
    return [("qkv", 3 * d, d), ("o", d, d), ("ffn_up", f, d), ("ffn_down", d, f)]


def row(size: str, name: str, n: int, k: int, m: int, rate: float) -> str:
    dev = torch.device("cuda")
    count = max(4, min(64, (256 << 20) // (n * k * 2)))
    ws = [(torch.randn(n, k, device=dev) / k ** 0.5).half() for _ in range(count)]
    wts = [w.t().contiguous() for w in ws]
    b = (0.1 * torch.randn(n, device=dev)).half()
    x = torch.randn(m, k, device=dev).half()
    xt = x.t().contiguous()
    ref = F.linear(x, ws[0], b).float()
    cells = []
    for way in WAYS:
        with _flags(way):
            y = product(way, x, xt, ws[0], wts[0], b).float()
            diff = ((y.t() if way == "swapped" else y) - ref).abs().max().item()
            us = time_graph(lambda: [product(way, x, xt, w, wt, b) for w, wt in zip(ws, wts)], dev) * 1e6 / count
        cells.append(f"{us:7.1f}{'*' if diff > 0 else ' '}")
    read = n * k * 2 / (rate * 1e9) * 1e6
    return f"  {size:5} {name:8} {m:5} {read:6.1f}  " + " ".join(cells)


def table(sizes: list[str], rows: list[int]):
    """The table's lines: its header, then a line a size, product and row count (:func:`row`)."""
    rate = read_rate_gbs(torch.device("cuda"))
    yield (f"a step's products in cuBLAS by layout, fp16, µs a product over cold weights "
           f"({torch.cuda.get_device_name()}; one read at {rate:.0f} GB/s, measured here; * rounds differently from "
           f"linear)")
    yield "  size  product   rows   read  " + " ".join(f"{w:>8}" for w in WAYS)
    for size in sizes:
        for name, n, k in shapes(size):
            for m in rows:
                yield row(size, name, n, k, m, rate)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["650M", "3B"])
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 48, 64, 195, 256])
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args(argv)
    stream(table(args.sizes, args.rows), args.out)


if __name__ == "__main__":
    main()
