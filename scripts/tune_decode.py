"""Time the fused decode-attention kernel alone under several launch configs (GPU); prints a table.
Used to pick the defaults of ``compressed_attention_triton``; the notes are in results/README.md.

    python scripts/tune_decode.py            # split-K launch configs
    python scripts/tune_decode.py single     # one-launch vs three-launch path for small steps
    python scripts/tune_decode.py prefetch   # next-tile prefetch on the bench's grid
    python scripts/tune_decode.py quantize   # quantize-and-pack configs"""

import itertools

import torch
import triton.testing

from esm_turbo.bench import _synthetic_cache
from esm_turbo.kernels.decode import compressed_attention_triton
from esm_turbo.ops.compressed import fused_tables


def step_args(heads: int, d: int, batch: int, t: int, dev: torch.device):
    """(codec, arguments of ``compressed_attention_triton``) for one fp16 query per row over a random
    3+1-bit cache of ``t`` tokens per row."""
    cache = _synthetic_cache(heads, d, batch, t, dev)
    codec = cache.codecs[0]
    tab = fused_tables(codec)
    p = cache.parts[0]
    q = torch.randn(batch, heads, 1, d, device=dev, dtype=torch.float16)
    y = torch.randn(batch, heads, 1, d, device=dev, dtype=torch.float16)
    valid = torch.ones(batch, 1, dtype=torch.uint8, device=dev)
    key, value = codec.key, codec.value
    return codec, (q, y, y, valid, *tab.packed(p, "k"), *tab.packed(p, "v"), tab.k_tab, tab.v_tab, tab.k_layout,
                   tab.v_layout, cache.lengths,
                   key.rot, key.offset, key.scale, value.rot, value.offset, value.scale, tab.k_codes.bits,
                   tab.v_codes.bits, tab.k_fields, tab.v_fields)


def main():
    dev = torch.device("cuda")
    configs = [dict(block_t=bt, num_warps=w, waves=wv)
               for bt, w, wv in itertools.product((16, 32, 64), (2, 4, 8), (4, 8))]
    print(f"{'heads':>5} {'d':>4} {'B':>3} {'T':>6} | best config -> µs (GB/s) | default µs")
    for heads, d, batch, t in ((20, 64, 1, 1024), (20, 64, 8, 16384), (20, 64, 64, 4096), (40, 128, 8, 4096)):
        codec, args = step_args(heads, d, batch, t, dev)
        nbytes = codec.bytes_per_token() * heads * batch * t
        results = []
        ref = compressed_attention_triton(*args)
        for cfg in configs:
            try:
                out = compressed_attention_triton(*args, config=cfg)
                assert torch.allclose(out, ref, atol=1e-4, rtol=1e-3)
                us = triton.testing.do_bench(lambda: compressed_attention_triton(*args, config=cfg),
                                             warmup=10, rep=40, return_mode="median") * 1e3
                results.append((us, cfg))
            except Exception as err:  # noqa: BLE001 - a config that does not compile is skipped
                print("  skip", cfg, type(err).__name__)
        default = triton.testing.do_bench(lambda: compressed_attention_triton(*args), warmup=10, rep=40,
                                          return_mode="median") * 1e3
        results.sort(key=lambda x: x[0])
        for us, cfg in results[:3]:
            print(f"{heads:>5} {d:>4} {batch:>3} {t:>6} | {cfg} -> {us:.1f} µs ({nbytes / us / 1e3:.0f} GB/s) "
                  f"| default {default:.1f}")


def tune_quantize():
    """Quantize-and-pack of one 650M-shaped layer (20 heads, d=64, K and V, fp16 inputs as the strided views a
    prefill hands over; the default codec's tables) for a 1024-token prefill and a 195-sequence decode step,
    timed as ``esm-turbo bench`` times (CUDA graph replay, cold L2); the arguments are those
    ``ops.compressed.write_compressed`` passes."""
    from esm_turbo.bench import _time, default_codec
    from esm_turbo.cache import KVCache
    from esm_turbo.kernels.quantize import quantize_pack_triton
    dev = torch.device("cuda")
    codec = default_codec(20, 64).to(dev)
    tab = fused_tables(codec)
    key, value = codec.key, codec.value
    for batch, s in ((1, 1024), (195, 1)):
        cache = KVCache([codec], batch, capacity=s, device=dev)
        x = torch.randn(batch, s, 20, 64, device=dev, dtype=torch.float16).transpose(1, 2)
        pos = torch.zeros(batch, dtype=torch.long, device=dev)
        args = (x, x, (key.rot, key.offset, key.scale, tab.k_bounds, key.centroids, tab.k_layout),
                (value.rot, value.offset, value.scale, tab.v_bounds, value.centroids, tab.v_layout),
                tab.packed(cache.parts[0], "k"), tab.packed(cache.parts[0], "v"), pos,
                (key.bits, key.combined_sign), (value.bits, value.combined_sign), tab.k_fields, tab.v_fields,
                (tab.k_rot16, tab.v_rot16), (key.grid, value.grid))
        print(f"quantize-and-pack of K and V, B={batch} S={s}, 20 heads, d=64: default "
              f"{_time(lambda: quantize_pack_triton(*args), dev) * 1e6:.1f} µs")
        for bn, w in itertools.product((16, 32, 64, 128), (2, 4, 8)):
            cfg = dict(block_n=bn, num_warps=w)
            try:
                us = _time(lambda: quantize_pack_triton(*args, config=cfg), dev) * 1e6
                print(f"  {cfg} -> {us:.1f} µs", flush=True)
            except Exception as err:  # noqa: BLE001 - a config that does not compile is skipped
                print("  skip", cfg, type(err).__name__)


def tune_single():
    """One-launch vs three-launch path for small decode steps (S = 1), whole op timed as a CUDA graph with
    a cold L2 (as ``esm-turbo bench`` times it): where the one launch wins sets ``one_launch``."""
    from esm_turbo.bench import _time
    dev = torch.device("cuda")
    singles = [dict(path="one", block_t=bt, num_warps=w, waves=wv) for bt, w, wv in
               ((64, 2, 4), (32, 2, 4), (32, 2, 8), (16, 2, 8), (64, 4, 4))]
    print(f"{'heads':>5} {'d':>4} {'B':>3} {'T':>6} | split µs | one-launch µs per (block_t, warps, waves) | best")
    for heads, d in ((20, 64), (40, 128)):
        for batch in (1, 2, 4, 8):
            for t in (256, 1024, 4096, 16384):
                _, args = step_args(heads, d, batch, t, dev)
                ref = compressed_attention_triton(*args, config=dict(path="split"))
                split = _time(lambda: compressed_attention_triton(*args, config=dict(path="split")), dev) * 1e6
                times = []
                for cfg in singles:
                    out = compressed_attention_triton(*args, config=cfg)
                    assert torch.allclose(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
                    times.append(_time(lambda: compressed_attention_triton(*args, config=cfg), dev) * 1e6)
                best = min(range(len(times)), key=times.__getitem__)
                cells = " ".join(f"{x:7.1f}" for x in times)
                print(f"{heads:>5} {d:>4} {batch:>3} {t:>6} | {split:8.1f} | {cells} | "
                      f"{str(singles[best]) if times[best] < split else 'split'}", flush=True)


def tune_prefetch():
    """Requesting the next tile's codes before computing this one (``prefetch``), on the bench's grid:
    whole op as a CUDA graph, cold L2, µs; default launch configs, then prefetch under a few configs."""
    from esm_turbo.bench import _time
    dev = torch.device("cuda")
    variants = [dict(prefetch=True)] + [dict(prefetch=True, block_t=bt, num_warps=w, waves=wv)
                                        for bt, w, wv in ((32, 2, 4), (64, 4, 4), (128, 4, 4), (64, 2, 8))]
    print(f"{'heads':>5} {'d':>4} {'B':>3} {'T':>6} | default µs | prefetch µs: default cfg, "
          f"{', '.join(str((v['block_t'], v['num_warps'], v['waves'])) for v in variants[1:])}")
    for heads, d in ((20, 64), (40, 128)):
        for batch in (1, 8, 64):
            for t in (1024, 4096, 16384):
                _, args = step_args(heads, d, batch, t, dev)
                ref = compressed_attention_triton(*args)
                base = _time(lambda: compressed_attention_triton(*args), dev) * 1e6
                times = []
                for cfg in variants:
                    out = compressed_attention_triton(*args, config=cfg)
                    assert torch.allclose(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
                    times.append(_time(lambda: compressed_attention_triton(*args, config=cfg), dev) * 1e6)
                print(f"{heads:>5} {d:>4} {batch:>3} {t:>6} | {base:10.1f} | "
                      + " ".join(f"{x:7.1f}" for x in times), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    import sys
    if "quantize" in sys.argv:
        tune_quantize()
    elif "prefetch" in sys.argv:
        tune_prefetch()
    elif "single" in sys.argv:
        tune_single()
    else:
        main()
