"""``esm-turbo bench weights``: the 4-bit dequantize-and-multiply kernel against fp16 cuBLAS on ESM-2's linear
shapes, timed in the same run, with the least time a kernel reading the same bytes takes (the read floor).

For each shape (out × in) of the 650M, 3B and 15B blocks (fused QKV, attention output, FFN up, FFN down) and each
row count (tokens in the batch), it times ``x @ Wᵀ`` in fp16 and :func:`~esm_turbo.kernels.weights.matmul_triton`
on random codes (speed does not depend on the values), first with the kernel's default launch constants and, with
``tune``, the fastest of a small grid (at 1, 16 and 4096 rows). Each kernel result is checked against
:func:`~esm_turbo.kernels.weights.matmul_reference` first. ``QuantizedLinear`` as a whole (the input rotation
included) is timed beside fp16 ``nn.Linear``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

import torch

from ..model.sizes import esm2_config
from .timing import read_floor_us, time_graph

WEIGHT_SIZES = ("650M", "3B", "15B")
ROWS = (1, 4, 16, 64, 4096)
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


@dataclass
class WeightBench:
    device: str
    rows: list[WeightRow] = field(default_factory=list)
    layer: list[dict] = field(default_factory=list)  # QuantizedLinear forward vs nn.Linear


def linear_shapes(size: str) -> list[tuple[str, int, int]]:
    """(name, out, in) of one block's linears at an ESM-2 size."""
    d = esm2_config(size).hidden_size
    return [("qkv", 3 * d, d), ("out", d, d), ("ffn_up", 4 * d, d), ("ffn_down", d, 4 * d)]


def _random_pass(m: int, n: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(m * 7 + n)
    codes = torch.randint(0, 256, (m, n // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = (torch.rand(m, n // GROUP, device=device, generator=gen) * 0.02 + 0.01).half()
    codebook = torch.linspace(-2.5, 2.5, 16, device=device).half()
    return codes, scales, codebook


def _config(t: tuple) -> dict:
    return dict(zip(("block_b", "block_m", "block_k", "num_warps", "num_stages"), t))


def bench_weights(device: torch.device, sizes: list[str] | None = None, rows: tuple[int, ...] = ROWS,
                  tune: bool = False, progress: bool = False) -> WeightBench:
    from ..kernels.weights import matmul_reference, matmul_triton
    res = WeightBench(device=torch.cuda.get_device_name(device))
    for size in sizes or WEIGHT_SIZES:
        for name, m, n in linear_shapes(size):
            codes, scales, codebook = _random_pass(m, n, device)
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
                                weight_bytes=nbytes, floor_us=floor, max_rel_err=err)
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
    return res


def _bench_layer(size: str, device: torch.device) -> list[dict]:
    """QuantizedLinear (rotation + kernel) against fp16 nn.Linear on the FFN-up shape."""
    from ..weights.codec import WeightQuantConfig
    from ..weights.linear import QuantizedLinear
    _, m, n = linear_shapes(size)[2]
    dense = torch.nn.Linear(n, m, device=device, dtype=torch.float16)
    quant = QuantizedLinear.from_linear(dense.float(), WeightQuantConfig(bits=4, group=GROUP), seed=0).to(device)
    dense = dense.half()
    out = []
    for b in (1, 16, 4096):
        x = torch.randn(b, n, device=device, dtype=torch.float16)
        with torch.no_grad():
            out.append(dict(size=size, linear="ffn_up", rows=b,
                            fp16_us=time_graph(lambda: dense(x), device) * 1e6,
                            quantized_linear_us=time_graph(lambda: quant(x), device) * 1e6))
    return out


def format_weights(res: WeightBench) -> str:
    lines = [f"4-bit weights (groups of {GROUP}): dequantize-and-multiply kernel vs fp16 cuBLAS, {res.device}",
             "  µs per call (CUDA graph, median); floor: a pure read of the kernel's bytes; ×: fp16 time / ours",
             f"  {'shape':<22}{'rows':>6}{'fp16':>9}{'ours':>9}{'×fp16':>7}{'tuned':>9}{'×fp16':>7}"
             f"{'floor':>8}{'%floor':>7}  best config"]
    for r in res.rows:
        best = r.best_us or r.ours_us
        shape = f"{r.size} {r.linear} {r.out_features}x{r.in_features}"
        tuned = f"{r.best_us:>9.1f}{r.fp16_us / r.best_us:>6.2f}×" if r.best_us else f"{'':>16}"
        lines.append(f"  {shape:<22}{r.rows:>6}{r.fp16_us:>9.1f}{r.ours_us:>9.1f}{r.fp16_us / r.ours_us:>6.2f}×"
                     f"{tuned}{r.floor_us:>8.1f}{r.floor_us / best:>6.0%}  {r.best_config or ''}")
    worst = max((r.max_rel_err for r in res.rows), default=0.0)
    lines.append(f"  kernel vs PyTorch reference: max relative error {worst:.1e} over every row above")
    if res.layer:
        lines.append("  QuantizedLinear (input rotation + kernel) vs fp16 nn.Linear, FFN up:")
        for r in res.layer:
            lines.append(f"    {r['size']:<5} rows {r['rows']:>5}: fp16 {r['fp16_us']:.1f} µs, quantized "
                         f"{r['quantized_linear_us']:.1f} µs ({r['fp16_us'] / r['quantized_linear_us']:.2f}×)")
    return "\n".join(lines)


def weights_json(res: WeightBench) -> dict:
    return asdict(res)
