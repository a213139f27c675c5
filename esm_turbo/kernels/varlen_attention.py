"""Attention of every sequence of a packed batch to itself, in query blocks cut to the sequences (Triton).

Protein batches hold many short sequences (a 16K-token batch of real proteins: about a hundred, a median near 150
tokens). A kernel whose query and key tiles are 128 tokens spends most of a short sequence's work on padding; here
each program owns one query block of one sequence and one head, walking only that sequence's keys with an online
softmax in float32 (exp2, the scale inside the exponent's FMA, the values' product accumulated into the rescaled sum
in place: 1.3-2.6% faster than a scale multiply and a separate sum, ``results/embed/attention_softmax_fma_h100.txt``):
full key tiles with no masks, then the sequence's last partial tile masked; the output rounded once to q's dtype.
The tile follows the length: :data:`LENGTH_CLASSES` gives short sequences 32-token key tiles and long ones 64-token
tiles, as measured (``tools/tune_attention.py``); query blocks are 64 tokens.

:func:`attention_plan` cuts a batch into those blocks once on the host (per class, ``[3, B]`` int32 tables of block
starts, sequence starts and sequence ends, :func:`query_blocks`), and every layer reuses it: one launch per class
present. Reference: ``esm_turbo.embed.varlen.varlen_attention_reference``, which the tests tie the kernel to under
the flash-attention rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..io import to_device_queued

#: the 64-token query and key tile of short sequences
BLOCK = 64
#: the dtypes FastEsm runs this kernel in on the GPU, instead of flash attention: where it measured faster (fp16 on an
#: H200, 16K-token batches of real lengths: 110 µs against 169 at 650M-shaped, 213 against 330 at 3B, 73 against 138
#: at 150M, ``tools/tune_gemm.py``; bf16 and FP8 products' bf16 work, whole forwards, ``tools/attention_dtypes.py``:
#: bf16 150M 14.19 ms against 15.95, 650M 43.02 against 45.00, 3B 163.8 against 160.2; FP8 150M 14.75 against
#: 16.72, 650M 35.81 against 38.11, 3B 115.2 against 119.5)
GPU_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionTile:
    """One launch's shape: query block ``bm`` and key tile ``bn`` tokens, ``warps``, key tiles in flight
    ``stages`` (None: 3 for heads up to 64 wide, 2 above, whose tiles would fill a smaller GPU's shared memory)."""

    bm: int = BLOCK
    bn: int = BLOCK
    warps: int = 4
    stages: int | None = None


#: (longest sequence in tokens, tile) in increasing order: a sequence takes the first class it fits, the last class
#: takes the rest. Measured on an H200 (``tools/tune_attention.py``, 20 heads of 64, 16K-token batches): key tiles
#: of 32 are 3-14% faster up to sequences of about 256 tokens (L ~ 128: 84.5 µs against 91.8), tiles of 64 from
#: about 320 on (L ~ 1,024: 263 against 288); query blocks of 128 won nowhere by more than the run's noise
LENGTH_CLASSES: tuple[tuple[int, AttentionTile], ...] = ((288, AttentionTile(64, 32, 4, 3)), (1 << 30, AttentionTile()))


@dataclass
class AttentionPlan:
    """A batch cut into query blocks, one :func:`query_blocks` table per tile class present: ``launches`` =
    [(table [3, B] int32 on the device, tile)]. ``gluon``: the launches run in the Gluon kernel
    (:func:`~esm_turbo.kernels.varlen_attention_gluon.varlen_attention_gluon_plan`) at each tile's key tile."""

    launches: list[tuple[torch.Tensor, AttentionTile]]
    gluon: bool = False


def query_blocks(lengths: list[int], device: torch.device | str, block: int = BLOCK,
                 select=None) -> torch.Tensor:
    """[3, B] int32 on ``device``: for each query block of ``block`` tokens of each sequence (sequences one after
    another, ``lengths`` tokens each; only those ``select`` marks when given, a boolean array), its first token, its
    sequence's first token and its sequence's end. From pinned memory, so that the copy does not wait for the GPU."""
    import numpy as np
    lens = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    if select is not None:
        lens, starts = lens[select], starts[select]
    counts = -(-lens // block)
    seq = np.repeat(np.arange(len(lens)), counts)
    first = np.repeat(starts, counts) + block * (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts,
                                                                                     counts))
    return to_device_queued(np.stack([first, starts[seq], (starts + lens)[seq]]), torch.device(device), torch.int32)


def attention_plan(lengths: list[int], device: torch.device | str,
                   classes: tuple[tuple[int, AttentionTile], ...] | None = None) -> AttentionPlan:
    """The batch's query blocks, each sequence in the first of ``classes`` (default :data:`LENGTH_CLASSES`) whose
    longest length it fits."""
    import numpy as np
    classes = classes or LENGTH_CLASSES
    lens = np.asarray(lengths, dtype=np.int64)
    launches, below = [], np.zeros(len(lens), dtype=bool)
    for i, (longest, tile) in enumerate(classes):
        fits = (lens <= longest) if i < len(classes) - 1 else np.ones(len(lens), dtype=bool)
        select = fits & ~below
        below |= fits
        if select.any():
            launches.append((query_blocks(lengths, device, tile.bm, select), tile))
    return AttentionPlan(launches)


@triton.jit
def _attend(q, k_ptr, v_ptr, start, s1, col, sk, sv, dims, dmask, m_i, l_i, acc, scale_log2e, BN: tl.constexpr,
            MASKED: tl.constexpr, PADDED: tl.constexpr):
    """One key tile [start, start + BN) of the online softmax: (m_i, l_i, acc) updated. ``MASKED``: keys from s1 on
    left out (the sequence's last, partial tile); ``PADDED``: channels from d on left out (d not a power of two).
    The scores are scaled inside the exponent (one FMA an element: the largest scaled score is the largest score
    scaled), and the values' product accumulates into the rescaled sum in place."""
    keys = start + tl.arange(0, BN)
    key_ok = keys < s1
    k_ptrs = k_ptr + keys[:, None].to(tl.int64) * sk + col + dims[None, :]
    v_ptrs = v_ptr + keys[:, None].to(tl.int64) * sv + col + dims[None, :]
    if MASKED or PADDED:
        if MASKED and PADDED:
            kv_mask = key_ok[:, None] & dmask[None, :]
        elif MASKED:
            kv_mask = key_ok[:, None]
        else:
            kv_mask = dmask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    s = tl.dot(q, k.T)
    if MASKED:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2e)
    p = tl.exp2(s * scale_log2e - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED or PADDED:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, o_ptr, blocks_ptr, n_blocks, sq, sk, sv, so, scale_log2e,
                   D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Program (b, h): query block b of the table at blocks_ptr [3, n_blocks], head h. q, k, v, o: [N, H, d] with
    token strides sq, sk, sv, so and head stride d (channels contiguous)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    q0 = tl.load(blocks_ptr + b)
    s0 = tl.load(blocks_ptr + n_blocks + b)
    s1 = tl.load(blocks_ptr + 2 * n_blocks + b)
    rows = q0 + tl.arange(0, BM)
    dims = tl.arange(0, DP)
    row_ok = rows < s1
    dmask = dims < D
    io_mask = row_ok[:, None] & dmask[None, :] if DP != D else row_ok[:, None]
    col = h * D
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * sq + col + dims[None, :], mask=io_mask, other=0.0)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, DP), tl.float32)
    full = s0 + (s1 - s0) // BN * BN
    for start in range(s0, full, BN):
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, start, s1, col, sk, sv, dims, dmask, m_i, l_i, acc, scale_log2e,
                                BN, False, DP != D)
    if full < s1:
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, full, s1, col, sk, sv, dims, dmask, m_i, l_i, acc, scale_log2e,
                                BN, True, DP != D)
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None].to(tl.int64) * so + col + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=io_mask)


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan | torch.Tensor,
                            scale: float | None = None, tile: AttentionTile | None = None) -> torch.Tensor:
    """q, k, v: [N, H, d] (any token stride, heads and channels contiguous: v may be a view of the fused
    projection's output); plan: :func:`attention_plan` of the batch, or one :func:`query_blocks` table run with
    ``tile`` (default :class:`AttentionTile`'s; its ``bm`` must be the table's block). Returns [N, H, d] in q's
    dtype; ``scale`` default 1/sqrt(d)."""
    n, heads, d = q.shape
    for t in (q, k, v):
        if t.shape != q.shape or t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"q, k, v {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} must be [N, H, d] with "
                             "heads and channels contiguous")
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty(n, heads, d, device=q.device, dtype=q.dtype)
    launches = plan.launches if isinstance(plan, AttentionPlan) else [(plan, tile or AttentionTile())]
    dp = triton.next_power_of_2(max(d, 16))
    for table, t in launches:
        nb = table.shape[1]
        if nb == 0:
            continue
        _varlen_kernel[(nb, heads)](q, k, v, out, table, nb, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                                    scale * 1.4426950408889634, D=d, DP=dp, BM=t.bm, BN=t.bn, num_warps=t.warps,
                                    num_stages=t.stages or (3 if dp <= 64 else 2))
    return out


__all__ = ["AttentionPlan", "AttentionTile", "BLOCK", "GPU_DTYPES", "LENGTH_CLASSES", "attention_plan",
           "query_blocks", "varlen_attention_triton"]
