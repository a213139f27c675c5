"""The packed attention's tile by sequence length (esm_turbo.kernels.varlen_attention), against flash-attention's
variable-length kernel, on one GPU.

usage: python tools/tune_attention.py [--heads 20] [--head-dim 64] [--tokens 16384] [--gluon] [--out DIR]

For each length class (16K-token batches of sequences drawn uniformly within ±20% of a length, real proteins'
lengths after that: the bench's records, length-sorted and cut into 16K-token batches), every tile of ``TILES`` and
flash's kernel: µs (median of do_bench) and useful TFLOP/s (4 · L² · d per head and sequence), each output checked
against the float64 reference on the batch's first 8 sequences under the flash-attention rule. Writes DIR/attention.json
and prints a table; the best passing tile per class is what ``LENGTH_CLASSES`` should say. ``--gluon`` adds the Gluon
kernel (``kernels/varlen_attention_gluon.py``: each key tile's scores under the previous tile's softmax) at the key
tiles and rings of :data:`GLUON_TILES`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton.testing

from esm_turbo.kernels.varlen_attention import AttentionTile, attention_plan, query_blocks, varlen_attention_triton

TILES = [AttentionTile(64, 64, 4, 3), AttentionTile(64, 64, 4, 2), AttentionTile(64, 32, 4, 3),
         AttentionTile(64, 128, 4, 2), AttentionTile(128, 64, 8, 3), AttentionTile(128, 64, 8, 2),
         AttentionTile(128, 64, 4, 3), AttentionTile(128, 128, 8, 2), AttentionTile(128, 32, 8, 3),
         AttentionTile(64, 64, 8, 3), AttentionTile(64, 32, 4, 2), AttentionTile(64, 32, 4, 4),
         AttentionTile(64, 32, 2, 3), AttentionTile(32, 32, 2, 3), AttentionTile(128, 32, 4, 3),
         AttentionTile(64, 16, 4, 3)]  # the last six for narrow heads (d = 32, 150M-shaped)
LENGTHS = (40, 80, 128, 160, 200, 256, 320, 400, 512, 640, 800, 1024)
#: the Gluon kernel's (key tile, ring slots) that ``--gluon`` times
GLUON_TILES = ((64, 3), (64, 4), (64, 5), (64, 6), (32, 4), (32, 5))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def synthetic(length: int, tokens: int, rng) -> list[int]:
    out, used = [], 0
    while True:
        n = int(np.clip(rng.integers(int(0.8 * length), int(1.2 * length) + 1), 3, 1026))
        if used + n > tokens:
            return out
        out.append(n)
        used += n


def real_batches(tokens: int) -> list[list[int]]:
    from esm_turbo.bench import EMBED_FASTA
    from esm_turbo.fasta import read_fastas
    lens = sorted((min(len(r.sequence), 1022) + 2 for r in read_fastas(EMBED_FASTA)), reverse=True) * 4
    lens.sort(reverse=True)
    batches, cur, used = [], [], 0
    for n in lens:
        if used + n > tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(n)
        used += n
    return batches + [cur]


def measure(lengths: list[int], heads: int, d: int, label: str, gluon: bool = False) -> list[dict]:
    from esm_turbo.embed.varlen import varlen_attention, varlen_attention_reference
    n = sum(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, heads, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    flops = sum(4 * x * x * heads * d for x in lengths)
    head = sum(lengths[:8])
    ref = varlen_attention_reference(q[:head].double(), k[:head].double(), v[:head].double(), lengths[:8])
    own = (varlen_attention_reference(q[:head], k[:head], v[:head], lengths[:8]).double() - ref).abs().max().item()
    cands = {"flash": lambda: varlen_attention(q, k, v, cu, max(lengths))}
    for t in TILES:
        table = query_blocks(lengths, "cuda", t.bm)
        cands[f"{t.bm}x{t.bn} w{t.warps} s{t.stages}"] = (lambda t=t, table=table:
                                                           varlen_attention_triton(q, k, v, table, tile=t))
    if gluon:
        from esm_turbo.kernels.varlen_attention_gluon import varlen_attention_gluon
        table = query_blocks(lengths, "cuda", 64)
        for bn, stages in GLUON_TILES:
            cands[f"gluon 64x{bn} s{stages}"] = (lambda bn=bn, stages=stages:
                                                 varlen_attention_gluon(q, k, v, table, bn=bn, stages=stages))
    rows = []
    for name, fn in cands.items():
        try:
            err = (fn()[:head].double() - ref).abs().max().item()
            us = 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            rows.append(dict(batch=label, kernel=name, tokens=n, sequences=len(lengths),
                             mean_length=n / len(lengths), us=us, tflops=flops / us / 1e6,
                             ok=err <= 2 * own + 1e-3))
        except Exception as e:  # noqa: BLE001 - a tile that does not build is reported, the others kept
            rows.append(dict(batch=label, kernel=name, error=f"{type(e).__name__}: {e}"[:200]))
    best = min((r for r in rows if r.get("ok") and r["kernel"] != "flash"), key=lambda r: r["us"])
    log(f"{label:>10}: {len(lengths)} sequences, flash {rows[0].get('us', float('nan')):.1f} µs, best "
        f"{best['kernel']} {best['us']:.1f} µs ({best['tflops']:.0f} TFLOP/s), 64x64 {rows[1].get('us', 0):.1f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--gluon", action="store_true", help="also the Gluon kernel at GLUON_TILES")
    ap.add_argument("--out", type=Path, default=Path("attention"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for length in LENGTHS:
        rows += measure(synthetic(length, args.tokens, rng), args.heads, args.head_dim, f"L~{length}", args.gluon)
    plan_rows = []
    for i, lengths in enumerate(real_batches(args.tokens)):
        rows += measure(lengths, args.heads, args.head_dim, f"real {i}", args.gluon)
        # the library's own plan on the same batch
        n = sum(lengths)
        q, k, v = (torch.randn(n, args.heads, args.head_dim, device="cuda", dtype=torch.float16) for _ in range(3))
        plan = attention_plan(lengths, "cuda")
        us = 1e3 * triton.testing.do_bench(lambda: varlen_attention_triton(q, k, v, plan), warmup=25, rep=100,
                                           return_mode="median")
        plan_rows.append(dict(batch=f"real {i}", us=us, launches=len(plan.launches)))
    (args.out / "attention.json").write_text(json.dumps(dict(rows=rows, plan=plan_rows, heads=args.heads,
                                                             head_dim=args.head_dim,
                                                             gpu=torch.cuda.get_device_name()), indent=1))
    by = {}
    for r in rows:
        if "us" in r:
            by.setdefault(r["batch"], {})[r["kernel"]] = r
    names = ["flash"] + [f"{t.bm}x{t.bn} w{t.warps} s{t.stages}" for t in TILES]
    names += [f"gluon 64x{bn} s{stages}" for bn, stages in GLUON_TILES] if args.gluon else []
    print("batch       mean L  " + "  ".join(f"{n:>15}" for n in names))
    for batch, ks in by.items():
        any_row = next(iter(ks.values()))
        print(f"{batch:10} {any_row['mean_length']:7.0f}  " + "  ".join(
            f"{ks[n]['us']:8.1f}{'' if ks[n]['ok'] else '!'}/{ks[n]['tflops']:4.0f}" if n in ks else f"{'-':>15}"
            for n in names))
    print("library plan on the real batches (µs):", [round(r["us"], 1) for r in plan_rows],
          "total", round(sum(r["us"] for r in plan_rows), 1))


if __name__ == "__main__":
    main()
