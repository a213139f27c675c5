"""Where a host-tier step's time goes: ``esm-turbo bench design``'s host tier (650M-shaped, random weights; 256
distinct 1,024-token rows on the paged compressed cache, a quarter of them stepped at a time in turn, eagerly, under a
device budget of a quarter of the cache), with the link's copies on streams of their own (``host_link.COPY_STREAMS``)
and all on the current stream, in interleaved rounds on one session: ms a step against the link's ceiling (the bytes a
step brings in at the measured host-to-device rate) and the same steps with every block on the device; then one turn
of steps of each profiled, per step: the copies each way, the staging scatters and gathers, the step's other kernels,
the time at least one of them ran, and the wall time.

    python tools/host_tier_profile.py --out results/gpu/host_tier_h100.txt
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from esm_turbo import host_link
from esm_turbo.bench.step import breakdown, kernel_times
from esm_turbo.bench.synthetic import layer_codec, random_protein, stand_in_model
from esm_turbo.bench.timing import link_h2d_gbs
from esm_turbo.model.alphabet import alphabet
from esm_turbo.model.engine import TurboEsm
from study_common import stream

ROUNDS, PER_ROUND = 3, 8


def link_rates(host: torch.Tensor, device: torch.device, rows=(1, 4, 16, 64, None)) -> list[tuple[int, float]]:
    """(bytes a copy, GB/s) of host-to-device copies of the pinned chunk ``host`` [n, row_bytes] cut in copies of
    ``rows`` rows each (None: the whole chunk in one), queued back to back on one stream, the fastest of five."""
    dev = torch.empty_like(host, device=device)
    out = []
    for r in rows:
        r = r or host.shape[0]
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(0, host.shape[0], r):
                dev[i:i + r].copy_(host[i:i + r], non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.append((r * host.shape[1], host.numel() / min(times) / 1e9))
    return out


def _kind(name: str) -> str:
    if "HtoD" in name:
        return "to device"
    if "DtoH" in name:
        return "to host"
    if "_blocks_kernel" in name:
        return "staging"
    return "step"


def numa_line(device: torch.device) -> str:
    """Where the host memory sits against the GPU (pinned copies run slower from a NUMA node away from it): the
    nodes, the GPU's node (from its PCI address in sysfs) and the CPUs this process may run on."""
    from pathlib import Path
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    try:
        props = torch.cuda.get_device_properties(device)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        gpu_node = Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text().strip()
    except (AttributeError, OSError, RuntimeError):
        gpu_node = "unknown"
    cpus = sorted(os.sched_getaffinity(0))
    return (f"host: {len(nodes)} NUMA node(s); the GPU's node {gpu_node}; this process on CPUs {cpus[0]}-{cpus[-1]} "
            f"({len(cpus)})")


@torch.no_grad()
def measure(rows: int = 256, prefix: int = 1024, block_size: int = 64):
    dev = torch.device("cuda")
    engine = TurboEsm(stand_in_model("650M", dev, torch.float16))
    quarter = rows // 4
    groups = [list(range(q * quarter, (q + 1) * quarter)) for q in range(4)]
    tokens = torch.full((quarter, 1), alphabet().get_idx("A"), device=dev)
    sequences = [random_protein(prefix - 1, seed) for seed in range(rows)]

    def session(budget):
        s = engine.session(layer_codec, capacity=prefix + 2 * ROUNDS * PER_ROUND + 64, paged=True,
                           block_size=block_size, gpu_budget_gib=budget)
        s.start(sequences)
        return s

    inside = session(None)
    rep = inside.memory_report()
    budget = (rep.used_bytes / 4 + 2 * quarter * rep.bytes_per_token * block_size) / 2**30
    over = session(budget)
    pool = over.cache.pool
    link = link_h2d_gbs(dev)
    counter = [0]

    def steps(s, n, streams=True):
        host_link.COPY_STREAMS = streams
        for _ in range(n):
            s.step(tokens, rows=groups[counter[0] % 4])
            counter[0] += 1

    modes = {"every block on the device": (inside, True), "over budget, copies on their own streams": (over, True),
             "over budget, copies on the current stream": (over, False)}
    for s, streams in modes.values():
        steps(s, 4, streams)
    times = {name: [] for name in modes}
    moved_in = 0
    runs: list[int] = []
    plain_runs = host_link.host_runs

    def counted_runs(host_slots, per_chunk):
        found = plain_runs(host_slots, per_chunk)
        runs.extend(n for _, _, n in found)
        return found

    host_link.host_runs = counted_runs
    for _ in range(ROUNDS):
        for name, (s, streams) in modes.items():
            before = pool.moved["in"]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps(s, PER_ROUND, streams)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / PER_ROUND * 1e3)
            if s is over:
                moved_in = max(moved_in, (pool.moved["in"] - before) / PER_ROUND)
    host_link.host_runs = plain_runs
    bytes_in = moved_in * pool.layout.row_bytes
    ceiling = bytes_in / (link * 1e9) * 1e3
    yield (f"{torch.cuda.get_device_name()}: {rows} distinct {prefix}-token rows, {quarter} stepped at a time, a "
           f"{budget * 2**10:.0f} MiB device budget; each budgeted step brings {bytes_in / 2**20:.0f} MiB in, "
           f"{ceiling:.1f} ms at the link's {link:.1f} GB/s (pinned, host to device)")
    yield "  " + numa_line(dev)
    for name, ms in times.items():
        best = min(ms)
        share = f", {ceiling / best:.0%} of the link's ceiling" if "budget" in name else ""
        yield (f"  {name:<44} {best:6.1f} ms a step ({quarter / best * 1e3:.0f} tokens/s{share}); rounds "
               + ", ".join(f"{t:.1f}" for t in ms))
    copies, n = len(runs) / (2 * ROUNDS * PER_ROUND), max(len(runs), 1)
    yield (f"  the budgeted steps' copies over the link (both ways): {copies:.0f} a step, {sum(runs) / n:.1f} blocks "
           f"of {pool.layout.row_bytes / 2**20:.2f} MiB a copy on average, {sum(r == 1 for r in runs) / n:.0%} of "
           f"them one block")
    yield "  host to device from the host tier's own pinned chunk, cut in copies of: " + ", ".join(
        f"{b / 2**20:.1f} MiB {gbs:.1f} GB/s" for b, gbs in link_rates(pool.host[0], dev))
    for name, (s, streams) in list(modes.items())[1:]:
        steps(s, 4, streams)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps(s, 4, streams)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 4 * 1e3
        kernels = kernel_times(prof.events())
        total: dict[str, float] = {}
        for kname, a, b in kernels:
            total[_kind(kname)] = total.get(_kind(kname), 0.0) + (b - a) / 1e3
        spent = breakdown(kernels)
        yield (f"  {name}, profiled (ms a step): " + ", ".join(f"{k} {v / 4:.1f}" for k, v in sorted(total.items()))
               + f"; busy {spent['busy_ms'] / 4:.1f}, span {spent['span_ms'] / 4:.1f}, wall {wall:.1f}")
    host_link.COPY_STREAMS = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stream(measure(), args.out, "# python tools/host_tier_profile.py\n")


if __name__ == "__main__":
    main()
