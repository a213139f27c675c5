"""Embedding extraction (``esm-turbo embed``): fair-esm's extract script, made fast and safe.

Length-sorted token-budget batches packed with no padding (:class:`~esm_turbo.embed.fast_esm.FastEsm`), fp16/bf16 on
GPU. The host's work is per batch, not per record: one plan of every batch up front, one device-to-host copy of each
batch's outputs into a shared-memory slot, one message to writer processes (:mod:`esm_turbo.embed.pool`) that turn it
into files while the GPU runs the next batches. Writes are atomic, ``resume`` skips ids already written, and
``torch.distributed`` ranks (torchrun) each embed a share balanced by tokens.

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
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import EsmTurboError
from ..fasta import Record
from ..io import to_device_queued
from ..model.alphabet import encode, encode_packed, packed_residue_mask
from ..model.family import MAX_CONTEXT, family_of
from ..model.sizes import MAX_RESIDUES
from ..schema import DTYPES
from .batching import Piece, owner_ranges, plan_batches, plan_pieces, shard_by_tokens, window_spans
from .chunk import Chunk
from .fast_esm import FastEsm, PackedBatch
from .writer_process import Message, slot_array

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
    dtype: str = "auto"  # auto (fp16 on CUDA, fp32 elsewhere) | fp32 | fp16 | bf16 | fp8 (FP8 products, bf16 around)
    fp8_keep: list[int] = field(default_factory=list)  # fp8: blocks whose products stay in bf16 (FastEsm.to_fp8)
    gelu: str | None = None  # erf (ESM-2's own GELU) | tanh (its approximation, faster: FastEsm.gelu) | None: as is

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the model's activations take on ``device``: ``dtype`` (bf16 for fp8, whose matrix products
        alone run in FP8), or for auto fp16 on CUDA and fp32 elsewhere."""
        if self.dtype == "fp8":
            from .fp8 import FP8_COMPUTE_DTYPE
            return FP8_COMPUTE_DTYPE
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32

    def check(self) -> None:
        bad = [k for k in self.include if k not in INCLUDE_KINDS]
        if bad:
            raise EsmTurboError(f"--include: unknown kind(s) {bad}; choose from {list(INCLUDE_KINDS)}")
        if self.dtype not in ("auto", "fp8") and self.dtype not in DTYPES:
            raise EsmTurboError(f"--dtype {self.dtype!r}: choose auto, fp32, fp16, bf16 or fp8")
        if self.fp8_keep and self.dtype != "fp8":
            raise EsmTurboError("--fp8-keep names blocks kept out of FP8: it goes with --dtype fp8")
        if self.gelu not in (None, "erf", "tanh"):
            raise EsmTurboError(f"--gelu {self.gelu!r}: choose erf or tanh")
        if self.gelu == "tanh" and "contacts" in self.include:
            raise EsmTurboError("--gelu tanh runs in FastEsm, which has no attention maps: contacts need --gelu erf")
        if self.dtype == "fp8" and "contacts" in self.include:
            raise EsmTurboError("--dtype fp8 runs in FastEsm, which has no attention maps: contacts need fp16, bf16 "
                                "or fp32")
        if not 1 <= self.truncation_seq_length <= MAX_CONTEXT:
            raise EsmTurboError(f"--truncation-seq-length must be in [1, {MAX_CONTEXT}] (ESM C's trained context; "
                                f"ESM-2's is {MAX_RESIDUES})")
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
    startup: dict = field(default_factory=dict)  # start-up phases: name → seconds
    written_ids: list = field(default_factory=list)  # by this run
    present_ids: list = field(default_factory=list)  # asked for and found already written (resume)
    wall_s: float = 0.0  # process start to the output closed

    def line(self) -> str:
        parts = ", ".join(f"{name} {sec:.1f}" for name, sec in self.startup.items())
        times = ", ".join(f"{name} {sec:.1f} s" + (f" ({parts})" if name == "start-up" and parts else "")
                          for name, sec in (("start-up", self.startup_s), ("first batch", self.first_batch_s),
                                            ("waiting on writes", self.write_wait_s), ("final merge", self.merge_s))
                          if sec)
        wall = (f"; end to end {self.wall_s:.1f} s ({self.tokens / self.wall_s:.0f} tokens/s)"
                if self.wall_s else "")
        return (f"written {self.written}, skipped {self.skipped} (already there), failed {len(self.failed)}, "
                f"truncated {len(self.truncated)}; {self.tokens} tokens in {self.seconds:.1f} s "
                f"({self.tokens / max(self.seconds, 1e-9):.0f} tokens/s)" + (f"; {times}" if times else "") + wall)


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
class _Launched:
    """One batch on its way: its pieces (whole records first), the slot its outputs are copied into, where each
    kind lies there, and the event after which the host may read them."""

    pieces: list[Piece]
    whole: int
    residues: np.ndarray  # [S] residues per row
    slot: int
    arrays: dict[str, tuple[int, tuple[int, ...]]]
    copied: object | None


class LocalSink:
    """The sink interface of :class:`~esm_turbo.embed.pool.WriterPool` over a writer called in this process (tests,
    benchmarks, writers that drop what they get): slots are pinned host buffers, each message written at once."""

    def __init__(self, writer):
        self.writer, self.ring, self.wait_s, self._free = writer, None, 0.0, []

    def set_ring(self, nbytes: int, pin: bool, slots: int = 2) -> None:
        from .pool import HostRing
        self.ring = HostRing(nbytes, slots, pin, shared=False)
        self._free = list(range(slots))

    def acquire(self) -> int:
        return self._free.pop()

    def submit(self, msg) -> None:
        memory = self.ring.tensors[msg.slot].numpy() if msg.slot is not None else None
        self.writer.write_chunk(msg.resolve(memory))
        if msg.slot is not None:
            self._free.append(msg.slot)

    def close(self) -> list[str]:
        return list(getattr(self.writer, "written", []))


class Embedder:
    """Runs ESM-2 over records and hands each batch's finished records to a writer.

    The forward is :class:`~esm_turbo.embed.fast_esm.FastEsm` (packed batches, no padding); contact maps, which need
    every attention map, take transformers' eager path over padded batches instead. ``model``: a FastEsm (on its
    device, in its dtype) or a transformers ``EsmForMaskedLM`` (moved to ``device`` in the config's dtype).
    """

    def __init__(self, model, config: EmbedConfig, device: str | torch.device | None = None):
        config.check()
        self.config = config
        self.padded = "contacts" in config.include
        family = family_of(model.config)  # what the family cannot do is refused before any work
        if self.padded and not family.contacts:
            raise EsmTurboError(f"--include contacts: {family.label} has no contact head")
        if config.truncation_seq_length > family.max_residues:
            raise EsmTurboError(f"--truncation-seq-length {config.truncation_seq_length}: {family.label}'s trained "
                                f"context is {family.max_residues} residues")
        if isinstance(model, FastEsm):
            if self.padded:
                raise EsmTurboError("contacts need transformers' attention maps: load the model with load_esm")
            weight = model.embed_tokens.weight
            self.fast, self.model, self.device, self.dtype = model, None, weight.device, weight.dtype
            self.num_layers = model.num_layers
        else:
            dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            dtype = config.torch_dtype(dev)
            self.model = model.to(device=dev, dtype=dtype).eval()
            self.device, self.dtype = dev, dtype
            self.num_layers = self.model.config.num_hidden_layers
            self.model.config._attn_implementation = "eager" if self.padded else "sdpa"
            self.fast = None if self.padded else FastEsm.from_hf(self.model)
        if config.gelu is not None and self.fast is not None and self.fast.gelu != config.gelu:
            if self.fast.gelu is None:
                raise EsmTurboError(f"--gelu {config.gelu}: {family.label}'s feed-forward is SwiGLU, not GELU")
            self.fast.gelu = config.gelu
        self.layers = resolve_layers(config.repr_layers, self.num_layers)

    def warm_up(self) -> None:
        """Compile (or find in the on-disk cache) and load every kernel of the forward on a small batch, so the first
        real batch does not wait for them. A no-op off CUDA, where nothing is compiled."""
        if self.device.type != "cuda":
            return
        # two token counts, one a multiple of 16 and one not: Triton builds a kernel for each (it specialises
        # integer arguments on divisibility by 16), and real batches meet both
        for seqs in (["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "GSHMLEDPVDA"],  # 48 tokens
                     ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIE"]):  # 33
            rows = np.arange(len(seqs)) if "per_tok" in self.config.include else np.arange(0)
            self.outputs(seqs, rows)
        torch.cuda.synchronize(self.device)

    # ---- one batch on the device ------------------------------------------------------------------
    def _token_rows(self, rows: int, whole: int) -> np.ndarray:
        """Rows whose per-residue states are kept: every row for ``per_tok``, else the windows (rows from ``whole``
        on), which the loop stitches."""
        return np.arange(0 if "per_tok" in self.config.include else whole, rows)

    @torch.inference_mode()
    def outputs(self, seqs: list[str], token_rows: np.ndarray) -> dict[str, torch.Tensor]:
        """One batch's outputs on the device, float32: ``mean``/``bos`` [nL, S, D]; ``tokens`` [nL, M, D] (the residues
        of ``token_rows`` one after another) when any; ``logits`` [M', V] (every row's residues) and ``contacts``
        [S, W, W] when asked."""
        if self.padded:
            return self._outputs_padded(seqs, token_rows)
        ids, positions, cu = encode_packed(seqs)
        batch = PackedBatch.from_arrays(ids, positions, cu, device=self.device)
        want_logits = "logits" in self.config.include
        hidden = self.fast(batch, sorted(set(self.layers) | ({self.num_layers} if want_logits else set())))
        pooled = [self.fast.pool(hidden[layer], batch) for layer in self.layers]
        out = {"mean": torch.stack([m for m, _ in pooled]), "bos": torch.stack([b for _, b in pooled])}

        def residues(mask: np.ndarray) -> torch.Tensor:
            return to_device_queued(np.flatnonzero(mask), self.device)
        if len(token_rows):
            idx = residues(packed_residue_mask(cu, None if len(token_rows) == len(seqs) else token_rows))
            out["tokens"] = torch.stack([hidden[layer].index_select(0, idx) for layer in self.layers]).float()
        if want_logits:
            idx = residues(packed_residue_mask(cu))
            out["logits"] = self.fast.logits(hidden[self.num_layers].index_select(0, idx)).float()
        return out

    def _outputs_padded(self, seqs: list[str], token_rows: np.ndarray) -> dict[str, torch.Tensor]:
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
        result = {"mean": mean, "bos": hidden[:, :, 0]}
        if len(token_rows):
            result["tokens"] = torch.cat([hidden[:, r, 1: residues[r] + 1] for r in token_rows], dim=1)
        if "logits" in self.config.include:
            logits = self.model.lm_head(out.last_hidden_state).float()
            result["logits"] = torch.cat([logits[r, 1: residues[r] + 1] for r in range(len(seqs))])
        attns = torch.stack(out.attentions, dim=1)
        attns = attns * mask[:, None, None, :, None] * mask[:, None, None, None, :]
        result["contacts"] = self.model.esm.contact_head(tokens, attns.to(self.dtype)).float()
        return result

    def _shapes(self, pieces: list[Piece], whole: int) -> dict[str, tuple[int, ...]]:
        """Where a batch's outputs lie in its slot: kind → shape (float32), from the plan alone."""
        nl, d, s = len(self.layers), self._hidden, len(pieces)
        lengths = [p.length for p in pieces]
        shapes: dict[str, tuple[int, ...]] = {"mean": (nl, s, d), "bos": (nl, s, d)}
        token_rows = self._token_rows(s, whole)
        if len(token_rows):
            shapes["tokens"] = (nl, sum(lengths[r] for r in token_rows), d)
        if "logits" in self.config.include:
            shapes["logits"] = (sum(lengths), self._vocab)
        if self.padded:
            shapes["contacts"] = (s, max(lengths), max(lengths))
        return shapes

    @property
    def _hidden(self) -> int:
        return (self.fast.config if self.fast is not None else self.model.config).hidden_size

    @property
    def _vocab(self) -> int:
        return (self.fast.config if self.fast is not None else self.model.config).vocab_size

    def _launch(self, pieces: list[Piece], whole: int, shapes: dict[str, tuple[int, ...]], records: list[Record],
                sink) -> _Launched:
        """Queue a batch's forward (``whole`` records first, then windows) and its copies into a slot laid out as
        ``shapes`` (:meth:`_shapes`); nothing waits for the device."""
        seqs = [records[p.index].sequence[p.start: p.stop] for p in pieces]
        slot = sink.acquire()
        out = self.outputs(seqs, self._token_rows(len(pieces), whole))
        arrays, offset = {}, 0
        for kind, shape in shapes.items():
            sink.ring.view(slot, offset, shape).copy_(out[kind], non_blocking=True)
            arrays[kind] = (offset, shape)
            offset += int(np.prod(shape))
        copied = None
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return _Launched(pieces, whole, np.asarray([p.length for p in pieces], np.int64), slot, arrays, copied)

    # ---- the whole job -----------------------------------------------------------------------------
    def run(self, records: list[Record], writer, resume: bool = False, progress: bool = True,
            rank: int = 0, world: int = 1, summary: EmbedSummary | None = None, sink=None) -> EmbedSummary:
        """Embed ``records`` (this rank's share when ``world`` > 1) into ``writer``: written in this process, or by
        ``sink`` (a started :class:`~esm_turbo.embed.pool.WriterPool`) when given, ``writer`` then only read for
        resume."""
        summary = summary or EmbedSummary()
        start = time.perf_counter()
        if resume:
            done = writer.written_ids([r.id for r in records])
            summary.present_ids += sorted(done)
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
        # whole records first in each batch: the writer takes a batch's first rows as they are
        batches = []  # (pieces, whole records, slot layout)
        for b in plan_batches(pieces, cfg.toks_per_batch, packed=not self.padded):
            b = sorted(b, key=lambda p: p.parts > 1)
            whole = sum(p.parts == 1 for p in b)
            batches.append((b, whole, self._shapes(b, whole)))
        sink = sink or LocalSink(writer)
        largest = max((sum(int(np.prod(s)) for s in shapes.values()) for _, _, shapes in batches), default=1)
        sink.set_ring(4 * largest, pin=self.device.type == "cuda")
        waiting: dict[int, list] = {}
        bar = tqdm(total=len(records), unit="seq", desc=f"embed{f' rank {rank}' if world > 1 else ''}",
                   disable=not progress, dynamic_ncols=True, mininterval=0.5)
        layers = list(self.layers)
        inc = set(cfg.include)  # what reaches the writers (the slot may hold more, for stitching windows)
        sent = {kind for kind, asked in (("mean", "mean"), ("bos", "bos"), ("tokens", "per_tok"), ("logits", "logits"),
                                         ("contacts", "contacts")) if asked in inc}

        def finish(job: _Launched) -> None:
            if job.copied is not None:
                job.copied.synchronize()  # this batch's copies only; the next batch keeps running
            memory = sink.ring.tensors[job.slot].numpy()
            done = [self._stitch(records[i], waiting.pop(i)) for i in self._windows(job, memory, waiting)]
            ids = [records[p.index].id for p in job.pieces[: job.whole]]
            sink.submit(Message(ids, job.residues[: job.whole], layers, slot=job.slot,
                                arrays={k: v for k, v in job.arrays.items() if k in sent}))
            for chunk in done:
                sink.submit(Message(chunk.ids, chunk.residues, layers, chunk=chunk))
            summary.written += len(ids) + len(done)
            bar.update(len(ids) + len(done))

        previous = None
        for batch in batches + [None]:
            current = self._launch(*batch, records, sink) if batch is not None else None
            if current is not None:
                summary.tokens += int(current.residues.sum()) + 2 * len(current.pieces)
            if previous is not None:
                finish(previous)
                if not summary.first_batch_s:
                    summary.first_batch_s = time.perf_counter() - start
            previous = current
        summary.written_ids = sink.close()
        summary.write_wait_s += sink.wait_s
        bar.close()
        summary.seconds += time.perf_counter() - start
        return summary

    def _windows(self, job: _Launched, memory: np.ndarray, waiting: dict[int, list]) -> list[int]:
        """Copy the batch's window rows out of its slot into ``waiting``; the records now complete."""
        if job.whole == len(job.pieces):
            return []
        per_tok = "per_tok" in self.config.include
        offsets = np.concatenate([[0], np.cumsum(job.residues)])
        tok_base = offsets[job.whole] if per_tok else 0  # window rows' residues start here in "tokens"

        def arr(kind):
            return slot_array(memory, job.arrays[kind])
        complete = []
        for row in range(job.whole, len(job.pieces)):
            piece = job.pieces[row]
            lo = offsets[row] - offsets[job.whole] + tok_base
            hi = lo + job.residues[row]
            part = {"tokens": arr("tokens")[:, lo:hi].copy(), "bos": arr("bos")[:, row].copy()}
            if "logits" in job.arrays:
                part["logits"] = arr("logits")[offsets[row]: offsets[row + 1]].copy()
            waiting.setdefault(piece.index, []).append((piece, part))
            if len(waiting[piece.index]) == piece.parts:
                complete.append(piece.index)
        return complete

    def _stitch(self, rec: Record, parts: list) -> Chunk:
        """One record from its windows: every residue from the window that centres it; ``bos`` from the first."""
        parts = sorted(parts, key=lambda x: x[0].part)
        spans = [(p.start, p.stop) for p, _ in parts]
        tokens, logits = [], []
        for (p, part), (lo, hi) in zip(parts, owner_ranges(spans)):
            tokens.append(part["tokens"][:, lo - p.start: hi - p.start])
            if "logits" in part:
                logits.append(part["logits"][lo - p.start: hi - p.start])
        per_tok = np.concatenate(tokens, axis=1)  # [nL, n, D]
        inc = self.config.include
        chunk = Chunk([rec.id], np.asarray([per_tok.shape[1]], np.int64))
        if "per_tok" in inc:
            chunk.tokens = {layer: per_tok[i] for i, layer in enumerate(self.layers)}
        if "mean" in inc:
            chunk.mean = {layer: per_tok[i].mean(0)[None] for i, layer in enumerate(self.layers)}
        if "bos" in inc:
            chunk.bos = {layer: parts[0][1]["bos"][i][None] for i, layer in enumerate(self.layers)}
        if logits:
            chunk.logits = np.concatenate(logits)
        return chunk


def distributed_context() -> tuple[int, int]:
    """(rank, world) from torchrun's environment (or ``esm-turbo embed --gpus``'), initialising the process group
    once: gloo, as the ranks only ever wait on each other (NCCL would build GPU communicators for nothing)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available() and local < torch.cuda.device_count():  # --nogpu ranks may outnumber GPUs
            torch.cuda.set_device(local)
    return dist.get_rank(), dist.get_world_size()


__all__ = ["EmbedConfig", "EmbedSummary", "Embedder", "INCLUDE_KINDS", "distributed_context", "resolve_layers",
           "window_spans"]
