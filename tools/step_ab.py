"""The decode steps the contracts must leave as fast as they were, timed in whichever tree esm_turbo imports from
(run it once per tree, on one GPU in one call: tools/gpu_contracts.sh's "ab" step): the decode suite's steps under
one 8 GiB budget (captured), the design loop's eager steps on the paged, contiguous and fp16 caches with its host
tier, and the 3B-shaped captured step with fp16 and 4-bit weights. Milliseconds a step, as JSON (written after
each part). A tree that profiles its steps leaves its process slower after: give each part a process of its own.
    usage: python tools/step_ab.py OUT.json [decode design weights]"""

import inspect
import json
import sys
from dataclasses import asdict
import time

import torch


def main(out: str, parts: list[str]) -> None:
    import esm_turbo
    dev = torch.device("cuda")
    res = dict(tree=esm_turbo.__file__, device=torch.cuda.get_device_name(dev))

    def save(name, value, t0):
        res[name] = value
        res[f"{name}_s"] = time.perf_counter() - t0
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        print(name, json.dumps(value), flush=True)

    if "decode" in parts:
        from esm_turbo.bench.decode import bench_decode
        t0 = time.perf_counter()
        more = "batches" in inspect.signature(bench_decode).parameters  # this tree also measures the step's floor
        if more:
            from esm_turbo.bench import DECODE_BATCHES
            rows = res["decode_rows"] = bench_decode(dev, batches=DECODE_BATCHES)
        else:
            rows = bench_decode(dev)
        save("decode", {r["cache"]: dict(batch=r["batch"], step_ms=r["step_ms"]) for r in rows
                        if r.get("at_budget", True)}, t0)
    if "design" in parts:
        from esm_turbo.bench.design import bench_design
        t0 = time.perf_counter()
        d = bench_design(dev)
        res["design_rows"] = asdict(d)
        save("design", {r["cache"]: dict(step_ms=r["step_ms"], round_ms=r["round_ms"]) for r in d.rows}
             | {"host tier tokens/s": d.offload["budget_tokens_per_s"],
                "all on device tokens/s": d.offload["in_device_tokens_per_s"]}, t0)
    if "weights" in parts:
        from esm_turbo.bench.weights import decode_step
        t0 = time.perf_counter()
        step = decode_step("3B", dev)
        save("weights", {k: step[k] for k in ("fp16_ms", "4-bit_ms", "free_ms")}, t0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["decode", "design", "weights"])
