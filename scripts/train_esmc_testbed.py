"""Train a small ESM C (transformers' ``EsmcForMaskedLM``) with masked-LM on real protein sequences: the ESM C
fidelity testbed, made as ``../shared/testbed/train_testbed.py`` makes the ESM-2 ones.

The recipe is that script's: 15% of residues selected, 80/10/10 mask/random/kept, AdamW (betas 0.9/0.98, weight decay
0.01), 300 warm-up steps then linear decay to 5% over a fixed wall time, gradients clipped at 1, bf16 autocast, about
65K tokens a step of random 254-residue crops, the corpus split by a CRC32 of each sequence (``--split``) and 500
sequences held out. ESM C takes no token-dropout rescaling, so none is trained. The layout (``--layout d64``): 6
layers, hidden 384, 6 heads of 64 (ESM C's head width at every size), SwiGLU width 1,024 (8/3 of the hidden size),
ESM C's 64-token vocabulary, residual branches divided by sqrt(6 / 36).

    python scripts/train_esmc_testbed.py corpus.fasta testbeds/esmc_d64_trained --minutes 4 --seed 7 --split even

Writes OUT (``save_pretrained`` in fp16) and OUT/train_log.json (loss curve; held-out masked-LM loss, perplexity and
accuracy on the 500 held-out sequences).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
import zlib

import torch
from transformers import EsmcForMaskedLM

from esm_turbo.model.alphabet import encode
from esm_turbo.model.sizes import esmc_config

LAYOUTS = {"d64": (6, 384, 6)}  # layers, hidden, heads
MASK, PAD = 32, 1


def read_corpus(path: str, split: str) -> list[str]:
    seqs = []
    for rec in open(path).read().split(">")[1:]:
        s = "".join(rec.split("\n")[1:]).strip().upper()
        if len(s) >= 20 and (split == "all" or (split == "even") == (zlib.crc32(s.encode()) % 2 == 0)):
            seqs.append(s)
    return seqs


def crop(s: str, n: int) -> str:
    if len(s) <= n:
        return s
    o = random.randrange(len(s) - n + 1)
    return s[o: o + n]


def mask_tokens(t: torch.Tensor, gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """15% of residues selected; of those 80% masked, 10% a random residue, 10% kept. Returns (input, labels)."""
    t = t.clone()
    labels = torch.full_like(t, -100)
    sel = (t > 3) & (t < MASK) & (torch.rand(t.shape, device=t.device, generator=gen) < 0.15)
    labels[sel] = t[sel]
    r = torch.rand(t.shape, device=t.device, generator=gen)
    t[sel & (r < 0.8)] = MASK
    rnd = sel & (r >= 0.8) & (r < 0.9)
    t[rnd] = torch.randint(4, 24, (int(rnd.sum()),), device=t.device, generator=gen)
    return t, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus")
    ap.add_argument("out")
    ap.add_argument("--layout", default="d64", choices=list(LAYOUTS))
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--split", default="even", choices=["even", "odd", "all"])
    ap.add_argument("--crop", type=int, default=254)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    seqs = read_corpus(args.corpus, args.split)
    random.shuffle(seqs)
    held, train = seqs[:500], seqs[500:]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers, hidden, heads = LAYOUTS[args.layout]
    cfg = esmc_config(layers=layers, hidden=hidden, heads=heads)
    cfg._attn_implementation = "sdpa"
    model = EsmcForMaskedLM(cfg).to(dev)

    def batch_of(pool: list[str], n_tokens: int) -> torch.Tensor:
        out, used = [], 0
        while used < n_tokens:
            out.append(crop(random.choice(pool), args.crop))
            used += len(out[-1]) + 2
        return encode(out)[0]

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    budget, warm = args.minutes * 60, 300
    log, step, t0 = [], 0, time.time()
    model.train()
    while (elapsed := time.time() - t0) < budget:
        lr = args.lr * min(1.0, (step + 1) / warm) * max(0.05, 1 - elapsed / budget)
        for g in opt.param_groups:
            g["lr"] = lr
        t = batch_of(train, args.tokens_per_step).to(dev, non_blocking=True)
        inp, lab = mask_tokens(t)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=inp, attention_mask=(t != PAD).long(), labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            log.append(dict(step=step, seconds=round(elapsed, 1), loss=round(float(loss), 4), lr=lr))
            print(log[-1], flush=True)
        step += 1

    model.eval()
    gen = torch.Generator(device=dev).manual_seed(0)
    total, n, correct = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(held), 50):
            t = encode([s[: args.crop] for s in held[i: i + 50]])[0].to(dev)
            inp, lab = mask_tokens(t, gen)
            logits = model(input_ids=inp, attention_mask=(t != PAD).long()).logits.float()
            m = lab != -100
            total += float(torch.nn.functional.cross_entropy(logits[m], lab[m], reduction="sum"))
            correct += int((logits[m].argmax(-1) == lab[m]).sum())
            n += int(m.sum())
    res = dict(layout=args.layout, seed=args.seed, split=args.split, minutes=args.minutes, steps=step,
               train_sequences=len(train), held_mlm_loss=total / max(n, 1),
               held_perplexity=math.exp(total / max(n, 1)), held_accuracy=correct / max(n, 1),
               device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", log=log)
    model.half().save_pretrained(args.out)
    with open(f"{args.out}/train_log.json", "w") as fh:
        json.dump(res, fh, indent=1)
    print({k: v for k, v in res.items() if k != "log"})


if __name__ == "__main__":
    main()
