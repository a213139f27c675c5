"""FastEsm's matrix products on the GPU: the cuBLAS ceiling, the Triton GEMMs with fused epilogues
(esm_turbo.kernels.gemm) over a list of tiles, checked against the reference, the attention kernels torch ships, and
the whole forward with and without the folded epilogues, all in one run. ``--gelu-forms``: only FFN-up with GELU,
each form of GELU (esm_turbo.kernels.common.GELU_FORMS: three of its erf, and its tanh approximation) over every tile,
beside cuBLAS alone, cuBLAS + F.gelu, cuBLASLt's own GELU epilogue (tanh-approximate) and the Triton kernel with the
bias only (what the epilogue's arithmetic costs); the erf form that wins goes into kernels.gemm.TILES with its tile;
the warp-specialized kernel (esm_turbo.kernels.gemm_ws) in the erfc, exp2poly and tanh forms; where one of those or
the tanh or exp2poly form in the table's kernel beats the table's by 2%, the forward and ``Embedder.run`` with it
against without (the tanh form changes the function: the A/B's worst token cosine says by how much in fp16).
``--overlap``: FFN-up with GELU over tiles whose epilogue may run beside products (two programs a multiprocessor, the
epilogue in four column parts; :data:`OVERLAP_TILES`), then, where one beats the table's tile, the forward and
``Embedder.run`` with it against the table (DIR/overlap.json).

usage: python tools/tune_gemm.py [--sizes 650M 3B 150M] [--tokens 16384] [--out DIR] [--skip-fp8] [--first N]
       python tools/tune_gemm.py --gelu-forms [--sizes ...] [--first N] [--out DIR]
       python tools/tune_gemm.py --overlap [--fp8-overlap] [--sizes ...] [--out DIR]
       python tools/tune_gemm.py --fp8-gelu-ab [--sizes ...] [--out DIR]
       python tools/tune_gemm.py --products qkv:rope [--sizes ...] [--out DIR]   # those rows, then the rotary A/B
       python tools/tune_gemm.py --attention-ab [--sizes ...] [--out DIR]   # the Triton against the Gluon attention

Per model shape and product (QKV with its bias, O with the residual add, FFN-up with GELU, FFN-down with the residual
add, QKV with the rotary embedding against cuBLAS and the rotary kernel), at ``--tokens`` rows:
cuBLAS alone (``F.linear`` with the bias: the ceiling of that product), cuBLAS followed by
the epilogue's op (what the block ran before), and each tile of the Triton kernel (µs, median of do_bench). A tile
whose output misses the flash-attention rule against a float32 reference is reported and never chosen. The best tiles
go to DIR/tiles.json (beside the unfused time: esm_turbo.kernels.gemm.TILES lists those that win). The forward A/B
(before: cuBLAS products and flash attention; after: the defaults) and the profile run on the library's own table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from esm_turbo.kernels import common
from esm_turbo.kernels import gemm as G
from esm_turbo.kernels import gemm_ws as WS

T = G.Tile
FP16_TILES = [T(128, 256, 64, 3, 8, 8, True), T(128, 256, 64, 3, 8, 8, False), T(128, 256, 64, 3, 8, 8, True, True),
              T(128, 256, 64, 3, 8, 8, False, True), T(256, 128, 64, 3, 8, 8, False), T(128, 128, 64, 4, 8, 8, False),
              T(128, 128, 64, 4, 4, 8, False, True), T(128, 256, 128, 2, 8, 8, True), T(128, 128, 128, 3, 8, 8, False)]
FP8_TILES = [T(128, 256, 128, 3, 8, 8, True), T(256, 128, 128, 3, 8, 8, False), T(128, 256, 128, 3, 8, 8, True, True),
             T(128, 128, 128, 4, 8, 8, False), T(128, 256, 128, 4, 8, 8, True), T(128, 128, 128, 4, 4, 8, False, True)]
#: FFN-up with GELU, tiles whose epilogue may overlap products: two programs a multiprocessor (each program's
#: tiles and registers fit twice), or the epilogue in four column parts (no spills at 128 × 256, so room for a fourth
#: stage or a narrower K step with more stages), warp-specialized where Triton offers it
OVERLAP_TILES = [T(128, 256, 64, 3, 8, 8, 4), T(128, 128, 64, 3, 8, 8, 4, programs=2, maxnreg=128),
                 T(128, 128, 64, 3, 4, 8, 4, programs=2), T(128, 128, 64, 2, 4, 8, 4, programs=2),
                 T(128, 64, 64, 4, 4, 8, 1, programs=2), T(128, 64, 64, 3, 4, 8, 2, programs=2),
                 T(128, 128, 32, 4, 8, 8, 4, programs=2, maxnreg=128),
                 T(128, 128, 64, 3, 8, 8, 2, programs=2, maxnreg=128), T(128, 128, 64, 3, 8, 8, 4),
                 T(128, 256, 64, 4, 8, 8, 4), T(128, 256, 32, 6, 8, 8, 4), T(128, 256, 32, 5, 8, 8, 4),
                 T(256, 128, 64, 3, 8, 8, 4), T(256, 128, 64, 4, 8, 8, 4), T(128, 256, 128, 2, 8, 8, 4),
                 T(128, 256, 64, 3, 8, 8, 4, True), T(128, 256, 64, 4, 8, 8, 4, True)]
#: the same for FFN-up's e4m3 products (GELU and each row's largest |value| in the epilogue, bf16 out)
OVERLAP_FP8_TILES = [T(128, 128, 128, 4, 8, 8, 1), T(128, 128, 128, 3, 8, 8, 4, programs=2, maxnreg=128),
                     T(128, 128, 128, 2, 8, 8, 4, programs=2, maxnreg=128),
                     T(128, 128, 64, 4, 8, 8, 4, programs=2, maxnreg=128),
                     T(128, 128, 128, 3, 8, 8, 2, programs=2, maxnreg=128), T(128, 256, 128, 3, 8, 8, 4)]
#: FFN-up with its epilogue in warps of its own (kernels.gemm_ws): epilogue partitions of two warps and one (the
#: default), of one and one, the default in wider chunks, another tile order, more slots of a narrower K step; 64-row
#: tiles in one warp group of products (a tile's products half as long: for small K) with four epilogue warps
WS_TILES = [WS.WsTile(), WS.WsTile(epi_warps=1), WS.WsTile(epi_n=128), WS.WsTile(group_m=16),
            WS.WsTile(bk=32, stages=6), WS.WsTile(group_m=16, bk=32, stages=6),
            WS.WsTile(bm=64, warps=4, stages=4, epi_warps2=2, epi_regs=128)]
#: the q/k/v projection with the rotary embedding in its epilogue warps (each epilogue chunk one head of 64)
WS_ROPE_TILES = [WS.WsTile(), WS.WsTile(epi_warps=1), WS.WsTile(bk=32, stages=6)]
#: the same in e4m3 (the float32 sums handed over: 128 × 128 tiles)
WS_FP8_TILES = [WS.WS_FP8, WS.WsTile(bn=128, bk=128, stages=4, epi_warps=1), WS.WsTile(bn=128, bk=64, stages=6),
                WS.WsTile(bn=128, bk=128, stages=4, group_m=16)]
#: (name, epilogue) of a block's four products, in order, and QKV with the rotary embedding folded in
PRODUCTS = (("qkv", "bias"), ("o", "residual"), ("ffn_up", "gelu"), ("ffn_down", "residual"), ("qkv", "rope"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench(fn) -> float:
    """Median µs."""
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def shapes(size: str) -> list[tuple[str, str, int, int]]:
    from esm_turbo.model.sizes import esm2_config
    cfg = esm2_config(size)
    d, f = cfg.hidden_size, cfg.intermediate_size
    dims = {"qkv": (3 * d, d), "o": (d, d), "ffn_up": (f, d), "ffn_down": (d, f)}
    return [(name, epi, *dims[name]) for name, epi in PRODUCTS]


def unfused(x, w, b, epi, h, xs=None, ws=None, rope=None):
    """The product as the block ran it before: cuBLAS (torch._scaled_mm for e4m3) with its bias, then the op (for
    ``"rope"`` the rotary kernel, ``rope_packed_triton``)."""
    if xs is not None:
        y = torch._scaled_mm(x, w.t(), scale_a=xs[:, None], scale_b=ws[None, :], bias=b, out_dtype=torch.bfloat16)
    else:
        y = F.linear(x, w, b)
    if epi == "rope":
        from esm_turbo.kernels.rope import rope_packed_triton
        return rope_packed_triton(y, *rope, y.shape[1] // 3 // rope[0].shape[1])
    return G.epilogue_reference(y, epi, h)


def rope_tables(m: int, head_dim: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [m, head_dim] float32 at the positions of 300-token sequences packed end to end."""
    pos = torch.arange(m, device=dev) % 300
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    emb = torch.cat(2 * [pos.float()[:, None] * inv[None, :]], -1)
    return emb.cos(), emb.sin()


def tune_product(size, name, epi, n, k, m, dtype, tiles, out_rows, head_dim=None):
    dev = torch.device("cuda")
    rope = rope_tables(m, head_dim, dev) if epi == "rope" else None
    if rope is not None:
        tiles = [t for t in tiles if G.rope_fits(t, head_dim)]
    gen = torch.Generator(device=dev).manual_seed(n + k)
    fp8 = dtype == torch.float8_e4m3fn
    out_dtype = torch.bfloat16 if fp8 else dtype
    xf = torch.randn(m, k, device=dev, generator=gen)
    wf = torch.randn(n, k, device=dev, generator=gen) / k ** 0.5
    b = (0.1 * torch.randn(n, device=dev, generator=gen)).to(out_dtype)
    h = torch.randn(m, n, device=dev, generator=gen).to(out_dtype) if epi == "residual" else None
    if fp8:
        from esm_turbo.embed.fp8 import Fp8Weight, quantize_rows
        xq, xs = quantize_rows(xf)
        xs = xs[:, 0].contiguous()
        wq = Fp8Weight.quantize(wf)
        x, w, ws = xq, wq.q, wq.scale
    else:
        x, w, xs, ws = xf.to(dtype), wf.to(dtype), None, None
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = G.gemm_reference(x, w, b, epi, h, x_scale=xs, w_scale=ws, rope=rope).double()
    base = unfused(x, w, b, epi, h, xs, ws, rope)
    if rope is not None:  # the pass's q and k laid over the product, as the folded epilogue writes them
        base = torch.cat([base[0].flatten(1), base[1].flatten(1), unfused(x, w, b, "bias", h, xs, ws)[:, 2 * n // 3:]],
                         1)
    err_base = (base.double() - ref).abs().max().item()
    eps = torch.finfo(out_dtype).eps * ref.abs().max().item()
    row = dict(size=size, product=name, epilogue=epi, m=m, n=n, k=k, dtype=str(dtype).removeprefix("torch."),
               cublas_plain_us=bench(lambda: unfused(x, w, b, "bias", None, xs, ws)),
               cublas_unfused_us=bench(lambda: unfused(x, w, b, epi, h, xs, ws, rope)), tiles=[])
    amax = fp8 and epi == "gelu"
    for t in tiles:
        for tma in ([True, False] if t in tiles[:1] else [True]):
            label = (f"{t.bm}x{t.bn}x{t.bk} s{t.stages} w{t.warps} parts {t.subtile}"
                     f"{' ws' if t.ws else ''} {'tma' if tma else 'ptr'}")
            try:
                def run():
                    return G.gemm(x, w, b, epi, h, x_scale=xs, w_scale=ws, row_amax=amax, tile=t, tma=tma,
                                  rope=rope)
                got = run()
                got = got[0] if amax else got
                err = (got.double() - ref).abs().max().item()
                ok = bool(torch.isfinite(got).all()) and err <= 2 * err_base + eps
                us = bench(run)
                row["tiles"].append(dict(tile=t.__dict__, tma=tma, label=label, us=us, err=err, ok=ok))
            except Exception as e:  # noqa: BLE001 - a tile that does not build (shared memory) is reported
                row["tiles"].append(dict(tile=t.__dict__, tma=tma, label=label, error=f"{type(e).__name__}: {e}"[:200]))
    good = [r for r in row["tiles"] if r.get("ok")]
    row["best"] = min(good, key=lambda r: r["us"]) if good else None
    row["err_base"] = err_base
    out_rows.append(row)
    best = row["best"]
    log(f"{size} {name:8} {row['dtype']:14} cuBLAS {row['cublas_plain_us']:8.1f} µs, unfused "
        f"{row['cublas_unfused_us']:8.1f}, best Triton {best['us'] if best else float('nan'):8.1f} "
        f"({best['label'] if best else 'none passed'})")
    return row


def real_batch(tokens: int) -> list[str]:
    """One length-sorted batch of real proteins (calibration_data) from the middle of the length distribution, up to
    ``tokens`` tokens with <cls> and <eos>."""
    from esm_turbo.bench import EMBED_FASTA
    from esm_turbo.fasta import read_fastas
    seqs = sorted((r.sequence for r in read_fastas(EMBED_FASTA)), key=len, reverse=True)
    picked, used = [], 0
    for s in seqs[len(seqs) // 4:]:
        if used + len(s) + 2 > tokens:
            break
        picked.append(s)
        used += len(s) + 2
    return picked


def attention_rows(size: str, tokens: int) -> list[dict]:
    """flash varlen vs cuDNN varlen on real lengths (one length-sorted batch of ``tokens``)."""
    from esm_turbo.embed.varlen import varlen_attention, varlen_attention_reference
    from esm_turbo.model.sizes import esm2_config
    cfg = esm2_config(size)
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    lengths = [len(s) + 2 for s in real_batch(tokens)]
    used = sum(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(used, heads, d, device="cuda", dtype=torch.float16) for _ in range(3))
    flops = sum(4 * n * n * heads * d for n in lengths)
    rows = []
    from esm_turbo.kernels.varlen_attention import AttentionTile, query_blocks, varlen_attention_triton
    blocks = query_blocks(lengths, "cuda")
    cands = {"flash_varlen": lambda: varlen_attention(q, k, v, cu, max(lengths))}
    for warps, stages in ((4, 2), (4, 3), (8, 2)):
        tile = AttentionTile(warps=warps, stages=stages)
        cands[f"triton_w{warps}_s{stages}"] = lambda t=tile: varlen_attention_triton(q, k, v, blocks, tile=t)
    ref = varlen_attention_reference(q.double(), k.double(), v.double(), lengths)
    own = (varlen_attention_reference(q, k, v, lengths).double() - ref).abs().max().item()
    for name, fn in cands.items():
        try:
            out = fn()
            err = (out.double() - ref).abs().max().item()
            us = bench(fn)
            rows.append(dict(size=size, kernel=name, tokens=used, sequences=len(lengths), us=us,
                             tflops=flops / us / 1e6, err_vs_fp64=err, sdpa_fp16_err=own, ok=err <= 2 * own + 1e-3))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(size=size, kernel=name, error=f"{type(e).__name__}: {e}"[:300]))
        log(f"attention {size} {rows[-1]}")
    return rows


def forward_rows(size: str, tokens: int, fp8: bool) -> list[dict]:
    """The whole forward on one real-length batch: folded epilogues on and off, fp16, bf16 (and FP8)."""
    from esm_turbo.embed.benchmark import random_masked_lm
    from esm_turbo.embed.fast_esm import FastEsm, PackedBatch
    dev = torch.device("cuda")
    picked = real_batch(tokens)
    used = sum(len(s) + 2 for s in picked)
    batch = PackedBatch.from_sequences(picked, dev)
    rows = []
    for dt in (["fp16", "bf16"] + (["fp8"] if fp8 else [])):
        net = random_masked_lm(size, dev, torch.float16 if dt == "fp16" else torch.bfloat16)
        fast = FastEsm.from_hf(net)
        if dt == "fp8":
            fast = fast.to_fp8()
        outs = {}
        variants = {"before": (False, "flash"), "after": (None, "triton")}
        best = {}
        for _ in range(3):  # interleaved, the best of three each: the card's clocks drift over a run
            for name, (policy, attention) in variants.items():
                fast.fused_products, fast.attention_kernel = policy, attention
                fn = lambda: fast(batch, [fast.num_layers])  # noqa: E731
                outs.setdefault(name, fn()[fast.num_layers].float())
                ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                best[name] = min(best.get(name, ms), ms)
        for name in variants:
            ms = best[name]
            rows.append(dict(size=size, dtype=dt, variant=name, tokens=used, ms=ms, tokens_per_s=used / ms * 1e3,
                             min_token_cos_vs_before=F.cosine_similarity(outs["before"], outs[name],
                                                                         dim=-1).min().item()))
            log(f"forward {size} {dt} {name}: {ms:.2f} ms, {used / ms * 1e3:.0f} tokens/s")
        net = fast = None
        torch.cuda.empty_cache()
    return rows


def warm_forward(size: str, tokens: int, fp8: bool = False) -> tuple:
    """A random ``size``-shaped FastEsm in fp16 (its products in e4m3 with ``fp8``) on the GPU and one
    :func:`real_batch` packed for it, three forwards run: (model, batch, the batch's sequences)."""
    from esm_turbo.embed.benchmark import random_masked_lm
    from esm_turbo.embed.fast_esm import FastEsm, PackedBatch
    dev = torch.device("cuda")
    picked = real_batch(tokens)
    fast = FastEsm.from_hf(random_masked_lm(size, dev, torch.float16))
    if fp8:
        fast = fast.to_fp8()
    batch = PackedBatch.from_sequences(picked, dev)
    for _ in range(3):
        fast(batch)
    torch.cuda.synchronize()
    return fast, batch, picked


def rope_ab(size: str, tokens: int, tiles: dict, copies: int = 4) -> list[dict]:
    """:func:`table_ab` of this run's best rotary QKV tile (``tiles``) added to the library's table, fp16 and (where
    tuned) e4m3, each in its own forward."""
    from esm_turbo.model.sizes import esm2_config
    cfg = esm2_config(size)
    rows = []
    for dtype in ("float16", "float8_e4m3fn"):
        key = (3 * cfg.hidden_size, cfg.hidden_size, dtype, "rope")
        found = tiles.get(",".join(map(str, key)))
        if found is not None:
            tile = G.Tile(**{f.name: found[f.name] for f in dataclasses.fields(G.Tile) if f.name in found})
            rows += table_ab(size, tokens, key, tile, "rope folded", copies, fp8=dtype != "float16")
    return rows


def table_ab(size: str, tokens: int, key: tuple, tile: G.Tile, label: str, copies: int = 4,
             fp8: bool = False) -> list[dict]:
    """:func:`variants_ab` of the library's table as it is ("table", left so) and with ``tile`` at ``key``
    (``label``)."""
    return variants_ab(size, tokens, {"table": table_entry(key, G.TILES.get(key)), label: table_entry(key, tile)},
                       copies, fp8)


def table_entry(key: tuple, entry):
    """A variant's set-up for :func:`variants_ab`: ``entry`` (a Tile or WsTile; None: no entry, cuBLAS) at ``key`` of
    the library's table."""
    def apply(_fast) -> None:
        if entry is None:
            G.TILES.pop(key, None)
        else:
            G.TILES[key] = entry
    return apply


def variants_ab(size: str, tokens: int, variants: dict, copies: int = 4, fp8: bool = False) -> list[dict]:
    """The forward on one real-length batch and ``Embedder.run`` over the bench's records (nothing written), fp16 (or
    its products in e4m3, ``fp8``), under
    each of ``variants`` (name → a function that sets the variant up on the model), interleaved, best of three each;
    each variant's last layer compared with the first's, and one forward of each profiled kernel by kernel. The first
    variant is left set."""
    from esm_turbo.bench import EMBED_FASTA
    from esm_turbo.embed.benchmark import _NullWriter
    from esm_turbo.embed.extract import EmbedConfig, Embedder
    from esm_turbo.fasta import Record, read_fastas
    fast, batch, picked = warm_forward(size, tokens, fp8)
    records = [Record(f"{r.id}#{c}", r.sequence, r.source) for c in range(copies) for r in read_fastas(EMBED_FASTA)]
    emb = Embedder(fast, EmbedConfig(include=["mean"]), torch.device("cuda"))
    n_tok = sum(len(r.sequence) + 2 for r in records)
    best, outs = {}, {}
    for _ in range(3):
        for variant, setup in variants.items():
            setup(fast)
            fn = lambda: fast(batch, [fast.num_layers])  # noqa: E731
            outs.setdefault(variant, fn()[fast.num_layers].float())
            ms = triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median")
            emb.run(records, _NullWriter(), progress=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            emb.run(records, _NullWriter(), progress=False)
            torch.cuda.synchronize()
            run_s = time.perf_counter() - t0
            old = best.get(variant, (float("inf"), float("inf")))
            best[variant] = (min(old[0], ms), min(old[1], run_s))
    kernels = {}
    for variant, setup in variants.items():  # one forward's GPU time by kernel, CUDA activity only
        setup(fast)
        kernels[variant] = kernel_totals(lambda: fast(batch, [fast.num_layers]))
    first = next(iter(variants))
    variants[first](fast)
    rows = [dict(size=size, fp8=fp8, variant=v, forward_ms=ms, forward_tokens_per_s=batch.tokens.numel() / ms * 1e3,
                 embedder_tokens_per_s=n_tok / run_s,
                 min_token_cos_vs_base=F.cosine_similarity(outs[first], outs[v], dim=-1).min().item(),
                 kernels_ms=kernels[v])
            for v, (ms, run_s) in best.items()]
    for r in rows:
        log(f"A/B {r}")
    return rows


def print_ab(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['size']:5} {r['variant']:14} forward {r['forward_ms']:7.2f} ms ({r['forward_tokens_per_s']:,.0f} "
              f"tokens/s)  Embedder.run {r['embedder_tokens_per_s']:,.0f} tokens/s  worst token cos vs the first "
              f"{r['min_token_cos_vs_base']:.6f}")
        print("    GPU ms by kernel: " + ", ".join(f"{k} {v:.3f}" for k, v in r["kernels_ms"].items()))


def kernel_totals(fn, top: int = 14) -> dict:
    """GPU ms by kernel name (the ``top`` longest; the rest as "other"; "busy" and "span" as well) of one call of
    ``fn`` under a CUDA-only profile, after one call untimed."""
    from torch.profiler import ProfilerActivity, profile

    from esm_turbo.bench.step import breakdown, kernel_times
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = kernel_times(prof.events())
    totals: dict[str, float] = {}
    for name, start, end in kernels:
        totals[name[:60]] = totals.get(name[:60], 0.0) + (end - start) / 1e3
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    out = dict(ranked[:top])
    out["other"] = sum(v for _, v in ranked[top:])
    b = breakdown(kernels)
    out.update(busy=b["busy_ms"], span=b["span_ms"], launches=len(kernels))
    return out


def profile_forward(size: str, tokens: int, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile
    fast, batch, _ = warm_forward(size, tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fast(batch)
        torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20,
                                              max_name_column_width=90))


def ffn_up_inputs(size: str, tokens: int) -> tuple:
    """FFN-up of a ``size``-shaped model at ``tokens`` rows in fp16 on the GPU: (N, K, x, w, b, the reference
    product with GELU in float64, cuBLAS + F.gelu's largest error against it)."""
    dev = torch.device("cuda")
    n, k = next((n, k) for name, _, n, k in shapes(size) if name == "ffn_up")
    gen = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(tokens, k, device=dev, generator=gen).half()
    w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).half()
    b = (0.1 * torch.randn(n, device=dev, generator=gen)).half()
    ref = G.gemm_reference(x, w, b, "gelu").double()
    return n, k, x, w, b, ref, (F.gelu(F.linear(x, w, b)).double() - ref).abs().max().item()


def gelu_rows(size: str, tokens: int, first: int | None = None) -> dict:
    """FFN-up at ``tokens`` rows, fp16: every form of GELU over the table's tile and the tiles of FP16_TILES (its
    ``first`` only, if given; see the module docstring)."""
    cfg_n, cfg_k, x, w, b, ref, err_base = ffn_up_inputs(size, tokens)
    table = G.TILES.get((cfg_n, cfg_k, "float16", "gelu"))
    tiles = ([dataclasses.replace(table, gelu=common.GELU_FORM)] if isinstance(table, G.Tile) else []) + \
        [t for t in FP16_TILES[:first] if not isinstance(table, G.Tile) or t != dataclasses.replace(table, gelu=t.gelu)]
    row = dict(size=size, n=cfg_n, k=cfg_k, m=tokens, cublas_us=bench(lambda: F.linear(x, w, b)),
               cublas_gelu_us=bench(lambda: F.gelu(F.linear(x, w, b))),
               cublaslt_tanh_gelu_us=bench(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)), forms={})
    for form in ["bias-only", *common.GELU_FORMS]:
        best = None
        for t in tiles:
            epi, tile = ("bias", t) if form == "bias-only" else ("gelu", dataclasses.replace(t, gelu=form))
            try:
                def run(epi=epi, tile=tile):
                    return G.gemm(x, w, b, epi, tile=tile)
                err = (run().double() - ref).abs().max().item() if epi == "gelu" else 0.0
                us = bench(run)
            except Exception as e:  # noqa: BLE001 - a tile that does not build is skipped
                log(f"{size} {form} {t}: {type(e).__name__}")
                continue
            if err <= 2 * err_base + 1e-3 and (best is None or us < best["us"]):
                best = dict(us=us, err=err, tile=t.__dict__)
        row["forms"][form] = best
        log(f"gelu {size} {form}: {best}")
    row["ws_forms"] = {}
    if WS.available(x.device):  # the epilogue in warps of its own, erfc (the kernels' form), exp2poly and tanh
        for form in ("erfc", "exp2poly", "tanh"):
            entries = [timed_plan(t, lambda t=t: WS.ws_gemm(x, w, b, "gelu", t), ref, 2 * err_base + 1e-3,
                                  dict(us=lambda t=t: WS.ws_gemm(x, w, b, "gelu", t)))
                       for t in (WS.WsTile(gelu=form), WS.WsTile(group_m=16, gelu=form))]
            row["ws_forms"][form] = best_plan(entries)
            log(f"gelu {size} ws {form}: {entries}")
    return row


def gelu_forms_main(args) -> None:
    """``--gelu-forms``: :func:`gelu_rows` at each size, printed; then, where GELU's tanh or exp2poly form (the
    table's tile or warp-specialized) or the warp-specialized erfc form beats the table's own by 2%, the forward and
    ``Embedder.run`` with each such plan against the table as it is; gelu_forms.json."""
    rows, ab = [], []
    for size in args.sizes:
        r = gelu_rows(size, args.tokens, args.first)
        rows.append(r)
        forms = "  ".join(f"{f} {v['us']:.1f}" for f, v in r["forms"].items() if v)
        ws = "  ".join(f"{f} {v['us']:.1f}" for f, v in r["ws_forms"].items() if v)
        print(f"{r['size']:5} FFN-up µs: cuBLAS {r['cublas_us']:.1f}  + F.gelu {r['cublas_gelu_us']:.1f}  "
              f"cuBLASLt tanh-GELU {r['cublaslt_tanh_gelu_us']:.1f}  Triton {forms}" + (f"  warp-specialized {ws}"
                                                                                     if ws else ""), flush=True)
        key = (r["n"], r["k"], "float16", "gelu")
        table = G.TILES.get(key)
        now = r["forms"].get(table.gelu if isinstance(table, G.Tile) else common.GELU_FORM)
        plans = {}
        for form in ("tanh", "exp2poly"):
            if r["forms"].get(form):
                plans[f"{form} GELU"] = (r["forms"][form], dataclasses.replace(G.Tile(**r["forms"][form]["tile"]),
                                                                               gelu=form))
        for form, found in r["ws_forms"].items():
            if found:
                plans[f"ws {form} GELU"] = (found, WS.WsTile(**found["tile"]))
        winners = {label: tile for label, (e, tile) in plans.items() if now and e["us"] < 0.98 * now["us"]}
        if winners:
            got = variants_ab(r["size"], args.tokens, {"table": table_entry(key, table),
                                                       **{k: table_entry(key, t) for k, t in winners.items()}})
            print_ab(got)
            ab += got
        (args.out / "gelu_forms.json").write_text(json.dumps(dict(rows=rows, ab=ab), indent=1))  # size by size


def timed_plan(tile, run, ref: torch.Tensor, tol: float, times: dict) -> dict:
    """One launch plan's entry: ``tile`` as a dict, the largest error of ``run()`` (its first output when it returns
    a tuple) against ``ref``, whether that is within ``tol``, and the time of each of ``times`` (name → function, µs);
    a plan that does not build is reported, not raised."""
    entry = dict(tile=dataclasses.asdict(tile))
    try:
        got = run()
        got = got[0] if isinstance(got, tuple) else got
        entry["err"] = (got.double() - ref).abs().max().item()
        entry["ok"] = entry["err"] <= tol
        for name, fn in times.items():
            entry[name] = bench(fn)
    except Exception as e:  # noqa: BLE001 - a plan that does not build is reported
        entry["error"] = f"{type(e).__name__}: {e}"[:200]
    return entry


def best_plan(entries: list[dict]) -> dict | None:
    """The fastest entry of :func:`timed_plan` within its tolerance, or None."""
    good = [e for e in entries if e.get("ok")]
    return min(good, key=lambda e: e["us"]) if good else None


def overlap_rows(size: str, tokens: int) -> dict:
    """FFN-up with GELU at ``tokens`` rows, fp16: cuBLAS, cuBLAS + F.gelu, the table's tile with the bias only and
    with GELU, and every tile of :data:`OVERLAP_TILES` (GELU in the table tile's form); each checked against the
    reference as :func:`gelu_rows` checks."""
    n, k, x, w, b, ref, err_base = ffn_up_inputs(size, tokens)
    table = G.tile_for(n, k, torch.float16, "gelu")
    row = dict(size=size, n=n, k=k, m=tokens, table_tile=dataclasses.asdict(table),
               cublas_us=bench(lambda: F.linear(x, w, b)), cublas_gelu_us=bench(lambda: F.gelu(F.linear(x, w, b))),
               table_bias_us=bench(lambda: G.gemm(x, w, b, "bias", tile=table)), tiles=[])
    for t in [table] + [dataclasses.replace(c, gelu=table.gelu) for c in OVERLAP_TILES]:
        def run(t=t):
            return G.gemm(x, w, b, "gelu", tile=t)
        row["tiles"].append(timed_plan(t, run, ref, 2 * err_base + 1e-3, dict(us=run)))
        log(f"overlap {size} {row['tiles'][-1]}")
    row["best"] = best_plan(row["tiles"][1:])
    return row


def ws_rows(size: str, tokens: int) -> dict:
    """FFN-up with GELU at ``tokens`` rows, fp16: cuBLAS, cuBLAS + F.gelu, the table's tile with the bias only and
    with GELU, and every plan of :data:`WS_TILES` (the epilogue in warps of its own) with GELU and with the bias
    only (its products' own pace); each checked against the reference as :func:`gelu_rows` checks."""
    n, k, x, w, b, ref, err_base = ffn_up_inputs(size, tokens)
    table = G.tile_for(n, k, torch.float16, "gelu")
    row = dict(size=size, n=n, k=k, m=tokens, table_tile=dataclasses.asdict(table),
               cublas_us=bench(lambda: F.linear(x, w, b)), cublas_gelu_us=bench(lambda: F.gelu(F.linear(x, w, b))),
               table_bias_us=bench(lambda: G.gemm(x, w, b, "bias", tile=table)),
               table_us=bench(lambda: G.gemm(x, w, b, "gelu", tile=table)), tiles=[])
    log(f"ws {size} {row}")
    for t in WS_TILES:
        def run(t=t, epilogue="gelu"):
            return WS.ws_gemm(x, w, b, epilogue, t)
        row["tiles"].append(timed_plan(t, run, ref, 2 * err_base + 1e-3,
                                       dict(us=run, bias_us=lambda run=run: run(epilogue="bias"))))
        log(f"ws {size} {row['tiles'][-1]}")
    row["best"] = best_plan(row["tiles"])
    return row


def ws_rope_rows(size: str, tokens: int, fp8: bool) -> dict:
    """The q/k/v projection at ``tokens`` rows as the forward runs it (fp16: cuBLAS, e4m3: the table's Triton tile;
    then the rotary launch) against the product with the queries scaled and queries and keys rotated in its epilogue
    warps, over :data:`WS_ROPE_TILES` (e4m3: the plans of :data:`WS_FP8_TILES`); each checked against the
    reference."""
    from esm_turbo.embed.fp8 import Fp8Weight, quantize_rows
    from esm_turbo.kernels.rope import rope_packed_triton
    from esm_turbo.model.sizes import esm2_config
    dev = torch.device("cuda")
    cfg = esm2_config(size)
    dim, head_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator(device=dev).manual_seed(dim)
    xf = torch.randn(tokens, dim, device=dev, generator=gen)
    wf = torch.randn(3 * dim, dim, device=dev, generator=gen) / dim ** 0.5
    rope = rope_tables(tokens, head_dim, dev)
    if fp8:
        xq, xs = quantize_rows(xf)
        wq = Fp8Weight.quantize(wf)
        x, w, scales, out_dtype = xq, wq.q, dict(x_scale=xs[:, 0].contiguous(), w_scale=wq.scale), torch.bfloat16
    else:
        x, w, scales, out_dtype = xf.half(), wf.half(), {}, torch.float16
    b = (0.1 * torch.randn(3 * dim, device=dev, generator=gen)).to(out_dtype)
    ref = G.gemm_reference(x, w, b, "rope", rope=rope, **scales).double()

    def forward_way():  # the block's way today: the product (bias only), then the rotary launch over q and k
        y = G.gemm(x, w, b, "bias", **scales) if fp8 else F.linear(x, w, b)
        return y, rope_packed_triton(y, *rope, dim // head_dim)
    y, (q, k) = forward_way()  # laid out as the reference for its error (a copy the forward does not make: untimed)
    err_base = (torch.cat([q.flatten(1), k.flatten(1), y[:, 2 * dim:]], 1).double() - ref).abs().max().item()
    eps = torch.finfo(out_dtype).eps * ref.abs().max().item()
    row = dict(size=size, fp8=fp8, n=3 * dim, k=dim, m=tokens, forward_way_us=bench(forward_way), tiles=[])
    for t in WS_FP8_TILES if fp8 else WS_ROPE_TILES:
        def run(t=t):
            return WS.ws_gemm(x, w, b, "rope", t, rope=rope, **scales)
        row["tiles"].append(timed_plan(t, run, ref, 2 * err_base + eps, dict(us=run)))
        log(f"ws rope {size} fp8={fp8} {row['tiles'][-1]}")
    row["best"] = best_plan(row["tiles"])
    return row


def ffn_up_fp8_inputs(size: str, tokens: int) -> tuple:
    """FFN-up of a ``size``-shaped model at ``tokens`` rows in e4m3 on the GPU: (N, K, x's codes, their row scales
    [M], the weight's codes and scales (Fp8Weight), the bf16 bias, the reference with GELU in float64, the unfused
    path's largest error against it, bf16's epsilon at the reference's largest value, and the FP8 forward's way as a
    function: ``torch._scaled_mm`` then the GELU-into-e4m3 launch)."""
    from esm_turbo.embed.fp8 import Fp8Weight, quantize_rows
    from esm_turbo.kernels.activation import activation_triton
    dev = torch.device("cuda")
    n, k = next((n, k) for name, _, n, k in shapes(size) if name == "ffn_up")
    gen = torch.Generator(device=dev).manual_seed(n)
    xq, xs = quantize_rows(torch.randn(tokens, k, device=dev, generator=gen))
    xs = xs[:, 0].contiguous()
    wq = Fp8Weight.quantize(torch.randn(n, k, device=dev, generator=gen) / k ** 0.5)
    b = (0.1 * torch.randn(n, device=dev, generator=gen)).to(torch.bfloat16)
    ref = G.gemm_reference(xq, wq.q, b, "gelu", x_scale=xs, w_scale=wq.scale).double()
    err_base = (unfused(xq, wq.q, b, "gelu", None, xs, wq.scale).double() - ref).abs().max().item()
    eps = torch.finfo(torch.bfloat16).eps * ref.abs().max().item()

    def cublas():
        return activation_triton(unfused(xq, wq.q, b, "bias", None, xs, wq.scale), "gelu", fp8=True)
    return n, k, xq, xs, wq, b, ref, err_base, eps, cublas


def ws_fp8_rows(size: str, tokens: int) -> dict:
    """FFN-up in e4m3 at ``tokens`` rows as the FP8 forward runs it (``torch._scaled_mm`` then the GELU-into-e4m3
    launch), against the product with its epilogue in warps of its own (scales, bias, GELU and the rows' maxima)
    then the quantize launch given those maxima, over :data:`WS_FP8_TILES`; each checked against the reference."""
    from esm_turbo.kernels.activation import activation_triton
    n, k, xq, xs, wq, b, ref, err_base, eps, cublas = ffn_up_fp8_inputs(size, tokens)
    row = dict(size=size, n=n, k=k, m=tokens, cublas_then_pass_us=bench(cublas),
               cublas_us=bench(lambda: unfused(xq, wq.q, b, "bias", None, xs, wq.scale)), tiles=[])
    for t in WS_FP8_TILES:
        def product(t=t):
            return WS.ws_gemm(xq, wq.q, b, "gelu", t, xs, wq.scale, row_amax=True)

        def folded(product=product):
            f, amax = product()
            return f, activation_triton(f, "none", fp8=True, amax=amax)
        row["tiles"].append(timed_plan(t, folded, ref, 2 * err_base + eps, dict(us=folded, product_us=product)))
        log(f"ws fp8 {size} {row['tiles'][-1]}")
    row["best"] = best_plan(row["tiles"])
    return row


def overlap_fp8_rows(size: str, tokens: int) -> dict:
    """FFN-up in e4m3 at ``tokens`` rows as the FP8 forward runs it: ``torch._scaled_mm`` (bf16 out, the bias) then
    the GELU-and-quantize kernel (two reads of its input), against the folded product (GELU and the rows' maxima in
    its epilogue) then the quantize kernel given those maxima (one read), over :data:`OVERLAP_FP8_TILES`; each
    folded output checked against the reference as :func:`tune_product` checks."""
    from esm_turbo.kernels.activation import activation_triton
    n, k, xq, xs, wq, b, ref, err_base, eps, cublas = ffn_up_fp8_inputs(size, tokens)
    row = dict(size=size, n=n, k=k, m=tokens, cublas_then_pass_us=bench(cublas), tiles=[])
    for t in OVERLAP_FP8_TILES:
        def folded(t=t):
            f, amax = G.gemm(xq, wq.q, b, "gelu", x_scale=xs, w_scale=wq.scale, row_amax=True, tile=t)
            return f, activation_triton(f, "none", fp8=True, amax=amax)
        row["tiles"].append(timed_plan(t, folded, ref, 2 * err_base + eps, dict(us=folded)))
        log(f"overlap fp8 {size} {row['tiles'][-1]}")
    row["best"] = best_plan(row["tiles"])
    return row


def fp8_gelu_ab(sizes: list[str], tokens: int) -> dict:
    """The FP8 forward's GELU-into-e4m3 launch after FFN-up three ways: its rows' maxima from GELU over the row (two
    sweeps, GELU in both), from the rows' bounding values (``activation.GELU_AMAX_FROM_BOUNDS``), and each row held
    in registers (``activation.HOLD_ROWS``: one read): the launch alone on a bf16 FFN-up output of ``tokens`` rows
    (µs, interleaved, best of three), then :func:`variants_ab` of the FP8 forward each way."""
    from esm_turbo.kernels import activation as A
    from esm_turbo.model.sizes import esm2_config
    dev = torch.device("cuda")
    ways = {"gelu over the row": (False, False), "from bounds": (True, False), "held rows": (True, True)}

    def use(way: str):
        def apply(_fast=None) -> None:
            A.GELU_AMAX_FROM_BOUNDS, A.HOLD_ROWS = ways[way]
        return apply
    launch, ab = [], []
    for size in sizes:
        f = esm2_config(size).intermediate_size
        u = (3 * torch.randn(tokens, f, device=dev)).to(torch.bfloat16)
        best = {}
        for _ in range(3):
            for way in ways:
                use(way)()
                us = bench(lambda: A.activation_triton(u, "gelu", fp8=True))
                best[way] = min(best.get(way, us), us)
        launch.append(dict(size=size, rows=tokens, width=f, us=best, read_write_floor_us=u.numel() * 3 / 3e6))
        log(f"fp8 gelu launch {launch[-1]}")
        ab += variants_ab(size, tokens, {way: use(way) for way in ways}, fp8=True)
    use("held rows")()  # the library's default
    return dict(launch=launch, ab=ab)


def plan_text(e: dict, timing) -> str:
    """An entry of :func:`timed_plan` as the tail of a line: ``timing(e)`` and its largest error, or why it did not
    build."""
    if "us" not in e:
        return e["error"]
    return f"{timing(e)}, max error {e['err']:.2e}" + ("" if e["ok"] else " (FAILS the reference)")


def ws_main(args) -> None:
    """``--ws``: each of ``--ws-parts`` at each size (:func:`ws_rows`, :func:`ws_fp8_rows`, :func:`ws_rope_rows`),
    printed, then the forward A/B of each plan that beats the forward's own way by 2%; ws.json."""
    rows, ab = {}, []
    jobs = [("ffn_up", size, False) for size in args.sizes] + \
        [("ffn_up_fp8", size, True) for size in args.sizes] + \
        [("rope", size, fp8) for size in args.sizes for fp8 in (False, True)]
    for part, size, fp8 in jobs:
        if part not in args.ws_parts or (fp8 and args.skip_fp8):
            continue
        if part == "ffn_up":
            r = ws_rows(size, args.tokens)
            base, head = r["table_us"], (f"FFN-up fp16 µs: cuBLAS {r['cublas_us']:.1f}  + F.gelu "
                                         f"{r['cublas_gelu_us']:.1f}  table tile bias {r['table_bias_us']:.1f}  GELU "
                                         f"{r['table_us']:.1f}")
            key, label = (r["n"], r["k"], "float16", "gelu"), "warp-specialized"

            def timing(e):
                return f"GELU {e['us']:.1f} µs, bias only {e.get('bias_us', float('nan')):.1f}"
        elif part == "ffn_up_fp8":
            r = ws_fp8_rows(size, args.tokens)
            base, head = r["cublas_then_pass_us"], (f"FFN-up e4m3 µs: cuBLAS {r['cublas_us']:.1f}, then the "
                                                    f"GELU-into-e4m3 launch {r['cublas_then_pass_us']:.1f}")
            key, label = (r["n"], r["k"], "float8_e4m3fn", "gelu"), "warp-specialized"

            def timing(e):
                product = e.get("product_us", float("nan"))
                return f"then the quantize launch {e['us']:.1f} µs (the product {product:.1f})"
        else:
            r = ws_rope_rows(size, args.tokens, fp8)
            base = r["forward_way_us"]
            head = f"QKV {'e4m3' if fp8 else 'fp16'} then the rotary launch: {base:.1f} µs"
            key, label = (r["n"], r["k"], "float8_e4m3fn" if fp8 else "float16", "rope"), "ws rotary"

            def timing(e):
                return f"rotary in the epilogue {e['us']:.1f} µs"
        rows.setdefault(part, []).append(r)
        print(f"{size:5} {head}", flush=True)
        for e in r["tiles"]:
            t = e["tile"]
            print(f"    ws {t['bm']}x{t['bn']}x{t['bk']} s{t['stages']} group {t['group_m']} epilogue {t['epi_warps']} "
                  f"+ {t['epi_warps2']} warps {t['epi_m']}x{t['epi_n']}: " + plan_text(e, timing), flush=True)
        if r["best"] and r["best"]["us"] < 0.98 * base:
            ab += table_ab(size, args.tokens, key, WS.WsTile(**r["best"]["tile"]), label, fp8=fp8)
    (args.out / "ws.json").write_text(json.dumps(dict(rows, ab=ab), indent=1))
    print_ab(ab)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["650M", "3B", "150M"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument("--skip-fp16", action="store_true", help="tune the e4m3 products only")
    ap.add_argument("--skip-products", action="store_true", help="only the attention, forward and profile parts")
    ap.add_argument("--first", type=int, default=None, help="only the first N tiles of each list")
    ap.add_argument("--gelu-forms", action="store_true", help="only the GELU forms in FFN-up and the forward")
    ap.add_argument("--overlap", action="store_true",
                    help="only FFN-up over OVERLAP_TILES, then the forward A/B of the best where it beats the table")
    ap.add_argument("--fp8-overlap", action="store_true",
                    help="FFN-up in e4m3 folded over OVERLAP_FP8_TILES against cuBLAS and its pass (after --overlap's "
                         "rows where both are given)")
    ap.add_argument("--fp8-gelu-ab", action="store_true",
                    help="only the FP8 GELU launch three ways (row maxima from GELU over the row, from bounds, rows "
                         "held), alone and in the forward")
    ap.add_argument("--ws", action="store_true",
                    help="only the products with their epilogue in warps of their own (WS_TILES, WS_FP8_TILES, "
                         "WS_ROPE_TILES), then the forward A/B of the best where it beats the forward's way")
    ap.add_argument("--ws-parts", nargs="+", default=["ffn_up", "ffn_up_fp8", "rope"],
                    choices=["ffn_up", "ffn_up_fp8", "rope"], help="with --ws: which products")
    ap.add_argument("--products", nargs="+", default=None, metavar="NAME:EPILOGUE",
                    help="only these products (e.g. qkv:rope), then the rotary A/B instead of the other parts")
    ap.add_argument("--tiles", type=Path, default=None,
                    help="with --products: the tiles of an earlier run's tiles.json instead of tuning them again")
    ap.add_argument("--attention-ab", action="store_true",
                    help="only the forward and Embedder.run with FastEsm.attention_kernel 'triton' against 'gluon'")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if args.gelu_forms:
        gelu_forms_main(args)
        return
    if args.fp8_gelu_ab:
        got = fp8_gelu_ab(args.sizes, args.tokens)
        (args.out / "fp8_gelu_ab.json").write_text(json.dumps(got, indent=1))
        for r in got["launch"]:
            print(f"{r['size']:5} GELU into e4m3, {r['rows']} x {r['width']}: "
                  + ", ".join(f"{way} {us:.1f} µs" for way, us in r["us"].items())
                  + f" (one read and a write at 3 TB/s: {r['read_write_floor_us']:.1f})")
        print_ab(got["ab"])
        return
    if args.ws:
        ws_main(args)
        return
    if args.attention_ab:
        def kernel(name):
            def apply(fast):
                fast.attention_kernel = name
            return apply
        ab = [r for size in args.sizes for r in variants_ab(size, args.tokens,
                                                             {"triton": kernel("triton"), "gluon": kernel("gluon")})]
        (args.out / "attention_ab.json").write_text(json.dumps(ab, indent=1))
        print_ab(ab)
        return
    if args.overlap or args.fp8_overlap:
        rows, ab = [overlap_rows(size, args.tokens) for size in args.sizes] if args.overlap else [], []
        for r in rows:
            table_us = r["tiles"][0].get("us", float("inf"))
            print(f"{r['size']:5} FFN-up µs: cuBLAS {r['cublas_us']:.1f}  + F.gelu {r['cublas_gelu_us']:.1f}  table "
                  f"tile bias {r['table_bias_us']:.1f}  GELU {table_us:.1f}")
            for e in r["tiles"][1:]:
                t = e["tile"]
                print(f"    {t['bm']}x{t['bn']}x{t['bk']} s{t['stages']} w{t['warps']} parts {t['subtile']} programs "
                      f"{t['programs']} maxnreg {t['maxnreg']}: " + (f"{e['us']:.1f} µs" if "us" in e else e["error"]))
            if r["best"] and r["best"]["us"] < 0.98 * table_us:
                key = (r["n"], r["k"], "float16", "gelu")
                ab += table_ab(r["size"], args.tokens, key, G.Tile(**r["best"]["tile"]), "overlap")
        fp8_rows = [overlap_fp8_rows(size, args.tokens) for size in args.sizes] if args.fp8_overlap else []
        for r in fp8_rows:
            print(f"{r['size']:5} FFN-up e4m3 µs: cuBLAS then the GELU-and-quantize pass "
                  f"{r['cublas_then_pass_us']:.1f}")
            for e in r["tiles"]:
                t = e["tile"]
                print(f"    folded {t['bm']}x{t['bn']}x{t['bk']} s{t['stages']} w{t['warps']} parts {t['subtile']} "
                      f"programs {t['programs']} maxnreg {t['maxnreg']}, then the quantize pass: "
                      + (f"{e['us']:.1f} µs" if "us" in e else e["error"]))
            if r["best"] and r["best"]["us"] < 0.98 * r["cublas_then_pass_us"]:
                key = (r["n"], r["k"], "float8_e4m3fn", "gelu")
                ab += table_ab(r["size"], args.tokens, key, G.Tile(**r["best"]["tile"]), "folded", fp8=True)
        (args.out / "overlap.json").write_text(json.dumps(dict(products=rows, fp8=fp8_rows, ab=ab), indent=1))
        print_ab(ab)
        return
    from esm_turbo.embed.fp8 import fp8_supported
    fp8 = fp8_supported("cuda") and not args.skip_fp8
    rows, tiles = [], {}
    if args.tiles:
        tiles = json.loads(args.tiles.read_text())
    for size in ([] if args.skip_products or args.tiles else args.sizes):
        from esm_turbo.model.sizes import esm2_config
        head_dim = esm2_config(size).hidden_size // esm2_config(size).num_attention_heads
        for name, epi, n, k in shapes(size):
            if args.products and f"{name}:{epi}" not in args.products:
                continue
            for dtype, cands in ((() if args.skip_fp16 else ((torch.float16, FP16_TILES),))
                                 + (((torch.float8_e4m3fn, FP8_TILES),) if fp8 else ())):
                cands = cands[: args.first] if args.first else cands
                row = tune_product(size, name, epi, n, k, args.tokens, dtype, cands, rows, head_dim)
                if row["best"]:
                    tiles[f"{n},{k},{row['dtype']},{epi}"] = dict(row["best"]["tile"], tma=row["best"]["tma"],
                                                                  us=row["best"]["us"],
                                                                  unfused_us=row["cublas_unfused_us"])
        (args.out / "tiles.json").write_text(json.dumps(tiles, indent=1))
    if args.products:
        ab = [r for size in args.sizes for r in rope_ab(size, args.tokens, tiles)]
        (args.out / "tune_gemm.json").write_text(json.dumps(dict(products=rows, rope_ab=ab), indent=1))
        print_products(rows)
        print_ab(ab)
        return
    attn, fwd = [], []
    for size in args.sizes:
        try:
            attn += attention_rows(size, args.tokens)
        except Exception as e:  # noqa: BLE001
            log(f"attention {size} failed: {e}")
        try:
            fwd += forward_rows(size, args.tokens, fp8)
        except Exception as e:  # noqa: BLE001
            log(f"forward {size} failed: {type(e).__name__}: {e}")
    try:
        profile_forward(args.sizes[0], args.tokens, args.out / "profile_folded.txt")
    except Exception as e:  # noqa: BLE001
        log(f"profile failed: {e}")
    (args.out / "tune_gemm.json").write_text(json.dumps(dict(products=rows, attention=attn, forward=fwd), indent=1))
    print_products(rows)
    for r in attn:
        print(r)
    for r in fwd:
        print(r)


def print_products(rows: list[dict]) -> None:
    print("\nproduct                 dtype          cuBLAS µs  unfused µs  Triton µs  best tile")
    for r in rows:
        b = r["best"]
        print(f"{r['size']:5} {r['product']:6} {r['epilogue']:9} {r['dtype']:14} {r['cublas_plain_us']:9.1f} "
              f"{r['cublas_unfused_us']:10.1f} {b['us'] if b else float('nan'):10.1f}  "
              f"{b['label'] if b else 'none passed'}")


if __name__ == "__main__":
    main()
