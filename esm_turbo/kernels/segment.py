"""The mean of each segment of rows of a packed batch (Triton): FastEsm's mean pooling of each sequence's residues.

One program sums one segment's rows over ``BLOCK_D`` columns, ``ROWS`` rows at a time, in float32 and in a fixed
order (the same result on every run). It reads the hidden states once, where a scan along the rows (a cumulative sum,
then the differences at the segment ends) reads and writes them in float32 and, on a GPU, runs as a slow scan along
the outer dimension. Reference: :func:`segment_mean_reference`, which the tests tie it to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: rows summed at a time, and columns per program
ROWS, BLOCK_D = 32, 128


def segment_mean_reference(h: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """h: [N, D]; starts, ends: [S] long, rows [start, end) of each segment (end ≥ start). Returns the float32 mean of
    each segment's rows [S, D] (zeros for an empty segment)."""
    counts = (ends - starts).clamp(min=0)
    rows = torch.arange(int(counts.sum()), device=h.device)
    seg = torch.repeat_interleave(torch.arange(len(starts), device=h.device), counts)
    first = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts)
    sums = torch.zeros(len(starts), h.shape[1], device=h.device, dtype=torch.float32)
    sums.index_add_(0, seg, h.index_select(0, rows + first).float())
    return sums / counts.clamp(min=1)[:, None].float()


@triton.jit
def _segment_mean_kernel(h_ptr, starts_ptr, ends_ptr, out_ptr, D, h_stride, ROWS: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Program (s, j): columns [j·BLOCK_D, (j + 1)·BLOCK_D) of segment s: out[s] = mean of rows [start, end)."""
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(starts_ptr + s)
    end = tl.load(ends_ptr + s)
    col_ok = cols < D
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    for r in range(start, end, ROWS):
        rows = r + tl.arange(0, ROWS)
        x = tl.load(h_ptr + rows[:, None].to(tl.int64) * h_stride + cols[None, :],
                    mask=(rows[:, None] < end) & col_ok[None, :], other=0.0)
        acc += x.to(tl.float32)
    total = tl.sum(acc, axis=0)
    count = tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + s.to(tl.int64) * D + cols, total / count, mask=col_ok)


def segment_mean_triton(h: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """:func:`segment_mean_reference` in one launch (CUDA, or CPU under Triton's interpreter); h's rows may be
    strided, its columns contiguous."""
    if h.dim() != 2 or h.stride(1) != 1 or starts.shape != ends.shape:
        raise ValueError(f"h {tuple(h.shape)} (columns contiguous) and starts, ends {tuple(starts.shape)}, "
                         f"{tuple(ends.shape)} do not describe segments of rows")
    n_seg, d = len(starts), h.shape[1]
    out = torch.empty(n_seg, d, device=h.device, dtype=torch.float32)
    if n_seg:
        _segment_mean_kernel[(n_seg, triton.cdiv(d, BLOCK_D))](h, starts, ends, out, d, h.stride(0), ROWS=ROWS,
                                                               BLOCK_D=BLOCK_D, num_warps=4)
    return out


__all__ = ["segment_mean_reference", "segment_mean_triton"]
