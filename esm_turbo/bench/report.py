"""The bench's result and how it is printed (tables) or stored (JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .synthetic import DEFAULT_RECIPE
from .timing import STEP_CALLS


@dataclass
class BenchResult:
    device: str
    peak_copy_gbs: float | None = None
    graph_floor_us: float | None = None
    attention: list[dict] = field(default_factory=list)
    widths: list[dict] = field(default_factory=list)
    quantize: dict = field(default_factory=dict)
    decode: list[dict] = field(default_factory=list)
    embed: dict = field(default_factory=dict)
    cpu_steps: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def format_result(res: BenchResult) -> str:
    lines = [f"device: {res.device}"]
    if res.peak_copy_gbs:
        lines.append(f"device-to-device copy: {res.peak_copy_gbs:.0f} GB/s (read + write)")
    if res.graph_floor_us:
        lines.append(f"a graph of one one-element add: {res.graph_floor_us:.1f} µs, timed as every call below (each µs "
                     "includes it)")
    if res.attention:
        r = DEFAULT_RECIPE
        lines.append(f"\ndecode attention per layer call (1 new token per sequence; the default widths: keys "
                     f"{r.key_index_bits} + {r.residual}, values {r.value_index_bits} + {r.residual} bits; default "
                     f"tables: {r.lut})")
        lines.append(f"(µs: one call replayed as a CUDA graph; step µs: per call of {STEP_CALLS} calls in one graph, "
                     f"as a decode step's layers replay)")
        lines.append("(fused: per-channel LUT codes, lut='channel'; grid: the same kernels and bytes on a grid codec's "
                     "cache, lut='grid', values computed from the codes, no table look-ups)")
        lines.append("(read µs: a kernel that only reads the bytes the grid kernel reads, the least any kernel reading "
                     "them takes; ceiling: fp16 SDPA µs / read µs, the most ×SDPA those bytes allow on this GPU)")
        lines.append(f"{'shape':6} {'B':>3} {'T':>6} {'fused µs':>9} {'two-step µs':>11} {'fp16 SDPA µs':>12} "
                     f"{'×two-step':>9} {'×SDPA':>6} {'GB/s':>6} {'%copy':>6} {'fused step µs':>13} "
                     f"{'SDPA step µs':>12} {'×SDPA step':>10} | {'grid µs':>8} {'×SDPA':>6} {'%copy':>6} "
                     f"{'grid step µs':>12} {'×SDPA step':>10} {'read µs':>8} {'ceiling':>7}")

    def f(x, fmt):
        return format(x, fmt) if x is not None else "n/a"
    for r in res.attention:
        pct = 100 * r["fused_gbs"] / res.peak_copy_gbs if res.peak_copy_gbs else None
        grid_pct = 100 * r["grid_gbs"] / res.peak_copy_gbs if res.peak_copy_gbs else None
        lines.append(f"{r['shape']:6} {r['batch']:>3} {r['context']:>6} {r['fused_us']:>9.1f} "
                     f"{f(r['two_step_us'], '.1f'):>11} {f(r['sdpa_fp16_us'], '.1f'):>12} "
                     f"{f(r['speedup_vs_two_step'], '.2f'):>9} {f(r['speedup_vs_sdpa_fp16'], '.2f'):>6} "
                     f"{r['fused_gbs']:>6.0f} {f(pct, '.0f'):>6} {f(r.get('fused_step_us'), '.1f'):>13} "
                     f"{f(r.get('sdpa_fp16_step_us'), '.1f'):>12} {f(r.get('step_speedup_vs_sdpa_fp16'), '.2f'):>10} | "
                     f"{r['grid_us']:>8.1f} {f(r['grid_speedup_vs_sdpa_fp16'], '.2f'):>6} {f(grid_pct, '.0f'):>6} "
                     f"{r['grid_step_us']:>12.1f} {f(r['grid_step_speedup_vs_sdpa_fp16'], '.2f'):>10} "
                     f"{f(r.get('read_us'), '.1f'):>8} {f(r.get('ceiling_vs_sdpa_fp16'), '.2f'):>7}")
    if res.widths:
        w = res.widths[0]
        lines.append(f"\ndecode attention per layer call at {w['shape']} B={w['batch']} T={w['context']} by bit budget "
                     f"and widest channel (bits all-in, as memory_report() counts them; widest: a field's bits, sign "
                     f"included; per bit: µs per bit stored against the first row's)")
        lines.append(f"{'recipe':26} {'bits':>5} {'widest k/v':>10} {'fused µs':>9} {'read µs':>8} {'%read':>6} "
                     f"{'GB/s':>6} {'step µs':>8} {'per bit':>8} {'×first':>7}")
        for r in res.widths:
            lines.append(f"{r['recipe']:26} {r['bits']:>5.2f} {r['widest_key']:>5}/{r['widest_value']:<4} "
                         f"{r['fused_us']:>9.1f} {r['read_us']:>8.1f} {100 * r['of_read']:>6.0f} "
                         f"{r['fused_gbs']:>6.0f} "
                         f"{r['fused_step_us']:>8.1f} {r['per_bit_vs_first']:>8.2f} {r['speedup_vs_first']:>7.2f}")
    q = res.quantize
    if q:
        lines.append(f"\nquantize-and-pack ({q['path']}), {q['model']}, prefill of {q['tokens']} tokens "
                     f"({q['prefill_ms']:.2f} ms):\n  prefill writing the compressed cache "
                     f"{q['prefill_writing_ms']:.2f} ms, added {q['added_ms']:.3f} ms = "
                     f"{100 * q['added_fraction']:.1f}%\n"
                     f"  its launches timed alone {q['quantize_pack_ms']:.3f} ms = {100 * q['fraction']:.1f}%")
    if res.decode:
        lines.append("\nend-to-end decode, one token a row a step (CUDA: the step captured as a graph)")
        if res.decode[0].get("read_gbs"):
            lines.append(f"(floor: one read of what a step must read, the cache's keys and values, the weights and "
                         f"each layer's hidden states, at a pure read's {res.decode[0]['read_gbs']:.0f} GB/s, "
                         f"measured here)")
        for r in res.decode:
            ratio = f"  {r['speedup_vs_fp16']:.2f}× fp16" if "speedup_vs_fp16" in r else ""
            budget = " (budget)" if r.get("at_budget") else ""
            floor = (f"  floor {r['floor_ms']:.2f} ms = {100 * r['of_floor']:.0f}% reached"
                     if "floor_ms" in r else "")
            if "launches_ms" in r:
                floor += (f" (its launches as pure reads: {r['launches_ms']:.2f} ms, "
                          f"{100 * r['launches_of_floor']:.0f}%; with cuBLAS's products: {r['products_ms']:.2f} ms, "
                          f"{100 * r['products_of_floor']:.0f}%)")
            lines.append(f"  {r['cache']:14} batch {r['batch']:>5}{budget:9} KV {r['kv_gib']:5.2f} GiB "
                         f"{r['tokens_per_s']:>9.0f} tokens/s ({r['step_ms']:.2f} ms/step){floor}{ratio}")
            if "breakdown" in r:
                from .step import format_breakdown
                lines.append(f"      {format_breakdown(r['breakdown'], r['step_ms'])}")
    if res.embed:
        from ..embed.benchmark import format_embed
        lines += format_embed(res.embed)
    if res.cpu_steps:
        lines.append("\nCPU decode step, batch 1 (PyTorch reference path), and calibration of the stand-in model")
        for r in res.cpu_steps:
            lines.append(f"  {r['size']:>4}-shaped, {r['context']} cached tokens, {r['threads']} threads: "
                         f"3+1-bit cache {r['turbo-3+1_step_ms']:.1f} ms/step, fp32 cache "
                         f"{r['fp32_step_ms']:.1f} ms/step; "
                         f"calibration on {r['calibration_tokens']} tokens {r['calibration_s']:.1f} s")
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


def to_json(res: BenchResult) -> str:
    return json.dumps(asdict(res), indent=2)
