"""A decode step's rows cut into groups, each group's blocks on a CUDA stream of its own, captured as one CUDA graph:
whether one group's memory-bound attention overlapping another's launch-bound products beats one stream (650M-shaped,
compressed contiguous cache, FastEsm's fused blocks; random weights, synthetic caches, as tools/step_paths.py).

    python tools/step_groups.py [--groups 1 2 3] [--out F.json]

Per step and group count: the captured step's ms, its floor and the share reached (esm_turbo.bench.step), the
logits' largest difference from one group's, and one replay's GPU time by kernel kind with the busy time (the union
of kernel intervals: less than their sum where groups overlap).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from esm_turbo import ops
from esm_turbo.bench.step import profile_step, read_rate_gbs, step_report
from esm_turbo.bench.synthetic import layer_codec, stand_in_model, synthetic_session
from esm_turbo.bench.timing import time_eager
from esm_turbo.model import engine as engine_module
from esm_turbo.model.alphabet import alphabet
from esm_turbo.model.engine import TurboEsm
from esm_turbo.ops.compressed import attend_compressed

STEPS = ((195, 1024), (256, 1088), (64, 1024))
_PLAIN = engine_module.fused_decode
_STREAMS: dict[int, list] = {}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def grouped(groups: int):
    """fused_step.fused_decode with the rows in ``groups`` groups, each group's blocks on its own stream (a
    contiguous compressed cache on the fused ops; anything else as one group)."""

    def fused_decode(fast, hidden: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        cache = ctx.cache
        batch, seq, dim = hidden.shape
        if groups == 1 or cache.pages()[0] is not None or not all(cache.fused) or batch < groups:
            return _PLAIN(fast, hidden, positions, ctx)
        heads = fast.config.num_attention_heads
        cuts = [batch * g // groups for g in range(groups + 1)]
        main = torch.cuda.current_stream()
        streams = _STREAMS.setdefault(groups, [torch.cuda.Stream() for _ in range(groups)])
        for s in streams:
            s.wait_stream(main)

        def attend_rows(r0: int, r1: int):
            def attend(q, k, v, layer: int):
                q, k, v = (t.view(r1 - r0, seq, heads, -1).transpose(1, 2) for t in (q, k, v))
                parts = {name: p[r0:r1] for name, p in cache.parts[layer].items()}
                lengths = cache.lengths[r0:r1]
                if ctx.commit:
                    ops.write_compressed(cache.codecs[layer], parts, k, v, lengths)
                out = attend_compressed(cache.codecs[layer], parts, lengths, q, k, v, ctx.new_valid[r0:r1], None, 0)
                return out.transpose(1, 2).reshape((r1 - r0) * seq, dim)
            return attend

        state = []
        for g in range(groups):
            r0, r1 = cuts[g], cuts[g + 1]
            with torch.cuda.stream(streams[g]):
                cos, sin = fast.rotary_tables(positions[r0:r1].reshape(-1))
                h, x = fast.first_norm(hidden[r0:r1].reshape(-1, dim))
                state.append([h, x, cos, sin, attend_rows(r0, r1)])
        for i in range(1, fast.num_layers + 1):
            for g in range(groups):
                with torch.cuda.stream(streams[g]):
                    h, x, cos, sin, attend = state[g]
                    state[g][0], state[g][1] = fast.fused_block(i, h, x, cos, sin, attend)
        for s in streams:
            main.wait_stream(s)
        return torch.cat([st[1] for st in state]).view(batch, seq, dim)

    return fused_decode


@torch.no_grad()
def rows_for(groups_list: list[int], rate: float) -> list[dict]:
    dev = torch.device("cuda")
    engine = TurboEsm(stand_in_model("650M", dev, torch.float16))
    engine.fused_step = True
    token = alphabet().get_idx("A")
    rows = []
    for batch, context in STEPS:
        logits = {}
        for groups in groups_list:
            engine_module.fused_decode = grouped(groups)
            session = synthetic_session(engine, layer_codec, batch, context, 8)
            step = session.capture_step(torch.full((batch, 1), token, device=dev))
            ms = min(time_eager(step.replay, dev, reps=30) * 1e3 for _ in range(3))
            logits[groups] = step.replay().logits.float().cpu()
            row = dict(cache="compressed", rows=batch, context=context, groups=groups, step_ms=ms,
                       **step_report(session, ms, rate))
            row["max_logit_diff_vs_one_group"] = (logits[groups] - logits[groups_list[0]]).abs().max().item()
            parts = profile_step(step.replay, dev)
            row.update(launches=parts["launches"], kinds_ms=parts["kinds_ms"], busy_ms=parts["busy_ms"],
                       span_ms=parts["span_ms"])
            rows.append(row)
            _log(f"{batch}x{context} groups {groups}: {ms:.3f} ms ({row['of_floor']:.0%} of {row['floor_ms']:.2f}), "
                 f"kernels {sum(parts['kinds_ms'].values()):.2f} ms, busy {parts['busy_ms']:.2f}, "
                 f"logit diff {row['max_logit_diff_vs_one_group']:.2e}")
            del session, step
            torch.cuda.empty_cache()
    engine_module.fused_decode = _PLAIN
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rate = read_rate_gbs(torch.device("cuda"))
    rows = rows_for(args.groups, rate)
    print(f"decode step with its rows in groups on streams of their own, 650M-shaped, captured "
          f"({torch.cuda.get_device_name()}; floor at a pure read's {rate:.0f} GB/s)")
    print("  rows  context  groups  step ms  floor ms  reached  kernels ms  busy ms  logit diff")
    for r in rows:
        print(f"  {r['rows']:4}  {r['context']:7}  {r['groups']:6}  {r['step_ms']:7.2f}  {r['floor_ms']:8.2f}  "
              f"{r['of_floor']:6.0%}  {sum(r['kinds_ms'].values()):10.2f}  {r['busy_ms']:7.2f}  "
              f"{r['max_logit_diff_vs_one_group']:.1e}")
    if args.out:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rate_gbs=rate, rows=rows), indent=1))


if __name__ == "__main__":
    main()
