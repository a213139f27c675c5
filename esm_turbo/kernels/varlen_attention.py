"""Attention of every sequence of a packed batch to itself, in query blocks cut to the sequences (Triton).

Protein batches hold many short sequences (a 16K-token batch of real proteins: about a hundred, a median near 150
tokens). A kernel whose query and key tiles are 128 tokens spends most of a short sequence's work on padding; here
the tiles are ``BLOCK`` (64) tokens, and each program owns one query block of one sequence and one head, walking only
that sequence's keys with an online softmax in float32 (exp2), the output rounded once to q's dtype.

:func:`query_blocks` cuts a batch into those blocks once on the host (``[B]`` int32 sequence starts, block starts and
sequence ends), and every layer reuses them. Reference: ``esm_turbo.embed.varlen.varlen_attention_reference``, which
the tests tie the kernel to under the flash-attention rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: query and key tile (tokens)
BLOCK = 64
#: the dtypes FastEsm runs this kernel in on the GPU, instead of flash attention: where it measured faster (fp16 on an
#: H200, 16K-token batches of real lengths: 110 µs against 169 at 650M-shaped, 213 against 330 at 3B, 73 against 138
#: at 150M, ``tools/tune_gemm.py``); in bf16 whole forwards ran slower with it (150M: 20.6 ms against 19.4)
GPU_DTYPES = (torch.float16,)


def query_blocks(lengths: list[int], device: torch.device | str, block: int = BLOCK) -> torch.Tensor:
    """[3, B] int32 on ``device``: for each query block of each sequence (sequences one after another, ``lengths``
    tokens each), its first token, its sequence's first token and its sequence's end."""
    import numpy as np
    lens = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    counts = -(-lens // block)
    seq = np.repeat(np.arange(len(lens)), counts)
    first = np.repeat(starts, counts) + block * (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts,
                                                                                     counts))
    table = np.stack([first, starts[seq], (starts + lens)[seq]]).astype(np.int32)
    return torch.from_numpy(table).to(device, non_blocking=True)


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
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * sq + h * D + dims[None, :], mask=row_ok[:, None] & dmask[None, :],
                other=0.0)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, DP), tl.float32)
    for start in range(s0, s1, BN):
        keys = start + tl.arange(0, BN)
        key_ok = keys < s1
        kv_mask = key_ok[:, None] & dmask[None, :]
        k = tl.load(k_ptr + keys[:, None].to(tl.int64) * sk + h * D + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, k.T) * scale_log2e
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + keys[:, None].to(tl.int64) * sv + h * D + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None].to(tl.int64) * so + h * D + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                            scale: float | None = None, warps: int = 4, stages: int | None = None) -> torch.Tensor:
    """q, k, v: [N, H, d] (any token stride, heads and channels contiguous: v may be a view of the fused
    projection's output); blocks: :func:`query_blocks` of the batch. Returns [N, H, d] in q's dtype; ``scale``
    default 1/sqrt(d). ``stages``: key tiles in flight, by default 3 (measured best at d = 32 and 64), 2 for heads
    wider than 64 (whose tiles would fill a smaller GPU's shared memory)."""
    n, heads, d = q.shape
    for t in (q, k, v):
        if t.shape != q.shape or t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"q, k, v {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} must be [N, H, d] with "
                             "heads and channels contiguous")
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty(n, heads, d, device=q.device, dtype=q.dtype)
    nb = blocks.shape[1]
    if nb == 0:
        return out
    dp = triton.next_power_of_2(max(d, 16))
    _varlen_kernel[(nb, heads)](q, k, v, out, blocks, nb, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                                scale * 1.4426950408889634, D=d, DP=dp, BM=BLOCK, BN=BLOCK, num_warps=warps,
                                num_stages=stages or (3 if dp <= 64 else 2))
    return out


__all__ = ["BLOCK", "GPU_DTYPES", "query_blocks", "varlen_attention_triton"]
