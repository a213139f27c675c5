"""``esm-turbo bench``: decode attention, quantize-and-pack and end-to-end decode, each timed against
its baseline in the same run (ratios, never absolute bars). Random weights and random cache codes:
speed does not depend on them.

1. attention per layer call for 650M-shaped (20 heads, d=64) and 15B-shaped (40 heads, d=128) layers,
   B ∈ {1, 8, 64} × T ∈ {1K, 4K, 16K}: fused kernel vs (a) the two-step path (dequantize, then SDPA)
   and (b) fp16 SDPA over an uncompressed cache; achieved GB/s on the bytes the kernel must read vs a
   device-to-device copy measured here; the same kernel on a grid codec's cache (``lut="grid"``: values
   computed from the codes, no table look-ups) at the same widths and bytes;
2. quantize-and-pack of a 650M-shaped model's prefill (L=1024) vs the prefill itself;
3. decode tokens/s of a 650M-shaped model at 1K context, compressed (LUT and grid codecs) vs fp16 cache under
   one KV budget;
4. the fused decode attention at 650M B=64 T=16K on caches of 4.0 and 3.0 bits all-in (channels capped as the
   default and the presets ``wide`` and ``values-capped`` cap them): µs, its read floor, µs per bit stored.

On CPU it runs the reference paths at small sizes (a smoke run; nothing there is a speed claim).
"""

from __future__ import annotations

import torch

from ..fasta import CALIBRATION_DATA
from ..ops import force_reference
from .decode import SHAPES, bench_attention, bench_cpu_steps, bench_decode, bench_quantize, bench_widths
from .report import BenchResult, format_result, to_json
from .timing import device_name, graph_floor_us, peak_copy_gbs

#: rows of the decode suite besides the most each cache fits in its budget
DECODE_BATCHES = (16, 64)

EMBED_FASTA = [str(CALIBRATION_DATA / "calibration.fasta"), str(CALIBRATION_DATA / "evaluation.fasta")]


def run(quick: bool = False, device: str | None = None, reference: bool = False, suite: str = "decode",
        fasta: list[str] | None = None, sizes: list[str] | None = None, corpus: str | None = None) -> BenchResult:
    """``suite``: decode (attention, quantize, decode tokens/s, widths), widths (CUDA), embed, or all."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    force_reference(reference)
    res = BenchResult(device=device_name(dev))
    if suite in ("embed", "all"):
        fasta = fasta or EMBED_FASTA
        from ..embed.benchmark import bench_embed
        res.embed = bench_embed(dev, fasta, quick=quick, sizes=sizes, corpus=corpus)
        if suite == "embed":
            return res
    if dev.type == "cuda":
        res.peak_copy_gbs = peak_copy_gbs(dev)
        res.graph_floor_us = graph_floor_us(dev)
        res.widths = bench_widths(dev, *((8, 4096) if quick else (64, 16384)))
        if suite == "widths":
            return res
        batches, lengths = ((1, 8), (1024, 4096)) if quick else ((1, 8, 64), (1024, 4096, 16384))
        res.attention = bench_attention(dev, batches, lengths)
        res.quantize = bench_quantize(dev)
        res.decode = bench_decode(dev, batches=() if quick else DECODE_BATCHES)
    else:
        res.notes.append("CPU: reference paths at small sizes; a smoke run, not a speed claim")
        res.attention = bench_attention(dev, (1, 4), (256,), {"650M": (20, 64)})
        res.quantize = bench_quantize(dev, "8M", length=128)
        res.decode = bench_decode(dev, "8M", context=128, budget_gib=0.01, steps=4, max_batch=16)
        if not quick:
            res.cpu_steps = bench_cpu_steps()
    return res


__all__ = ["BenchResult", "SHAPES", "bench_attention", "bench_cpu_steps", "bench_decode", "bench_quantize",
           "bench_widths", "format_result", "run", "to_json"]
