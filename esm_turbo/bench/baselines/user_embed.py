"""What a careful user writes to embed a FASTA with transformers, end to end (the baseline of ``esm-turbo bench
embed``'s end-to-end rows). It imports nothing from esm_turbo.

    python user_embed.py MODEL_DIR proteins.fasta out.h5 [--compile] [--toks-per-batch 16384]

Length-sorted batches under a token budget (rows × longest), tokenised by the model's tokenizer in DataLoader
workers (pinned, overlapping the GPU), ``EsmModel`` with SDPA in fp16 (fp32 without a GPU),
``torch.compile(dynamic=True)`` when asked;
mean of the last layer over the residues kept on the GPU and copied once at the end; ids and means written with
h5py. Prints its tokens and its loop's seconds on the last line.
"""

import argparse
import time


def batches(seqs, budget):
    """Indices, longest first, so that rows × (longest + 2) ≤ budget (``esm-turbo bench embed``'s transformers loops
    batch with this too)."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * (len(seqs[cur[0]]) + 2) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


def main():
    import h5py
    import torch
    from Bio.SeqIO.FastaIO import SimpleFastaParser
    from transformers import AutoTokenizer, EsmModel

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("fasta")
    ap.add_argument("out")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--toks-per-batch", type=int, default=16384)
    args = ap.parse_args()
    with open(args.fasta) as fh:
        records = [(title.split()[0], seq) for title, seq in SimpleFastaParser(fh)]
    ids, seqs = [r[0] for r in records], [r[1] for r in records]
    tok = AutoTokenizer.from_pretrained(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = EsmModel.from_pretrained(args.model, dtype=torch.float16 if device == "cuda" else torch.float32,
                                     attn_implementation="sdpa", add_pooling_layer=False).to(device).eval()
    if args.compile:
        model = torch.compile(model, dynamic=True)
    plan = batches(seqs, args.toks_per_batch)
    loader = torch.utils.data.DataLoader(plan, batch_size=None, num_workers=4, pin_memory=device == "cuda",
                                         collate_fn=lambda idx: tok([seqs[i] for i in idx], padding=True,
                                                                    return_tensors="pt"))
    means, tokens = [], 0
    start = time.perf_counter()
    with torch.inference_mode():
        for enc in loader:
            ids_t = enc["input_ids"].to(device, non_blocking=True)
            mask = enc["attention_mask"].to(device, non_blocking=True)
            h = model(input_ids=ids_t, attention_mask=mask).last_hidden_state
            res = mask.clone()
            res[:, 0] = 0  # <cls>
            res.scatter_(1, mask.sum(1, keepdim=True) - 1, 0)  # <eos>
            res = res[..., None].to(h.dtype)
            means.append(((h * res).sum(1) / res.sum(1)).float())
            tokens += int(enc["attention_mask"].sum())
    order = [i for b in plan for i in b]
    mean = torch.cat(means).cpu().numpy()
    seconds = time.perf_counter() - start
    with h5py.File(args.out, "w") as fh:
        fh.create_dataset("ids", data=[ids[i] for i in order], dtype=h5py.string_dtype())
        fh.create_dataset("mean", data=mean)
    print(f"{tokens} tokens in {seconds:.1f} s")


if __name__ == "__main__":
    main()
