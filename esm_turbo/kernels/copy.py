"""One contiguous buffer copied into another by the GPU's multiprocessors (Triton), in 4-byte words read and written
16 bytes at a time: a replayed block's weights into its captured graph's buffer
(:class:`~esm_turbo.embed.block_replay.BlockGraph`, where ``block_replay.COPY_KERNEL`` asks for it).
``Tensor.copy_`` between two device buffers is a device-to-device memcpy, which moved a 150M-shaped block's 9.8 MB
at about 1.7 TB/s of traffic on an H100. Reference: ``dst.copy_(src)``, which :func:`copy_words_triton` equals bit
for bit (tested under the interpreter; not yet timed on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: 4-byte words a program copies (16 KB)
WORDS = 4096
#: what :func:`copy_words_triton` asks of the buffers' sizes (bytes), so that every program's loads run 16 bytes wide
ALIGN = 64


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n_words, WORDS: tl.constexpr):
    """Program p: words [p·WORDS, (p + 1)·WORDS) of src into dst (int32 words; n_words a multiple of 16)."""
    offs = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
    ok = offs < n_words
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok), mask=ok)


def copy_words_triton(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for two contiguous buffers of one dtype and size, a multiple of :data:`ALIGN` bytes, at
    16-byte-aligned addresses, in one launch (CUDA, or CPU under Triton's interpreter). Returns dst."""
    nbytes = src.numel() * src.element_size()
    if (dst.dtype != src.dtype or dst.shape != src.shape or not (dst.is_contiguous() and src.is_contiguous())
            or nbytes % ALIGN or dst.data_ptr() % 16 or src.data_ptr() % 16):
        raise ValueError(f"copy of {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}: both must be "
                         f"contiguous, alike, {ALIGN}-byte multiples at 16-byte-aligned addresses")
    n_words = nbytes // 4
    if n_words:
        words = (src.view(torch.uint8).view(-1).view(torch.int32), dst.view(torch.uint8).view(-1).view(torch.int32))
        _copy_kernel[(triton.cdiv(n_words, WORDS),)](*words, n_words, WORDS=WORDS, num_warps=4)
    return dst


__all__ = ["ALIGN", "WORDS", "copy_words_triton"]
