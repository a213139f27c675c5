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
from ..ops.blocks import BLOCK_SIZE
from ..ops.compressed import fused_tables
from .synthetic import as_blocks, layer_codec, random_protein, shuffled_pages, stand_in_model, synthetic_cache
from .step import format_breakdown, kv_bytes_held, profile_step, read_rate_gbs, step_report
from .timing import device_name, link_h2d_gbs, time_eager, time_graph


@dataclass
class DesignBench:
    device: str
    model: str
    prefix: int
    candidates: int
    tail: int
    block_size: int
    rows: list[dict] = field(default_factory=list)  # tokens/s: the fastest of ROUNDS interleaved rounds
    offload: dict = field(default_factory=dict)  # a quarter of distinct rows a step, in and over a budget
    block_tables: dict = field(default_factory=dict)  # decode attention through block tables vs contiguous
    read_gbs: float | None = None  # a pure read's rate, what each step's floor is taken at (CUDA)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


#: timed steps of each session run in this many interleaved rounds (each session a round in turn) and the fastest
#: round counts: an eager step is bound by the host, whose pace drifts over a run
ROUNDS = 3


def _interleaved(steps: dict, count: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each ``steps[name](i)`` (i: the step's index) over :data:`ROUNDS` rounds of ``count //
    ROUNDS`` steps, the sessions taking turns each round; the first step of each (blocks taken, copies on write)
    runs untimed before."""
    for step in steps.values():
        step(0)
    per = max(1, count // ROUNDS)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(ROUNDS):
        for name, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            for i in range(per):
                step(1 + r * per + i)
            _sync(device)
            times[name].append((time.perf_counter() - t0) / per)
    return times


@torch.no_grad()
def bench_design(device: torch.device, size: str = "650M", prefix: int = 1024, candidates: int = 256, tail: int = 64,
                 block_size: int = BLOCK_SIZE, layers: int | None = None) -> DesignBench:
    from ..model.alphabet import alphabet
    from ..model.engine import TurboEsm
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    engine = TurboEsm(stand_in_model(size, device, dtype, layers))
    scaffold = random_protein(prefix - 1, 0)  # <cls> + residues = prefix tokens
    res = DesignBench(device_name(device), f"{size}-shaped" + (f" ({layers} layers)" if layers else ""), prefix,
                      candidates, tail, block_size)
    step = torch.full((candidates, 1), alphabet().get_idx("A"), device=device)
    room = prefix + tail + REPLAYS + 1  # the eager steps, then a captured step's replays
    sessions = {kind: _forked(engine, kind, scaffold, candidates, room, block_size) for kind in CACHES}
    times = _interleaved({kind: (lambda i, s=s: s.step(step)) for kind, s in sessions.items()}, tail - 1, device)
    print("bench design: forks done", file=sys.stderr, flush=True)
    rate = read_rate_gbs(device) if device.type == "cuda" else None
    for kind, session in sessions.items():
        rep = session.memory_report()
        per_token = rep.bytes_per_token
        least = (prefix + candidates * tail) * per_token
        held = kv_bytes_held(rep, session.paged)
        sec = min(times[kind])
        row = dict(cache=kind, held_bytes=held, least_bytes=least, vs_least=held / least,
                   shared_saved_bytes=rep.shared_saved_bytes, tokens_per_s=candidates / sec,
                   step_ms=sec * 1e3, round_ms=[t * 1e3 for t in times[kind]])
        if rate is not None:
            row.update(step_report(session, row["step_ms"], rate))
            row["captured_ms"] = _captured_ms(session, step, device)  # the step as a CUDA graph
            row["captured_of_floor"] = row["floor_ms"] / row["captured_ms"]
        res.rows.append(row)
    res.read_gbs = rate
    del sessions, session
    _sync(device)
    fp16 = res.rows[-1]["held_bytes"]
    for r in res.rows:
        r["vs_fp16"] = r["held_bytes"] / fp16
    res.offload = _bench_offload(engine, device, prefix, candidates, tail, block_size)
    heads, dim = engine.heads, engine.head_dim
    res.block_tables = (bench_block_tables(device, heads, dim, 64, 16384, block_size) if device.type == "cuda" else
                        bench_block_tables(device, heads, dim, 2, 256, block_size))
    if rate is not None:  # last: a profiler leaves the process slower after it (CUPTI stays attached)
        for row in res.rows:
            session = _forked(engine, row["cache"], scaffold, candidates, room, block_size)
            for _ in range(tail):
                session.step(step)
            row["breakdown"] = profile_step(lambda: session.step(step, commit=False), device) | dict(eager=True)
            del session
            _sync(device)
    return res


#: the design loop's caches: the compressed cache paged and contiguous, and the contiguous fp16 cache
CACHES = ("compressed, paged", "compressed, contiguous", "fp16, contiguous")


def _forked(engine, kind: str, scaffold: str, candidates: int, capacity: int, block_size: int):
    """A session of cache ``kind`` (:data:`CACHES`) holding ``scaffold`` forked into ``candidates`` rows."""
    session = engine.session("fp16" if kind.startswith("fp16") else layer_codec, capacity=capacity,
                             paged=kind.endswith("paged"), block_size=block_size)
    session.start([scaffold])
    session.fork(candidates)
    return session


#: replays of a captured step timed after one untimed (the sessions hold room for them)
REPLAYS = 8


def _captured_ms(session, step: torch.Tensor, device: torch.device) -> float:
    """Milliseconds of ``session``'s committing step captured as a CUDA graph (room for :data:`REPLAYS` + 1 more
    tokens a row reserved first: the contiguous cache within its capacity, the paged cache's blocks taken), the
    median of :data:`REPLAYS` replays after one untimed (:func:`~.timing.time_eager`)."""
    captured = session.capture_step(step, commit=True, reserve=REPLAYS + 1)
    return time_eager(captured.replay, device, reps=REPLAYS) * 1e3


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


def _bench_offload(engine, device: torch.device, prefix: int, rows: int, steps: int, block_size: int) -> dict:
    """``rows`` distinct sequences of ``prefix`` tokens, a quarter of them stepped at a time (in turn), with every
    block on the device and under a device budget of a quarter of the cache (and room for the step's new blocks),
    in interleaved rounds: decode tokens/s of each, the cache's share on the host, the bytes a budgeted step brings
    in, and the link's ceiling: a step can be no faster than its bytes' copy at the measured host-to-device rate,
    nor than the step with every block on the device."""
    from ..model.alphabet import alphabet
    quarter = max(1, rows // 4)
    step = torch.full((quarter, 1), alphabet().get_idx("A"), device=device)
    groups = [list(range(q * quarter, (q + 1) * quarter)) for q in range(rows // quarter)]
    sequences = [random_protein(prefix - 1, seed) for seed in range(rows)]

    def session(budget):
        s = engine.session(layer_codec, capacity=prefix + steps, paged=True, block_size=block_size,
                           gpu_budget_gib=budget)
        s.start(sequences)
        return s

    inside = session(None)
    rep = inside.memory_report()
    block = rep.bytes_per_token * block_size
    budget = (rep.used_bytes / 4 + 2 * quarter * block) / 2**30
    over = session(budget)
    moved = over.cache.pool.moved
    runs = {"device": inside, "budget": over}
    counted = {}

    def stepper(name):
        def run(i):
            if i == 1 and name == "budget":  # the untimed first steps are done: count the moves from here
                counted["in"] = moved["in"]
            runs[name].step(step, rows=groups[i % len(groups)])
        return run

    times = _interleaved({name: stepper(name) for name in runs}, steps - 1, device)
    print("bench design: host tier done", file=sys.stderr, flush=True)
    timed = ROUNDS * max(1, (steps - 1) // ROUNDS)
    bytes_in = (moved["in"] - counted["in"]) * over.cache.pool.layout.row_bytes / timed
    link = link_h2d_gbs(device)
    t_in, t_over = min(times["device"]), min(times["budget"])
    ceiling = max(t_in, bytes_in / (link * 1e9)) if link else t_in
    held = over.memory_report()
    out = dict(rows=rows, rows_per_step=quarter, budget_gib=budget, held_bytes=held.used_bytes,
               host_bytes=held.host_bytes, in_device_tokens_per_s=quarter / t_in,
               budget_tokens_per_s=quarter / t_over, vs_in_device=t_in / t_over, bytes_in_per_step=bytes_in,
               link_gbps=link, ceiling_tokens_per_s=quarter / ceiling, vs_ceiling=ceiling / t_over,
               round_ms={name: [t * 1e3 for t in ts] for name, ts in times.items()})
    runs.clear()
    del inside, over
    return out


def format_design(res: DesignBench) -> str:
    lines = [f"design loop: {res.candidates} candidates forked from one {res.prefix}-token scaffold, each extended by "
             f"{res.tail} tokens ({res.model}, {res.device}; blocks of {res.block_size})",
             f"  {'cache':<24}{'held MiB':>10}{'× least':>9}{'× fp16':>8}{'tokens/s':>11}{'step ms':>9}"
             + (f"{'floor ms':>10}{'reached':>9}" if res.read_gbs else "")]
    for r in res.rows:
        floor = f"{r['floor_ms']:>10.2f}{100 * r['of_floor']:>8.0f}%" if "floor_ms" in r else ""
        lines.append(f"  {r['cache']:<24}{r['held_bytes'] / 2**20:>10.1f}{r['vs_least']:>8.2f}×{r['vs_fp16']:>7.3f}×"
                     f"{r['tokens_per_s']:>11.0f}{r['step_ms']:>9.2f}{floor}")
    lines.append("  least: one scaffold plus every tail at the cache's bytes per token; steps run eagerly")
    if res.read_gbs:
        lines.append(f"  floor: one read of what a step must read (the cache's keys and values, the weights, each "
                     f"layer's hidden states) at a pure read's {res.read_gbs:.0f} GB/s, measured here")
        flat = next(r for r in res.rows if r["cache"] == "compressed, contiguous")
        for r in res.rows:
            lines.append(f"  {r['cache']}: {format_breakdown(r['breakdown'], r['step_ms'])}")
            lines.append(f"    captured as a CUDA graph: {r['captured_ms']:.2f} ms a step, "
                         f"{100 * r['captured_of_floor']:.0f}% of the floor, "
                         f"{flat['captured_ms'] / r['captured_ms']:.2f}x the contiguous compressed cache's speed")
    if res.offload:
        o = res.offload
        lines.append(f"host tier: {o['rows']} distinct {res.prefix}-token sequences on the paged cache, "
                     f"{o['rows_per_step']} stepped at a time in turn")
        lines.append(f"  every block on the device: {o['in_device_tokens_per_s']:.0f} tokens/s; under a "
                     f"{o['budget_gib'] * 2**10:.1f} MiB budget ({o['host_bytes'] / max(o['held_bytes'], 1):.0%} of "
                     f"{o['held_bytes'] / 2**20:.1f} MiB on the host): {o['budget_tokens_per_s']:.0f} tokens/s "
                     f"({o['vs_in_device']:.2f}x)")
        if o["link_gbps"]:
            lines.append(f"  each budgeted step brings {o['bytes_in_per_step'] / 2**20:.0f} MiB in; at the link's "
                         f"{o['link_gbps']:.1f} GB/s (pinned, host to device) the ceiling is "
                         f"{o['ceiling_tokens_per_s']:.0f} tokens/s: {o['vs_ceiling']:.0%} of it reached")
    if res.block_tables:
        b = res.block_tables
        lines.append(f"decode attention, one layer, B={b['batch']} T={b['context']} ({b['path']}): contiguous "
                     f"{b['contiguous_us']:.1f} µs, through block tables {b['paged_us']:.1f} µs "
                     f"({b['contiguous_over_paged']:.2f}x the contiguous speed)")
    return "\n".join(lines)


def design_json(res: DesignBench) -> dict:
    return asdict(res)
