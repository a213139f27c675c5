"""Beam search over the last positions of a real scaffold on a paged compressed cache: prefill the scaffold's start
once, then at every position expand each beam by its most likely residues, keep the best ``--beam`` (forks that share
their prefix blocks, the rest pruned) and commit the chosen residue. Prints throughput and cache memory as it goes,
and how many native residues the best beam recovers.

Offline by default: a small stand-in ESM-2 (random weights, so recovery is at chance), calibrated here in seconds.
With real weights:

    python examples/beam_search.py --model facebook/esm2_t33_650M_UR50D --calibration esm2_650M.turbo.safetensors
"""

from __future__ import annotations

import argparse
import time

import torch

from esm_turbo import alphabet, calibrate, Calibration, load_esm, read_fasta, residue_ids, stress_esm2, TurboEsm


def beam_search(turbo: TurboEsm, prefix: str, length: int, beam: int = 64, expand: int = 4, block_size: int = 16,
                log=print):
    """The ``beam`` best continuations of ``prefix`` by summed log-probability, ``length`` residues each:
    (residue strings, scores), best first. Blocks of ``block_size`` tokens: every beam copies the block its tail
    starts in, so smaller blocks share more of a short prefix."""
    session = turbo.session(paged=True, block_size=block_size)
    session.start([prefix])
    allowed = residue_ids()
    letters = [alphabet().get_tok(int(i)) for i in allowed]
    scores = torch.zeros(1)
    chosen: list[list[int]] = [[]]
    mib = 2**20
    for pos in range(length):
        t0 = time.perf_counter()
        rows = session.cache.batch_size
        peek = session.step(["<mask>"] * rows, commit=False)  # each beam's view of the next position
        logp = torch.log_softmax(peek.logits[:, 0, allowed].float(), -1).cpu()
        top = logp.topk(min(expand, len(allowed)), dim=-1)
        cand = (scores[:, None] + top.values).flatten()
        keep = cand.topk(min(beam, cand.numel())).indices
        parents, picks = keep // top.indices.shape[1], top.indices.flatten()[keep]
        session.select(parents.tolist())  # fork the survivors: block tables copied, blocks shared
        session.step(allowed[picks][:, None].to(session.cache.device))  # commit (copy-on-write of a shared tail)
        scores = cand[keep]
        chosen = [chosen[p] + [int(k)] for p, k in zip(parents.tolist(), picks.tolist())]
        sec = time.perf_counter() - t0
        rep = session.memory_report()
        log(f"position {len(prefix) + pos + 1}: {rows} beams in, {len(keep)} kept, {2 * rows / sec:.0f} decode "
            f"tokens/s; cache {rep.used_bytes / mib:.2f} MiB held, {rep.shared_saved_bytes / mib:.2f} MiB saved by "
            f"sharing ({(rep.used_bytes + rep.shared_saved_bytes) / max(rep.used_bytes, 1):.1f}x)")
    return ["".join(letters[k] for k in c) for c in chosen], scores.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="ESM-2 hub id, save_pretrained folder or fair-esm .pt (default: a stand-in)")
    ap.add_argument("--calibration", help="a checkpoint of `esm-turbo calibrate` (default: calibrate here)")
    ap.add_argument("--fasta", default="calibration_data/evaluation.fasta", help="where the scaffold comes from")
    ap.add_argument("--scaffold", type=int, default=0, help="which record of --fasta (default: the first)")
    ap.add_argument("--length", type=int, default=8, help="positions to redesign at the scaffold's end")
    ap.add_argument("--beam", type=int, default=64)
    ap.add_argument("--expand", type=int, default=4, help="residues tried per beam and position")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per cache block")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in ("length", "beam", "expand", "block_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    torch.manual_seed(args.seed)
    records = read_fasta(args.fasta)[0]
    if not 0 <= args.scaffold < len(records):
        ap.error(f"--scaffold {args.scaffold}: {args.fasta} holds records 0..{len(records) - 1}")
    scaffold = records[args.scaffold]
    if args.length >= len(scaffold.sequence):
        ap.error(f"--length {args.length}: {scaffold.id} has only {len(scaffold.sequence)} residues")
    model = load_esm(args.model) if args.model else stress_esm2(layers=4, hidden=64, heads=4)
    cal = (Calibration.load(args.calibration) if args.calibration else
           calibrate(model, read_fasta("calibration_data/calibration.fasta")[0][:40], progress=False))
    cut = len(scaffold.sequence) - args.length
    print(f"scaffold {scaffold.id} ({len(scaffold.sequence)} residues): redesigning positions {cut + 1}.."
          f"{len(scaffold.sequence)} with a beam of {args.beam}")
    tails, scores = beam_search(TurboEsm(model, cal), scaffold.sequence[:cut], args.length, args.beam, args.expand,
                                args.block_size)
    native = scaffold.sequence[cut:]
    for tail, score in list(zip(tails, scores))[:3]:
        print(f"  {tail}  log-prob {score:.2f}")
    print(f"native {native}; best beam recovers {sum(a == b for a, b in zip(tails[0], native))}/{args.length}")


if __name__ == "__main__":
    main()
