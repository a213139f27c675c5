"""Study: a few values kept exact in fp16 beside the codes, at 3.0 and 4.0 bits all-in, on a trained testbed (PyTorch
path, CPU). Two choices of which:

- ``--sinks N``: the first N tokens of every row (``<cls>`` and the next few, which trained models attend to as
  sinks), every channel; their fp16 bytes are spread over the mean row length of the evaluation set;
- ``--sparse F``: the fraction F of each layer's values whose coding error is largest (dense-and-sparse, the
  outliers picked by the error they would leave), each stored as fp16 and its channel index (log2 d bits), plus a
  16-bit count per token and layer for the side list.

The codec of each layer is wrapped so that its decoded K̂, V̂ carry those exact values (fp16-rounded); the all-in bits
add their bytes.

    python tools/exact_study.py ../shared/testbed/esm2_8M_trained --bits 3 4 --sinks 0 1 2 4 --out R.txt
    python tools/exact_study.py ../shared/testbed/esm2_8M_trained --bits 3 --sinks 0 --sparse 0.005 0.01 0.02 --out R
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from esm_turbo import TurboEsm, calibrate
from esm_turbo.experiments.methods import collect_kv
from esm_turbo.model.recipe import recipe
from esm_turbo.quant.codec import KVCodec
from study_common import data_flags, measure, parse, stream


class ExactCodec(KVCodec):
    """``inner``'s codes, with some values decoded exactly (fp16-rounded): the first ``sinks`` positions (axis −2), or
    the fraction ``sparse`` of values with the largest coding error. The exact values of the last ``encode`` are laid
    over its ``decode`` (the evaluation's teacher-forced pass decodes what it has just encoded). With ``cuts`` (a
    threshold per kind, fitted on the calibration set) a value is kept where its error passes its kind's cut, each
    error first divided by its channel's spread where ``scales`` [H, 1, d] per kind are given; ``also`` adds a second
    (cuts, scales) rule, and a value passing either is kept. With ``slots`` = k instead, each token keeps its k values
    of each kind (over all heads and channels) whose error, over ``scales`` where given, is largest: a side list of
    fixed size, k slots a token (in the values' own domain; the library's slots, in the codes' affine domain, are
    ``KVCodec(..., slots=k)``, :mod:`esm_turbo.quant.slots`)."""

    def __init__(self, inner: KVCodec, sinks: int = 0, sparse: float = 0.0, cuts: tuple[float, float] | None = None,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None, also: tuple | None = None, slots: int = 0):
        super().__init__(inner.key, inner.value, window=0)
        # not KVCodec.slots: the library's own slots would add parts to the cache
        self.sinks, self.sparse, self.keep_slots, self.scales = sinks, sparse, slots, scales
        self.rules = [r for r in ((cuts, scales), also) if r is not None and r[0] is not None]
        self.exact: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kept = [0, 0]  # values kept exact, values seen (with ``cuts``)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        self.exact = k.half(), v.half()
        return super().encode(k, v)

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        decoded = super().decode(parts)
        out = []
        for kind, (x_hat, x) in enumerate(zip(decoded, self.exact)):
            x = x.float()
            if self.sinks:
                x_hat[..., : self.sinks, :] = x[..., : self.sinks, :]
            if self.keep_slots:
                x_hat = torch.where(_top_per_token((x - x_hat).abs() / (1.0 if self.scales is None
                                                                       else self.scales[kind]), self.keep_slots),
                                    x, x_hat)
            if self.sparse:
                err = (x - x_hat).abs()
                if self.rules:  # thresholds fitted on the calibration set, as a streaming kernel would
                    keep = torch.zeros_like(err, dtype=torch.bool)
                    for cuts, scales in self.rules:
                        keep |= (err if scales is None else err / scales[kind]) > cuts[kind]
                    self.kept[0] += int(keep.sum())
                    self.kept[1] += err.numel()
                else:  # this tensor's own top fraction
                    n = max(1, int(self.sparse * err.numel()))
                    keep = err >= err.flatten().kthvalue(err.numel() - n + 1).values
                x_hat = torch.where(keep, x, x_hat)
            out.append(x_hat)
        return out[0], out[1]


def _top_per_token(score: torch.Tensor, k: int) -> torch.Tensor:
    """score [..., H, N, d] → bool mask of each token's k largest over its H·d values."""
    s = score.transpose(-3, -2)  # [..., N, H, d]
    flat = s.reshape(*s.shape[:-2], -1)
    idx = flat.topk(min(k, flat.shape[-1]), dim=-1).indices
    keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
    return keep.reshape(s.shape).transpose(-3, -2)


def _coding_errors(model, codecs: list[KVCodec], records, relative: bool = False) -> list[tuple]:
    """Per layer ((k errors, v errors), (k spreads, v spreads)): the absolute coding errors of keys and of values over
    the prefill of ``records`` (a sample of at most 2^24 each, for the quantile), with ``relative`` each over its
    channel's spread, and those spreads (std over the tokens, [H, 1, d]; None without ``relative``)."""
    errors = []
    for codec, (k, v) in zip(codecs, collect_kv(model, records, max_tokens=2**30)):  # [H, N, d] each
        k_hat, v_hat = codec.decode(codec.encode(k, v))
        spreads = tuple(x.std(dim=1, keepdim=True).clamp_min(1e-6) for x in (k, v)) if relative else (1.0, 1.0)
        errs = tuple(((x - x_hat).abs() / s).flatten()[: 2**24]
                     for x, x_hat, s in ((k, k_hat, spreads[0]), (v, v_hat, spreads[1])))
        errors.append((errs, spreads if relative else None))
    return errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=float, nargs="+", default=[3.0, 4.0], help="all-in bits of the codes (3 or 4)")
    ap.add_argument("--sinks", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--sparse", type=float, nargs="+", default=[], help="fractions of values kept exact (with 0 sinks)")
    ap.add_argument("--fitted", action="store_true",
                    help="--sparse: keep the values whose error passes a per-layer threshold fitted on the "
                         "calibration set at that fraction (what a streaming kernel can do), not each tensor's top "
                         "fraction; the kept share measured on the evaluation set counts in the bits")
    args, model, cal_records, eval_records = parse(ap)
    mean_len = sum(len(r.sequence) + 1 for r in eval_records) / len(eval_records)  # <cls> + residues
    command = f"python tools/exact_study.py {args.model} --bits {' '.join(map(str, args.bits))} --sinks " + " ".join(
        map(str, args.sinks)) + (f" --sparse {' '.join(map(str, args.sparse))}" if args.sparse else "") + (
        " --fitted" if args.fitted else "") + data_flags(args)
    lines = [f"# {command}",
             f"# {len(eval_records)} held-out sequences (mean {mean_len:.0f} tokens), half prefilled exactly, the rest "
             "decoded; PyTorch path, CPU",
             f"{'code bits':>9} {'sinks':>5}" + (f" {'sparse':>6}" if args.sparse else "")
             + f" {'all-in':>7} {'mean cos':>9} {'worst seq':>9} {'worst tok':>9} {'<0.95':>7}"]
    for bits in args.bits:
        t0 = time.time()
        cal = calibrate(model, cal_records, recipe("default", index_bits=int(bits) - 1), progress=False)
        engine = TurboEsm(model, cal)
        heads, dim = cal.codecs[0].key.heads, cal.codecs[0].key.dim
        errors = _coding_errors(model, cal.codecs, cal_records[:32]) if args.fitted and args.sparse else None
        for sinks, sparse in [(n, 0.0) for n in args.sinks] + [(0, f) for f in args.sparse]:
            cuts = ([tuple(float(e.quantile(1 - sparse)) for e in layer) for layer, _ in errors] if errors and sparse
                    else [None] * len(cal.codecs))
            codecs = [ExactCodec(c, sinks, sparse, cut) if sinks or sparse else c for c, cut in zip(cal.codecs, cuts)]
            r = measure(engine, eval_records, codecs)
            exact = sinks * 16 / mean_len  # fp16 bits per value of the exact tokens, spread over a row
            if errors and sparse:  # the share the fitted thresholds kept on the evaluation set
                sparse = sum(c.kept[0] for c in codecs) / max(1, sum(c.kept[1] for c in codecs))
            side = sparse * (16 + math.log2(dim)) + 16 / (heads * dim) if sparse else 0.0  # value, index, count
            all_in = r["bits"] * (1 - sinks / mean_len) + exact + side
            lines.append(f"{bits:>9.1f} {sinks:>5d}" + (f" {sparse:>6.4f}" if args.sparse else "")
                         + f" {all_in:>7.3f} {r['mean']:>9.4f} {r['worst']:>9.4f} {r['token']:>9.4f} {r['tail']:>7.2%}")
            print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
    stream(lines, args.out)


if __name__ == "__main__":
    main()
