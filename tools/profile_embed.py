"""Where the time of one embed batch goes on the GPU: FastEsm's forward vs the stock transformers model
under torch.compile, one batch of real lengths (calibration_data) at the default token budget.

usage: python tools/profile_embed.py [--size 650M] [--tokens 16384]
Prints wall ms per batch, the GPU's busy ms, and the kernels taking the most GPU time for each.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from esm_turbo.bench.baselines.user_embed import batches as sorted_batches
from esm_turbo.embed.benchmark import hf_loop, random_masked_lm
from esm_turbo.embed.fast_esm import FastEsm, PackedBatch
from esm_turbo.bench import EMBED_FASTA
from esm_turbo.fasta import read_fastas

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="650M")
ap.add_argument("--tokens", type=int, default=16384)
ap.add_argument("--only", choices=["fast_esm", "hf_compiled"], default=None)
args = ap.parse_args()
dev = torch.device("cuda")
seqs = sorted((r.sequence for r in read_fastas(EMBED_FASTA)), key=len, reverse=True)
picked, used = [], 0
for s in seqs[len(seqs) // 4:]:  # a batch from the middle of the length distribution
    if used + len(s) + 2 > args.tokens:
        break
    picked.append(s)
    used += len(s) + 2
net = random_masked_lm(args.size, dev, torch.float16)
fast = FastEsm.from_hf(net)
batch = PackedBatch.from_sequences(picked, dev)
compiled = torch.compile(net.esm)
hf_batches = sorted_batches(picked, args.tokens)
runs = {"fast_esm": lambda: fast(batch, [fast.num_layers]),
        "hf_compiled": lambda: hf_loop(compiled, picked, hf_batches, dev)}
for name, fn in runs.items():
    if args.only and name != args.only:
        continue
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5 * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e3
    print(f"\n== {name}: {len(picked)} sequences, {used} tokens; wall {wall:.2f} ms per batch, GPU busy {busy:.2f} ms "
          f"({used / wall * 1e3:.0f} tokens/s)")
    print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=70))
