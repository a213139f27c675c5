"""ESM-2 with GELU's tanh approximation in place of its erf GELU (``kernels.common.GELU_FORMS["tanh"]``): how far the
model moves, in float32 on the CPU, the functions the only difference. For each checkpoint: masked-LM perplexity on
the sequences with 15% of residues masked (the same positions both ways) and the last layer's embeddings (each
sequence's mean over its residues, and each residue) against the erf model's. Then the flash-attention rule's
question in fp16 and bf16: the last layer's largest |error| against the float32 erf model, for the erf model in that
dtype (the rounding's own error) and for the tanh form in it:

    python tools/gelu_forms_fidelity.py ../shared/testbed/esm2_8M_trained ../shared/testbed/esm2_d64_trained \\
        --out results/embed/gelu_forms_fidelity_cpu.txt
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from Bio import SeqIO
from transformers import EsmForMaskedLM, EsmTokenizer
from transformers.models.esm import modeling_esm


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, as the kernels' "tanh" form computes it."""
    return F.gelu(x, approximate="tanh")


def measure(model: EsmForMaskedLM, tok: EsmTokenizer, seqs: list[str], act,
            perplexity: bool = True) -> tuple[float, list[torch.Tensor]]:
    """Masked-LM perplexity over ``seqs`` (15% of each sequence's residues masked, seeded; NaN without
    ``perplexity``) and each sequence's last hidden states [L, d] in float32, with transformers' ESM GELU replaced by
    ``act``."""
    erf_gelu, modeling_esm.gelu = modeling_esm.gelu, act  # the module's layers look the function up at call time
    try:
        gen = torch.Generator().manual_seed(0)
        nll, count, states = 0.0, 0, []
        with torch.no_grad():
            for s in seqs:
                ids = tok(s, return_tensors="pt")["input_ids"]
                states.append(model(ids, output_hidden_states=True).hidden_states[-1][0, 1:-1].float())
                if not perplexity:
                    continue
                mask = torch.rand(ids.shape, generator=gen) < 0.15
                mask[0, 0] = mask[0, -1] = False
                masked = ids.masked_fill(mask, tok.mask_token_id)
                logits = model(masked).logits[mask]
                nll += F.cross_entropy(logits, ids[mask], reduction="sum").item()
                count += int(mask.sum())
    finally:
        modeling_esm.gelu = erf_gelu
    return math.exp(nll / count) if count else math.nan, states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--fasta", type=Path, default=Path("calibration_data/evaluation.fasta"))
    ap.add_argument("--max-length", type=int, default=1022)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    seqs = [str(r.seq)[:args.max_length] for r in SeqIO.parse(args.fasta, "fasta")]
    lines = [f"{len(seqs)} sequences of {args.fasta}, float32, CPU; erf GELU (the model's) against the tanh form"]
    for path in args.checkpoints:
        tok = EsmTokenizer.from_pretrained(path)
        model = EsmForMaskedLM.from_pretrained(path, dtype=torch.float32).eval()
        ppl_erf, erf_states = measure(model, tok, seqs, modeling_esm.gelu)
        ppl_tanh, tanh_states = measure(model, tok, seqs, tanh_gelu)
        mean_cos = min(F.cosine_similarity(a.mean(0), b.mean(0), dim=0).item()
                       for a, b in zip(erf_states, tanh_states))
        residue_cos = min(F.cosine_similarity(a, b, dim=1).min().item() for a, b in zip(erf_states, tanh_states))
        lines.append(f"{path.name}: perplexity erf {ppl_erf:.4f}, tanh {ppl_tanh:.4f} "
                     f"({100 * (ppl_tanh / ppl_erf - 1):+.3f}%); worst mean embedding cos {mean_cos:.6f}, "
                     f"worst residue cos {residue_cos:.6f}")
        print(lines[-1], flush=True)
        for dtype in (torch.float16, torch.bfloat16):
            low = EsmForMaskedLM.from_pretrained(path, dtype=dtype).eval()
            err = {form: max((a - b).abs().max().item() for a, b in
                             zip(erf_states, measure(low, tok, seqs, act, perplexity=False)[1]))
                   for form, act in (("erf", modeling_esm.gelu), ("tanh", tanh_gelu))}
            lines.append(f"    {str(dtype).removeprefix('torch.')}: last layer's largest |error| against float32 erf: "
                         f"erf {err['erf']:.4g}, tanh {err['tanh']:.4g} ({err['tanh'] / err['erf']:.2f}x)")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
