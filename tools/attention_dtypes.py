"""The packed attention kernel against flash-attention's varlen kernel inside whole forwards in bf16 and with FP8
products (whose work around the products runs in bf16), on one GPU: what sets
``esm_turbo.kernels.varlen_attention.GPU_DTYPES``.

usage: python tools/attention_dtypes.py [--sizes 150M 650M 3B] [--out F.json]

Per shape (random weights, one real-length 16K-token batch): the forward's median ms with each attention kernel,
interleaved, best of two, and the smallest per-token cosine between the two forwards' last layers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

import esm_turbo.kernels.varlen_attention as VA

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rows_for(size: str, tokens: int) -> list[dict]:
    from tune_gemm import warm_forward
    fast, batch, _ = warm_forward(size, tokens)
    kept = VA.GPU_DTYPES
    rows = []
    for mode in ("bf16", "fp8"):
        if mode == "bf16":
            fast.to_dtype(torch.bfloat16)
        else:
            fast.to_fp8()
        best, outs = {}, {}
        for _ in range(2):
            for kernel, dtypes in (("flash", (torch.float16,)), ("triton", (torch.float16, torch.bfloat16))):
                VA.GPU_DTYPES = dtypes
                fn = lambda: fast(batch, [fast.num_layers])  # noqa: E731
                outs[kernel] = fn()[fast.num_layers].float()
                ms = triton.testing.do_bench(fn, warmup=10, rep=150, return_mode="median")
                best[kernel] = min(best.get(kernel, float("inf")), ms)
        VA.GPU_DTYPES = kept
        cos = F.cosine_similarity(outs["triton"], outs["flash"], dim=-1).min().item()
        rows.append(dict(size=size, mode=mode, tokens=int(batch.tokens.numel()), flash_ms=best["flash"],
                         triton_ms=best["triton"], speedup=best["flash"] / best["triton"], min_token_cos=cos))
        print(f"{size} {mode}: flash {best['flash']:.2f} ms, triton {best['triton']:.2f} ms "
              f"({best['flash'] / best['triton']:.3f}x), min token cos between them {cos:.6f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["150M", "650M", "3B"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for size in args.sizes:
        rows += rows_for(size, args.tokens)
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
