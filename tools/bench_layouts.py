"""Fused decode attention with equal code widths vs allocated widths (shared by the heads: shifts compiled in;
or each head its own: a field layout read per head), one synthetic layer each, 3+1 bits, one new token per
sequence, the code tables (fp16 values) read as float16 and as float32; CUDA graph, median.
Prints a table (one H100 run chose the fp32 / fp16 tables of ``ops.compressed._op_table``).

    python tools/bench_layouts.py
"""

import torch

from esm_turbo.bench.synthetic import fill_synthetic
from esm_turbo.bench.timing import time_graph as _time
from esm_turbo.cache import KVCache
from esm_turbo.ops.compressed import attend_compressed, fused_tables
from esm_turbo.testing import random_turbo_codec

#: (name, allocate, widest channel, widths shared by the heads): equal widths; the default allocation (widths up
#: to bits + 1, the same for every head: shifts compiled in); each head its own (a layout read per head); bits + 2
VARIANTS = (("uniform", False, None, True), ("alloc", True, None, True), ("per-head", True, None, False),
            ("cap5", True, 5, True))
SHAPES = ((20, 64, 64, 16384), (20, 64, 8, 16384), (40, 128, 8, 16384), (20, 64, 1, 1024))  # H, d, B, T


def main() -> None:
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}")
    for heads, dim, batch, length in SHAPES:
        for name, allocate, max_bits, shared in VARIANTS:
            codec = random_turbo_codec(heads, dim, 3, 3, "sign", 0, allocate=allocate, max_bits=max_bits,
                                       shared=shared).to(dev)
            cache = KVCache([codec], batch, capacity=length, device=dev)
            fill_synthetic(cache, length, torch.Generator(device=dev).manual_seed(0))
            q = torch.randn(batch, heads, 1, dim, device=dev, dtype=torch.float16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            valid = torch.ones(batch, 1, dtype=torch.bool, device=dev)
            tables = fused_tables(codec)
            timed = []
            for dtype in (torch.float16, torch.float32):  # the same fp16 values, read in either dtype
                tables.k_tab, tables.v_tab = tables.k_tab.to(dtype), tables.v_tab.to(dtype)
                timed.append(_time(lambda: attend_compressed(codec, cache.parts[0], cache.lengths, q, k, v, valid),
                                   dev) * 1e6)
            print(f"H{heads} d{dim} B{batch} T{length} {name:8s} K={codec.key.centroids.shape[-1]} "
                  f"fp16 tables {timed[0]:9.1f} us, fp32 tables {timed[1]:9.1f} us", flush=True)


if __name__ == "__main__":
    main()
