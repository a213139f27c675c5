"""Bulk prefetches into L2 (sm_90's ``cp.async.bulk.prefetch.L2``, PTX): a kernel that reads each of its bytes once
asks for all of them at its start, so the reads it then makes in its walk hit L2 and its memory traffic is not bound
by how many loads its walk keeps in flight. A prefetch is a hint: it computes nothing, and nothing waits for it.
PTX only (Triton's interpreter takes the kernels without it)."""

from __future__ import annotations

import triton
import triton.language as tl

_BULK = tl.constexpr("{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $3;\n"
                     "mov.u32 $0, 0;\n}")


@triton.jit
def prefetch_l2(start, stop, ok):
    """Prefetch bytes [start, stop) into L2 where ``ok``: start and stop int64 addresses [T] (rounded out to whole
    16-byte units, as the bulk prefetch takes them), ok [T] bool."""
    lo = start & -16
    size = ((stop + 15) & -16) - lo
    tl.inline_asm_elementwise(_BULK, "=r,l,r,r", [lo, ok.to(tl.int32), size.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(ptr, row, row_elems, first, count, ok):
    """Prefetch elements [first, first + count) of rows ``row`` [T] of a row-major tensor at ``ptr`` (``row_elems``
    elements a row) into L2, where ``ok`` [T]."""
    base = ptr + row.to(tl.int64) * row_elems + first
    start = base.to(tl.int64, bitcast=True)
    prefetch_l2(start, (base + count).to(tl.int64, bitcast=True), ok)
