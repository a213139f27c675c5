"""A kernel that only reads: what any kernel reading the same bytes must take at least. The bench times it on the
bytes a decode call reads, so each size shows the most its speed-up over fp16 SDPA could be on this GPU
(``esm_turbo.bench``). Its PyTorch reference is :func:`read_words_reference`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.common import FP_FUSION

#: int32 words a warp reads per chunk: four 128-bit loads a thread
WORDS_PER_WARP = 512


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_chunks, per_prog, BLOCK: tl.constexpr):
    """Program p XORs chunks [p·per_prog, (p + 1)·per_prog) ∩ [0, n_chunks) of x (BLOCK int32 words each,
    contiguous) into out[p] [BLOCK]."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    start = pid * per_prog
    stop = tl.minimum(start + per_prog, n_chunks)
    ptr = x_ptr + start.to(tl.int64) * BLOCK + offs
    acc = tl.zeros([BLOCK], tl.int32)
    for _ in range(start, stop):
        acc ^= tl.load(ptr)
        ptr += BLOCK
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def _plan(words: torch.Tensor, programs: int, num_warps: int) -> tuple[int, int, int]:
    """(chunk words, chunks, chunks per program) of reading ``words`` [n] int32 with ``programs`` programs."""
    block = WORDS_PER_WARP * num_warps
    if words.dtype != torch.int32 or words.dim() != 1 or words.numel() % block:
        raise ValueError(f"read_words takes a 1-D int32 tensor of a multiple of {block} words, got "
                         f"{tuple(words.shape)} {words.dtype}")
    chunks = words.numel() // block
    return block, chunks, -(-chunks // programs)


def read_words(words: torch.Tensor, programs: int, num_warps: int = 1) -> torch.Tensor:
    """Every word of ``words`` [n] int32 (n a multiple of 512·num_warps) read once, in ``programs`` programs
    of ``num_warps`` warps, each taking a contiguous run of chunks → [programs, 512·num_warps] int32, each
    program's chunks XORed together (so nothing is optimised away)."""
    block, chunks, per = _plan(words, programs, num_warps)
    out = torch.empty(programs, block, dtype=torch.int32, device=words.device)
    _read_kernel[(programs,)](words, out, chunks, per, BLOCK=block, num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    return out


def read_words_reference(words: torch.Tensor, programs: int, num_warps: int = 1) -> torch.Tensor:
    """:func:`read_words` in PyTorch."""
    block, chunks, per = _plan(words, programs, num_warps)
    x = words.view(chunks, block)
    out = torch.zeros(programs, block, dtype=torch.int32, device=words.device)
    for c in range(chunks):
        out[c // per] ^= x[c]
    return out
