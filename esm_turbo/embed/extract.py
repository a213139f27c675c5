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
from ..io import to_host_queued
from ..model.alphabet import encode, encode_packed
from ..model.sizes import MAX_RESIDUES
from ..schema import DTYPES
from .batching import Piece, owner_ranges, plan_batches, plan_pieces, shard_by_tokens, window_spans
from .fast_esm import FastEsm, PackedBatch

log = logging.getLogger(__name__)

INCLUDE_KINDS = ("mean", "per_tok", "bos", "contacts", "logits")
#: default tokens per batch: a 3B model's peak stays well inside 24 GB (results/embed: peak memory per budget)
TOKS_PER_BATCH = 16384


@dataclass
class EmbedConfig:
    """What to extract and how (fair-esm's defaults where it has them)."""

    repr_layers: list[int] = field(default_factory=lambda: [-1])
    include: list[str] = field(default_factory=lambda: ["mean"])
    toks_per_batch: int = TOKS_PER_BATCH
    truncation_seq_length: int = MAX_RESIDUES
    long_policy: str = "truncate"  # truncate | windows
    window_overlap: int | None = None  # default: 256, at most a quarter of the window
    dtype: str = "auto"  # auto (fp16 on CUDA, fp32 elsewhere) | fp32 | fp16 | bf16

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the model runs in on ``device``: ``dtype``, or for auto fp16 on CUDA and fp32 elsewhere."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32

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
        if self.window_overlap is None:
            self.window_overlap = min(256, self.truncation_seq_length // 4)
        if not 0 <= self.window_overlap < self.truncation_seq_length:
            raise EsmTurboError(f"--window-overlap {self.window_overlap}: must be below the window, "
                                f"--truncation-seq-length {self.truncation_seq_length}")
        if "contacts" in self.include and self.long_policy == "windows":
            raise EsmTurboError("contacts need the whole sequence in one pass; use --long-policy truncate")


@dataclass
class EmbedSummary:
    written: int = 0
    skipped: int = 0  # already present (resume)
    failed: list[str] = field(default_factory=list)  # invalid records (skip-invalid)
    truncated: list[str] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0  # the embedding loop, first batch included
    startup_s: float = 0.0  # process start to the loop: imports, FASTA, model load
    first_batch_s: float = 0.0  # the loop's start to the first batch's outputs (compilation)
    write_wait_s: float = 0.0  # the loop waiting on the writer thread
    merge_s: float = 0.0  # after the last batch: the rest of the parts merged (rank 0, HDF5)

    def line(self) -> str:
        times = ", ".join(f"{name} {sec:.1f} s" for name, sec in (
            ("start-up", self.startup_s), ("first batch", self.first_batch_s),
            ("waiting on writes", self.write_wait_s), ("final merge", self.merge_s)) if sec)
        return (f"written {self.written}, skipped {self.skipped} (already there), failed {len(self.failed)}, "
                f"truncated {len(self.truncated)}; {self.tokens} tokens in {self.seconds:.1f} s "
                f"({self.tokens / max(self.seconds, 1e-9):.0f} tokens/s)" + (f"; {times}" if times else ""))


def resolve_layers(layers: list[int], num_layers: int) -> list[int]:
    """fair-esm semantics: layer 0 is the embedding output, negative indices count from num_layers + 1."""
    out = []
    for layer in layers:
        resolved = (layer + num_layers + 1) % (num_layers + 1) if layer < 0 else layer
        if not 0 <= resolved <= num_layers or layer < -(num_layers + 1):
            raise EsmTurboError(f"--repr-layers {layer}: the model has layers 0..{num_layers}")
        out.append(resolved)
    return sorted(set(out))


@dataclass
class BatchOutput:
    """One batch's results on the host (float32). mean, bos: [n_layers, S, D]; tokens: residue states
    [n_layers, M, D] of the rows in ``token_rows`` (row → (offset, residues)), ``logits`` [M', V] of every
    row's residues at ``logit_rows``; ``contacts`` [S, T-2, T-2] (padded) when asked."""

    mean: torch.Tensor
    bos: torch.Tensor
    tokens: torch.Tensor | None = None
    token_rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    logit_rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    contacts: torch.Tensor | None = None


def _row_offsets(lengths: list[int], rows: list[int]) -> dict[int, tuple[int, int]]:
    out, offset = {}, 0
    for r in rows:
        out[r] = (offset, lengths[r])
        offset += lengths[r]
    return out


class Embedder:
    """Runs ESM-2 over records and hands per-sequence results to a writer.

    The forward is :class:`~esm_turbo.embed.fast_esm.FastEsm` (packed batches, no padding); contact maps,
    which need every attention map, take transformers' eager path over padded batches instead.
    """

    def __init__(self, model, config: EmbedConfig, device: str | torch.device | None = None):
        config.check()
        self.config = config
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = config.torch_dtype(dev)
        self.model = model.to(device=dev, dtype=dtype).eval()
        self.device, self.dtype = dev, dtype
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.layers = resolve_layers(config.repr_layers, self.num_layers)
        self.padded = "contacts" in config.include
        self.model.config._attn_implementation = "eager" if self.padded else "sdpa"
        self.fast = None if self.padded else FastEsm.from_hf(self.model)

    # ---- one batch ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list[str], token_rows: list[int] | None = None) -> BatchOutput:
        """One batch's outputs, copies to the host queued. Per-residue states are kept for every row when
        ``per_tok`` is asked, else only for ``token_rows`` (the rows that are windows of a longer record)."""
        token_rows = list(range(len(seqs))) if "per_tok" in self.config.include else (token_rows or [])
        if self.padded:
            return self._forward_padded(seqs, token_rows)
        batch = PackedBatch.from_arrays(*encode_packed(seqs), device=self.device)
        want_logits = "logits" in self.config.include
        hidden = self.fast(batch, sorted(set(self.layers) | ({self.num_layers} if want_logits else set())))
        pooled = [self.fast.pool(hidden[layer], batch) for layer in self.layers]
        out = BatchOutput(to_host_queued(torch.stack([m for m, _ in pooled])),
                          to_host_queued(torch.stack([b for _, b in pooled])))
        residues = [n - 2 for n in batch.lengths]
        starts = batch.cu_seqlens[:-1].long()

        def residue_index(rows: list[int]) -> torch.Tensor:  # packed positions of these rows' residues
            return torch.cat([torch.arange(1, residues[r] + 1, device=self.device) + starts[r] for r in rows])
        if token_rows:
            idx = residue_index(token_rows)
            out.tokens = to_host_queued(torch.stack([hidden[layer][idx].float() for layer in self.layers]))
            out.token_rows = _row_offsets(residues, token_rows)
        if want_logits:
            rows = list(range(len(seqs)))
            out.logits = to_host_queued(self.fast.logits(hidden[self.num_layers][residue_index(rows)]).float())
            out.logit_rows = _row_offsets(residues, rows)
        return out

    def _forward_padded(self, seqs: list[str], token_rows: list[int]) -> BatchOutput:
        """transformers' eager forward over a padded batch (for contact maps)."""
        tokens, mask = encode(seqs)  # <cls> residues <eos>, right-padded
        tokens, mask = tokens.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        out = self.model.esm(input_ids=tokens, attention_mask=mask, output_hidden_states=True, output_attentions=True)
        hidden = torch.stack([out.hidden_states[i] for i in self.layers]).float()  # [nL, B, T, D]
        residues = [len(s) for s in seqs]
        res_mask = torch.zeros(tokens.shape, device=self.device)
        for r, n in enumerate(residues):
            res_mask[r, 1: n + 1] = 1
        mean = (hidden * res_mask[None, ..., None]).sum(2) / res_mask.sum(1).clamp(min=1)[None, :, None]
        result = BatchOutput(to_host_queued(mean), to_host_queued(hidden[:, :, 0]))
        if token_rows:
            result.tokens = to_host_queued(torch.cat([hidden[:, r, 1: residues[r] + 1] for r in token_rows], dim=1))
            result.token_rows = _row_offsets(residues, token_rows)
        if "logits" in self.config.include:
            logits = self.model.lm_head(out.last_hidden_state).float()
            result.logits = to_host_queued(torch.cat([logits[r, 1: residues[r] + 1] for r in range(len(seqs))]))
            result.logit_rows = _row_offsets(residues, list(range(len(seqs))))
        attns = torch.stack(out.attentions, dim=1)
        attns = attns * mask[:, None, None, :, None] * mask[:, None, None, None, :]
        result.contacts = to_host_queued(self.model.esm.contact_head(tokens, attns.to(self.dtype)).float())
        return result

    # ---- assembling per-sequence items -------------------------------------------------------------
    def _item(self, rec: Record, pieces: list[tuple[Piece, BatchOutput, int]]) -> dict:
        """fair-esm-style dict for one record from its piece(s): (piece, batch outputs, row)."""
        inc = self.config.include
        pieces = sorted(pieces, key=lambda x: x[0].part)
        first, out0, row0 = pieces[0]
        item: dict = {"label": rec.id}

        def rows_of(tensor, table, row, lo=0, hi=None):  # residues [lo, hi) of one row
            offset, n = table[row]
            return tensor[..., offset + lo: offset + (n if hi is None else hi), :]

        if len(pieces) == 1:
            per_tok = rows_of(out0.tokens, out0.token_rows, row0) if "per_tok" in inc else None
            mean = out0.mean[:, row0]
            logits = rows_of(out0.logits, out0.logit_rows, row0) if "logits" in inc else None
        else:  # windows: every residue from the window that centres it
            spans = [(p.start, p.stop) for p, _, _ in pieces]
            chunks, lchunks = [], []
            for (p, out, row), (lo, hi) in zip(pieces, owner_ranges(spans)):
                chunks.append(rows_of(out.tokens, out.token_rows, row, lo - p.start, hi - p.start))
                if "logits" in inc:
                    lchunks.append(rows_of(out.logits, out.logit_rows, row, lo - p.start, hi - p.start))
            per_tok = torch.cat(chunks, dim=1)
            mean = per_tok.mean(1)
            logits = torch.cat(lchunks, dim=0) if "logits" in inc else None
        if "per_tok" in inc:
            item["representations"] = {layer: per_tok[i].clone() for i, layer in enumerate(self.layers)}
        if "mean" in inc:
            item["mean_representations"] = {layer: mean[i].clone() for i, layer in enumerate(self.layers)}
        if "bos" in inc:
            item["bos_representations"] = {layer: out0.bos[i, row0].clone() for i, layer in enumerate(self.layers)}
        if "contacts" in inc:
            n = first.length
            item["contacts"] = out0.contacts[row0, :n, :n].clone()
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
            done = writer.written_ids([r.id for r in records])
            todo = [r for r in records if r.id not in done]
            summary.skipped += len(records) - len(todo)
            records = todo
            if world > 1:  # every rank has read the same parts before any rank writes a new one
                import torch.distributed as dist
                dist.barrier()
        cfg = self.config
        if world > 1:  # shard whole records (windows of one record stay together), balanced by tokens
            mine = shard_by_tokens([len(r.sequence) + 2 for r in records], world)[rank]
            records = [records[i] for i in mine]
        pieces, warnings = plan_pieces(records, cfg.truncation_seq_length, cfg.long_policy, cfg.window_overlap)
        for _, message in warnings:
            log.warning("warning: %s", message)
        summary.truncated += [rid for rid, _ in warnings]
        batches = plan_batches(pieces, cfg.toks_per_batch, packed=not self.padded)
        waiting: dict[int, list] = {}
        bar = tqdm(total=len(records), unit="seq", desc=f"embed{f' rank {rank}' if world > 1 else ''}",
                   disable=not progress, dynamic_ncols=True)

        def finish(batch: list[Piece], out: BatchOutput, copied) -> list[dict]:
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
                    windows = [r for r, p in enumerate(batch) if p.parts > 1]
                    out = self.forward(seqs, windows)  # queued on the GPU; the previous batch is assembled meanwhile
                    copied = torch.cuda.Event() if self.device.type == "cuda" else None
                    if copied is not None:
                        copied.record()
                    summary.tokens += sum(len(s) + 2 for s in seqs)
                    current = (batch, out, copied)
                if previous is not None:
                    items = finish(*previous)
                    if not summary.first_batch_s:
                        summary.first_batch_s = time.perf_counter() - start
                    if writes:
                        waited = time.perf_counter()
                        writes.pop().result()
                        summary.write_wait_s += time.perf_counter() - waited
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
