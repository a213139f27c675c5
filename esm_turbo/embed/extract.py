"""Embedding extraction (``esm-turbo embed``): fair-esm's extract script, made fast and safe.

Length-sorted token-budget batches (almost no padding), SDPA attention in fp16/bf16 on GPU, outputs
copied to the host once per batch and written by a background thread while the GPU runs the next
batch, atomic per-item writes, ``resume`` that skips ids already written, sharding over
``torch.distributed`` ranks (torchrun) with per-rank outputs and manifests.

Outputs follow fair-esm: per-token representations exclude ``<cls>``/``<eos>``; ``mean`` averages the
residues; ``bos`` is the ``<cls>`` state; ``contacts`` [L, L] come from the model's contact head (eager
attention, since it reads attention maps); ``logits`` [L, vocab] are ours. Long sequences are
truncated (default, with a warning naming the record) or cut into overlapping windows whose residues
are stitched from the window that centres them (``bos`` then comes from the first window; contacts
need the whole sequence and are refused with windows).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..errors import EsmTurboError
from ..fasta import Record
from ..model.alphabet import encode
from ..model.sizes import MAX_RESIDUES
from .batching import Piece, owner_ranges, plan_batches, plan_pieces, window_spans

log = logging.getLogger(__name__)

INCLUDE_KINDS = ("mean", "per_tok", "bos", "contacts", "logits")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class EmbedConfig:
    """What to extract and how (fair-esm's defaults where it has them)."""

    repr_layers: list[int] = field(default_factory=lambda: [-1])
    include: list[str] = field(default_factory=lambda: ["mean"])
    toks_per_batch: int = 4096
    truncation_seq_length: int = MAX_RESIDUES
    long_policy: str = "truncate"  # truncate | windows
    window_overlap: int = 256
    dtype: str = "auto"  # auto (fp16 on CUDA, fp32 elsewhere) | fp32 | fp16 | bf16

    def check(self) -> None:
        bad = [k for k in self.include if k not in INCLUDE_KINDS]
        if bad:
            raise EsmTurboError(f"--include: unknown kind(s) {bad}; choose from {list(INCLUDE_KINDS)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise EsmTurboError(f"--dtype {self.dtype!r}: choose auto, fp32, fp16 or bf16")
        if not 1 <= self.truncation_seq_length <= MAX_RESIDUES:
            raise EsmTurboError(f"--truncation-seq-length must be in [1, {MAX_RESIDUES}] (ESM-2's trained context)")
        if self.toks_per_batch < 3:
            raise EsmTurboError("--toks-per-batch must be at least 3 (a piece longer than it runs alone)")
        if "contacts" in self.include and self.long_policy == "windows":
            raise EsmTurboError("contacts need the whole sequence in one pass; use --long-policy truncate")


@dataclass
class EmbedSummary:
    written: int = 0
    skipped: int = 0  # already present (resume)
    failed: list[str] = field(default_factory=list)  # invalid records (skip-invalid)
    truncated: list[str] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        return (f"written {self.written}, skipped {self.skipped} (already there), failed {len(self.failed)}, "
                f"truncated {len(self.truncated)}; {self.tokens} tokens in {self.seconds:.1f} s "
                f"({self.tokens / max(self.seconds, 1e-9):.0f} tokens/s)")


def resolve_layers(layers: list[int], num_layers: int) -> list[int]:
    """fair-esm semantics: layer 0 is the embedding output, negative indices count from num_layers + 1."""
    out = []
    for layer in layers:
        resolved = (layer + num_layers + 1) % (num_layers + 1) if layer < 0 else layer
        if not 0 <= resolved <= num_layers or layer < -(num_layers + 1):
            raise EsmTurboError(f"--repr-layers {layer}: the model has layers 0..{num_layers}")
        out.append(resolved)
    return sorted(set(out))


class Embedder:
    """Runs a loaded ``EsmForMaskedLM`` over records and hands per-sequence results to a writer."""

    def __init__(self, model, config: EmbedConfig, device: str | torch.device | None = None):
        config.check()
        self.config = config
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = DTYPES[config.dtype] if config.dtype != "auto" else (torch.float16 if dev.type == "cuda"
                                                                      else torch.float32)
        self.model = model.to(device=dev, dtype=dtype).eval()
        self.device, self.dtype = dev, dtype
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.layers = resolve_layers(config.repr_layers, self.num_layers)
        self.model.config._attn_implementation = "eager" if "contacts" in config.include else "sdpa"

    # ---- one batch ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list[str]) -> dict[str, torch.Tensor]:
        """Model outputs of one batch on the host: ``hidden`` [n_layers_asked, B, T, D] float32, and
        ``contacts`` [B, T-2, T-2] / ``logits`` [B, T, V] when asked."""
        tokens, mask = encode(seqs)  # <cls> residues <eos>, right-padded
        tokens, mask = tokens.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        want_contacts = "contacts" in self.config.include
        out = self.model.esm(input_ids=tokens, attention_mask=mask, output_hidden_states=True,
                             output_attentions=want_contacts)
        result = {"hidden": torch.stack([out.hidden_states[i] for i in self.layers]).float()}
        if want_contacts:
            attns = torch.stack(out.attentions, dim=1)
            attns = attns * mask[:, None, None, :, None] * mask[:, None, None, None, :]
            result["contacts"] = self.model.esm.contact_head(tokens, attns.to(self.dtype)).float()
        if "logits" in self.config.include:
            result["logits"] = self.model.lm_head(out.last_hidden_state).float()
        return {k: v.to("cpu", non_blocking=True) for k, v in result.items()}

    # ---- assembling per-sequence items -------------------------------------------------------------
    def _item(self, rec: Record, pieces: list[tuple[Piece, dict, int]]) -> dict:
        """fair-esm-style dict for one record from its piece(s): (piece, batch outputs, row)."""
        inc = self.config.include
        pieces = sorted(pieces, key=lambda x: x[0].part)
        first, out0, row0 = pieces[0]
        item: dict = {"label": rec.id}
        if len(pieces) == 1:
            n = first.length
            per_tok = out0["hidden"][:, row0, 1: n + 1]
            logits = out0["logits"][row0, 1: n + 1] if "logits" in inc else None
        else:
            spans = [(p.start, p.stop) for p, _, _ in pieces]
            chunks, lchunks = [], []
            for (p, out, row), (lo, hi) in zip(pieces, owner_ranges(spans)):
                sl = slice(1 + lo - p.start, 1 + hi - p.start)
                chunks.append(out["hidden"][:, row, sl])
                if "logits" in inc:
                    lchunks.append(out["logits"][row, sl])
            per_tok = torch.cat(chunks, dim=1)
            logits = torch.cat(lchunks, dim=0) if "logits" in inc else None
        if "per_tok" in inc:
            item["representations"] = {layer: per_tok[i].clone() for i, layer in enumerate(self.layers)}
        if "mean" in inc:
            item["mean_representations"] = {layer: per_tok[i].mean(0).clone() for i, layer in enumerate(self.layers)}
        if "bos" in inc:
            item["bos_representations"] = {layer: out0["hidden"][i, row0, 0].clone()
                                           for i, layer in enumerate(self.layers)}
        if "contacts" in inc:
            n = first.length
            item["contacts"] = out0["contacts"][row0, :n, :n].clone()
        if logits is not None:
            item["logits"] = logits.clone()
        return item

    # ---- the whole job -----------------------------------------------------------------------------
    def run(self, records: list[Record], writer, resume: bool = False, progress: bool = True,
            rank: int = 0, world: int = 1, summary: EmbedSummary | None = None) -> EmbedSummary:
        """Embed ``records`` (this rank's share of the batches when ``world`` > 1) into ``writer``."""
        summary = summary or EmbedSummary()
        start = time.perf_counter()
        if resume:
            done = writer.existing_ids()
            todo = [r for r in records if r.id not in done]
            summary.skipped += len(records) - len(todo)
            records = todo
        cfg = self.config
        if world > 1:  # shard whole records (windows of one record stay together), balanced by length
            by_len = sorted(range(len(records)), key=lambda i: (-len(records[i].sequence), i))
            records = [records[i] for i in sorted(by_len[rank::world])]
        pieces, warnings = plan_pieces(records, cfg.truncation_seq_length, cfg.long_policy, cfg.window_overlap)
        for _, message in warnings:
            log.warning("warning: %s", message)
        summary.truncated += [rid for rid, _ in warnings]
        batches = plan_batches(pieces, cfg.toks_per_batch)
        waiting: dict[int, list] = {}
        bar = tqdm(total=len(records), unit="seq", desc=f"embed{f' rank {rank}' if world > 1 else ''}",
                   disable=not progress, dynamic_ncols=True)

        def finish(batch: list[Piece], out: dict, copied) -> list[dict]:
            if copied is not None:
                copied.synchronize()  # this batch's host copies only; the next batch keeps running
            ready = []
            for row, piece in enumerate(batch):
                waiting.setdefault(piece.index, []).append((piece, out, row))
                if len(waiting[piece.index]) == piece.parts:
                    ready.append(piece.index)
            return [self._item(records[i], waiting.pop(i)) for i in ready]

        with ThreadPoolExecutor(max_workers=1) as pool:
            writes, previous = [], None
            for batch in batches + [None]:
                current = None
                if batch is not None:
                    seqs = [records[p.index].sequence[p.start: p.stop] for p in batch]
                    out = self.forward(seqs)  # queued on the GPU; the previous batch is assembled meanwhile
                    copied = torch.cuda.Event() if self.device.type == "cuda" else None
                    if copied is not None:
                        copied.record()
                    summary.tokens += sum(len(s) + 2 for s in seqs)
                    current = (batch, out, copied)
                if previous is not None:
                    items = finish(*previous)
                    if writes:
                        writes.pop().result()
                    writes.append(pool.submit(writer.write, items))
                    summary.written += len(items)
                    bar.update(len(items))
                previous = current
            for w in writes:
                w.result()
        bar.close()
        summary.seconds += time.perf_counter() - start
        return summary


def distributed_context() -> tuple[int, int]:
    """(rank, world) from torchrun's environment, initialising the process group once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


__all__ = ["EmbedConfig", "EmbedSummary", "Embedder", "INCLUDE_KINDS", "distributed_context", "resolve_layers",
           "window_spans"]
