"""What values predicted from the keys (``calibrate --predict-values``) cost the fused ops (GPU): decode attention and
the cache write timed for the plain codec of the 3.0-bit recipe's widths (keys-first 4 + 2 bits, as ``--bits 3``
stores them), the same codec with its values predicted (the same bytes), and its keys alone with the values not
stored (``--bits 2 --predict-values``: 2.0 bits), beside a pure read of each one's bytes and the PyTorch path a
predicted layer took before its walk existed. Then the same with the predictor's map within the scores walk's groups
of heads (``calibrate --predict-group 128/d``): one walk that pools the features as it scores.

Per bit: (time / the plain codec's time) / (bits / the plain codec's bits), the issue's bar being ≤ 1.10. Timing as
``esm-turbo bench`` times: a CUDA graph replayed after an L2 flush, median µs.

    python tools/predicted_speed.py --out results/studies/predicted_kernels_h100.txt
"""

from __future__ import annotations

import argparse
import sys

import torch

from esm_turbo.bench.synthetic import bytes_read, default_codec, fill_synthetic, step_args, write_inputs
from esm_turbo.bench.timing import read_floor_us, time_graph
from esm_turbo.cache import KVCache
from esm_turbo.kernels.decode import compressed_attention_triton
from esm_turbo.kernels.decode.predicted import fits, one_pass, score_heads
from esm_turbo.model.recipe import recipe
from esm_turbo.ops.compressed import write_compressed
from esm_turbo.ops.predicted import codec_walk_tables, predicted_attention_reference, predicted_attention_triton
from esm_turbo.quant.codec import KVCodec
from esm_turbo.quant.predict import Unstored, ValuePredictor, within_groups

#: (name, heads, head_dim, batch, cached tokens a row) of decode steps
DECODE = (("8M", 20, 16, 64, 4096), ("8M", 20, 16, 195, 1024), ("8M", 20, 16, 8, 512), ("150M", 20, 32, 64, 4096),
          ("150M", 20, 32, 195, 1024), ("650M", 20, 64, 64, 4096), ("650M", 20, 64, 195, 1024),
          ("3B", 40, 64, 64, 4096), ("3B", 40, 64, 16, 1024))
#: (name, heads, head_dim, batch, new tokens a row) of cache writes: a 1024-token prefill, a decode step
WRITES = (("8M", 20, 16, 1, 1024), ("8M", 20, 16, 195, 1), ("650M", 20, 64, 195, 1))
RECIPE = recipe("default", index_bits=2, predict_values=True).resolved()


def codecs(heads: int, dim: int, dev: torch.device, group: int = 0) -> tuple[KVCodec, KVCodec, KVCodec]:
    """(plain, predicted, keys alone): one random codec of the 3.0-bit predicted recipe's widths, without and with a
    random predictor (``group``: its map within groups of that many heads, as ``calibrate --predict-group``), and its
    keys with the values not stored."""
    base = default_codec(heads, dim, recipe=RECIPE, permuted_keys=True)
    g = torch.Generator().manual_seed(1)
    width = heads * dim
    weight = torch.randn(width, width, generator=g) / width
    if group:
        weight = within_groups(weight, heads, dim, group)
    pred = ValuePredictor(weight, 0.1 * torch.randn(width, generator=g),
                          1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), heads, dim)
    return (KVCodec(base.key, base.value).to(dev), KVCodec(base.key, base.value, predictor=pred).to(dev),
            KVCodec(base.key, Unstored(heads, dim), predictor=pred).to(dev))


def decode_rows(out, launches: tuple[tuple[int, int], ...] = (), shapes: list[str] | None = None) -> None:
    dev = torch.device("cuda")
    print("## decode attention, one query a row: µs per call (the walks and their merge; the plain walk with its "
          "merge)", file=out)
    for name, heads, d, batch, t in DECODE:
        if shapes and name not in shapes:
            continue
        if not fits(heads, d):
            print(f"{name} B={batch} T={t}: the walk does not fit a program here (the PyTorch path's shape)", file=out)
            continue
        plain, pred, keys_only = codecs(heads, d, dev)
        cache = KVCache([plain], batch, capacity=t, device=dev)
        fill_synthetic(cache, t, torch.Generator(device=dev).manual_seed(0))
        q, k_new, v_new, valid, lengths, keys, values = step_args(cache)
        tables = codec_walk_tables(pred)
        args = (q, k_new, v_new, valid, lengths, keys, values)
        nbytes = bytes_read(cache)
        key_bytes = nbytes * keys.code.all_in_bits // (keys.code.all_in_bits + values.code.all_in_bits)
        t_p = time_graph(lambda: compressed_attention_triton(*args), dev) * 1e6
        t_w = time_graph(lambda: predicted_attention_triton(*args, pred.predictor, tables=tables), dev) * 1e6
        t_k = time_graph(lambda: predicted_attention_triton(*args[:6], None, pred.predictor, tables=tables), dev) * 1e6
        floor, key_floor = read_floor_us(nbytes, dev), read_floor_us(key_bytes, dev)
        per_bit = (t_k / t_p) / (key_bytes / nbytes)
        line = (f"{name} B={batch} T={t}: plain {t_p:.1f} µs ({floor / t_p:.0%} of a read); predicted {t_w:.1f} µs "
                f"({floor / t_w:.0%} of a read, ×{t_w / t_p:.2f} per bit); keys alone {t_k:.1f} µs "
                f"({key_floor / t_k:.0%} of a read of their bytes, ×{t_k / t_p:.2f} time, ×{per_bit:.2f} per bit)")
        if batch * t <= 64 * 4096 and not launches:
            t_r = time_graph(lambda: predicted_attention_reference(*args, pred.predictor), dev) * 1e6
            line += f"; PyTorch path {t_r:.0f} µs (×{t_r / t_w:.1f} the walk)"
        print(line, file=out, flush=True)
        # the map within the scores walk's groups of heads (calibrate --predict-group): one walk that pools as it scores
        _, gpred, gkeys = codecs(heads, d, dev, score_heads(heads, d))
        assert one_pass(gpred.predictor, heads, d)
        gtables = codec_walk_tables(gpred)
        t_gw = time_graph(lambda: predicted_attention_triton(*args, gpred.predictor, tables=gtables, grouped=True),
                          dev) * 1e6  # asked for: a coded residual takes the two walks by default (one_pass)
        t_gk = time_graph(lambda: predicted_attention_triton(*args[:6], None, gpred.predictor, tables=gtables),
                          dev) * 1e6
        line = (f"  one pass (groups of {score_heads(heads, d)} heads): predicted {t_gw:.1f} µs (×{t_gw / t_p:.2f} per "
                f"bit, {t_gw / t_w:.2f}× the two walks); keys alone {t_gk:.1f} µs ({key_floor / t_gk:.0%} of a read, "
                f"×{(t_gk / t_p) / (key_bytes / nbytes):.2f} per bit, {t_gk / t_k:.2f}× the two walks)")
        for tile, warps in launches:
            launch = dict(tile=tile, warps=warps)
            t_l = time_graph(lambda: predicted_attention_triton(*args[:6], None, gpred.predictor, tables=gtables,
                                                                launch=launch), dev) * 1e6
            line += f"; keys alone at tile {tile}, {warps} warps {t_l:.1f} µs"
        print(line, file=out, flush=True)
        del cache, keys, values
        torch.cuda.empty_cache()


def write_rows(out) -> None:
    dev = torch.device("cuda")
    print("\n## cache write of one layer's keys and values (fp16 inputs): µs per call", file=out)
    for name, heads, d, batch, s, x, pos in write_inputs(WRITES, dev):
        plain, pred, keys_only = codecs(heads, d, dev)
        times = []
        for codec in (plain, pred, keys_only):
            parts = KVCache([codec], batch, capacity=s, device=dev).parts[0]
            times.append(time_graph(lambda: write_compressed(codec, parts, x, x, pos), dev) * 1e6)
        print(f"{name} B={batch} S={s}: plain {times[0]:.1f} µs, predicted {times[1]:.1f} µs "
              f"(×{times[1] / times[0]:.2f}), keys alone {times[2]:.1f} µs (×{times[2] / times[0]:.2f})", file=out,
              flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the table here (default: stdout)")
    parser.add_argument("--launches", nargs="*", default=[], metavar="TILE:WARPS",
                        help="also time the one-pass walk's keys alone at these launches (tuning)")
    parser.add_argument("--shapes", nargs="*", metavar="NAME", help="only these model shapes' decode rows (8M, 650M…)")
    parser.add_argument("--no-writes", action="store_true", help="skip the cache-write rows")
    args = parser.parse_args(argv)
    out = open(args.out, "w") if args.out else sys.stdout
    print(f"# {torch.cuda.get_device_name()}: values predicted from the keys vs not, the 3.0-bit recipe's widths "
          f"(keys {RECIPE.key_index_bits} + sign, values {RECIPE.value_index_bits} + sign)", file=out)
    launches = tuple(tuple(int(x) for x in spec.split(":")) for spec in args.launches)
    decode_rows(out, launches, args.shapes)
    if not args.no_writes:
        write_rows(out)


if __name__ == "__main__":
    main()
