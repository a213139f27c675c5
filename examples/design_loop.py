"""A design loop on a compressed cache: prefill a scaffold once, fork it into designs that share it, and extend every
design by sampling residues from the model's own logits, peeking before each commit.

Offline by default: a small stand-in ESM-2 (random weights), calibrated here in seconds. With real weights (ESM-2 or
ESM C alike; the trained ESM C testbed in testbeds/ works too):

    python examples/design_loop.py --model facebook/esm2_t33_650M_UR50D --calibration esm2_650M.turbo.safetensors
    python examples/design_loop.py --model testbeds/esmc_d64_trained
"""

from __future__ import annotations

import argparse

import torch

from esm_turbo import calibrate, Calibration, load_esm, read_fasta, residue_ids, stress_esm2, TurboEsm


def design(turbo: TurboEsm, scaffold: str, designs: int = 4, length: int = 12, temperature: float = 1.0):
    """``designs`` continuations of ``scaffold``, ``length`` residues each: the session that holds them."""
    session = turbo.session()
    session.start([scaffold])  # exact prefill, once
    session.fork(designs)  # every design starts from the scaffold's cache
    allowed = residue_ids()
    for _ in range(length):
        peek = session.step(["<mask>"] * designs, commit=False)  # what goes next? (the cache is unchanged)
        probs = torch.softmax(peek.logits[:, 0, allowed] / temperature, -1)
        session.step(allowed[torch.multinomial(probs, 1)])  # commit one sampled residue per design
    return session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="ESM-2 or ESM C hub id, save_pretrained folder or weight file (default: a stand-in)")
    ap.add_argument("--calibration", help="a checkpoint of `esm-turbo calibrate` (default: calibrate here)")
    ap.add_argument("--scaffold", default="MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ")
    ap.add_argument("--designs", type=int, default=4)
    ap.add_argument("--length", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = load_esm(args.model) if args.model else stress_esm2(layers=4, hidden=64, heads=4)
    cal = (Calibration.load(args.calibration) if args.calibration else
           calibrate(model, read_fasta("calibration_data/calibration.fasta")[0][:40], progress=False))
    session = design(TurboEsm(model, cal), args.scaffold, args.designs, args.length)
    for seq in session.sequences():
        print(seq.replace("<cls>", ""))
    rep = session.memory_report()
    print(f"KV cache: {rep.bits_per_value:.2f} bits per value, {rep.ratio_vs_fp16:.1f}x smaller than FP16")


if __name__ == "__main__":
    main()
