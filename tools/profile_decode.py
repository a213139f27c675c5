"""Where a captured 650M-shaped decode step's GPU time goes, kernel by kernel (random weights, synthetic 1,024-token
contexts, FastEsm's fused blocks as the engine takes them on a GPU): for each step, its time against its floor (one
read of what the step must read at a pure read's rate, ``esm_turbo.bench.step``), the GPU's busy time and span in
one profiled replay, the least its launches take as pure reads of their bytes (``bench.step.launch_bytes``: the
ceiling of a step of this many launches; then the same with its products as cuBLAS runs them, fp16 and FP8, over
cold weights of the step's shapes: the ceiling with the products as the GPU's GEMM library runs them), and the
kernels that take it, by name (total, launches, µs a launch).

    python tools/profile_decode.py --out results/gpu/step_kernels_h100.txt
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from esm_turbo.bench.step import launch_bytes, read_rate_gbs, step_report
from esm_turbo.bench.synthetic import layer_codec, stand_in_model, synthetic_session
from esm_turbo.bench.timing import launch_floors_us, time_eager
from esm_turbo.model.alphabet import alphabet
from esm_turbo.model.engine import TurboEsm
from study_common import stream

#: (cache, rows, cached tokens a row): bench decode's steps at its 8 GiB budget, and a smaller compressed one
STEPS = (("compressed", 195, 1024), ("fp16", 48, 1024), ("compressed", 64, 1024))


@torch.no_grad()
def profile_steps(steps=STEPS, top: int = 12):
    dev = torch.device("cuda")
    rate = read_rate_gbs(dev)
    yield f"{torch.cuda.get_device_name()}: a pure read at {rate:.0f} GB/s"
    engine = TurboEsm(stand_in_model("650M", dev, torch.float16))
    engine.fused_step = True
    token = alphabet().get_idx("A")
    for cache, batch, context in steps:
        session = synthetic_session(engine, layer_codec if cache == "compressed" else "fp16", batch, context, 8)
        step = session.capture_step(torch.full((batch, 1), token, device=dev))
        ms = time_eager(step.replay, dev, reps=30) * 1e3
        rep = step_report(session, ms, rate)
        step.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step.replay()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        total, count = collections.defaultdict(float), collections.Counter()
        for e in events:
            total[e.name] += e.device_time_total
            count[e.name] += 1
        spans = sorted((e.time_range.start, e.time_range.end) for e in events)
        busy = sum(b - a for a, b in spans)
        sizes = launch_bytes(session)
        by_launch = launch_floors_us(sizes, dev) / 1e3
        yield (f"\n{cache} cache, {batch} rows x {context}: {ms:.3f} ms a step, floor {rep['floor_ms']:.3f} ms "
               f"({rep['of_floor']:.0%}); one replay profiled: {len(events)} kernels, busy {busy / 1e3:.3f} ms, "
               f"span {(spans[-1][1] - spans[0][0]) / 1e3:.3f} ms\n  its {len(sizes)} launches as pure reads of their "
               f"bytes: {by_launch:.3f} ms (at best {rep['floor_ms'] / by_launch:.0%} of the floor for a step of these "
               f"launches; this one takes {ms / by_launch:.2f}x that)")
        for kind, what in (("fp16", "cuBLAS's fp16 products"), ("fp8", "row-scaled FP8 products (torch._scaled_mm)")):
            with_products = launch_floors_us(launch_bytes(session, products=kind), dev) / 1e3
            yield (f"  the same, its products as {what} of the step's shapes over cold weights: "
                   f"{with_products:.3f} ms (at best {rep['floor_ms'] / with_products:.0%} of the floor; this step "
                   f"takes {ms / with_products:.2f}x that)")
        for name, t in sorted(total.items(), key=lambda x: -x[1])[:top]:
            yield f"  {t / 1e3:8.3f} ms  x{count[name]:4}  {t / count[name]:7.1f} us  {name[:90]}"
        del session, step
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--prep", action="store_true",
                    help="the queries rotated by a prep launch, as before the walks gathered them "
                         "(launch_config's gather_query off)")
    ap.add_argument("--ffn-rows", type=int, default=None,
                    help="the most rows a block's feed-forward half runs in one launch at (kernels.ffn_step's "
                         "FFN_STEP_ROWS; 0: cuBLAS products with their passes)")
    ap.add_argument("--split-rows", type=int, default=None,
                    help="the most rows a block's plain products run split along K at, their epilogues folded "
                         "(kernels.gemm_split's SPLIT_ROWS; 0: cuBLAS)")
    args = ap.parse_args()
    if args.split_rows is not None:
        import esm_turbo.kernels.gemm_split as gemm_split
        gemm_split.SPLIT_ROWS = args.split_rows
    if args.ffn_rows is not None:
        import esm_turbo.kernels.ffn_step as ffn
        ffn.FFN_STEP_ROWS = args.ffn_rows
    if args.prep:
        import esm_turbo.kernels.decode.plan as plan
        plan.GATHER_QUERY = False
    stream(profile_steps(), args.out)


if __name__ == "__main__":
    main()
