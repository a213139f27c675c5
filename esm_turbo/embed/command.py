"""``esm-turbo embed`` from arguments to closed output: what the command does around the embedding loop.

In order, so that a bad request is refused before the model is touched and nothing is paid twice: the output checked
against the request (``--resume`` / ``--overwrite``), writer processes started (their imports overlap the rest), the
FASTA read, the model read straight onto the device (:mod:`esm_turbo.model.folder`; transformers only where a
checkpoint needs it), its fingerprint checked against the output, the forward compiled on a small batch (the graph
found in torch's on-disk cache on a second run), then the loop, the writers' last files and the merge.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from ..io import seconds_since_start
from ..schema import DTYPES
from .extract import EmbedConfig, Embedder, EmbedSummary, distributed_context, resolve_layers
from .writers import check_output, make_writer

log = logging.getLogger("esm_turbo")


class _Phases:
    """Start-up phases as they pass: name → seconds."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self._last
        self._last = now


class _Background:
    """``fn()`` on a daemon thread (a run that fails elsewhere exits without waiting for it); :meth:`result` joins
    and returns its value or raises its error."""

    def __init__(self, fn):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="esm-turbo-fasta")
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._value = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller at the join
            self._error = error

    def raise_if_failed(self) -> None:
        if not self._thread.is_alive() and self._error is not None:
            raise self._error

    def result(self):
        self._thread.join()
        self.raise_if_failed()
        return self._value


def default_writers(fmt: str, ranks_here: int) -> int:
    """Writer processes per rank: one for HDF5 (parts are cheap), for ``.pt`` files up to 4 of this host's cores."""
    if fmt == "h5":
        return 1
    return max(1, min(4, (os.cpu_count() or 2) // (2 * max(1, ranks_here))))


def load_for_embedding(model: str, cfg: EmbedConfig, device: torch.device, logits: bool, offload: bool,
                       phases: _Phases | None = None, quiet: bool = False):
    """(the model to embed with, its fingerprint). A transformers folder with safetensors (or a hub id in the local
    cache) is read straight into FastEsm on the device; contacts, quantized folders, fair-esm files and downloads
    take transformers' masked-LM class (``EsmForMaskedLM``, ``EsmcForMaskedLM``)."""
    from ..model.folder import (arch_of, canonical_name, direct_folder, expected_shapes, load_tensors,
                                weights_fingerprint)
    from ..model.sizes import resolve_model_id
    dtype = cfg.torch_dtype(device)
    folder = None if ("contacts" in cfg.include or offload) else direct_folder(resolve_model_id(model))
    if folder is not None:
        from .fast_esm import FastEsm
        config, tensors = load_tensors(folder, device=device, dtype=dtype, heads=logits)
        if phases is not None:
            phases.mark("model")
        body = expected_shapes(config)[0]
        fingerprint = weights_fingerprint(config.arch(), [(n, t) for n, t in tensors.items() if n in body])
        if phases is not None:
            phases.mark("fingerprint")
        fast = FastEsm.from_tensors(config, tensors)
        return (fast.to_fp8(fp8_blocks(cfg.fp8_keep, fast.num_layers)) if cfg.dtype == "fp8" else fast), fingerprint
    from ..model.loading import load_esm
    if quiet:  # transformers' own loading bar
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    net = load_esm(model, dtype=dtype)  # loaded in the dtype it runs in (no fp32 copy), checked
    if offload:  # the residual pass in pinned host memory, a layer copied ahead (weights.offload)
        from ..weights.offload import offload_residual
        offload_residual(net, device)
    arch = arch_of(net.config)
    named = [(canonical_name(n), t) for n, t in net.state_dict().items()
             if not n.startswith(("lm_head.", "esm.contact_head.")) and not n.endswith(("position_ids", "inv_freq"))]
    if phases is not None:
        phases.mark("model")
    fingerprint = weights_fingerprint(arch, named)
    if cfg.dtype == "fp8":
        from .fast_esm import FastEsm
        fast = FastEsm.from_hf(net)
        return fast.to_fp8(fp8_blocks(cfg.fp8_keep, fast.num_layers)), fingerprint
    return net, fingerprint


def fp8_blocks(keep: list[int], layers: int) -> tuple[int, ...]:
    """``--fp8-keep``'s blocks, checked against the model's ``layers`` (one line naming the block)."""
    from .fast_esm import check_blocks
    return check_blocks(keep, layers, "--fp8-keep")


def run_embed(args) -> int:
    """The command; returns its exit code (errors raise :class:`EsmTurboError`)."""
    from ..fasta import read_fasta
    phases = _Phases()
    phases.times["imports"] = seconds_since_start() or 0.0
    rank, world = distributed_context()
    cfg = EmbedConfig(repr_layers=args.repr_layers, include=args.include, toks_per_batch=args.toks_per_batch,
                      truncation_seq_length=args.truncation_seq_length, long_policy=args.long_policy,
                      window_overlap=args.window_overlap, dtype=args.dtype, fp8_keep=list(args.fp8_keep),
                      gelu=args.gelu)
    cfg.check()
    device = torch.device("cpu" if args.nogpu else (args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if device.type == "cuda" and world > 1 and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = cfg.torch_dtype(device)
    dtype_name = cfg.dtype if cfg.dtype != "auto" else next(k for k, v in DTYPES.items() if v == dtype)
    if cfg.dtype == "fp8":
        from .fp8 import require_fp8
        require_fp8(device, "--dtype fp8", "use --dtype fp16 or bf16")
    from ..cli_checks import known_layer_count
    layers = known_layer_count(str(args.model))
    meta = dict(model=str(args.model), dtype=dtype_name, include=sorted(set(cfg.include)),
                truncation_seq_length=cfg.truncation_seq_length, long_policy=cfg.long_policy,
                window_overlap=cfg.window_overlap, gelu=cfg.gelu or "erf")
    if cfg.dtype == "fp8":
        meta["fp8_keep"] = sorted(cfg.fp8_keep)
    if layers is not None:
        meta["repr_layers"] = resolve_layers(args.repr_layers, layers)  # refused here, before the model is loaded
        fp8_blocks(cfg.fp8_keep, layers)
    writer = make_writer(args.format, args.output, rank, world)
    check_output(writer, meta, args.resume, args.overwrite)
    summary = EmbedSummary()

    def read_all() -> tuple[list, list]:
        records, problems, seen = [], [], set()
        for path in args.fasta:  # length limits are the embedder's job (truncate / windows), not an error
            recs, bad = read_fasta(path, skip_invalid=args.skip_invalid, seen=seen, strip_gaps=args.strip_gaps)
            records += recs
            problems += bad
        return records, problems
    # the FASTA is read on a thread while the model loads and its kernels warm up (each mostly waits on files and
    # the GPU); its errors surface as soon as they are seen, before any batch runs
    fasta = _Background(read_all)
    pool = None
    try:
        if args.writers != 0:
            from .pool import WriterPool
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            pool = WriterPool(args.format, args.output, rank, world,
                              workers=args.writers or default_writers(args.format, local)).start()
        phases.mark("writers")
        if device.type == "cuda":  # the context, apart from the weights' own time
            torch.empty(1, device=device)
            phases.mark("cuda")
        model, fingerprint = load_for_embedding(str(args.model), cfg, device, "logits" in cfg.include,
                                                args.offload_residual, phases, quiet=args.quiet)
        embedder = Embedder(model, cfg, device)
        phases.mark("model")
        fasta.raise_if_failed()
        meta.update(repr_layers=embedder.layers, model_fingerprint=fingerprint)
        check_output(writer, meta, args.resume, args.overwrite)
        if args.overwrite and rank == 0:
            writer.clear()
        writer.meta = meta
        writer.start()
        if world > 1:  # no rank writes before rank 0 has cleared and started the output
            import torch.distributed as dist
            dist.barrier()
        if pool is not None:
            pool.meta = meta
        embedder.warm_up()
        phases.mark("warm-up")
        records, summary.failed = fasta.result()
        for problem in summary.failed:
            log.warning("skipped: %s", problem)
        phases.mark("fasta")
        if args.format == "h5" and rank == 0:
            writer.start_merging()
        summary.startup = phases.times
        summary.startup_s = seconds_since_start() or sum(phases.times.values())
        embedder.run(records, writer, resume=args.resume, progress=not args.quiet, rank=rank, world=world,
                     summary=summary, sink=pool)
    except BaseException:
        if pool is not None:
            pool.abort()
        raise
    writer.finalize(summary.written_ids + summary.present_ids)
    if world > 1:
        import torch.distributed as dist
        dist.barrier()
    if rank == 0:
        merging = time.perf_counter()
        writer.merge()
        summary.merge_s = time.perf_counter() - merging
    summary.wall_s = seconds_since_start() or 0.0
    print(f"esm-turbo embed{f' (rank {rank}/{world})' if world > 1 else ''}: {summary.line()}", file=sys.stderr)
    for problem in summary.failed:
        print(f"  failed: {problem}", file=sys.stderr)
    if world > 1:
        dist.destroy_process_group()
    return 0


__all__ = ["default_writers", "load_for_embedding", "run_embed"]
