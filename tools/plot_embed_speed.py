"""Plot of FastEsm's 650M-shaped forward against its matrix products' ceiling, and of each block product in cuBLAS,
cuBLAS with its pointwise pass and the Triton kernel with the pass folded in, from the tune_gemm results.

usage: python tools/plot_embed_speed.py [results/embed/fastesm_h200.json] [--out results/plots/fastesm_650m_h200.png]
"""
import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path, nargs="?", default=Path("results/embed/fastesm_h200.json"))
    ap.add_argument("--out", type=Path, default=Path("results/plots/fastesm_650m_h200.png"))
    args = ap.parse_args()
    d = json.loads(args.results.read_text())
    prof = d["profile_650m_fp16"]
    rows = [r for r in d["products"] if r["size"] == "650M"]
    ceiling = 33 * sum(r["cublas_plain_us"] for r in rows if r["dtype"] == "float16") / 1e3
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw=dict(width_ratios=[1, 1.6]))
    parts = dict(prof["kernels_ms"], **{"GPU idle": prof["forward_ms"] - prof["gpu_busy_ms"]})
    bottom = 0.0
    for (name, ms), color in zip(parts.items(), plt.cm.tab10.colors):
        left.bar(0, ms, bottom=bottom, color=color, label=f"{name}: {ms:.1f} ms")
        bottom += ms
    left.axhline(ceiling, color="k", ls="--", lw=1)
    left.text(0.45, ceiling, f"four products in cuBLAS: {ceiling:.1f} ms", va="bottom", ha="right", fontsize=8)
    left.axhline(ceiling / 0.75, color="r", ls=":", lw=1)
    left.text(0.45, ceiling / 0.75, f"75% of that ceiling: {ceiling / 0.75:.1f} ms", va="bottom", ha="right",
              fontsize=8, color="r")
    left.set_xticks([])
    left.set_xlim(-0.6, 0.6)
    left.set_ylabel("ms per forward")
    left.set_title(f"650M-shaped fp16 forward, {prof['tokens']:,} tokens ({d['device']})", fontsize=10)
    left.legend(fontsize=7, loc="lower right")
    labels = [f"{r['product']}\n{'fp16' if r['dtype'] == 'float16' else 'e4m3'}" for r in rows]
    xs = range(len(rows))
    w = 0.27
    right.bar([x - w for x in xs], [r["cublas_plain_us"] for r in rows], w, label="cuBLAS alone (the ceiling)")
    right.bar(list(xs), [r["cublas_unfused_us"] for r in rows], w, label="cuBLAS, then the pass")
    right.bar([x + w for x in xs], [r["best"]["us"] if r["best"] else 0 for r in rows], w,
              label="Triton, the pass folded in")
    right.set_xticks(list(xs))
    right.set_xticklabels(labels, fontsize=8)
    right.set_ylabel("µs at 16,384 rows")
    right.set_title("each product with its epilogue (qkv: bias; o, ffn_down: + residual; ffn_up: + GELU)",
                    fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(args.out)


if __name__ == "__main__":
    main()
