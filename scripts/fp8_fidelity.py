"""Fidelity of FastEsm in fp16, bf16 and FP8 against fp32 on the trained testbeds, with and without planted outlier
channels in the matrix products' inputs.

For each testbed folder: the model as trained, and the same model with outliers planted
(:func:`esm_turbo.testing.plant_product_outliers`: 4 channels of every LayerNorm output and of the attention output
at 20× the weights' scale in the first block rising to 100× in the last; the fp32 model computes what it did).
Measured against that model's own fp32 forward:

* masked-LM perplexity on the held-out corpus windows of ``scripts/weights_fidelity.py`` (15% of residues masked,
  seeded; the same positions for every dtype);
* the cosine of each sequence's mean embedding (last layer), worst sequence;
* the cosine of every residue's last-layer state, worst token (and the mean);

over the held-out windows (<= 128 residues) and the real proteins of ``--tsv`` at their full lengths (cut at 1,022).
The table also gives how far the largest channel of the products' inputs stands above the median channel (RMS over
tokens, LayerNorm outputs, worst layer). FP8 runs in its PyTorch reference here (:mod:`esm_turbo.embed.fp8`: the
numbers a GPU's FP8 products give, summed in another order); fp16 and bf16 in FastEsm's reference path.

    python scripts/fp8_fidelity.py ../shared/testbed/esm2_8M_trained ../shared/testbed/esm2_d64_trained \\
        --out results/fp8/fidelity_cpu.txt
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from weights_fidelity import held_out

from esm_turbo.embed.fast_esm import FastEsm, PackedBatch
from esm_turbo.model.alphabet import alphabet, encode_packed
from esm_turbo.testing import plant_product_outliers

DTYPES = ("fp16", "bf16", "fp8")
TOKENS_PER_BATCH = 8192


def batches(seqs: list[str]) -> list[list[int]]:
    out, cur, used = [], [], 0
    for i, s in enumerate(seqs):
        if cur and used + len(s) + 2 > TOKENS_PER_BATCH:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += len(s) + 2
    return out + ([cur] if cur else [])


@torch.no_grad()
def states(model: FastEsm, seqs: list[str]) -> list[torch.Tensor]:
    """Each sequence's last-layer residue states [L_i, D] float32."""
    out = []
    for idx in batches(seqs):
        part = [seqs[i] for i in idx]
        batch = PackedBatch.from_sequences(part)
        h = model(batch)[model.num_layers].float()
        starts = batch.cu_seqlens.tolist()
        out += [h[a + 1: b - 1] for a, b in zip(starts, starts[1:])]
    return out


@torch.no_grad()
def perplexity(model: FastEsm, seqs: list[str], masks: list[torch.Tensor]) -> float:
    """exp(mean cross-entropy) over the masked residues (``masks[i]``: [L_i] bool)."""
    total, count = 0.0, 0
    for idx in batches(seqs):
        ids, positions, cu = encode_packed([seqs[i] for i in idx])
        ids = torch.as_tensor(ids).clone()
        target = ids.clone()
        where = torch.zeros(len(ids), dtype=torch.bool)
        for j, i in enumerate(idx):
            where[int(cu[j]) + 1: int(cu[j + 1]) - 1] = masks[i]
        ids[where] = alphabet().mask_idx
        batch = PackedBatch.from_arrays(ids, positions, cu)
        h = model(batch)[model.num_layers]
        logits = model.logits(h[where]).float()
        total += float(F.cross_entropy(logits, target[where], reduction="sum"))
        count += int(where.sum())
    return math.exp(total / count)


@torch.no_grad()
def outlier_ratio(model: FastEsm, seqs: list[str]) -> float:
    """max over layers of (largest channel RMS / median channel RMS) of the LayerNorm outputs the products take."""
    batch = PackedBatch.from_sequences(seqs[:64])
    hidden = model(batch, list(range(model.num_layers + 1)))
    worst = 0.0
    for i, b in enumerate(model.blocks):
        x = F.layer_norm(hidden[i].float(), (hidden[i].shape[1],), b.attn_norm.weight.float(),
                         b.attn_norm.bias.float(), model.eps)
        rms = x.pow(2).mean(0).sqrt()
        worst = max(worst, float(rms.max() / rms.median()))
    return worst


def variant(folder: Path, dtype: str, planted: bool) -> FastEsm:
    """The testbed in ``dtype``: fp32, fp16, bf16, fp8, or ``fp8:K,...`` (FP8 with blocks K, ... kept in bf16,
    :meth:`FastEsm.to_fp8`'s ``keep``)."""
    model = FastEsm.from_pretrained(folder, dtype=torch.float32, device="cpu")
    if planted:
        plant_product_outliers(model)
    if dtype.startswith("fp8"):
        keep = tuple(int(k) for k in dtype.partition(":")[2].split(",") if k)
        return model.to_fp8(keep=keep)
    if dtype != "fp32":
        return model.to_dtype({"fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("testbeds", type=Path, nargs="+")
    ap.add_argument("--sequences", type=int, default=500, help="held-out corpus windows")
    ap.add_argument("--tsv", type=Path, default=Path(__file__).resolve().parents[2] / "shared/protein_data/"
                    "real_proteins.tsv", help="real proteins at full length (id, sequence columns)")
    ap.add_argument("--real", type=int, default=485, help="how many of --tsv's proteins")
    ap.add_argument("--corpus", type=Path, default=None, help="the corpus.fasta.gz the testbeds were trained on "
                    "(default: beside each testbed)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES),
                    help="rows beside fp32: fp16, bf16, fp8, fp8:K,... (FP8, blocks K, ... in bf16; 0 the first)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    real = []
    if args.tsv.is_file():
        with open(args.tsv) as fh:
            real = [r["sequence"].upper()[:1022] for r in csv.DictReader(fh, delimiter="\t")][: args.real]
    corpus = f" --corpus {args.corpus}" if args.corpus else ""
    corpus += f" --dtypes {' '.join(args.dtypes)}" if args.dtypes != list(DTYPES) else ""
    lines = [f"# python scripts/fp8_fidelity.py {' '.join(str(t) for t in args.testbeds)}{corpus} --sequences "
             f"{args.sequences} --real {args.real} (CPU, torch {torch.__version__})",
             f"# per testbed: {args.sequences} held-out corpus windows (perplexity: 15% of residues masked) + "
             f"{len(real)} real proteins at full length; cosines against the same model in fp32",
             "testbed            outliers  max/median | dtype | perplexity vs fp32 | mean-emb cos min | "
             "token cos min    mean | seconds"]
    print("\n".join(lines), flush=True)
    for folder in args.testbeds:
        window = held_out(folder, args.sequences, args.corpus)
        gen = torch.Generator().manual_seed(0)
        masks = [torch.rand(len(s), generator=gen) < 0.15 for s in window]
        seqs = window + real
        for planted in (False, True):
            ref = variant(folder, "fp32", planted)
            ratio = outlier_ratio(ref, seqs)
            ppl0 = perplexity(ref, window, masks)
            h0 = states(ref, seqs)
            lines.append(f"{folder.name:18} {'planted' if planted else 'none':>8} {ratio:11.1f} | fp32  | "
                         f"{ppl0:10.3f}         |                  |                       |")
            print(lines[-1], flush=True)
            for dtype in args.dtypes:
                start = time.perf_counter()
                model = variant(folder, dtype, planted)
                ppl = perplexity(model, window, masks)
                h = states(model, seqs)
                seconds = time.perf_counter() - start
                mean_cos = torch.stack([F.cosine_similarity(a.mean(0), b.mean(0), dim=0) for a, b in zip(h, h0)])
                tok = torch.cat([F.cosine_similarity(a, b, dim=-1) for a, b in zip(h, h0)])
                lines.append(f"{folder.name:18} {'planted' if planted else 'none':>8} {ratio:11.1f} | {dtype:5} | "
                             f"{ppl:10.3f} {ppl / ppl0 - 1:+7.2%} | {float(mean_cos.min()):16.5f} | "
                             f"{float(tok.min()):13.4f} {float(tok.mean()):7.5f} | {seconds:7.1f}")
                print(lines[-1], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
