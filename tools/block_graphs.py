"""FastEsm's forward with every block launched eagerly against blocks 2 … L − 1 replayed from one captured block
(``FastEsm.block_graphs`` False / True), on one GPU, interleaved, best of each; replayed blocks take their weights
in one contiguous copy (``block_replay.PackedBlocks``) or, as ``replayed_leaf``, leaf by leaf.

usage: python tools/block_graphs.py [--sizes 35M 150M 650M 650M:4096] [--embed 35M 150M] [--out F.json]

Per shape (``size`` or ``size:tokens``, a real-length batch of about that many tokens, random weights, fp16): the
host's time to enqueue one forward with the GPU kept busy, a forward's wall time alone (synchronised), and the time per
forward of six queued back to back (what a stream of batches meets), for each; whether all give every layer bit for
bit. ``--embed``: ``Embedder.run`` over the bench's records (nothing written) both ways, tokens/s.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from esm_turbo.embed import block_replay

sys.path.insert(0, str(Path(__file__).resolve().parent))
MODES = (("eager", False, True), ("replayed", True, True), ("replayed_leaf", True, False))


def _copies(flat: bool) -> None:
    """Replays copy each block's weights in one contiguous copy (``flat``) or leaf by leaf."""
    block_replay.PackedBlocks.flat = _FLAT if flat else (lambda self, i, leaves: None)


_FLAT = block_replay.PackedBlocks.flat


def _host_ms(fn, busy: torch.Tensor, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        for _ in range(60):  # queued work, so that nothing the host enqueues waits for the GPU
            busy @ busy
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return best


def _wall_ms(fn, reps: int = 10, queued: int = 1) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(queued):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e3 / queued)
    return best


def forward_rows(spec: str) -> dict:
    from tune_gemm import warm_forward
    size, _, tokens = spec.partition(":")
    fast, batch, _ = warm_forward(size, int(tokens or 16384))
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    layers = list(range(fast.num_layers + 1))
    row: dict = dict(size=size, tokens=int(batch.tokens.shape[0]), layers=fast.num_layers,
                     width=fast.config.hidden_size)
    outs = {}
    for _ in range(2):
        for name, mode, flat in MODES:
            fast.block_graphs = mode
            _copies(flat)
            outs[name] = fast(batch, layers)
            for key, value in (("host_ms", _host_ms(lambda: fast(batch), busy)),
                               ("wall_ms", _wall_ms(lambda: fast(batch))),
                               ("queued_ms", _wall_ms(lambda: fast(batch), reps=3, queued=6))):
                row[f"{name}_{key}"] = min(row.get(f"{name}_{key}", float("inf")), value)
    _copies(True)
    row["identical"] = all(torch.equal(outs["eager"][k], outs[m][k]) for k in layers for m in outs)
    row["queued_speedup"] = row["eager_queued_ms"] / row["replayed_queued_ms"]
    row["flat_copy_speedup"] = row["replayed_leaf_queued_ms"] / row["replayed_queued_ms"]
    return row


def embedder_row(size: str, copies: int = 4) -> dict:
    from esm_turbo.bench import EMBED_FASTA
    from esm_turbo.embed.benchmark import _NullWriter, random_masked_lm
    from esm_turbo.embed.extract import EmbedConfig, Embedder
    from esm_turbo.fasta import Record, read_fastas
    dev = torch.device("cuda")
    records = [Record(f"{r.id}#{k}", r.sequence, r.source) for k in range(copies) for r in read_fastas(EMBED_FASTA)]
    tokens = sum(len(r.sequence) + 2 for r in records)
    emb = Embedder(random_masked_lm(size, dev, torch.float16), EmbedConfig(include=["mean"]), dev)
    emb.run(records, _NullWriter(), progress=False)
    best: dict[str, float] = {}
    for _ in range(3):
        for name, mode, flat in MODES:
            emb.fast.block_graphs = mode
            _copies(flat)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            emb.run(records, _NullWriter(), progress=False)
            torch.cuda.synchronize()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    _copies(True)
    return dict(size=size, part="embedder", tokens=tokens, **{f"{k}_tokens_per_s": tokens / v for k, v in best.items()},
                speedup=best["eager"] / best["replayed"], flat_copy_speedup=best["replayed_leaf"] / best["replayed"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="*", default=["35M", "150M", "650M", "650M:4096"])
    ap.add_argument("--embed", nargs="*", default=["35M", "150M"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.sizes:
        rows.append(forward_rows(spec))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    for size in args.embed:
        rows.append(embedder_row(size))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
