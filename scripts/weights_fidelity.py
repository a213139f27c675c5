"""Fidelity of quantized weights on a testbed model: masked-LM perplexity and per-sequence mean embeddings against the
model's own weights, on sequences it never saw in training.

The testbeds (``../shared/testbed``, ``testbeds/``; ESM-2 or ESM C) were trained on one half of the corpus, split by
crc32 of the sequence
(``train_log.json``'s ``split``); the held-out sequences here are the first ``--sequences`` of the other half, cut to
128 residues as in training. 15% of each sequence's residues are masked (seeded, the same positions for every model).

    python scripts/weights_fidelity.py ../shared/testbed/esm2_8M_trained --out results/weights/fidelity_8M_cpu.txt
    python scripts/weights_fidelity.py testbeds/esmc_d64_trained --corpus ../shared/testbed/corpus.fasta.gz
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import time
import zlib
from pathlib import Path

import torch

from esm_turbo.model.alphabet import alphabet, encode
from esm_turbo.model.family import family_of_net
from esm_turbo.model.loading import load_esm
from esm_turbo.weights import WeightQuantConfig, quantize_model, weight_memory

VARIANTS = ((4, False), (4, True), (3, False), (3, True), (2, False))


def held_out(testbed: Path, count: int, corpus: Path | None = None) -> list[str]:
    split = json.loads((testbed / "train_log.json").read_text()).get("split", "all")
    if split == "all":
        raise SystemExit(f"{testbed} was trained on the whole corpus: no held-out half")
    unseen = 1 if split == "even" else 0  # crc32 % 2 of the half it was not trained on
    seqs = []
    with gzip.open(corpus or testbed.parent / "corpus.fasta.gz", "rt") as fh:
        for rec in fh.read().split(">")[1:]:
            s = "".join(rec.split("\n")[1:]).strip().upper()
            if len(s) >= 20 and zlib.crc32(s.encode()) % 2 == unseen:
                seqs.append(s[:128])
            if len(seqs) == count:
                break
    return seqs


@torch.no_grad()
def measure(model, tokens: torch.Tensor, mask: torch.Tensor, masked: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(masked-LM perplexity, per-sequence mean embeddings [B, D] of the unmasked input)."""
    inp = tokens.masked_fill(masked, alphabet().mask_idx)
    logits = model(input_ids=inp, attention_mask=mask).logits.float()
    ce = torch.nn.functional.cross_entropy(logits[masked], tokens[masked])
    base = family_of_net(model).base(model)
    hidden = base(input_ids=tokens, attention_mask=mask).last_hidden_state.float()
    residues = mask.bool().clone()
    residues[:, 0] = False
    residues &= tokens != alphabet().eos_idx
    mean = (hidden * residues[..., None]).sum(1) / residues.sum(1, keepdim=True)
    return math.exp(float(ce)), mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("testbed", type=Path)
    ap.add_argument("--sequences", type=int, default=500)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--corpus", type=Path, default=None, help="the corpus.fasta.gz the testbed was trained on "
                    "(default: beside the testbed's folder)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    seqs = held_out(args.testbed, args.sequences, args.corpus)
    tokens, mask = encode(seqs, add_eos=True)
    gen = torch.Generator().manual_seed(0)
    residue = mask.bool() & (tokens != alphabet().cls_idx) & (tokens != alphabet().eos_idx)
    masked = residue & (torch.rand(tokens.shape, generator=gen) < 0.15)
    base = load_esm(args.testbed)
    ppl0, emb0 = measure(base, tokens, mask, masked)
    corpus = f" --corpus {args.corpus}" if args.corpus else ""
    lines = [f"# python scripts/weights_fidelity.py {args.testbed}{corpus} (CPU, torch {torch.__version__}): "
             f"{len(seqs)} held-out "
             f"corpus sequences (<= 128 residues), {int(masked.sum())} masked residues",
             f"# the model's own weights (fp32): masked-LM perplexity {ppl0:.3f}",
             "bits  residual | perplexity  vs own | mean-embedding cos: mean    min  | weights vs fp16 (all-in) | seconds"]
    for bits, residual in VARIANTS:
        start = time.perf_counter()
        model = quantize_model(copy.deepcopy(base), WeightQuantConfig(bits=bits, group=args.group, residual=residual))
        seconds = time.perf_counter() - start
        ppl, emb = measure(model, tokens, mask, masked)
        cos = torch.nn.functional.cosine_similarity(emb, emb0)
        mem = weight_memory(model)
        lines.append(f"{bits:>4}  {'yes' if residual else 'no':>8} | {ppl:10.3f} {ppl / ppl0 - 1:+6.1%} | "
                     f"{float(cos.mean()):22.5f} {float(cos.min()):.5f} | {mem['ratio_vs_fp16']:24.3f} | {seconds:7.1f}")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
