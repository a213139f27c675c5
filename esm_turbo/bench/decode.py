"""The decode suite: attention per layer call against its baselines and the read floor, quantize-and-pack's share
of a prefill, decode tokens/s under one KV budget, and CPU step latencies."""

from __future__ import annotations

import time

import torch

from ..cache import KVCache
from ..fasta import CALIBRATION_DATA
from ..ops import attend_compressed, use_kernels
from ..ops.compressed import fused_tables
from .synthetic import (TRAINED_SPREAD, bytes_read, decode_inputs, default_codec, layer_codec, random_protein,
                        stand_in_model, synthetic_cache, synthetic_session)
from .timing import read_floor_us, time_graph, time_in_step

SHAPES = {"650M": (20, 64), "15B": (40, 128)}


def time_fused(cache: KVCache, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                valid: torch.Tensor) -> tuple[float, float, float]:
    """The fused decode attention of q [B, H, 1, d] over layer 0 of ``cache`` (all rows ``cache.lengths`` long):
    (µs as one graph, µs per call in a step's graph, GB/s on the cache bytes it reads)."""
    codec, parts = cache.codecs[0], cache.parts[0]
    fused_tables(codec)

    def fused():
        return attend_compressed(codec, parts, cache.lengths, q, k_new, v_new, valid)
    device = q.device
    us = time_graph(fused, device) * 1e6
    return us, time_in_step(fused, device) * 1e6, bytes_read(cache) / (us * 1e-6) / 1e9


def bench_attention(device: torch.device, batches, lengths, shapes=SHAPES) -> list[dict]:
    rows = []
    f16 = torch.float16 if device.type == "cuda" else torch.float32
    for name, (heads, dim) in shapes.items():
        for batch in batches:
            for length in lengths:
                row = dict(shape=name, heads=heads, head_dim=dim, batch=batch, context=length)
                q, k_new, v_new, valid = decode_inputs(batch, heads, dim, device)
                grid = synthetic_cache(heads, dim, batch, length, device, grid=True)
                row["grid_us"], row["grid_step_us"], row["grid_gbs"] = time_fused(grid, q, k_new, v_new, valid)
                nbytes = bytes_read(grid)
                grid = None
                row["read_us"] = read_floor_us(nbytes, device) if device.type == "cuda" else None
                cache = synthetic_cache(heads, dim, batch, length, device, grid=False)
                codec = cache.codecs[0]
                row["fused_us"], row["fused_step_us"], row["fused_gbs"] = time_fused(cache, q, k_new, v_new, valid)

                def two_step():
                    k_hat, v_hat = codec.decode(cache.layer_parts(0, upto=length))
                    keys = torch.cat([k_hat.to(f16), k_new.to(f16)], 2)
                    vals = torch.cat([v_hat.to(f16), v_new.to(f16)], 2)
                    return torch.nn.functional.scaled_dot_product_attention(q.to(f16), keys, vals, scale=1.0)

                row["fused_path"] = "triton" if use_kernels(q) else "pytorch-reference"
                try:
                    row["two_step_us"] = time_graph(two_step, device) * 1e6
                except torch.OutOfMemoryError:
                    row["two_step_us"] = None
                cache = codec = None  # free the packed cache before the fp16 one
                try:
                    kf = torch.randn(batch, heads, length + 1, dim, device=device, dtype=f16)
                    vf = torch.randn_like(kf)
                    qf = q.to(f16)
                    def sdpa():
                        return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, scale=1.0)
                    row["sdpa_fp16_us"] = time_graph(sdpa, device) * 1e6
                    row["sdpa_fp16_step_us"] = time_in_step(sdpa, device) * 1e6
                    kf = vf = None
                except torch.OutOfMemoryError:
                    row["sdpa_fp16_us"] = row["sdpa_fp16_step_us"] = None
                for base in ("two_step", "sdpa_fp16"):
                    t = row[f"{base}_us"]
                    row[f"speedup_vs_{base}"] = t / row["fused_us"] if t else None
                    row[f"grid_speedup_vs_{base}"] = t / row["grid_us"] if t else None
                t = row["sdpa_fp16_us"]
                row["ceiling_vs_sdpa_fp16"] = t / row["read_us"] if t and row["read_us"] else None
                t = row["sdpa_fp16_step_us"]
                row["step_speedup_vs_sdpa_fp16"] = t / row["fused_step_us"] if t else None
                row["grid_step_speedup_vs_sdpa_fp16"] = t / row["grid_step_us"] if t else None
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


#: the widths rows: (label, preset, mean index bits); the first is the one the others are held to per bit stored
WIDTH_RECIPES = (("4.0 bits, channels <= 4", "values-capped", 3), ("4.0 bits, default", "default", 3),
                 ("3.0 bits, values <= 2", "values-capped", 2), ("3.0 bits, default", "default", 2),
                 ("3.0 bits, wide", "wide", 2))


def bench_widths(device: torch.device, batch: int = 64, length: int = 16384, shape: str = "650M") -> list[dict]:
    """The fused decode attention per layer call on caches of each of :data:`WIDTH_RECIPES` (random codes of the
    recipe's widths, allocated as unevenly as on a trained model (:data:`TRAINED_SPREAD`): how wide a channel may be
    changes the fields the kernel unpacks, not the bytes): µs, the read floor of its own bytes, and µs per bit stored
    against the first row's (CUDA)."""
    from ..model.recipe import recipe
    heads, dim = SHAPES[shape]
    rows = []
    q, k_new, v_new, valid = decode_inputs(batch, heads, dim, device)
    for label, preset, bits in WIDTH_RECIPES:
        cfg = recipe(preset, bits).resolved()
        cache = synthetic_cache(heads, dim, batch, length, device, recipe=cfg, spread=TRAINED_SPREAD)
        codec = cache.codecs[0]
        widths = [qz.code_layout().widest for qz in (codec.key, codec.value)]  # bits, the sign's included
        all_in = cache.memory_report().bits_per_value
        us, step_us, gbs = time_fused(cache, q, k_new, v_new, valid)
        read_us = read_floor_us(bytes_read(cache), device)
        rows.append(dict(recipe=label, preset=preset, shape=shape, batch=batch, context=length, bits=all_in,
                         widest_key=widths[0], widest_value=widths[1], fused_us=us, fused_step_us=step_us,
                         fused_gbs=gbs, read_us=read_us, of_read=read_us / us, us_per_bit=us / all_in))
        cache = codec = None
        torch.cuda.empty_cache()
    for r in rows:
        r["per_bit_vs_first"] = r["us_per_bit"] / rows[0]["us_per_bit"]
        r["speedup_vs_first"] = rows[0]["fused_us"] / r["fused_us"]
    return rows


@torch.no_grad()
def bench_quantize(device, size: str = "650M", length: int = 1024, layers: int | None = None) -> dict:
    """Prefill time with and without writing the compressed cache (what quantize-and-pack adds to a
    prefill), and the quantize-and-pack launches of all layers timed on their own."""
    from ..model.attention import RunContext
    from ..model.engine import TurboEsm
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = stand_in_model(size, device, dtype, layers)
    engine = TurboEsm(model)
    h, d = engine.heads, engine.head_dim
    seq = random_protein(length - 2, 0)

    from ..model.alphabet import encode
    tokens, mask = encode([seq], add_eos=True)
    tokens, mask = tokens.to(device), mask.to(device)
    session = engine.session(layer_codec, capacity=length + 8)
    session.start([seq], add_eos=True)  # builds tables, compiles kernels
    cache = session.cache
    plain = time_graph(lambda: engine.base(input_ids=tokens, attention_mask=mask), device, reps=10)

    def prefill_writing():
        cache.set_lengths(0)
        with engine.context(RunContext(mode="prefill", cache=cache, valid=mask.bool())):
            engine.base(input_ids=tokens, attention_mask=mask)

    writing = time_graph(prefill_writing, device, reps=10)

    def quantize_only():  # nothing commits, so every layer writes at row 0
        cache.set_lengths(0)
        for layer in range(len(cache.codecs)):
            cache.write(layer, kv[layer][0], kv[layer][1])

    kv = [(torch.randn(1, h, tokens.shape[1], d, device=device, dtype=dtype),
           torch.randn(1, h, tokens.shape[1], d, device=device, dtype=dtype)) for _ in cache.codecs]
    quant = time_graph(quantize_only, device, reps=10)
    return dict(model=f"{size}-shaped" + (f" ({layers} layers)" if layers else ""), tokens=int(tokens.shape[1]),
                prefill_ms=plain * 1e3, prefill_writing_ms=writing * 1e3, added_ms=(writing - plain) * 1e3,
                added_fraction=(writing - plain) / plain, quantize_pack_ms=quant * 1e3, fraction=quant / plain,
                path="triton" if use_kernels(tokens) else "pytorch-reference")


@torch.no_grad()
def bench_decode(device, size: str = "650M", context: int = 1024, budget_gib: float = 8.0, steps: int = 16,
                 layers: int | None = None, max_batch: int = 1024, batches: tuple[int, ...] = ()) -> list[dict]:
    """Decode tokens/s with an fp16 cache and the compressed caches, each at the largest batch whose KV cache fits
    ``budget_gib`` at ``context`` + ``steps`` tokens and at each of ``batches`` below it. On CUDA each row also holds
    the step's floor (:func:`~esm_turbo.bench.step.step_report`: one read of what the step must read, at the pure-read
    rate measured here) and where its time goes (:func:`~esm_turbo.bench.step.profile_step` of a replay)."""
    from ..model.engine import TurboEsm
    from ..model.alphabet import alphabet
    from .step import read_rate_gbs
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = stand_in_model(size, device, dtype, layers)
    engine = TurboEsm(model)
    rate = read_rate_gbs(device) if device.type == "cuda" else None
    token = alphabet().get_idx("A")
    rows, made = [], []
    for kind in ("fp16", "turbo-3+1-lut", "turbo-3+1-grid"):
        factory = (lambda layer, h, d, grid=kind.endswith("grid"): default_codec(h, d, layer, grid)) \
            if kind != "fp16" else "fp16"
        codecs = engine.codecs(factory)
        per_token = sum(c.token_bytes(engine.heads) for c in codecs)
        tokens_per_row = context + steps
        most = min(max_batch, int(budget_gib * 2**30 // (per_token * tokens_per_row)))
        for batch in sorted({b for b in batches if b < most} | {most}):
            made.append((factory, batch))
            row = _decode_row(engine, factory, kind, batch, context, steps, device, token, rate)
            row.update(kv_bytes_per_token=per_token, kv_gib=per_token * tokens_per_row * batch / 2**30,
                       at_budget=batch == most)
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rate is not None:  # last: a profiler leaves the process slower after it (CUPTI stays attached)
        for row, (factory, batch) in zip(rows, made):
            row["breakdown"] = _profile_row(engine, factory, batch, context, device, token)
            torch.cuda.empty_cache()
    fp16 = {r["batch"]: r["tokens_per_s"] for r in rows if r["cache"] == "fp16"}
    fp16_budget = next(r["tokens_per_s"] for r in rows if r["cache"] == "fp16" and r["at_budget"])
    for row in rows:  # under one budget against the fp16 cache's most rows; else at the same rows, where measured
        base = fp16_budget if row["at_budget"] else fp16.get(row["batch"])
        if row["cache"] != "fp16" and base:
            row["speedup_vs_fp16"] = row["tokens_per_s"] / base
    return rows


def _profile_row(engine, factory, batch: int, context: int, device, token: int) -> dict:
    """:func:`.step.profile_step` of one captured step of ``batch`` rows over a fresh synthetic ``context``-token
    cache (the same kernels eagerly if the profiler sees none inside the graph)."""
    from .step import profile_step
    session = synthetic_session(engine, factory, batch, context, 4)
    tokens = torch.full((batch, 1), token, device=device)
    found = profile_step(session.capture_step(tokens, commit=True, reserve=4).replay, device)
    if not found["launches"]:
        found = profile_step(lambda: session.step(tokens, commit=False), device) | dict(eager=True)
    return found


def _decode_row(engine, factory, kind: str, batch: int, context: int, steps: int, device, token: int,
                rate_gbs: float | None) -> dict:
    """Tokens/s of ``steps`` decode steps of ``batch`` rows over a synthetic ``context``-token cache (CUDA: one
    captured step replayed), and with ``rate_gbs`` (CUDA) the step's floor (:func:`.step.step_report`) and, where the
    step runs FastEsm's fused blocks, the least a step of its launches takes (``launches_ms``: each launch a pure read
    of its bytes, :func:`.step.launch_bytes`) and the share of the floor that allows (``launches_of_floor``); the same
    with the step's products as cuBLAS runs them over cold weights of their shapes (``products_ms``,
    ``products_of_floor``: the ceiling with a GEMM library's products)."""
    from ..model.fused_step import fused_step_applies
    from .step import launch_bytes, step_report
    from .timing import launch_floors_us
    session = synthetic_session(engine, factory, batch, context, steps + 2)
    step_tokens = torch.full((batch, 1), token, device=device)
    step = session.capture_step(step_tokens, commit=True, reserve=steps + 2).replay if device.type == "cuda" \
        else (lambda: session.step(step_tokens))
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    row = dict(cache=kind, batch=batch, context=context, tokens_per_s=batch * steps / sec, step_ms=sec / steps * 1e3)
    if rate_gbs is not None:
        row.update(step_report(session, row["step_ms"], rate_gbs), read_gbs=rate_gbs)
        sizes = launch_bytes(session, commit=True) if fused_step_applies(engine, False) else []
        if sizes and sum(sizes) < 0.9 * torch.cuda.mem_get_info(device)[0]:
            row["launches_ms"] = launch_floors_us(sizes, device) / 1e3  # a buffer a launch: none finds L2 warm
            row["launches_of_floor"] = row["floor_ms"] / row["launches_ms"]
            row["products_ms"] = launch_floors_us(launch_bytes(session, commit=True, products="fp16"), device) / 1e3
            row["products_of_floor"] = row["floor_ms"] / row["products_ms"]
    return row


@torch.no_grad()
def bench_cpu_steps(sizes=("8M", "35M"), context: int = 256, steps: int = 8,
                    calibration_tokens: int = 8192) -> list[dict]:
    """CPU, batch 1: decode-step latency (PyTorch reference path) with the compressed (mean 3+1-bit) cache and
    with an fp32 cache at ``context`` tokens, and calibration time of the same-shaped stand-in model on
    the first ``calibration_tokens`` tokens of calibration_data (default recipe)."""
    from dataclasses import replace

    from ..fasta import read_fastas
    from ..model.alphabet import alphabet
    from ..model.calibrate import calibrate
    from ..model.checkpoint import PRESETS
    from ..model.engine import TurboEsm
    from ..testing import stress_esm2
    dev = torch.device("cpu")
    rows = []
    records = read_fastas([str(CALIBRATION_DATA / "calibration.fasta")])
    for size in sizes:
        model = stress_esm2(size=size, layers=None, hidden=None, heads=None)
        engine = TurboEsm(model)
        row = dict(size=size, context=context, threads=torch.get_num_threads())
        for kind in ("fp32", "turbo-3+1"):
            factory = (lambda layer, h, d: default_codec(h, d, seed=layer)) \
                if kind != "fp32" else "fp32"
            session = synthetic_session(engine, factory, 1, context, steps + 2)
            tok = torch.full((1, 1), alphabet().get_idx("A"))
            row[f"{kind}_step_ms"] = time_graph(lambda: session.step(tok, commit=False), dev, reps=5 * steps) * 1e3
        start = time.perf_counter()
        calibrate(model, records, replace(PRESETS["default"], max_tokens=calibration_tokens), progress=False)
        row["calibration_s"] = time.perf_counter() - start
        row["calibration_tokens"] = calibration_tokens
        rows.append(row)
    return rows
