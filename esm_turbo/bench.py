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
   one KV budget.

On CPU it runs the reference paths at small sizes (a smoke run; nothing there is a speed claim).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch

from .cache import KVCache
from .fasta import CALIBRATION_DATA
from .model.checkpoint import CalibrationConfig
from .ops import attend_compressed, force_reference, use_kernels
from .ops.compressed import fused_tables
from .testing import random_turbo_codec

SHAPES = {"650M": (20, 64), "15B": (40, 128)}


@dataclass
class BenchResult:
    device: str
    peak_copy_gbs: float | None = None
    graph_floor_us: float | None = None
    attention: list[dict] = field(default_factory=list)
    quantize: dict = field(default_factory=dict)
    decode: list[dict] = field(default_factory=list)
    embed: dict = field(default_factory=dict)
    cpu_steps: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _time(fn, device: torch.device, reps: int = 20) -> float:
    """Median seconds of ``fn`` (CUDA: replayed as a CUDA graph, timed with events; CPU: wall clock)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(max(3, reps // 5)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    import triton.testing
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / 1e3


#: layer calls captured in one CUDA graph for the "in a step" timings: a decode step of the 650M model replays its
#: 33 layers' calls as one graph, so the graph's launch is paid once per step, not once per call
STEP_CALLS = 33


def _time_in_step(fn, device: torch.device, calls: int = STEP_CALLS) -> float:
    """Median seconds per call of ``fn`` among ``calls`` calls captured in one CUDA graph (CPU: :func:`_time`)."""
    if device.type != "cuda":
        return _time(fn, device)

    def step():
        for _ in range(calls):
            fn()
    return _time(step, device, reps=10) / calls


def peak_copy_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth (bytes read + written) over a 2 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    sec = _time(lambda: dst.copy_(src), device)
    return 2 * src.numel() / sec / 1e9


def graph_floor_us(device: torch.device) -> float:
    """µs of a graph holding one one-element add, timed as every call here is (:func:`_time`): what each
    timing includes besides its kernels."""
    one = torch.zeros(1, device=device)
    return _time(lambda: one.add_(1), device) * 1e6


#: programs per SM of the read-only floor: one-warp programs, 12 and 16 per SM read fastest on an H100
#: (results/gpu/decode_session25_h100.txt, round 1)
READ_PROGRAMS_PER_SM = (12, 16)


def read_floor_us(nbytes: int, device: torch.device) -> float:
    """µs (as :func:`_time`) of a kernel that only reads ``nbytes`` (rounded up to whole 2 KB chunks), the
    fastest of :data:`READ_PROGRAMS_PER_SM`: the least any kernel reading those bytes takes (CUDA)."""
    from .kernels.read import WORDS_PER_WARP, read_words
    words = torch.empty(-(-nbytes // (4 * WORDS_PER_WARP)) * WORDS_PER_WARP, dtype=torch.int32, device=device)
    words.random_()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(_time(lambda: read_words(words, sms * n), device) for n in READ_PROGRAMS_PER_SM) * 1e6


#: the recipe a default calibration runs (its widths and residual, :meth:`CalibrationConfig.resolved`)
DEFAULT_RECIPE = CalibrationConfig().resolved()


def default_codec(heads: int, dim: int, seed: int = 0, grid: bool | None = None):
    """A random codec of the default calibration's widths and residual (:data:`DEFAULT_RECIPE`) and tables (its
    grid, unless ``grid`` says: uniform levels or per-channel LUTs)."""
    grid = DEFAULT_RECIPE.lut == "grid" if grid is None else grid
    return random_turbo_codec(heads, dim, DEFAULT_RECIPE.key_bits, DEFAULT_RECIPE.value_bits, DEFAULT_RECIPE.residual,
                              seed, grid=grid)


def _synthetic_cache(heads: int, dim: int, batch: int, length: int, device, seed: int = 0,
                     grid: bool | None = None) -> KVCache:
    """A one-layer TurboESM cache of the default widths (:func:`default_codec`) full of random codes at
    ``length`` per row."""
    codec = default_codec(heads, dim, seed, grid).to(device)
    cache = KVCache([codec], batch, capacity=length, device=device)
    fill_synthetic(cache, length, torch.Generator(device=device).manual_seed(seed))
    return cache


def fill_synthetic(cache: KVCache, length: int, generator: torch.Generator | None = None) -> None:
    """Make every row of ``cache`` hold ``length`` tokens of random codes (packed parts) or values
    (dense parts): speed only, nothing is prefilled."""
    for layer in cache.parts:
        for buf in layer.values():
            if buf.dtype == torch.uint8:
                buf.random_(0, 256, generator=generator)
            else:
                buf.normal_(generator=generator)
    cache.lengths.fill_(length)
    cache._max_bound = length


def _bytes_read(cache: KVCache) -> int:
    """Bytes of the cache's layer 0 that a decode call over every row (all ``cache.lengths.max()`` long) reads."""
    return cache.memory_report().bytes_per_token_per_layer * cache.batch_size * int(cache.lengths.max())


def _time_fused(cache: KVCache, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                valid: torch.Tensor) -> tuple[float, float, float]:
    """The fused decode attention of q [B, H, 1, d] over layer 0 of ``cache`` (all rows ``cache.lengths`` long):
    (µs as one graph, µs per call in a step's graph, GB/s on the cache bytes it reads)."""
    codec, parts = cache.codecs[0], cache.parts[0]
    fused_tables(codec)

    def fused():
        return attend_compressed(codec, parts, cache.lengths, q, k_new, v_new, valid)
    device = q.device
    us = _time(fused, device) * 1e6
    return us, _time_in_step(fused, device) * 1e6, _bytes_read(cache) / (us * 1e-6) / 1e9


def bench_attention(device: torch.device, batches, lengths, shapes=SHAPES) -> list[dict]:
    rows = []
    f16 = torch.float16 if device.type == "cuda" else torch.float32
    for name, (heads, dim) in shapes.items():
        for batch in batches:
            for length in lengths:
                row = dict(shape=name, heads=heads, head_dim=dim, batch=batch, context=length)
                q = torch.randn(batch, heads, 1, dim, device=device) * dim**-0.5
                k_new = torch.randn(batch, heads, 1, dim, device=device)
                v_new = torch.randn_like(k_new)
                valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
                grid = _synthetic_cache(heads, dim, batch, length, device, grid=True)
                row["grid_us"], row["grid_step_us"], row["grid_gbs"] = _time_fused(grid, q, k_new, v_new, valid)
                nbytes = _bytes_read(grid)
                grid = None
                row["read_us"] = read_floor_us(nbytes, device) if device.type == "cuda" else None
                cache = _synthetic_cache(heads, dim, batch, length, device, grid=False)
                codec = cache.codecs[0]
                row["fused_us"], row["fused_step_us"], row["fused_gbs"] = _time_fused(cache, q, k_new, v_new, valid)

                def two_step():
                    k_hat, v_hat = codec.decode(cache.layer_parts(0, upto=length))
                    keys = torch.cat([k_hat.to(f16), k_new.to(f16)], 2)
                    vals = torch.cat([v_hat.to(f16), v_new.to(f16)], 2)
                    return torch.nn.functional.scaled_dot_product_attention(q.to(f16), keys, vals, scale=1.0)

                row["fused_path"] = "triton" if use_kernels(q) else "pytorch-reference"
                try:
                    row["two_step_us"] = _time(two_step, device) * 1e6
                except torch.OutOfMemoryError:
                    row["two_step_us"] = None
                cache = codec = None  # free the packed cache before the fp16 one
                try:
                    kf = torch.randn(batch, heads, length + 1, dim, device=device, dtype=f16)
                    vf = torch.randn_like(kf)
                    qf = q.to(f16)
                    def sdpa():
                        return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, scale=1.0)
                    row["sdpa_fp16_us"] = _time(sdpa, device) * 1e6
                    row["sdpa_fp16_step_us"] = _time_in_step(sdpa, device) * 1e6
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


def _model(size: str, device, dtype, layers: int | None = None):
    from .model.sizes import esm2_config
    from transformers import EsmForMaskedLM
    cfg = esm2_config(size, layers=layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return EsmForMaskedLM(cfg).to(device=device, dtype=dtype).eval()


def _random_protein(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    aa = "ACDEFGHIKLMNPQRSTVWY"
    return "".join(aa[i] for i in torch.randint(0, 20, (n,), generator=gen).tolist())


@torch.no_grad()
def bench_quantize(device, size: str = "650M", length: int = 1024, layers: int | None = None) -> dict:
    """Prefill time with and without writing the compressed cache (what quantize-and-pack adds to a
    prefill), and the quantize-and-pack launches of all layers timed on their own."""
    from .model.attention import RunContext
    from .model.engine import TurboEsm
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = _model(size, device, dtype, layers)
    engine = TurboEsm(model)
    h, d = engine.heads, engine.head_dim
    seq = _random_protein(length - 2, 0)

    def factory(layer, heads, dim):
        return default_codec(heads, dim, seed=layer)

    from .model.alphabet import encode
    tokens, mask = encode([seq], add_eos=True)
    tokens, mask = tokens.to(device), mask.to(device)
    session = engine.session(factory, capacity=length + 8)
    session.start([seq], add_eos=True)  # builds tables, compiles kernels
    cache = session.cache
    plain = _time(lambda: engine.esm(input_ids=tokens, attention_mask=mask), device, reps=10)

    def prefill_writing():
        cache.lengths.zero_()
        cache._max_bound = 0
        with engine.context(RunContext(mode="prefill", cache=cache, valid=mask.bool())):
            engine.esm(input_ids=tokens, attention_mask=mask)

    writing = _time(prefill_writing, device, reps=10)

    def quantize_only():  # nothing commits, so every layer writes at row 0
        cache.lengths.zero_()
        cache._max_bound = 0
        for layer in range(len(cache.codecs)):
            cache.write(layer, kv[layer][0], kv[layer][1])

    kv = [(torch.randn(1, h, tokens.shape[1], d, device=device, dtype=dtype),
           torch.randn(1, h, tokens.shape[1], d, device=device, dtype=dtype)) for _ in cache.codecs]
    quant = _time(quantize_only, device, reps=10)
    return dict(model=f"{size}-shaped" + (f" ({layers} layers)" if layers else ""), tokens=int(tokens.shape[1]),
                prefill_ms=plain * 1e3, prefill_writing_ms=writing * 1e3, added_ms=(writing - plain) * 1e3,
                added_fraction=(writing - plain) / plain, quantize_pack_ms=quant * 1e3, fraction=quant / plain,
                path="triton" if use_kernels(tokens) else "pytorch-reference")


def synthetic_session(engine, factory, batch: int, context: int, extra: int):
    """A decode session of ``batch`` rows whose caches hold ``context`` tokens of random codes/values
    (speed only: nothing is prefilled), with room for ``extra`` more."""
    session = engine.session(factory, capacity=context + extra)
    session.start(["M"] * batch)
    fill_synthetic(session.cache, context)
    session._grow_tokens()
    return session


@torch.no_grad()
def bench_decode(device, size: str = "650M", context: int = 1024, budget_gib: float = 8.0, steps: int = 16,
                 layers: int | None = None, max_batch: int = 1024) -> list[dict]:
    """Decode tokens/s with an fp16 cache and the compressed cache, each at the largest batch whose
    KV cache fits ``budget_gib`` at ``context`` + ``steps`` tokens."""
    from .model.engine import TurboEsm
    from .model.alphabet import alphabet
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = _model(size, device, dtype, layers)
    engine = TurboEsm(model)
    rows = []
    for kind in ("fp16", "turbo-3+1-lut", "turbo-3+1-grid"):
        factory = (lambda layer, h, d, grid=kind.endswith("grid"): default_codec(h, d, layer, grid)) \
            if kind != "fp16" else "fp16"
        codecs = engine.codecs(factory)
        per_token = sum(c.bytes_per_token() for c in codecs) * engine.heads
        tokens_per_row = context + steps
        batch = min(max_batch, int(budget_gib * 2**30 // (per_token * tokens_per_row)))
        session = synthetic_session(engine, factory, batch, context, steps)
        cache = session.cache
        step_tokens = torch.full((batch, 1), alphabet().get_idx("A"), device=device)
        if device.type == "cuda":
            captured = session.capture_step(step_tokens, commit=True, reserve=steps + 2)
            captured.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                captured.replay()
            torch.cuda.synchronize()
            sec = time.perf_counter() - t0
        else:
            session.step(step_tokens)
            t0 = time.perf_counter()
            for _ in range(steps):
                session.step(step_tokens)
            sec = time.perf_counter() - t0
        rows.append(dict(cache=kind, batch=batch, context=context, kv_bytes_per_token=per_token,
                         kv_gib=per_token * tokens_per_row * batch / 2**30, tokens_per_s=batch * steps / sec,
                         step_ms=sec / steps * 1e3))
        del session, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows[1:]:
        row["speedup_vs_fp16"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


@torch.no_grad()
def bench_cpu_steps(sizes=("8M", "35M"), context: int = 256, steps: int = 8,
                    calibration_tokens: int = 8192) -> list[dict]:
    """CPU, batch 1: decode-step latency (PyTorch reference path) with the compressed (mean 3+1-bit) cache and
    with an fp32 cache at ``context`` tokens, and calibration time of the same-shaped stand-in model on
    the first ``calibration_tokens`` tokens of calibration_data (default recipe)."""
    from dataclasses import replace

    from .fasta import read_fastas
    from .model.alphabet import alphabet
    from .model.calibrate import calibrate
    from .model.checkpoint import PRESETS
    from .model.engine import TurboEsm
    from .testing import stress_esm2
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
            row[f"{kind}_step_ms"] = _time(lambda: session.step(tok, commit=False), dev, reps=5 * steps) * 1e3
        start = time.perf_counter()
        calibrate(model, records, replace(PRESETS["default"], max_tokens=calibration_tokens), progress=False)
        row["calibration_s"] = time.perf_counter() - start
        row["calibration_tokens"] = calibration_tokens
        rows.append(row)
    return rows


EMBED_FASTA = [str(CALIBRATION_DATA / "calibration.fasta"), str(CALIBRATION_DATA / "evaluation.fasta")]


def run(quick: bool = False, device: str | None = None, reference: bool = False, suite: str = "decode",
        fasta: list[str] | None = None, sizes: list[str] | None = None) -> BenchResult:
    """``suite``: decode (attention, quantize, decode tokens/s), embed, or all."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    force_reference(reference)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    res = BenchResult(device=name)
    if suite in ("embed", "all"):
        fasta = fasta or EMBED_FASTA
        from .embed.benchmark import bench_embed
        res.embed = bench_embed(dev, fasta, quick=quick, sizes=sizes)
        if suite == "embed":
            return res
    if dev.type == "cuda":
        res.peak_copy_gbs = peak_copy_gbs(dev)
        res.graph_floor_us = graph_floor_us(dev)
        batches, lengths = ((1, 8), (1024, 4096)) if quick else ((1, 8, 64), (1024, 4096, 16384))
        res.attention = bench_attention(dev, batches, lengths)
        res.quantize = bench_quantize(dev)
        res.decode = bench_decode(dev)
    else:
        res.notes.append("CPU: reference paths at small sizes; a smoke run, not a speed claim")
        res.attention = bench_attention(dev, (1, 4), (256,), {"650M": (20, 64)})
        res.quantize = bench_quantize(dev, "8M", length=128)
        res.decode = bench_decode(dev, "8M", context=128, budget_gib=0.01, steps=4, max_batch=16)
        if not quick:
            res.cpu_steps = bench_cpu_steps()
    return res


def format_result(res: BenchResult) -> str:
    lines = [f"device: {res.device}"]
    if res.peak_copy_gbs:
        lines.append(f"device-to-device copy: {res.peak_copy_gbs:.0f} GB/s (read + write)")
    if res.graph_floor_us:
        lines.append(f"a graph of one one-element add: {res.graph_floor_us:.1f} µs, timed as every call below (each µs "
                     "includes it)")
    if res.attention:
        lines.append(f"\ndecode attention per layer call (1 new token per sequence; the default widths: keys "
                     f"{DEFAULT_RECIPE.key_bits} + {DEFAULT_RECIPE.residual}, values {DEFAULT_RECIPE.value_bits} + "
                     f"{DEFAULT_RECIPE.residual} bits; default tables: {DEFAULT_RECIPE.lut})")
        lines.append(f"(µs: one call replayed as a CUDA graph; step µs: per call of {STEP_CALLS} calls in one graph, as a "
                     f"decode step's layers replay)")
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
    q = res.quantize
    if q:
        lines.append(f"\nquantize-and-pack ({q['path']}), {q['model']}, prefill of {q['tokens']} tokens "
                     f"({q['prefill_ms']:.2f} ms):\n  prefill writing the compressed cache {q['prefill_writing_ms']:.2f} ms,"
                     f" added {q['added_ms']:.3f} ms = {100 * q['added_fraction']:.1f}%\n"
                     f"  its launches timed alone {q['quantize_pack_ms']:.3f} ms = {100 * q['fraction']:.1f}%")
    if res.decode:
        lines.append("\nend-to-end decode under one KV budget")
        for r in res.decode:
            ratio = f"  {r['speedup_vs_fp16']:.2f}× fp16" if "speedup_vs_fp16" in r else ""
            lines.append(f"  {r['cache']:14} batch {r['batch']:>5}  KV {r['kv_gib']:.2f} GiB  "
                         f"{r['tokens_per_s']:>10.0f} tokens/s  ({r['step_ms']:.2f} ms/step){ratio}")
    if res.embed:
        from .embed.benchmark import format_embed
        lines += format_embed(res.embed)
    if res.cpu_steps:
        lines.append("\nCPU decode step, batch 1 (PyTorch reference path), and calibration of the stand-in model")
        for r in res.cpu_steps:
            lines.append(f"  {r['size']:>4}-shaped, {r['context']} cached tokens, {r['threads']} threads: "
                         f"3+1-bit cache {r['turbo-3+1_step_ms']:.1f} ms/step, fp32 cache {r['fp32_step_ms']:.1f} ms/step; "
                         f"calibration on {r['calibration_tokens']} tokens {r['calibration_s']:.1f} s")
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


def to_json(res: BenchResult) -> str:
    return json.dumps(asdict(res), indent=2)


__all__ = ["BenchResult", "run", "format_result", "to_json"]
