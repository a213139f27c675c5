"""A decode step's paths on the GPU, timed in one run: through transformers' layers and through FastEsm's fused
blocks (esm_turbo.model.fused_step), each captured as a CUDA graph, on the 650M-shaped steps ``esm-turbo bench
decode`` and ``bench design`` take (random weights, synthetic caches; the fused blocks' products as the library picks
them, in cuBLAS, or in the Triton kernel), each with its floor (one read of what the step
must read, esm_turbo.bench.step) and its GPU time by kernel kind. Then where folding a product's epilogue pays: the
folded products of kernels.gemm.TILES against cuBLAS followed by the pass, from a decode step's rows to an
embedding batch's (what sets kernels.gemm.FOLD_MIN_ROWS).

    python tools/step_paths.py --out results/gpu/step_paths_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from esm_turbo.bench.step import breakdown, kernel_times, read_rate_gbs, step_report
from esm_turbo.bench.synthetic import layer_codec, stand_in_model, synthetic_session
from esm_turbo.bench.timing import time_eager, time_graph
from esm_turbo.kernels import gemm as G
from esm_turbo.model.alphabet import alphabet
from esm_turbo.model.engine import TurboEsm

#: (cache, rows, cached tokens): bench decode's steps at its 8 GiB budget, and bench design's
STEPS = (("compressed", 195, 1024), ("fp16", 48, 1024), ("compressed", 256, 1088), ("compressed", 64, 1024))
#: the step's paths: transformers' layers, and the fused blocks with their products as FastEsm.fused_products asks
#: (None: each as kernels.gemm.measured says; False: cuBLAS and the pointwise passes; True: every product in the
#: persistent Triton kernel, epilogues folded)
PATHS = {"layers": None, "fused": None, "fused-cublas": False, "fused-triton": True}
ROWS = (1024, 2048, 4096, 8192, 16384)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@torch.no_grad()
def step_rows(rate: float, profiled: bool = True, paths=tuple(PATHS), steps=STEPS) -> list[dict]:
    """Each of STEPS through both paths: captured step ms, its floor and the logits' largest difference between the
    paths; then (``profiled``) one replay of each profiled by kernel kind, in a pass after every timing (a profiler
    leaves CUDA's tracing attached, which slows what runs after it)."""
    dev = torch.device("cuda")
    engine = TurboEsm(stand_in_model("650M", dev, torch.float16))
    token = alphabet().get_idx("A")
    rows = []

    def captured(cache: str, batch: int, context: int, path: str):
        session = synthetic_session(engine, layer_codec if cache == "compressed" else "fp16", batch, context, 8)
        engine.fused_step = path != "layers"
        engine.fast().fused_products = PATHS[path]
        return session, session.capture_step(torch.full((batch, 1), token, device=dev))

    for cache, batch, context in steps:
        logits = {}
        for path in ("layers",) + tuple(p for p in paths if p != "layers"):
            session, step = captured(cache, batch, context, path)
            ms = time_eager(step.replay, dev, reps=30) * 1e3  # as bench design times a captured step
            logits[path] = step.replay().logits.float().cpu()
            row = dict(cache=cache, rows=batch, context=context, path=path, step_ms=ms,
                       **step_report(session, ms, rate))
            row["max_logit_diff_vs_layers"] = (logits[path] - logits["layers"]).abs().max().item()
            rows.append(row)
            _log(f"{cache} {batch}x{context} {path}: {ms:.3f} ms ({row['of_floor']:.0%} of {row['floor_ms']:.2f})")
            del session, step
            torch.cuda.empty_cache()
    if profiled:
        from torch.profiler import ProfilerActivity, profile
        for row in rows:
            session, step = captured(row["cache"], row["rows"], row["context"], row["path"])
            step.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step.replay()
                torch.cuda.synchronize()
            parts = breakdown(kernel_times(prof.events()))
            row.update(launches=parts["launches"], kinds_ms=parts["kinds_ms"])
            del session, step
            torch.cuda.empty_cache()
    engine.fused_step = engine.fast().fused_products = None
    return rows


def fold_rows() -> list[dict]:
    """The folded fp16 products of TILES at each of ROWS, µs (CUDA graph, cold L2): cuBLAS + the pass, folded."""
    dev = torch.device("cuda")
    out = []
    for (n, k, dtype, epi), tile in G.TILES.items():
        if dtype != "float16":
            continue
        w = (torch.randn(n, k, device=dev) / k ** 0.5).half()
        b = (0.1 * torch.randn(n, device=dev)).half()
        for m in ROWS:
            x = torch.randn(m, k, device=dev).half()
            h = torch.randn(m, n, device=dev).half() if epi == "residual" else None
            unfused = time_graph(lambda: G.epilogue_reference(F.linear(x, w, b), epi, h), dev) * 1e6
            folded = time_graph(lambda: G.gemm(x, w, b, epi, h, tile=tile), dev) * 1e6
            out.append(dict(n=n, k=k, epilogue=epi, rows=m, unfused_us=unfused, folded_us=folded))
            _log(f"N={n} K={k} {epi} rows {m}: cuBLAS + pass {unfused:.1f} µs, folded {folded:.1f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON here (and the table beside it, .txt)")
    ap.add_argument("--no-profile", action="store_true", help="time the steps only")
    ap.add_argument("--no-folds", action="store_true", help="leave out the products' rows sweep")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--steps", nargs="+", type=int, default=None, help="only these of STEPS (indices)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rate = read_rate_gbs(dev)
    res = dict(device=torch.cuda.get_device_name(), read_gbs=rate, folds=[] if args.no_folds else fold_rows())
    steps = STEPS if args.steps is None else tuple(STEPS[i] for i in args.steps)
    res["steps"] = step_rows(rate, not args.no_profile, tuple(args.paths), steps)
    lines = [f"decode step paths, 650M-shaped, captured as CUDA graphs ({res['device']}; floor at a pure read's "
             f"{rate:.0f} GB/s, measured here)",
             "  cache       rows  context  path          step ms  floor ms  reached  kernels  attention  linears"
             "  other"]
    for r in res["steps"]:
        k = r.get("kinds_ms", {})
        kinds = " ".join(f"{k[kind]:{w}.2f}" if kind in k else " " * w for kind, w in
                         (("attention", 10), ("linears", 8), ("other", 6)))
        lines.append(f"  {r['cache']:10} {r['rows']:5} {r['context']:8}  {r['path']:12} {r['step_ms']:8.2f} "
                     f"{r['floor_ms']:9.2f} {r['of_floor']:8.0%} {r.get('launches', ''):>8} {kinds}")
    lines.append("folded products (kernels.gemm.TILES, fp16) against cuBLAS + the pass, µs by rows")
    for r in res["folds"]:
        lines.append(f"  N={r['n']:5} K={r['k']:5} {r['epilogue']:8} rows {r['rows']:6}: cuBLAS + pass "
                     f"{r['unfused_us']:8.1f}  folded {r['folded_us']:8.1f}  ({r['unfused_us'] / r['folded_us']:.2f}x)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        with open(args.out.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
