"""The launch constants of the decode-attention and quantize-and-pack kernels, each against its alternatives (GPU).

For every shape, the default launch (``esm_turbo.kernels.decode.launch_config``) is timed, then each knob changed
alone; an alternative must give the default's output (to 2e-3) before it is timed. Timing as ``esm-turbo bench``
times: one call replayed as a CUDA graph after an L2 flush, median µs. Writes a table whose ``× default`` column is
the alternative's time over the default's: every entry ≥ 1 (within noise) says the default is the fastest choice.
Beside each default: a pure read of the bytes the call reads (``bench.timing.read_floor_us``) and its share of it.

    python tools/tune_kernels.py                    # decode attention and quantize-and-pack
    python tools/tune_kernels.py --out results/gpu/launch_constants_h100.txt
    python tools/tune_kernels.py --index-bits 2 --steps 64:16384   # the 3.0-bit default's cache at 650M B=64 T=16K
    python tools/tune_kernels.py --heads 8M:20:16 150M:20:32 --steps 64:4096 195:1024 --grid   # every launch jointly
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from esm_turbo.bench.synthetic import TRAINED_SPREAD, bytes_read, default_codec, step_args, synthetic_cache
from esm_turbo.bench.timing import read_floor_us, time_graph
from esm_turbo.cache import KVCache
from esm_turbo.kernels.decode import compressed_attention_triton, launch_config
from esm_turbo.kernels.quantize import quantize_pack_triton
from esm_turbo.model.recipe import recipe
from esm_turbo.ops.compressed import fused_tables

#: (name, heads, head_dim): ESM-2 650M's and 15B's attention layers
SHAPES = (("650M", 20, 64), ("15B", 40, 128))
#: (batch, cached tokens per row) of a decode step with one query per row
STEPS = ((1, 1024), (1, 4096), (8, 4096), (8, 16384), (16, 4096), (64, 1024), (64, 4096), (64, 16384))


def alternatives(cfg: dict, d: int) -> list[tuple[str, dict]]:
    """(label, overrides) of each launch knob changed alone from the default ``cfg``."""
    alts = [("path=" + ("split" if cfg["small"] else "one"), dict(path="split" if cfg["small"] else "one"))]
    alts += [(f"block_t={b}", dict(block_t=b)) for b in (cfg["block_t"] // 2, cfg["block_t"] * 2) if b >= 16]
    alts += [(f"num_warps={w}", dict(num_warps=w)) for w in (1, 2, 4) if w != cfg["num_warps"]]
    alts += [(f"prefetch={n}", dict(prefetch=n)) for n in (0, 1, 2, 3) if n != cfg["prefetch"]]
    alts += [("maxnreg=" + str(None if cfg["maxnreg"] else 168), dict(maxnreg=None if cfg["maxnreg"] else 168)),
             ("subnormal=" + str(not cfg["subnormal"]), dict(subnormal=not cfg["subnormal"]))]
    if not cfg["small"]:  # gather_query: taken where the keys' rotation permutes their channels (the default codec's)
        alts += [("gather_query=" + str(not cfg["gather_query"]), dict(gather_query=not cfg["gather_query"]))]
        alts += [("pdl=" + str(not cfg["pdl"]), dict(pdl=not cfg["pdl"]))]
        alts += [(f"stream={n}", dict(stream=n)) for n in (0, 8, 16) if n != cfg["stream"]]
        alts += [(f"merge_rows={r}", dict(merge_rows=r)) for r in (1, 4, 16)]
        if d > 64:
            alts += [(f"prep_cols={c}", dict(prep_cols=c)) for c in (32, 128)]
            alts += [(f"merge_cols={c}", dict(merge_cols=c)) for c in (32, 128)]
    return alts


def decode_cases(out, title: str, index_bits: int | None, shapes, steps):
    """Print ``title`` (and the recipe), then for each shape and step a cache on the default codec, or (``index_bits``)
    on the default recipe at that many mean index bits with widths allocated as unevenly as a trained model's: yields
    (name, heads, d, batch, t, args, cfg, ref, base µs, floor µs) of the default launch."""
    dev = torch.device("cuda")
    print(title + (f"; the default recipe at {index_bits} index bits" if index_bits is not None else ""), file=out)
    widths = {} if index_bits is None else dict(recipe=recipe("default", index_bits).resolved(), spread=TRAINED_SPREAD)
    for name, heads, d in shapes:
        for batch, t in steps:
            cache = synthetic_cache(heads, d, batch, t, dev, **widths)
            args = step_args(cache)
            cfg = launch_config(d, args[5].code, args[6].code, batch, heads, 1, t)
            ref = compressed_attention_triton(*args)
            base = time_graph(lambda: compressed_attention_triton(*args), dev) * 1e6
            yield name, heads, d, batch, t, args, cfg, ref, base, read_floor_us(bytes_read(cache), dev)
            del cache
            torch.cuda.empty_cache()


def timed_launch(args, ref: torch.Tensor, over: dict) -> float | str:
    """µs of the decode call on ``args`` launched with ``over``, once it gives the default's output ``ref`` (to 2e-3);
    else "WRONG", or the error's name where the launch does not compile or fit."""
    try:
        got = compressed_attention_triton(*args, config=over)
        if not torch.allclose(got.float(), ref.float(), atol=2e-3, rtol=2e-3):
            return "WRONG"
        return time_graph(lambda: compressed_attention_triton(*args, config=over), ref.device) * 1e6
    except Exception as err:  # noqa: BLE001 - a launch that does not compile or fit is reported
        return type(err).__name__


def tune_decode(out, index_bits: int | None = None, shapes=SHAPES, steps=STEPS) -> None:
    """The decode attention's launch knobs, each changed alone (:func:`alternatives`), on :func:`decode_cases`."""
    for name, heads, d, batch, t, args, cfg, ref, base, floor in decode_cases(
            out, "## decode attention: µs per call (CUDA graph, cold L2); × default = alternative / default",
            index_bits, shapes, steps):
        cells = []
        for label, over in alternatives(cfg, d):
            us = timed_launch(args, ref, over)
            cells.append(f"{label} {us / base:.2f}" if isinstance(us, float) else f"{label} {us}")
            print(f"{name} B={batch} T={t}: default {base:.1f} µs, {cells[-1]}", file=sys.stderr, flush=True)
        path = "one launch" if cfg["small"] else ("stream-K" if cfg["stream"] else "split-K")
        print(f"{name} B={batch} T={t}: default ({path}, block_t {cfg['block_t']}, {cfg['num_warps']} warps) "
              f"{base:.1f} µs, {floor / base:.0%} of a {floor:.1f} µs read | " + ", ".join(cells),
              file=out, flush=True)


#: the joint grid of ``--grid``: the walk's tile, warps, look-ahead and programs an SM, every combination
GRID = dict(block_t=(16, 32, 64, 128), num_warps=(1, 2), prefetch=(1, 2, 3), stream=(8, 12, 16, 24))


def grid_decode(out, index_bits: int | None, shapes, steps, top: int = 6) -> None:
    """Every launch of :data:`GRID` on the stream-K walk (the default cache's) at each shape and step: the default,
    then the ``top`` fastest with their time over the default's and their share of a pure read."""
    for name, heads, d, batch, t, args, cfg, ref, base, floor in decode_cases(
            out, "## decode attention, the walk's launch grid: µs per call (CUDA graph, cold L2); × default",
            index_bits, shapes, steps):
        timed = sorted((us, values) for values in itertools.product(*GRID.values())
                       if isinstance(us := timed_launch(args, ref, dict(zip(GRID, values), path="split")), float))
        now = "/".join(str(cfg[k]) for k in GRID)
        cells = [f"{'/'.join(map(str, v))} {us:.1f} µs ×{us / base:.2f} ({floor / us:.0%})" for us, v in timed[:top]]
        print(f"{name} B={batch} T={t}: default {now} {base:.1f} µs ({floor / base:.0%} of a {floor:.1f} µs read) | "
              f"best {'/'.join(GRID)}: " + ", ".join(cells), file=out, flush=True)


def tune_quantize(out) -> None:
    """Quantize-and-pack of one 650M-shaped layer's keys and values (fp16 strided inputs, as a prefill hands them
    over; the default codec) for a 1024-token prefill and a decode step of 195 sequences."""
    dev = torch.device("cuda")
    codec = default_codec(20, 64).to(dev)
    tab = fused_tables(codec)
    key, value = codec.key, codec.value
    print("\n## quantize-and-pack, one 650M-shaped layer (K and V): µs per launch; × default", file=out)
    for batch, s in ((1, 1024), (195, 1)):
        cache = KVCache([codec], batch, capacity=s, device=dev)
        x = torch.randn(batch, s, 20, 64, device=dev, dtype=torch.float16).transpose(1, 2)
        pos = torch.zeros(batch, dtype=torch.long, device=dev)
        args = (x, x, (key.rot, key.offset, key.scale, tab.k_bounds, key.centroids, tab.k_layout),
                (value.rot, value.offset, value.scale, tab.v_bounds, value.centroids, tab.v_layout),
                tab.packed(cache.parts[0], "k"), tab.packed(cache.parts[0], "v"), pos, tab.k_code, tab.v_code,
                (tab.k_rot16, tab.v_rot16))
        base = time_graph(lambda: quantize_pack_triton(*args), dev) * 1e6
        cells = []
        for block_n in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                over = dict(block_n=block_n, num_warps=warps)
                try:
                    us = time_graph(lambda: quantize_pack_triton(*args, config=over), dev) * 1e6
                    cells.append(f"block_n={block_n}/warps={warps} {us / base:.2f}")
                except Exception as err:  # noqa: BLE001
                    cells.append(f"block_n={block_n}/warps={warps} {type(err).__name__}")
        print(f"B={batch} S={s}: default {base:.1f} µs | " + ", ".join(cells), file=out, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the table here (default: stdout)")
    parser.add_argument("--index-bits", type=int, default=None,
                        help="decode attention only, on the default recipe's caches at these mean index bits")
    parser.add_argument("--steps", nargs="+", default=None, metavar="B:T",
                        help="only these steps (batch:cached tokens), 650M-shaped unless --heads")
    parser.add_argument("--heads", nargs="+", default=None, metavar="NAME:H:D",
                        help="decode attention only, at these shapes (name, heads, head_dim)")
    parser.add_argument("--grid", action="store_true", help="every launch of the walk's grid jointly (GRID)")
    args = parser.parse_args(argv)
    out = open(args.out, "w") if args.out else sys.stdout
    import triton
    print(f"# tools/tune_kernels.py on {torch.cuda.get_device_name()} (triton {triton.__version__}, "
          f"torch {torch.__version__})", file=out)
    steps = tuple(tuple(int(x) for x in st.split(":")) for st in args.steps) if args.steps else STEPS
    shapes = SHAPES[:1] if args.steps else SHAPES
    if args.heads:
        shapes = tuple((n, int(h), int(d)) for n, h, d in (x.split(":") for x in args.heads))
    (grid_decode if args.grid else tune_decode)(out, args.index_bits, shapes, steps)
    if args.index_bits is None and not args.steps and not args.heads:
        tune_quantize(out)
    if args.out:
        out.close()


if __name__ == "__main__":
    main()
