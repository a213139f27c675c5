"""Decode attention over forks of one scaffold (GPU): the per-row walks, which read the shared scaffold once a row,
against the shared walk (``esm_turbo/kernels/decode/shared.py``), which reads it once for a group of rows.

For each shape: B forks of a T-token scaffold, each with its own tail of ``--tail`` tokens, in a paged pool of 64-token
blocks (the default codec's random codes; the forks' table entries for the scaffold are row 0's). Each call is timed
as ``esm-turbo bench`` times it (one call replayed as a CUDA graph after an L2 flush, median µs), the two outputs are
compared, and beside them: a pure read of the bytes each must read (the scaffold once and every tail, or the scaffold
once a row) at the run's read rate (``bench.timing.read_floor_us``).

    python tools/shared_walk_speed.py --out results/gpu/shared_walk_h100.txt
"""

from __future__ import annotations

import argparse
import sys

import torch

from esm_turbo.bench.synthetic import as_blocks, step_args, synthetic_cache
from esm_turbo.bench.timing import device_name, read_floor_us, time_graph
from esm_turbo.kernels.decode import compressed_attention_triton

#: (name, heads, head_dim)
SHAPES = (("8M", 20, 16), ("650M", 20, 64), ("3B", 40, 64), ("15B", 40, 128))
#: (forks, scaffold tokens)
FORKS = ((16, 1024), (64, 1024), (256, 1024), (64, 4096))
BLOCK = 64


def forks_args(heads: int, d: int, batch: int, scaffold: int, tail: int, device) -> tuple[tuple, torch.Tensor, int]:
    """(the decode call's arguments with pooled parts, the block table, bytes a token holds in a layer)."""
    cache = synthetic_cache(heads, d, batch, scaffold + tail, device)
    args = step_args(cache)
    blocks = -(-(scaffold + tail) // BLOCK)
    own = torch.arange(batch * blocks, device=device, dtype=torch.int32).view(batch, blocks)
    pages = own.clone()
    pages[:, :scaffold // BLOCK] = own[0, :scaffold // BLOCK]  # the forks' scaffold: row 0's blocks

    def pooled(part):
        return as_blocks(part, own, BLOCK, batch * blocks) if part.numel() else part
    kinds = [c._replace(main=pooled(c.main), sign=pooled(c.sign)) for c in args[5:7]]
    return (*args[:5], *kinds), pages, cache.memory_report().bytes_per_token_per_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--tail", type=int, default=64, help="each fork's own tokens past the scaffold")
    parser.add_argument("--forks", nargs="*", help="forks:scaffold pairs (default: 16:1024 64:1024 256:1024 64:4096)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run under Triton's interpreter, no floors")
    parser.add_argument("--out", help="also write the table here")
    a = parser.parse_args()
    dev = torch.device(a.device)
    forks = [tuple(map(int, f.split(":"))) for f in a.forks] if a.forks else FORKS
    lines = [f"# python tools/shared_walk_speed.py --tail {a.tail} ({device_name(dev)}); µs a call, CUDA graph, "
             "cold L2",
             "  size  heads  d  forks  scaffold  per-row walks  (read floor)  shared walk  (read floor)  speed-up  "
             "max |Δ|"]
    print("\n".join(lines), flush=True)
    for name, heads, d in SHAPES:
        if name not in a.sizes:
            continue
        for batch, scaffold in forks:
            args, pages, token_bytes = forks_args(heads, d, batch, scaffold, a.tail, dev)
            call = dict(pages=pages, block_size=BLOCK, shared=scaffold)
            walks = compressed_attention_triton(*args, **call)
            shared = compressed_attention_triton(*args, config=dict(shared=True), **call)
            diff = (walks.float() - shared.float()).abs().max().item()
            t_walks = time_graph(lambda: compressed_attention_triton(*args, **call), dev) * 1e6
            t_shared = time_graph(lambda: compressed_attention_triton(*args, config=dict(shared=True), **call),
                                  dev) * 1e6
            cuda = dev.type == "cuda"
            floor_walks = read_floor_us(batch * (scaffold + a.tail) * token_bytes, dev) if cuda else float("nan")
            floor_shared = read_floor_us((scaffold + batch * a.tail) * token_bytes, dev) if cuda else float("nan")
            line = (f"  {name:5} {heads:5} {d:3} {batch:6} {scaffold:9} {t_walks:13.1f}  {floor_walks:12.1f}  "
                    f"{t_shared:11.1f}  {floor_shared:12.1f}  {t_walks / t_shared:7.2f}x  {diff:.1e}")
            print(line, flush=True)
            lines.append(line)
            del args, pages
            if cuda:
                torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
