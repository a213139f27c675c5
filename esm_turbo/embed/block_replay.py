"""Replaying one captured block of FastEsm's fused forward for the blocks after it (:class:`BlockGraph`), and the
per-block weight storage that makes each replay's weight copy one contiguous copy (:class:`PackedBlocks`).

A CUDA graph reads the tensors it was captured with, so a captured block stands for another only once that block's
weights, biases and norms are copied into the graph's own. Held as separate tensors, that copy is a multi-tensor copy
over a block's leaves (:meth:`~esm_turbo.embed.fast_esm.BlockTensors.leaves`); held as views of one flat buffer per
block, laid out alike in every block and in the graph's own, it is one copy of that buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .fast_esm import BlockTensors, FastEsm

#: a batch's blocks replay one captured block (:class:`BlockGraph`) by default where a block's work, tokens × width²,
#: is at most this: its GPU time is then near the host's time to launch it eagerly. On an H200 and its host CPU,
#: 16K-token batches (results/embed/block_graphs_h200.json): 150M-shaped (work 6.7e9) the host's work a forward
#: 13.8 -> 4.1 ms, Embedder.run 2.08x faster on a busy host and queued forwards 4% slower where the host keeps up;
#: 650M-shaped (2.7e10) 3% slower, bound by the GPU either way
BLOCK_GRAPH_MAX_WORK = 1.2e10
#: ... and at least this many blocks replay: the capture costs about three blocks' launches on the host
BLOCK_GRAPH_MIN_REPLAYS = 8
#: where each leaf of a flat block buffer starts: a multiple of this many bytes (what TMA descriptors and 128-bit
#: loads ask of a base address, with room to spare)
FLAT_ALIGN = 256


def replay_pays(tokens: int, width: int, replays: int) -> bool:
    """Whether replaying a captured block ``replays`` times beats launching each block (see
    :data:`BLOCK_GRAPH_MAX_WORK`)."""
    return replays >= BLOCK_GRAPH_MIN_REPLAYS and tokens * width ** 2 <= BLOCK_GRAPH_MAX_WORK


def replayed_run(fp8s: list[bool], last: int) -> int:
    """The block after the run 2, 3, … (before ``last``) that one captured block 2 can stand for: a captured block
    writes its output over its input, so each block of the run and the block after it must take block 2's input
    form (``fp8s[i - 1]``: block i's products in FP8). 2 where there is no such run."""
    stop = 2
    while stop < last and fp8s[stop - 1] == fp8s[stop] == fp8s[1]:
        stop += 1
    return stop


def flat_layout(leaves: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of ``leaves`` packed one after another, each at a multiple of :data:`FLAT_ALIGN`, and the
    buffer's size in bytes. The same shapes and dtypes give the same layout."""
    offsets, total = [], 0
    for t in leaves:
        total = -(-total // FLAT_ALIGN) * FLAT_ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    return offsets, total


def flat_views(flat: torch.Tensor, leaves: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Contiguous views of the uint8 buffer ``flat`` [bytes] shaped and typed as ``leaves``, at ``offsets``."""
    return [flat[o: o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for t, o in zip(leaves, offsets)]


def packable(leaves: list[torch.Tensor]) -> bool:
    """Whether a block's leaves can live in one flat buffer: contiguous, on one device, none twice."""
    return (bool(leaves) and all(t.is_contiguous() and t.device == leaves[0].device for t in leaves)
            and len({t.data_ptr() for t in leaves}) == len(leaves))


class PackedBlocks:
    """Blocks 2 … num_layers of a model with their leaves moved into one flat uint8 buffer each, as
    :func:`flat_layout` lays them out: each leaf tensor is kept (the model's parameters stay the same objects) and
    made a view of its block's buffer (``tensor.data = view``), so a :class:`BlockGraph` built over the same layout
    replays block i after one copy of ``flat(i)``. A block whose leaves move afterwards (``model.to(...)``, new FP8
    weights) no longer matches the pointers recorded here and :meth:`flat` gives None for it (and marks this
    :attr:`stale`): the replay then copies leaf by leaf, as correct and slower. Memory: the blocks' leaves once, as
    before (their old storage is freed unless something else holds it, e.g. a transformers net that
    :meth:`FastEsm.from_hf` shares weights with)."""

    def __init__(self, model: "FastEsm", rows: int):
        self._flats: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}
        self.stale = False  # a block's leaves were found moved (FastEsm then packs the blocks again)
        # made outside inference mode, whatever the caller's: the parameters stay ordinary tensors (a later in-place
        # load into them must not meet an inference tensor)
        with torch.inference_mode(False), torch.no_grad():
            for i in range(2, model.num_layers + 1):
                leaves = model.block_tensors(i, rows).leaves()
                if not packable(leaves):
                    continue
                offsets, total = flat_layout(leaves)
                flat = torch.empty(total, dtype=torch.uint8, device=leaves[0].device)
                for t, view in zip(leaves, flat_views(flat, leaves, offsets)):
                    view.copy_(t)
                    t.data = view
                self._flats[i] = (flat, tuple(t.data_ptr() for t in leaves))

    def flat(self, i: int, leaves: list[torch.Tensor]) -> torch.Tensor | None:
        """Block i's buffer, where ``leaves`` (its leaves now) still are the views it was packed into; else None."""
        held = self._flats.get(i)
        if held is None or len(held[1]) != len(leaves):
            return None
        flat, ptrs = held
        if all(t.data_ptr() == p for t, p in zip(leaves, ptrs)):
            return flat
        self.stale = True
        return None

    def __len__(self) -> int:
        return len(self._flats)


class BlockGraph:
    """One batch's block of the fused forward, captured once as a CUDA graph and replayed for block after block.

    The graph reads its input (h, x) from the buffers it is made with (block 1's outputs) and writes its output back
    into them, and reads the block's weights, biases and norms from views of one flat buffer of its own:
    :meth:`replay` copies a block's into it (one contiguous copy where the model's blocks are
    :class:`PackedBlocks`, else a multi-tensor copy over the leaves) and replays. So the host enqueues a block's
    nine launches once a batch instead of once a block; on the CPUs that drive an H100 or H200 that is what bounds
    the smaller ESM-2s' forwards. The capture runs on a side stream without synchronising (``torch.cuda.graph``
    would wait for the device and empty the cache); block 1, run eagerly before it, has built and loaded every
    kernel the capture meets. Every batch's graph allocates from one memory pool (the model's), and the model keeps
    the last graph until the next is captured: the pool's memory then stays allocated between batches instead of
    being asked of the driver again at every capture.
    """

    def __init__(self, model: "FastEsm", h: torch.Tensor, x, cos: torch.Tensor, sin: torch.Tensor, attend, fp8: bool,
                 packed: PackedBlocks | None = None):
        tensors = model.block_tensors(2, h.shape[0])
        leaves = tensors.leaves()
        offsets, total = flat_layout(leaves)
        self.flat = torch.empty(total, dtype=torch.uint8, device=h.device)
        self.buffers = flat_views(self.flat, leaves, offsets)
        self.packed = packed
        own = tensors.with_leaves(self.buffers)
        into = (h, tuple(x) if fp8 else x)  # the block's output in its input's form: fp8 for both its and the next's
        self.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(h.device)
        side = torch.cuda.Stream(h.device)
        side.wait_stream(current)  # the buffers were allocated on the current stream
        with torch.cuda.stream(side):
            if model._block_pool is None:
                model._block_pool = torch.cuda.graph_pool_handle()
            self.graph.capture_begin(pool=model._block_pool, capture_error_mode="thread_local")
            try:
                model.fused_block(2, h, x, cos, sin, attend, fp8, fp8, tensors=own, into=into)
            finally:
                self.graph.capture_end()
        current.wait_stream(side)

    def replay(self, i: int, tensors: "BlockTensors") -> None:
        """Block ``i``: its ``tensors`` (:meth:`FastEsm.block_tensors`) copied in, the graph replayed on the current
        stream."""
        leaves = tensors.leaves()
        flat = self.packed.flat(i, leaves) if self.packed is not None else None
        if flat is not None and flat.numel() == self.flat.numel():
            self.flat.copy_(flat)
        else:
            torch._foreach_copy_(self.buffers, leaves)
        self.graph.replay()
