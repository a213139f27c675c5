"""``esm-turbo bench weights``: the 4-bit dequantize-and-multiply kernel against fp16 cuBLAS on ESM-2's linear
shapes, timed in the same run, with the least time a kernel reading the same bytes takes (the read floor).

For each shape (out × in) of the 650M, 3B and 15B blocks (fused QKV, attention output, FFN up, FFN down) and each
row count (tokens in the batch), it times ``x @ Wᵀ`` in fp16 and :func:`~esm_turbo.kernels.weights.matmul_triton`
on random codes (speed does not depend on the values), first with the kernel's default launch constants and, with
``tune``, the fastest of a small grid (at 1, 16 and 4096 rows); and the other path, the weight dequantized to fp16
(:func:`~esm_turbo.kernels.weights.dequantize_triton`, turned back to the original domain) then cuBLAS. Each kernel
result is checked against :func:`~esm_turbo.kernels.weights.matmul_reference` first. ``QuantizedLinear`` as a whole
(it picks the fused kernel up to ``KERNEL_ROWS`` rows, the dequantized weight past it) is timed beside fp16
``nn.Linear``.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import asdict, dataclass, field

import torch

from ..model.sizes import esm2_config
from ..weights.step import StepProduct
from .timing import launch_floors_us, read_floor_us, time_graph

WEIGHT_SIZES = ("650M", "3B", "15B")
ROWS = (1, 2, 4, 16, 64, 4096)
GROUP = 32

#: tuning grids: (block_b, block_m, block_k, num_warps, num_stages); few rows read weights, many rows multiply
SMALL_GRID = [(16, m, k, w, s) for m in (16, 32, 64) for k in (64, 128, 256) for w, s in ((4, 3), (4, 4))]
TUNED_ROWS = (1, 16, 4096)
LARGE_GRID = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3),
              (128, 128, 32, 8, 4), (64, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 64, 128, 4, 4)]


@dataclass
class WeightRow:
    size: str
    linear: str
    out_features: int
    in_features: int
    rows: int
    fp16_us: float
    ours_us: float  # default launch constants
    best_us: float | None = None  # fastest of the grid (tune)
    best_config: tuple | None = None
    weight_bytes: int = 0  # codes + scales + codebook
    floor_us: float = 0.0  # a pure read of weight_bytes
    max_rel_err: float = 0.0  # kernel vs PyTorch reference, on these inputs
    dequant_us: float = 0.0  # the weight dequantized to fp16 (original domain), then cuBLAS


@dataclass
class WeightBench:
    device: str
    rows: list[WeightRow] = field(default_factory=list)
    layer: list[dict] = field(default_factory=list)  # QuantizedLinear forward vs nn.Linear
    peak: list[dict] = field(default_factory=list)  # a whole quantized model's peak device memory (peak_memory)
    torchao: list[dict] = field(default_factory=list)  # torchao's int4 weight-only linear vs bf16 nn.Linear
    decode: list[dict] = field(default_factory=list)  # a design-loop decode step, 4-bit weights vs fp16 (decode_step)
    offload: list[dict] = field(default_factory=list)  # the residual pass in host memory vs resident (offload_forward)


def linear_shapes(size: str) -> list[tuple[str, int, int]]:
    """(name, out, in) of one block's linears at an ESM-2 size."""
    d = esm2_config(size).hidden_size
    return [("qkv", 3 * d, d), ("out", d, d), ("ffn_up", 4 * d, d), ("ffn_down", d, 4 * d)]


def random_pass(m: int, n: int, device: torch.device, seed: int | None = None) -> tuple:
    """A random 4-bit pass of an [m, n] weight in groups of :data:`GROUP` (speed does not depend on the values):
    (codes [m, n/2] uint8, scales [m, n/GROUP] fp16, codebook [16] fp16), seeded by the shape unless ``seed``."""
    gen = torch.Generator(device=device).manual_seed(m * 7 + n if seed is None else seed)
    codes = torch.randint(0, 256, (m, n // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = (torch.rand(m, n // GROUP, device=device, generator=gen) * 0.02 + 0.01).half()
    codebook = torch.linspace(-2.5, 2.5, 16, device=device).half()
    return codes, scales, codebook


def _config(t: tuple) -> dict:
    return dict(zip(("block_b", "block_m", "block_k", "num_warps", "num_stages"), t))


def bench_weights(device: torch.device, sizes: list[str] | None = None, rows: tuple[int, ...] = ROWS,
                  tune: bool = False, progress: bool = False, peak: tuple[str, ...] = ("15B",),
                  decode: tuple[str, ...] = ("3B",), offload: tuple[str, ...] = ("3B",)) -> WeightBench:
    from ..kernels.weights import dequantize_triton, matmul_reference, matmul_triton, sign_matrix
    from ..weights.codec import rotation
    res = WeightBench(device=torch.cuda.get_device_name(device))
    turn = sign_matrix(rotation(GROUP, 0).to(device))
    for size in sizes or WEIGHT_SIZES:
        for name, m, n in linear_shapes(size):
            codes, scales, codebook = random_pass(m, n, device)
            w16 = torch.randn(m, n, device=device, dtype=torch.float16) * 0.02
            nbytes = sum(t.numel() * t.element_size() for t in (codes, scales, codebook))
            floor = read_floor_us(nbytes, device)
            for b in rows:
                x = torch.randn(b, n, device=device, dtype=torch.float16)
                ref = matmul_reference(x, codes, scales, codebook)
                got = matmul_triton(x, codes, scales, codebook)
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                row = WeightRow(size, name, m, n, b, fp16_us=time_graph(lambda: x @ w16.T, device) * 1e6,
                                ours_us=time_graph(lambda: matmul_triton(x, codes, scales, codebook), device) * 1e6,
                                weight_bytes=nbytes, floor_us=floor, max_rel_err=err,
                                dequant_us=time_graph(lambda: x @ dequantize_triton(codes, scales, codebook,
                                                                                    torch.float16, rotation=turn).T,
                                                      device) * 1e6)
                if tune and b in TUNED_ROWS:
                    best = None
                    for t in SMALL_GRID if b <= 16 else LARGE_GRID:
                        cfg = _config(t)
                        if n % cfg["block_k"]:
                            continue
                        try:
                            us = time_graph(lambda: matmul_triton(x, codes, scales, codebook, config=cfg), device) * 1e6
                        except Exception:  # a config the compiler cannot fit (shared memory): not a candidate
                            continue
                        if best is None or us < best[0]:
                            best = (us, t)
                    if best is not None:
                        row.best_us, row.best_config = best
                        check = matmul_triton(x, codes, scales, codebook, config=_config(best[1]))
                        row.max_rel_err = max(err, ((check - ref).abs().max() / ref.abs().max()).item())
                res.rows.append(row)
                if progress:
                    print(format_weights(WeightBench(res.device, [row])).splitlines()[3], file=sys.stderr, flush=True)
        res.layer.extend(_bench_layer(size, device))
        res.torchao.extend(_bench_torchao(size, device))
    for size in peak:  # first: what the process holds before it counts
        res.peak.append(peak_memory(size, device))
        if progress:
            print(format_weights(WeightBench(res.device, peak=res.peak[-1:])).splitlines()[-1], file=sys.stderr,
                  flush=True)
    for size in decode:  # the forks holding copies of the scaffold, then sharing its blocks
        res.decode.extend(decode_step(size, device, paged=paged) for paged in (False, True))
    for size in offload:
        res.offload.append(offload_forward(size, device))
    return res


@torch.no_grad()
def offload_forward(size: str, device: torch.device, batch: int = 4, length: int = 1024) -> dict:
    """A forward of ``batch`` × ``length`` tokens through a ``size``-shaped model with 4-bit weights and a residual
    pass (random, ``weights.model.random_model``), resident on the device and with the residual pass in pinned host
    memory (``weights.offload``), in ms (median of 5 after a warm-up), with the device bytes of each and the
    host-to-device link's GB/s."""
    import copy

    from ..weights.codec import WeightQuantConfig
    from ..weights.model import random_model, weight_memory
    from ..weights.offload import offload_residual
    from .timing import link_h2d_gbs, time_eager
    host = random_model(esm2_config(size), "cpu", WeightQuantConfig(bits=4, group=GROUP, residual=True))
    tokens = torch.randint(4, 24, (batch, length), device=device)
    out = dict(size=size, tokens=batch * length, link_gbs=link_h2d_gbs(device))
    for name in ("resident", "offloaded"):
        model = copy.deepcopy(host)
        if name == "resident":
            model.to(device)
        else:
            offload_residual(model, device)
        out[f"{name}_bytes"] = weight_memory(model)["quantized_linear_bytes"]
        # copies queued from the host as layers run: timed eagerly, not as a CUDA graph
        out[f"{name}_ms"] = time_eager(lambda net=model: net(tokens), device) * 1e3
        if name == "offloaded":
            out["host_bytes"] = model.residual_offload.host_bytes
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return out


@torch.no_grad()
def peak_memory(size: str, device: torch.device, tokens: int = 4096, prefix: int = 1024, beam: int = 16,
                steps: int = 8) -> dict:
    """A ``size``-shaped model with random 4-bit weights in groups of :data:`GROUP`, built on the device
    (``weights.model.random_model``): its weight bytes, and the peak device memory (``max_memory_allocated``,
    weights included) of embedding one packed batch of ``tokens`` tokens (``FastEsm``, every block's weights
    dequantized in turn) and of a design loop (a ``prefix``-token scaffold forked ``beam`` ways on the 3+1-bit paged
    cache, stepped ``steps`` times). Bytes."""
    from ..embed.fast_esm import FastEsm, PackedBatch
    from ..model.alphabet import alphabet, encode_packed
    from ..model.engine import TurboEsm
    from ..model.sizes import esm2_config
    from ..weights.codec import WeightQuantConfig
    from ..weights.model import random_model, weight_memory
    from .synthetic import layer_codec, random_protein
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = random_model(esm2_config(size), device, WeightQuantConfig(bits=4, group=GROUP))
    out = dict(size=size, weight_bytes=weight_memory(model)["total_bytes"],
               allocated_bytes=torch.cuda.memory_allocated(device))
    fast = FastEsm.from_hf(model)
    seqs = [random_protein(1022, i) for i in range(tokens // 1024)]
    torch.cuda.reset_peak_memory_stats(device)
    fast(PackedBatch.from_arrays(*encode_packed(seqs), device=device), [model.config.num_hidden_layers])
    torch.cuda.synchronize(device)
    out.update(embed_tokens=len(seqs) * 1024, embed_peak_bytes=torch.cuda.max_memory_allocated(device))
    del fast
    session = TurboEsm(model).session(layer_codec, capacity=prefix + steps, paged=True)
    torch.cuda.reset_peak_memory_stats(device)
    session.start([random_protein(prefix - 1, 0)])
    session.fork(beam)
    step = torch.full((beam, 1), alphabet().get_idx("A"), device=device)
    for _ in range(steps):
        session.step(step)
    torch.cuda.synchronize(device)
    out.update(decode_prefix=prefix, decode_beam=beam, decode_steps=steps,
               decode_peak_bytes=torch.cuda.max_memory_allocated(device))
    del session, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


class _FreeProduct(StepProduct):
    """A fused block's product that costs nothing: one preallocated zero tensor per input shape (no kernel); with a
    residual to add (the kernel's epilogue), that residual itself. To time the rest of a step."""

    def __call__(self, x: torch.Tensor, epilogue: str = "bias", residual: torch.Tensor | None = None,
                 residual_scale: float = 1.0) -> torch.Tensor:
        if epilogue == "residual":
            return residual
        shape = (x.shape[0], self.shape[0])
        out = self.__dict__.setdefault("_out", {})
        if shape not in out:
            out[shape] = x.new_zeros(shape)
        return out[shape]


def _free_products(engine) -> None:
    """Every block product of ``engine``'s fused step at a step's rows made free (:class:`_FreeProduct`)."""
    from ..weights.step import step_products
    for block in engine.fast().blocks:
        block._step_products = tuple(_FreeProduct(p.linears) for p in step_products(block.quantized))


def design_step(engine, beam: int = 16, prefix: int = 1024, paged: bool = False) -> tuple:
    """(session, captured step) of a design loop on ``engine`` (a ``TurboEsm`` on CUDA): a ``prefix``-token random
    scaffold forked ``beam`` ways on the 3+1-bit cache, one token a row, the step captured as a CUDA graph (its
    replay computes ``step.output``'s logits [beam, 1, V] again, committing nothing). ``paged``: the forks share the
    scaffold's blocks (``TurboEsm.session(paged=True)``), so every fork's walk reads the same bytes (from L2 after
    the first); else each fork holds a copy."""
    from ..model.alphabet import alphabet
    from .synthetic import layer_codec, random_protein
    session = engine.session(layer_codec, capacity=prefix + 8, paged=paged)
    session.start([random_protein(prefix - 1, 0)])
    session.fork(beam)
    return session, session.capture_step(torch.full((beam, 1), alphabet().get_idx("A"), device=engine.device))


@torch.no_grad()
def decode_step(size: str, device: torch.device, beam: int = 16, prefix: int = 1024, profiled: bool = False,
                paged: bool = False) -> dict:
    """A design loop's decode step on a ``size``-shaped model with fp16 weights and with 4-bit weights in groups of
    :data:`GROUP` (both random, built on the device: ``weights.model.random_model``): a ``prefix``-token scaffold
    forked ``beam`` ways on the 3+1-bit cache, one token a row, the step captured as a CUDA graph
    (``DecodeSession.capture_step``; eagerly a step is bound by the host, not the weights). Milliseconds per step:
    both on FastEsm's fused blocks (``model.fused_step``; 4-bit products on their own kernels,
    ``weights.step.StepProduct``), and the 4-bit step through transformers' layers (``4-bit_layers_ms``).
    The ceiling of the 4-bit step: the fused 4-bit step with products that cost nothing (``free_ms``: its LayerNorms,
    rotary, attention and cache writes still run; the skip connections' adds go with the products) plus a pure read
    of the 4-bit weights' bytes (``read_ms``: one read of them all), or plus each product launch's own read floor
    (``launch_ms``: QKV, attention output, FFN up and FFN down a layer, each a pure read of its bytes in a launch of its
    own, all in one graph: ``timing.launch_floors_us``).
    ``profiled``: each step's kernels by kind too (``{name}_kernels``: ``bench.step.breakdown`` less its top list).
    ``paged``: the forks share the scaffold's blocks (:func:`design_step`)."""
    import triton.testing

    from ..model.engine import TurboEsm
    from ..weights.codec import WeightQuantConfig
    from ..weights.model import random_model, weight_memory
    from .step import profile_step
    out = dict(size=size, beam=beam, prefix=prefix, paged=paged)
    four = WeightQuantConfig(bits=4, group=GROUP)
    for name, quant in (("fp16", None), ("4-bit", four), ("4-bit_layers", four), ("free", four)):
        model = random_model(esm2_config(size), device, quant)
        if name == "4-bit":  # transformers' module paths, before the engine wraps the attention
            out["read_ms"] = read_floor_us(weight_memory(model)["quantized_linear_bytes"], device) / 1e3
            first = model.esm.encoder.layer[0]
            launches = [first.attention.self.query, first.attention.self.key, first.attention.self.value], \
                [first.attention.output.dense], [first.intermediate.dense], [first.output.dense]
            out["launch_ms"] = launch_floors_us([sum(m.nbytes() for m in group) for group in launches]
                                                * len(model.esm.encoder.layer), device) / 1e3
        engine = TurboEsm(model)
        engine.fused_step = name != "4-bit_layers"
        if name == "free":
            _free_products(engine)
        session, step = design_step(engine, beam, prefix, paged)
        out[f"{name}_ms"] = triton.testing.do_bench(step.graph.replay, warmup=25, rep=100, return_mode="median")
        if profiled:
            parts = profile_step(step.graph.replay, device)
            out[f"{name}_kernels"] = {k: v for k, v in parts.items() if k != "top"}
        del session, step, model, engine
        gc.collect()
        torch.cuda.empty_cache()
    return out


def _bench_torchao(size: str, device: torch.device) -> list[dict]:
    """What a user would pick instead: torchao's int4 weight-only quantization (groups of :data:`GROUP`, bf16, the
    tinygemm kernel) of the FFN-up linear, against the same linear in bf16, at the rows of :func:`_bench_layer`.
    Empty without torchao; one row naming the error where it does not run."""
    try:
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, quantize_
    except ImportError:
        return []
    except Exception as err:  # noqa: BLE001 - installed but not loadable with this torch
        return [dict(size=size, linear="ffn_up", version="?", error=f"{type(err).__name__}: {str(err)[:200]}")]
    version = torchao.__version__
    _, m, n = linear_shapes(size)[2]
    dense = torch.nn.Linear(n, m, device=device, dtype=torch.bfloat16)
    quant = torch.nn.Linear(n, m, device=device, dtype=torch.bfloat16)
    quant.load_state_dict(dense.state_dict())
    try:
        # tinygemm's tile-packed layout (aten._weight_int4pack_mm): the int4 path that runs on an H100 without mslk
        quantize_(quant, Int4WeightOnlyConfig(group_size=GROUP, int4_packing_format="tile_packed_to_4d"))
        return _timed_rows(size, n, torch.bfloat16, device, dict(bf16_us=dense, torchao_us=quant), version=version)
    except Exception as err:  # noqa: BLE001 - reported, the rest of the bench stands
        return [dict(size=size, linear="ffn_up", version=version, error=f"{type(err).__name__}: {str(err)[:200]}")]


def _bench_layer(size: str, device: torch.device) -> list[dict]:
    """QuantizedLinear (its whole forward) against fp16 nn.Linear on the FFN-up shape."""
    from ..weights.codec import WeightQuantConfig
    from ..weights.linear import QuantizedLinear
    _, m, n = linear_shapes(size)[2]
    dense = torch.nn.Linear(n, m, device=device, dtype=torch.float16)
    quant = QuantizedLinear.from_linear(dense.float(), WeightQuantConfig(bits=4, group=GROUP), seed=0).to(device)
    return _timed_rows(size, n, torch.float16, device, dict(fp16_us=dense.half(), quantized_linear_us=quant))


@torch.no_grad()
def _timed_rows(size: str, n: int, dtype: torch.dtype, device: torch.device, modules: dict, **extra) -> list[dict]:
    """The FFN-up linears ``modules`` (the key each one's µs is stored under) timed on the same input at 1, 16 and
    4096 rows of ``n`` channels in ``dtype``: one dict a row count."""
    out = []
    for b in (1, 16, 4096):
        x = torch.randn(b, n, device=device, dtype=dtype)
        out.append(dict(size=size, linear="ffn_up", rows=b, **extra,
                        **{key: time_graph(lambda mod=mod: mod(x), device) * 1e6 for key, mod in modules.items()}))
    return out


def format_weights(res: WeightBench) -> str:
    lines = [f"4-bit weights (groups of {GROUP}): dequantize-and-multiply kernel vs fp16 cuBLAS, {res.device}",
             "  µs per call (CUDA graph, median); floor: a pure read of the kernel's bytes; ×: fp16 time / ours;",
             "  deq+mm: the weight dequantized to fp16 (rotated back), then cuBLAS",
             f"  {'shape':<22}{'rows':>6}{'fp16':>9}{'ours':>9}{'×fp16':>7}{'tuned':>9}{'×fp16':>7}"
             f"{'floor':>8}{'%floor':>7}{'deq+mm':>9}{'×fp16':>7}  best config"]
    for r in res.rows:
        best = r.best_us or r.ours_us
        shape = f"{r.size} {r.linear} {r.out_features}x{r.in_features}"
        tuned = f"{r.best_us:>9.1f}{r.fp16_us / r.best_us:>6.2f}×" if r.best_us else f"{'':>16}"
        lines.append(f"  {shape:<22}{r.rows:>6}{r.fp16_us:>9.1f}{r.ours_us:>9.1f}{r.fp16_us / r.ours_us:>6.2f}×"
                     f"{tuned}{r.floor_us:>8.1f}{r.floor_us / best:>6.0%}{r.dequant_us:>9.1f}"
                     f"{r.fp16_us / r.dequant_us:>6.2f}×  {r.best_config or ''}")
    if res.rows:
        worst = max(r.max_rel_err for r in res.rows)
        lines.append(f"  kernel vs PyTorch reference: max relative error {worst:.1e} over every row above")
    if res.layer:
        from ..weights.linear import KERNEL_ROWS
        lines.append(f"  QuantizedLinear's forward (the fused kernel up to {KERNEL_ROWS} rows, else the dequantized "
                     "weight and cuBLAS) vs fp16 nn.Linear, FFN up:")
        for r in res.layer:
            lines.append(f"    {r['size']:<5} rows {r['rows']:>5}: fp16 {r['fp16_us']:.1f} µs, quantized "
                         f"{r['quantized_linear_us']:.1f} µs ({r['fp16_us'] / r['quantized_linear_us']:.2f}×)")
    if res.torchao:
        lines.append(f"  torchao {res.torchao[0]['version']} int4 weight-only (groups of {GROUP}, bf16, tinygemm) vs "
                     "bf16 nn.Linear, FFN up:")
        for r in res.torchao:
            lines.append(f"    {r['size']:<5} error: {r['error']}" if "error" in r else
                         f"    {r['size']:<5} rows {r['rows']:>5}: bf16 {r['bf16_us']:.1f} µs, torchao "
                         f"{r['torchao_us']:.1f} µs ({r['bf16_us'] / r['torchao_us']:.2f}×)")
    for d in res.decode:
        lines.append(f"  design-loop decode step, {d['size']}-shaped, {d['beam']} rows on a {d['prefix']}-token "
                     f"scaffold ({'paged forks sharing its blocks' if d.get('paged') else 'forks holding copies'}, "
                     f"CUDA graph): fp16 weights {d['fp16_ms']:.2f} ms, 4-bit {d['4-bit_ms']:.2f} ms "
                     f"({d['fp16_ms'] / d['4-bit_ms']:.2f}×" + (
                         f"; through transformers' layers {d['4-bit_layers_ms']:.2f} ms, "
                         f"{d['fp16_ms'] / d['4-bit_layers_ms']:.2f}×" if "4-bit_layers_ms" in d else "") + ")" + (
                         f"; ceiling {d['fp16_ms'] / (d['free_ms'] + d['read_ms']):.2f}× (the 4-bit step without "
                         f"its linears {d['free_ms']:.2f} ms + a pure read of the 4-bit weights {d['read_ms']:.2f} ms)"
                         if "free_ms" in d else "") + (
                         f", {d['fp16_ms'] / (d['free_ms'] + d['launch_ms']):.2f}× launch by launch (+ each linear "
                         f"launch's read floor, {d['launch_ms']:.2f} ms a step)" if "launch_ms" in d else ""))
    for o in res.offload:
        gib = 2**30
        lines.append(f"  residual pass in pinned host memory, {o['size']}-shaped, a forward of {o['tokens']} tokens: "
                     f"resident {o['resident_ms']:.1f} ms ({o['resident_bytes'] / gib:.2f} GiB of 4-bit linears on "
                     f"the device), offloaded {o['offloaded_ms']:.1f} ms ({o['offloaded_bytes'] / gib:.2f} GiB; "
                     f"{o['host_bytes'] / gib:.2f} GiB on the host; the link {o['link_gbs']:.1f} GB/s, so its copy "
                     f"alone takes {o['host_bytes'] / o['link_gbs'] / 1e6:.1f} ms)")
    for p in res.peak:
        gib = 2**30
        lines.append(f"  {p['size']}-shaped, 4-bit weights {p['weight_bytes'] / gib:.2f} GiB: peak device memory "
                     f"{p['embed_peak_bytes'] / gib:.2f} GiB embedding {p['embed_tokens']} tokens, "
                     f"{p['decode_peak_bytes'] / gib:.2f} GiB decoding a {p['decode_prefix']}-token scaffold forked "
                     f"{p['decode_beam']} ways (3+1-bit paged cache, {p['decode_steps']} steps)")
    return "\n".join(lines)


def weights_json(res: WeightBench) -> dict:
    return asdict(res)
