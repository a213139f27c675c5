"""The register-fed 4-bit kernel's launch variants against its default launch, each product over cold weights at a
decode step's rows, on the GPU: µs a product, the best of three interleaved runs, every launch checked against
``matmul_reference`` first (a variant off by more than 2·10⁻³ of the largest output reads "wrong" and is not timed).
A variant overrides ``launch_config``'s keys: ``mma_maxnreg`` (a register cap: with more room than its own choice of
68 a thread, ptxas issues a step's input loads and the next step's code loads at the step's start), ``mma_upfront``
(every step's codes and scales requested before the walk), ``pdl`` (a programmatic dependent launch: with
``mma_upfront`` every code is requested before the kernel waits for the one before it). ``--design``: then the
3B-shaped design step under each variant (:func:`design_lines`).

    python tools/mma_launch_speed.py [--sizes 3B 15B 650M] [--rows 16 8] [--configs "mma_maxnreg=96" ...]
        [--design "" "pdl=1 mma_upfront=1 early=2"] [--out FILE]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from esm_turbo.bench.timing import launch_floors_us
from esm_turbo.kernels.common import num_sms
from esm_turbo.kernels.weights import launch_config, matmul_reference, matmul_triton
from slot_speed import parse_config
from study_common import stream
from tune_split import per_product_us
from tune_weights_step import cold_passes, products


def product_line(size: str, name: str, m: int, n: int, rows: int, variants: list[dict], dev: torch.device) -> str:
    """One product's line: its launch floor, the default launch's µs and each variant's (its speed against the
    default)."""
    weights, nbytes = cold_passes(m, n, dev)
    first, count = weights[0], len(weights)
    x = torch.randn(rows, n, device=dev).half()
    ref = matmul_reference(x, *first).float()
    base = dict(launch_config(rows, m, n, num_sms(dev)), mma=True, gemv=False)
    cfgs = [base] + [dict(base, **v) for v in variants]
    times: list[list[float]] = [[] for _ in cfgs]
    for _ in range(3):
        for i, cfg in enumerate(cfgs):
            def call(w, cfg=cfg):
                return matmul_triton(x, *w, config=cfg, out_dtype=torch.float16)
            err = (call(first).float() - ref).abs().max().item() / ref.abs().max().item()
            assert i or err < 2e-3, (cfg, err)  # a variant that computes wrong sums is reported, not timed
            times[i].append(per_product_us(call, weights, dev) if err < 2e-3 else float("nan"))
    best = [min(t) for t in times]
    floor = launch_floors_us([nbytes] * count, dev) / count
    return (f"  {size:5} {name:8} {rows:4} {floor:6.1f} {best[0]:8.1f}  "
            + "  ".join(f"{b:6.1f} ({best[0] / b:4.2f}×)" if b == b else f"{'wrong':>14}" for b in best[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["3B", "15B", "650M"])
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 8])
    ap.add_argument("--configs", nargs="+", default=["mma_maxnreg=96", "mma_maxnreg=128"],
                    help='launch variants, each "key=value ..." over launch_config\'s keys')
    ap.add_argument("--design", nargs="*", default=[],
                    help='then the 3B design step with each variant ("": the default launch; early=1: the rotations '
                         'let the products after them start at once, early=2: and are dependent launches; paged=1: '
                         'the forks share the scaffold\'s blocks)')
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    variants = [parse_config(c) for c in args.configs]
    head = [f"# python tools/mma_launch_speed.py --sizes {' '.join(args.sizes)} --rows "
            f"{' '.join(map(str, args.rows))} --configs " + " ".join(f'"{c}"' for c in args.configs)
            + (" --design " + " ".join(f'"{c}"' for c in args.design) if args.design else ""),
            f"# {torch.cuda.get_device_name()}"]
    if args.sizes:
        head[-1] += (": µs a product over cold weights; the default register-fed launch, then each variant (its speed "
                     "against the default's): " + "; ".join(f"{i + 1} {c}" for i, c in enumerate(args.configs)))
        head.append("  size  product  rows  floor  default  " + "  ".join(f"{i + 1:<14}" for i in range(len(variants))))
    lines = stream((product_line(size, name, m, n, rows, variants, dev) for size in args.sizes
                    for name, _, m, n in products(size) for rows in args.rows), None)
    lines += stream(design_lines(args.design, dev) if args.design else (), None)
    if args.out:
        Path(args.out).write_text("\n".join(head + lines) + "\n")


#: a design-step variant's logits off the first variant's by more than this (of their largest) are wrong: a launch
#: variant changes no sum's order, so a right one is off by nothing
WRONG = 1e-3


def design_lines(texts: list[str], dev: torch.device):
    """The 3B design step (``bench.weights.design_step``: a 1,024-token scaffold forked 16 ways, 3+1-bit cache,
    captured, FastEsm's fused blocks) with fp16 weights, then with 4-bit weights under each variant (``early=1``:
    the rotations before the products let a dependent launch start at once, ``early=2``: and are dependent launches
    themselves, ``rotate.EARLY_DEPENDENTS``; ``paged=1``: the forks share the scaffold's blocks, the fp16 step timed
    so too; the other keys as ``matmul.LAUNCH_OVERRIDES``): ms a step (the best of three medians), each variant's
    logits against the first's of its kind of cache (off by more than :data:`WRONG`: marked wrong)."""
    import gc

    import triton.testing

    from esm_turbo.bench.weights import GROUP, design_step
    from esm_turbo.kernels.weights import matmul, rotate
    from esm_turbo.model.engine import TurboEsm
    from esm_turbo.model.sizes import esm2_config
    from esm_turbo.weights.codec import WeightQuantConfig
    from esm_turbo.weights.model import random_model

    def timed(engine, paged: bool) -> tuple[float, torch.Tensor]:
        session, step = design_step(engine, paged=paged)
        ms = min(triton.testing.do_bench(step.graph.replay, warmup=25, rep=100, return_mode="median")
                 for _ in range(3))
        step.graph.replay()
        logits = step.output.logits.float().clone()
        del session, step
        gc.collect()
        torch.cuda.empty_cache()
        return ms, logits

    def off(logits: torch.Tensor, ref: torch.Tensor) -> float:
        """logits' largest difference from ref, over ref's largest magnitude."""
        return ((logits - ref).abs().max() / ref.abs().max()).item()

    yield "# the 3B design step (16 forks of a 1,024-token scaffold, one token a row, captured): ms a step"
    modes = sorted({bool(parse_config(text).get("paged", 0)) for text in texts})
    fp16 = {}
    with torch.no_grad():
        engine = TurboEsm(random_model(esm2_config("3B"), dev, None))
        engine.fused_step = True
        for paged in modes:
            fp16[paged] = timed(engine, paged)[0]
            yield f"  fp16 weights{', paged forks' if paged else ''} {fp16[paged]:.3f} ms"
        del engine
        gc.collect()
        engine = TurboEsm(random_model(esm2_config("3B"), dev, WeightQuantConfig(bits=4, group=GROUP)))
        engine.fused_step = True
        first = {}
        for text in texts:
            keys = parse_config(text)
            paged = bool(keys.pop("paged", 0))
            rotate.EARLY_DEPENDENTS = keys.pop("early", 0)
            matmul.LAUNCH_OVERRIDES = keys
            ms, logits = timed(engine, paged)
            err = off(logits, first.setdefault(paged, logits))
            wrong = "" if err <= WRONG else " WRONG (its time says nothing)"
            # the same scaffold and token: the copies' logits, within the walks' rounding
            copies = f"; against the copies' first: {off(logits, first[False]):.1e}" if paged and False in first else ""
            yield (f"  4-bit, {text or 'the default launch'}: {ms:.3f} ms ({fp16[paged] / ms:.2f}× fp16); logits "
                   f"against the first's{' of paged forks' if paged else ''}: {err:.1e}{wrong}{copies}")
        rotate.EARLY_DEPENDENTS, matmul.LAUNCH_OVERRIDES = 0, {}


if __name__ == "__main__":
    main()
