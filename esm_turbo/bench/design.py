"""``esm-turbo bench design``: a design loop's fork-and-extend on three caches in one run: the paged compressed cache
(forks share their prefix blocks), the contiguous compressed cache (a fork copies rows) and the contiguous fp16 cache.

One scaffold of ``prefix`` tokens is prefilled once, forked into ``candidates`` rows, and every row is extended by
``tail`` tokens, one decode step at a time. Reported per cache: the cache's bytes held at the end (against one
prefix plus every tail, the least any cache of that codec can hold) and decode tokens/s. A random-weight model of
the size's shape and random codecs of the default recipe's widths: memory and speed do not depend on the values.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ..ops import attend_compressed, use_kernels
from ..ops.compressed import fused_tables
from .synthetic import as_blocks, layer_codec, random_protein, shuffled_pages, stand_in_model, synthetic_cache
from .timing import time_graph


@dataclass
class DesignBench:
    device: str
    model: str
    prefix: int
    candidates: int
    tail: int
    block_size: int
    rows: list[dict] = field(default_factory=list)
    offload: list[dict] = field(default_factory=list)  # a quarter of distinct rows a step, in and over a budget
    block_tables: dict = field(default_factory=dict)  # decode attention through block tables vs contiguous


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed_steps(step, steps: int, device: torch.device) -> float:
    """Seconds of steps 2..``steps`` of ``step(i)``; the first (blocks taken, copies on write) runs untimed."""
    step(0)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(1, steps):
        step(i)
    _sync(device)
    return time.perf_counter() - t0


@torch.no_grad()
def bench_design(device: torch.device, size: str = "650M", prefix: int = 1024, candidates: int = 256, tail: int = 64,
                 block_size: int = 64, layers: int | None = None) -> DesignBench:
    from ..model.alphabet import alphabet
    from ..model.engine import TurboEsm
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    engine = TurboEsm(stand_in_model(size, device, dtype, layers))
    scaffold = random_protein(prefix - 1, 0)  # <cls> + residues = prefix tokens
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    res = DesignBench(name, f"{size}-shaped" + (f" ({layers} layers)" if layers else ""), prefix, candidates, tail,
                      block_size)
    step = torch.full((candidates, 1), alphabet().get_idx("A"), device=device)
    for kind, paged in (("compressed, paged", True), ("compressed, contiguous", False), ("fp16, contiguous", False)):
        factory = "fp16" if kind.startswith("fp16") else layer_codec
        session = engine.session(factory, capacity=prefix + tail, paged=paged, block_size=block_size)
        session.start([scaffold])
        session.fork(candidates)
        sec = _timed_steps(lambda i, s=session: s.step(step), tail, device)
        print(f"bench design: {kind} done", file=sys.stderr, flush=True)
        rep = session.memory_report()
        per_token = rep.bytes_per_token_per_layer * rep.layers
        least = (prefix + candidates * tail) * per_token
        held = rep.used_bytes if paged else rep.tokens * per_token  # contiguous: every row's tokens, at its bytes
        res.rows.append(dict(cache=kind, held_bytes=held, least_bytes=least, vs_least=held / least,
                             shared_saved_bytes=rep.shared_saved_bytes,
                             tokens_per_s=candidates * (tail - 1) / sec, step_ms=sec / (tail - 1) * 1e3))
        del session
        _sync(device)
    fp16 = res.rows[-1]["held_bytes"]
    for r in res.rows:
        r["vs_fp16"] = r["held_bytes"] / fp16
    res.offload = _bench_offload(engine, device, prefix, candidates, tail, block_size)
    heads, dim = engine.heads, engine.head_dim
    res.block_tables = (bench_block_tables(device, heads, dim, 64, 16384, block_size) if device.type == "cuda" else
                        bench_block_tables(device, heads, dim, 2, 256, block_size))
    return res


def bench_block_tables(device: torch.device, heads: int, dim: int, batch: int, context: int,
                       block_size: int) -> dict:
    """One layer's decode attention over ``batch`` rows of ``context`` cached tokens (random codes, the default
    codec): the contiguous cache against the same rows in blocks at shuffled pool slots read through a block
    table. µs each (CUDA graphs) and contiguous / paged (≥ 1: paged as fast)."""
    cache = synthetic_cache(heads, dim, batch, context, device)
    codec = cache.codecs[0]
    fused_tables(codec)
    q = torch.randn(batch, heads, 1, dim, device=device) * dim**-0.5
    k_new, v_new = torch.randn(2, batch, heads, 1, dim, device=device)
    valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
    pages = shuffled_pages(batch, -(-context // block_size), seed=1, device=device)
    pool = {name: as_blocks(part, pages, block_size, pages.numel()) for name, part in cache.parts[0].items()}
    flat_us = time_graph(lambda: attend_compressed(codec, cache.parts[0], cache.lengths, q, k_new, v_new, valid),
                         device) * 1e6
    cache.parts[0] = {}  # the pool holds a copy
    paged_us = time_graph(lambda: attend_compressed(codec, pool, cache.lengths, q, k_new, v_new, valid, pages,
                                                    block_size), device) * 1e6
    return dict(batch=batch, context=context, heads=heads, head_dim=dim, block_size=block_size,
                path="triton" if use_kernels(q) else "pytorch-reference", contiguous_us=flat_us, paged_us=paged_us,
                contiguous_over_paged=flat_us / paged_us)


def _bench_offload(engine, device: torch.device, prefix: int, rows: int, steps: int, block_size: int) -> list[dict]:
    """``rows`` distinct sequences of ``prefix`` tokens, a quarter of them stepped at a time (in turn), with every
    block on the device and then under a device budget of a quarter of the cache (and room for the step's new
    blocks): decode tokens/s of each, and the cache's share on the host."""
    from ..model.alphabet import alphabet
    quarter = max(1, rows // 4)
    step = torch.full((quarter, 1), alphabet().get_idx("A"), device=device)
    out, budget = [], None
    for _ in range(2):
        session = engine.session(layer_codec, capacity=prefix + steps, paged=True, block_size=block_size,
                                 gpu_budget_gib=budget)
        session.start([random_protein(prefix - 1, seed) for seed in range(rows)])
        groups = [list(range(q * quarter, (q + 1) * quarter)) for q in range(rows // quarter)]
        sec = _timed_steps(lambda i, s=session: s.step(step, rows=groups[i % len(groups)]), steps, device)
        print(f"bench design: host tier, budget {budget} GiB, done", file=sys.stderr, flush=True)
        rep = session.memory_report()
        out.append(dict(budget_gib=budget, rows=rows, rows_per_step=quarter, held_bytes=rep.used_bytes,
                        host_bytes=rep.host_bytes, tokens_per_s=quarter * (steps - 1) / sec))
        block = rep.bytes_per_token_per_layer * rep.layers * block_size
        budget = (rep.used_bytes / 4 + 2 * quarter * block) / 2**30
        del session
    out[1]["vs_in_device"] = out[1]["tokens_per_s"] / out[0]["tokens_per_s"]
    return out


def format_design(res: DesignBench) -> str:
    lines = [f"design loop: {res.candidates} candidates forked from one {res.prefix}-token scaffold, each extended by "
             f"{res.tail} tokens ({res.model}, {res.device}; blocks of {res.block_size})",
             f"  {'cache':<24}{'held MiB':>10}{'× least':>9}{'× fp16':>8}{'tokens/s':>11}{'step ms':>9}"]
    for r in res.rows:
        lines.append(f"  {r['cache']:<24}{r['held_bytes'] / 2**20:>10.1f}{r['vs_least']:>8.2f}×{r['vs_fp16']:>7.3f}×"
                     f"{r['tokens_per_s']:>11.0f}{r['step_ms']:>9.2f}")
    lines.append("  least: one scaffold plus every tail at the cache's bytes per token")
    if res.offload:
        inside, over = res.offload
        lines.append(f"host tier: {inside['rows']} distinct {res.prefix}-token sequences on the paged cache, "
                     f"{inside['rows_per_step']} stepped at a time in turn")
        lines.append(f"  every block on the device: {inside['tokens_per_s']:.0f} tokens/s; under a "
                     f"{over['budget_gib'] * 2**10:.1f} MiB budget ({over['host_bytes'] / max(over['held_bytes'], 1):.0%}"
                     f" of {over['held_bytes'] / 2**20:.1f} MiB on the host): {over['tokens_per_s']:.0f} tokens/s "
                     f"({over['vs_in_device']:.2f}x)")
    if res.block_tables:
        b = res.block_tables
        lines.append(f"decode attention, one layer, B={b['batch']} T={b['context']} ({b['path']}): contiguous "
                     f"{b['contiguous_us']:.1f} µs, through block tables {b['paged_us']:.1f} µs "
                     f"({b['contiguous_over_paged']:.2f}x the contiguous speed)")
    return "\n".join(lines)


def design_json(res: DesignBench) -> dict:
    return asdict(res)
