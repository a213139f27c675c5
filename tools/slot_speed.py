"""What one slot a token and kind (``esm_turbo.quant.slots``) costs the fused kernels (GPU): decode attention and
quantize-and-pack timed with and without slots on the same default-codec cache, beside the bits each stores.

The issue's bar is speed per bit stored: ``(t_slots / t_plain) / (bits_slots / bits_plain)`` ≤ 1.10, where bits
count every stored byte (codes, sign planes, slot words) a value. Decode attention also beside a pure read of its
bytes (``bench.timing.read_floor_us``). Timing as ``esm-turbo bench`` times: a CUDA graph replayed after an L2 flush,
median µs.

    python tools/slot_speed.py --configs "" "prefetch=1" --out results/studies/slot_kernels_h100.txt
"""

from __future__ import annotations

import argparse
import sys

import torch

from esm_turbo.bench.synthetic import bytes_read, default_codec, fill_synthetic, step_args, write_inputs
from esm_turbo.bench.timing import read_floor_us, time_graph
from esm_turbo.cache import KVCache
from esm_turbo.kernels.decode import compressed_attention_triton, launch_config
from esm_turbo.kernels.quantize import quantize_pack_triton
from esm_turbo.ops.compressed import fused_tables
from esm_turbo.quant.codec import KVCodec

#: (name, heads, head_dim, batch, cached tokens a row) of decode steps
DECODE = (("650M", 20, 64, 64, 16384), ("650M", 20, 64, 195, 1024), ("150M", 20, 32, 64, 4096),
          ("8M", 20, 16, 64, 4096), ("8M", 20, 16, 195, 1024))
#: (name, heads, head_dim, batch, new tokens a row) of cache writes: a 1024-token prefill, a decode step
WRITES = (("650M", 20, 64, 1, 1024), ("650M", 20, 64, 195, 1), ("8M", 20, 16, 1, 1024), ("8M", 20, 16, 195, 1))


def slotted_cache(heads: int, dim: int, batch: int, length: int, dev: torch.device) -> KVCache:
    """A one-layer cache over the default codec with one slot a token and kind, full of random codes and random slot
    words (an index among the token's values, a small δ)."""
    base = default_codec(heads, dim)
    codec = KVCodec(base.key, base.value, slots=1).to(dev)
    cache = KVCache([codec], batch, capacity=length, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    parts = cache.parts[0]
    slots = {n: parts.pop(n) for n in ("k.slots", "v.slots")}
    fill_synthetic(cache, length, gen)
    for name, buf in slots.items():
        index = torch.randint(0, heads * dim, buf.shape, device=dev, generator=gen, dtype=torch.int32)
        delta = (torch.randn(buf.shape, device=dev, generator=gen) * 0.1).half().view(torch.int16).int() & 0xFFFF
        buf.copy_((index << 16) | delta)
        parts[name] = buf
    return cache


def bits_per_value(cache: KVCache, slots: bool) -> float:
    """Stored bits a cached value (keys and values), the slots' words counted or not."""
    codec = cache.codecs[0]
    token = codec.token_bytes(cache.heads) - (0 if slots else 8)
    return 8 * token / (2 * cache.heads * cache.head_dim)


def parse_config(text: str) -> dict:
    """``"prefetch=2 block_t=64"`` → launch overrides (``launch_config``'s keys, integer values)."""
    return {k: int(v) for k, v in (item.split("=") for item in text.split())}


def decode_rows(out, shapes: list[str] | None = None, config: dict | None = None) -> None:
    dev = torch.device("cuda")
    print(f"## decode attention, one query a row: µs per call; per bit = time ratio / stored-bits ratio"
          f"{'; launch ' + str(config) if config else ''}", file=out)
    for name, heads, d, batch, t in DECODE:
        if shapes and name not in shapes:
            continue
        cache = slotted_cache(heads, d, batch, t, dev)
        with_slots = step_args(cache)
        keys, values = with_slots[5:]
        plain = (*with_slots[:5], keys._replace(slots=None), values._replace(slots=None))
        cfg = launch_config(d, keys.code, values.code, batch, heads, 1, t, config)
        path = "one launch" if cfg["small"] else ("stream-K" if cfg["stream"] else "split-K")
        nbytes = bytes_read(cache)
        t_s = time_graph(lambda: compressed_attention_triton(*with_slots, config=config), dev) * 1e6
        t_p = time_graph(lambda: compressed_attention_triton(*plain, config=config), dev) * 1e6
        f_s = read_floor_us(nbytes, dev)
        f_p = read_floor_us(nbytes - 8 * batch * t, dev)
        b_s, b_p = bits_per_value(cache, True), bits_per_value(cache, False)
        print(f"{name} B={batch} T={t} ({path}): plain {t_p:.1f} µs ({f_p / t_p:.0%} of a read) at {b_p:.3f} bits, "
              f"slots {t_s:.1f} µs ({f_s / t_s:.0%} of a read) at {b_s:.3f} bits: ×{t_s / t_p:.3f} time, "
              f"per bit ×{(t_s / t_p) / (b_s / b_p):.3f}", file=out, flush=True)
        del cache, keys, values
        torch.cuda.empty_cache()


def write_rows(out) -> None:
    dev = torch.device("cuda")
    print("\n## quantize-and-pack of one layer's keys and values (fp16 strided inputs): µs per launch", file=out)
    for name, heads, d, batch, s, x, pos in write_inputs(WRITES, dev):
        base = default_codec(heads, d)
        codec = KVCodec(base.key, base.value, slots=1).to(dev)
        tab = fused_tables(codec)
        key, value = codec.key, codec.value
        cache = KVCache([codec], batch, capacity=s, device=dev)
        parts = cache.parts[0]
        args = (x, x, (key.rot, key.offset, key.scale, tab.k_bounds, key.centroids, tab.k_layout),
                (value.rot, value.offset, value.scale, tab.v_bounds, value.centroids, tab.v_layout),
                tab.packed(parts, "k"), tab.packed(parts, "v"), pos, tab.k_code, tab.v_code,
                (tab.k_rot16, tab.v_rot16))
        slots = (parts["k.slots"], parts["v.slots"], tab.k_tab, tab.v_tab, False)
        t_p = time_graph(lambda: quantize_pack_triton(*args), dev) * 1e6
        t_s = time_graph(lambda: quantize_pack_triton(*args, slots=slots), dev) * 1e6
        b_s, b_p = bits_per_value(cache, True), bits_per_value(cache, False)
        print(f"{name} B={batch} S={s}: plain {t_p:.1f} µs, slots {t_s:.1f} µs: ×{t_s / t_p:.3f} time, per bit "
              f"×{(t_s / t_p) / (b_s / b_p):.3f}", file=out, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the table here (default: stdout)")
    parser.add_argument("--shapes", nargs="+", help="only these decode shapes' names (8M, 150M, 650M)")
    parser.add_argument("--configs", nargs="+", default=[""],
                        help='launches to time both with, each as "key=value ..." (launch_config\'s keys; "" the '
                             'default)')
    parser.add_argument("--no-write", action="store_true", help="decode attention only")
    args = parser.parse_args(argv)
    out = open(args.out, "w") if args.out else sys.stdout
    print(f"# {torch.cuda.get_device_name()}: one slot a token and kind vs none, the default codec", file=out)
    for text in args.configs:
        decode_rows(out, args.shapes, parse_config(text) or None)
    if not args.no_write:
        write_rows(out)


if __name__ == "__main__":
    main()
