"""A paged pool's blocks as staging rows: :class:`BlockLayout` says where each (layer, part) segment of a block lies
in one row, and :meth:`BlockLayout.move` copies blocks between the pool's slots and staging rows (the Triton kernel
``esm_turbo.kernels.blocks`` on CUDA, :func:`move_blocks_reference` elsewhere). The host tier keeps blocks as such
rows, so moving a run of blocks across the link is one copy."""

from __future__ import annotations

import math

import torch

from ..io import to_device_queued

#: tokens per block of a paged cache: the one default (PagedKVCache, TurboEsm.session, bench design)
BLOCK_SIZE = 64


def _bytes(buf: torch.Tensor) -> torch.Tensor:
    """A pool buffer [slots, …] as [slots, bytes of a slot] uint8 (a view)."""
    return buf.view(buf.shape[0], -1).view(torch.uint8)


def part_heads(entry: tuple, heads: int) -> int:
    """The heads a part spec ``(shape, dtype)`` or ``(shape, dtype, heads of the part)`` is stored for (a token part:
    1, ``KVCodec.part_heads``)."""
    return entry[2] if len(entry) > 2 else heads


class BlockLayout:
    """Segments of one block: for each layer and part of ``specs`` (``KVCodec.part_specs()`` per layer, each entry
    ``(shape, dtype)`` or with the part's own head count third, :func:`part_heads`) a slot of [heads, block_size,
    *shape] in its dtype, laid side by side in that order; ``row_bytes`` in all. ``word``: the widest of 8, 4, 2, 1
    bytes dividing every segment (the unit the kernel moves)."""

    def __init__(self, specs: list[dict], heads: int, block_size: int):
        sizes = [part_heads(entry, heads) * block_size * math.prod(entry[0]) * entry[1].itemsize for spec in specs
                 for entry in spec.values()]
        self.sizes = sizes
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.row_bytes = sum(sizes)
        self.word = next(w for w in (8, 4, 2, 1) if all(s % w == 0 for s in sizes))
        self._table: tuple[tuple[int, ...], torch.Tensor] | None = None

    def _word_dtype(self) -> torch.dtype:
        return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[self.word]

    def _segments(self, pools: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
        """[3, segments] int64 on ``device``: buffer addresses, word offsets, word lengths (kept while the buffers
        stay)."""
        ptrs = tuple(buf.data_ptr() for layer in pools for buf in layer.values())
        if self._table is None or self._table[0] != ptrs:
            table = [ptrs, [o // self.word for o in self.offsets], [s // self.word for s in self.sizes]]
            self._table = (ptrs, to_device_queued(table, device))
        return self._table[1]

    def move(self, pools: list[dict[str, torch.Tensor]], stage: torch.Tensor, slots: torch.Tensor,
             to_pool: bool) -> None:
        """Copy blocks between ``pools`` (per layer, per part [slots, heads, block_size, *shape]) at device ``slots``
        [n] long and ``stage`` [≥ n, row_bytes] uint8 rows 0…n-1: into the pools (``to_pool``) or out of them."""
        from . import use_kernels
        stage = stage[: slots.numel()]
        if use_kernels(stage):
            from ..kernels.blocks import move_blocks_triton
            bases, offsets, words = self._segments(pools, stage.device)
            move_blocks_triton(stage.view(self._word_dtype()), bases, offsets, words, slots, to_pool)
        else:
            move_blocks_reference(self, pools, stage, slots, to_pool)


def move_blocks_reference(layout: BlockLayout, pools: list[dict[str, torch.Tensor]], stage: torch.Tensor,
                          slots: torch.Tensor, to_pool: bool) -> None:
    """:meth:`BlockLayout.move` in PyTorch: one ``index_copy_`` / ``index_select`` per segment."""
    bufs = [buf for layer in pools for buf in layer.values()]
    for buf, offset, size in zip(bufs, layout.offsets, layout.sizes):
        rows = _bytes(buf)
        if to_pool:
            rows.index_copy_(0, slots, stage[:, offset:offset + size])
        else:
            stage[:, offset:offset + size] = rows.index_select(0, slots)
