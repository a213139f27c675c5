"""Iterative masked re-sampling of a design's tail on a compressed cache, with rollback.

The fixed head of the design is prefilled once; each round rolls back the designed tail, re-decodes
it with one position masked and re-sampled, and keeps the change if the model's pseudo-log-likelihood
of the tail improves. Run: python examples/iterative_resample.py [--model M]
"""

from __future__ import annotations

import argparse

import torch

from esm_turbo import alphabet, calibrate, load_esm, read_fasta, residue_ids, stress_esm2, TurboEsm


def tail_score(session, tail: torch.Tensor) -> float:
    """Mean log-probability of the tail tokens when fed in one step (then rolled back)."""
    out = session.step(tail[None, :])
    session.rollback(tail.numel())
    logp = torch.log_softmax(out.logits[0], -1)
    return float(logp.gather(-1, tail[:, None]).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    model = load_esm(args.model) if args.model else stress_esm2(layers=4, hidden=64, heads=4)
    cal = calibrate(model, read_fasta("calibration_data/calibration.fasta")[0][:40], progress=False)
    session = TurboEsm(model, cal).session()
    session.start(["MKTAYIAKQRQISFVKSHFSRQ"])
    allowed = residue_ids()
    tail = allowed[torch.randint(0, len(allowed), (12,), generator=g)]
    best = tail_score(session, tail)
    for _ in range(args.rounds):
        pos = int(torch.randint(0, tail.numel(), (1,), generator=g))
        masked = tail.clone()
        masked[pos] = alphabet().mask_idx
        out = session.step(masked[None, :], commit=False)
        probs = torch.softmax(out.logits[0, pos, allowed], -1)
        cand = tail.clone()
        cand[pos] = allowed[torch.multinomial(probs, 1, generator=g)]
        score = tail_score(session, cand)
        if score > best:
            tail, best = cand, score
    print("design tail:", "".join(alphabet().get_tok(int(t)) for t in tail), f"mean log-p {best:.3f}")


if __name__ == "__main__":
    main()
