"""Whole cache blocks between a paged pool's buffers and a staging buffer, one launch (Triton).
Reference: ``esm_turbo.ops.blocks.move_blocks_reference`` (same contract).

A pool is one buffer per (layer, part), each [slots, …] with a slot's bytes contiguous (a *segment*). A staging row
holds one block's every segment side by side, so a row copies to or from host memory in one piece. Program (i, s)
copies segment ``s`` of block ``i``: staging row ``i`` at ``offsets[s]`` ↔ slot ``slots[i]`` of the buffer at
address ``bases[s]``, ``words[s]`` words long (a word: the staging dtype; every offset and size a whole number).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting


@triton.jit
def _blocks_kernel(stage_ptr, base_ptr, offset_ptr, words_ptr, slot_ptr, row_words,
                   TO_POOL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    seg = tl.program_id(1)
    words = tl.load(words_ptr + seg)
    pool = tl.load(base_ptr + seg).to(tl.pointer_type(stage_ptr.dtype.element_ty))
    pool += tl.load(slot_ptr + i).to(tl.int64) * words
    stage = stage_ptr + i.to(tl.int64) * row_words + tl.load(offset_ptr + seg)
    for start in range(0, words, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < words
        if TO_POOL:
            tl.store(pool + cols, tl.load(stage + cols, mask=mask), mask=mask)
        else:
            tl.store(stage + cols, tl.load(pool + cols, mask=mask), mask=mask)


def move_blocks_triton(stage: torch.Tensor, bases: torch.Tensor, offsets: torch.Tensor, words: torch.Tensor,
                       slots: torch.Tensor, to_pool: bool) -> None:
    """stage [n, row_words] (the word dtype); bases / offsets / words [segments] int64 (buffer addresses, a segment's
    word offset in a staging row, its length in words); slots [n] int64 on the device. ``to_pool``: staging →
    pool, else pool → staging."""
    n, row_words = stage.shape
    if n == 0:
        return
    _blocks_kernel[(n, bases.numel())](stage, bases, offsets, words, slots, row_words, TO_POOL=to_pool,
                                       BLOCK=256 if interpreting() else 2048, num_warps=4)
