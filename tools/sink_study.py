"""Study: the first tokens of every row (``<cls>`` and the next few, which trained ESM-2s attend to as sinks) kept
exact in fp16 beside the codes, at 3.0 and 4.0 bits all-in, on a trained testbed (PyTorch path, CPU).

The codec of each layer is wrapped so that its decoded K̂, V̂ carry the exact (fp16-rounded) keys and values of the
first ``sinks`` positions; the all-in bits add those tokens' fp16 bytes spread over the mean row length of the
evaluation set (a row of T tokens holds ``sinks`` exact tokens and T − ``sinks`` coded ones).

    python tools/sink_study.py ../shared/testbed/esm2_8M_trained --bits 3 4 --sinks 0 1 2 4 --out R.txt
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from esm_turbo import TurboEsm, calibrate, load_esm, read_fasta
from esm_turbo.model.evaluate import evaluate
from esm_turbo.model.recipe import recipe
from esm_turbo.quant.codec import KVCodec


class SinkCodec(KVCodec):
    """``inner``'s codes, with the first ``sinks`` positions (axis −2) decoded exactly (fp16-rounded): the exact
    tokens of the last ``encode`` are laid over its ``decode`` (the evaluation's teacher-forced pass decodes what it
    has just encoded)."""

    def __init__(self, inner: KVCodec, sinks: int):
        super().__init__(inner.key, inner.value, window=0)
        self.sinks = sinks
        self.exact: tuple[torch.Tensor, torch.Tensor] | None = None

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        self.exact = k[..., : self.sinks, :].half(), v[..., : self.sinks, :].half()
        return super().encode(k, v)

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().decode(parts)
        sk, sv = self.exact
        n = sk.shape[-2]
        k[..., :n, :], v[..., :n, :] = sk.float(), sv.float()
        return k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--bits", type=float, nargs="+", default=[3.0, 4.0], help="all-in bits of the codes (3 or 4)")
    ap.add_argument("--sinks", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--calibration", default="calibration_data/calibration.fasta")
    ap.add_argument("--evaluation", default="calibration_data/evaluation.fasta")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = load_esm(args.model)
    cal_records, eval_records = read_fasta(args.calibration)[0], read_fasta(args.evaluation)[0]
    mean_len = sum(len(r.sequence) + 1 for r in eval_records) / len(eval_records)  # <cls> + residues
    lines = [f"# python tools/sink_study.py {args.model} --bits {' '.join(map(str, args.bits))} "
             f"--sinks {' '.join(map(str, args.sinks))}",
             f"# {len(eval_records)} held-out sequences (mean {mean_len:.0f} tokens), half prefilled exactly, the rest "
             "decoded; PyTorch path, CPU",
             f"{'code bits':>9} {'sinks':>5} {'all-in':>7} {'mean cos':>9} {'worst seq':>9} {'worst tok':>9} "
             f"{'<0.95':>7}"]
    for bits in args.bits:
        t0 = time.time()
        cal = calibrate(model, cal_records, recipe("default", index_bits=int(bits) - 1), progress=False)
        engine = TurboEsm(model, cal)
        for sinks in args.sinks:
            codecs = [SinkCodec(c, sinks) if sinks else c for c in cal.codecs]
            report = evaluate(engine, eval_records, cache=lambda layer, h, d, cs=codecs: cs[layer], progress=False)
            o, m = report["overall"], report["memory"]
            exact = sinks * 16 / mean_len  # fp16 bits per value of the exact tokens, spread over a row
            all_in = m["bits_per_value"] * (1 - sinks / mean_len) + exact
            lines.append(f"{bits:>9.1f} {sinks:>5d} {all_in:>7.3f} {o['decode_cos_mean']:>9.4f} "
                         f"{o['decode_cos_worst_seq']:>9.4f} {o['decode_cos_min']:>9.4f} "
                         f"{o['decode_tail_share']:>7.2%}")
            print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
