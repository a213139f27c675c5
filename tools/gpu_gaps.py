"""Where the GPU waits in FastEsm's forward and in ``Embedder.run``: host enqueue time against GPU time, and the
largest idle gaps between kernels with what the host was doing in them (torch.profiler, CPU and CUDA).

usage: python tools/gpu_gaps.py [--size 650M] [--tokens 16384] [--copies 4] [--gelu erf|tanh] [--out DIR]

Per part (one forward on one real-length batch; the embedder over the bench's records, nothing written): wall time,
GPU busy time (the union of kernel and copy intervals), the host's own time to enqueue a forward with the GPU kept
busy, the share of GPU idle, and the 12 largest gaps with the kernels either side and the CPU ops inside them. The
embedder is profiled once more with CUDA activity only (the host then runs at its own speed): where its idle time
lies (:func:`timeline`). Each part's GPU time by kernel, per 1,000 tokens (``kernels_us_per_1k_tokens``), says which
kernels the embedder's batches spend more on than the one forward. ``--gelu``: FastEsm.gelu for both.

Each part's ``bound``: the rate it would run at with its matrix products at the cuBLAS ceiling of the same run
(``esm_turbo.embed.benchmark.gemm_ceiling`` at ``--tokens`` rows) and every other kernel as it ran, with no idle
GPU time (:func:`bound`): what no change to the products or the launch order alone can pass.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gaps(prof, wall_ms: float, top: int = 12) -> dict:
    """Busy time of the GPU (``esm_turbo.bench.step.breakdown``) and its largest idle gaps, from a profile's
    events."""
    from esm_turbo.bench.step import breakdown, kernel_times
    events = prof.events()
    kernels = kernel_times(events)
    cpu = [(e.time_range.start, e.time_range.end, e.name) for e in events
           if e.device_type == torch.autograd.DeviceType.CPU]
    holes, last_end, last_name = [], None, None
    for name, start, end in kernels:
        if last_end is not None and start > last_end:
            holes.append((start - last_end, last_end, start, last_name, name))
        if last_end is None or end >= last_end:
            last_end, last_name = end, name
    holes.sort(reverse=True)
    out = []
    for width, a, b, before, after in holes[:top]:
        inside = sorted({n for s, e, n in cpu if s < b and e > a and not n.startswith("ProfilerStep")})[:8]
        out.append(dict(gap_us=round(width, 1), before=before[:60], after=after[:60], cpu=inside))
    return dict(wall_ms=wall_ms, gpu_busy_ms=breakdown(kernels)["busy_ms"], gaps_ms=sum(h[0] for h in holes) / 1e3,
                n_gaps=len(holes), gaps_over_20us_ms=sum(h[0] for h in holes if h[0] > 20) / 1e3, largest=out)


def timeline(prof, marker: str = "fill") -> dict:
    """Where a CUDA-only profile's idle time lies (the host not slowed by CPU tracing): between the start marker
    (the first ``marker`` kernel) and the first kernel after it (``lead``), between the last kernel and the end marker
    (``tail``), gaps of 20 µs or more next to a host-to-device copy (batch boundaries) or elsewhere, and the short gaps
    (launch latency between kernels, inside CUDA graphs too): ms and counts, with the 12 longest gaps' place."""
    from esm_turbo.bench.step import kernel_times
    kernels = kernel_times(prof.events())
    marks = [i for i, k in enumerate(kernels) if marker in k[0].lower()]
    first, last = marks[0], marks[-1]
    body = kernels[first + 1: last]
    out = dict(lead_ms=(body[0][1] - kernels[first][2]) / 1e3, tail_ms=(kernels[last][1] - body[-1][2]) / 1e3,
               kernels=len(body), copies_in=sum("HtoD" in k[0] for k in body))
    sums = dict(boundary=[0.0, 0], long=[0.0, 0], short=[0.0, 0])
    holes, end, before = [], body[0][2], body[0][0]
    for name, start, stop in body[1:]:
        if start > end:
            width = start - end
            kind = ("short" if width < 20 else "boundary" if "HtoD" in name or "HtoD" in before else "long")
            sums[kind][0] += width / 1e3
            sums[kind][1] += 1
            holes.append((width, (end - body[0][1]) / 1e3, before[:40], name[:40]))
        if stop >= end:
            end, before = stop, name
    for kind, (ms, n) in sums.items():
        out[f"{kind}_gaps_ms"], out[f"{kind}_gaps"] = ms, n
    out["longest"] = [dict(gap_us=round(w, 1), at_ms=round(t, 2), before=b, after=a)
                      for w, t, b, a in sorted(holes, reverse=True)[:12]]
    return out


def per_1k_tokens(prof, tokens: int) -> dict:
    """GPU µs per 1,000 tokens by kernel name (60 characters), from a profile's events, longest first."""
    from esm_turbo.bench.step import kernel_times
    totals: dict[str, float] = {}
    for name, start, end in kernel_times(prof.events()):
        totals[name[:60]] = totals.get(name[:60], 0.0) + (end - start)
    return {k: round(v * 1e3 / tokens, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def bound(per_1k: dict, ceiling: float) -> dict:
    """From a part's GPU µs per 1,000 tokens by kernel (:func:`per_1k_tokens`) and the products' ceiling (tokens/s):
    the products' (the kernels ``esm_turbo.bench.step.kernel_kind`` calls linears) and the other kernels' µs per
    1,000 tokens, and the rate with the products at the ceiling and the rest as it ran, no GPU idle (tokens/s and %
    of the ceiling)."""
    from esm_turbo.bench.step import kernel_kind
    products = sum(v for k, v in per_1k.items() if kernel_kind(k) == "linears")
    rest = sum(per_1k.values()) - products
    rate = 1 / (1 / ceiling + rest * 1e-9)  # µs per 1,000 tokens: 1e-9 s a token each
    return dict(ceiling_tokens_per_s=ceiling, products_us_per_1k=round(products, 1), rest_us_per_1k=round(rest, 1),
                bound_tokens_per_s=rate, bound_pct_ceiling=100 * rate / ceiling)


def forward_part(size: str, tokens: int, gelu: str) -> tuple[dict, str]:
    from torch.profiler import ProfilerActivity, profile
    from tune_gemm import warm_forward
    dev = torch.device("cuda")
    fast, batch, picked = warm_forward(size, tokens)
    fast.gelu = gelu
    for _ in range(3):
        fast(batch)
    # host enqueue time with the GPU kept busy: a big matmul first so nothing the host queues can start at once
    big = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    enqueue = []
    for _ in range(5):
        for _ in range(20):
            big @ big
        t0 = time.perf_counter()
        fast(batch)
        enqueue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fast(batch)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fast(batch)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    row = gaps(prof, wall)
    row.update(part="forward", tokens=sum(len(s) + 2 for s in picked), host_enqueue_ms=min(enqueue),
               wall_unprofiled_ms=min(walls))
    row["kernels_us_per_1k_tokens"] = per_1k_tokens(prof, row["tokens"])
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    return row, cpu


def embedder_part(size: str, copies: int, gelu: str) -> tuple[dict, str]:
    from torch.profiler import ProfilerActivity, profile

    from esm_turbo.bench import EMBED_FASTA
    from esm_turbo.embed.benchmark import _NullWriter, random_masked_lm
    from esm_turbo.embed.extract import EmbedConfig, Embedder
    from esm_turbo.fasta import Record, read_fastas
    dev = torch.device("cuda")
    base = read_fastas(EMBED_FASTA)
    records = [Record(f"{r.id}#{k}", r.sequence, r.source) for k in range(copies) for r in base]
    emb = Embedder(random_masked_lm(size, dev, torch.float16), EmbedConfig(include=["mean"], gelu=gelu), dev)
    emb.run(records, _NullWriter(), progress=False)
    torch.cuda.synchronize()
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        emb.run(records, _NullWriter(), progress=False)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        emb.run(records, _NullWriter(), progress=False)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    row = gaps(prof, wall)
    mark = torch.zeros(1 << 20, device=dev)
    with profile(activities=[ProfilerActivity.CUDA]) as quiet:
        mark.fill_(1.0)
        t0 = time.perf_counter()
        emb.run(records, _NullWriter(), progress=False)
        mark.fill_(2.0)
        torch.cuda.synchronize()
        row["cuda_only_wall_ms"] = (time.perf_counter() - t0) * 1e3
    row["cuda_only"] = timeline(quiet)
    tokens = sum(len(r.sequence) + 2 for r in records)
    row.update(part="embedder", tokens=tokens, wall_unprofiled_ms=min(walls),
               tokens_per_s=tokens / min(walls) * 1e3)
    row["kernels_us_per_1k_tokens"] = per_1k_tokens(prof, tokens)
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    cpu += "\n" + prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=90)
    return row, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="650M")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--gelu", choices=["erf", "tanh"], default="erf")
    ap.add_argument("--out", type=Path, default=Path("gaps"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from esm_turbo.embed.benchmark import gemm_ceiling
    from esm_turbo.model.sizes import esm2_config
    ceiling = gemm_ceiling(esm2_config(args.size), args.tokens, torch.device("cuda"), torch.float16)
    rows = []
    for name, fn, arg in (("forward", forward_part, args.tokens), ("embedder", embedder_part, args.copies)):
        row, cpu = fn(args.size, arg, args.gelu)
        row["size"], row["gelu"] = args.size, args.gelu
        row["bound"] = bound(row["kernels_us_per_1k_tokens"], ceiling)
        rate = row["tokens"] / row["wall_unprofiled_ms"] * 1e3
        row["bound"].update(tokens_per_s=rate, pct_ceiling=100 * rate / ceiling)
        rows.append(row)
        (args.out / f"cpu_{name}.txt").write_text(cpu)
        log(json.dumps(row, indent=1))
    (args.out / "gaps.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
