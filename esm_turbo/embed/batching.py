"""Work planning for embedding: length-sorted token-budget batches and sliding windows for sequences
longer than ESM-2's trained context.

A *piece* is what the model sees: a whole sequence, its first ``truncation`` residues, or one window
of it. Batches hold pieces of similar length (sorted, longest first, so an out-of-memory batch shows
up at once) within ``toks_per_batch`` tokens: for packed batches the tokens themselves, for padded
ones ``rows × (longest + 2)``, the padding-inclusive count fair-esm's ``--toks_per_batch`` uses.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

from ..fasta import Record

LONG_POLICIES = ("truncate", "windows")


class Piece(NamedTuple):
    """Residues ``[start, stop)`` of record ``index`` (window ``part`` of ``parts``). A named tuple: a run plans one
    per record, hundreds of thousands of them before its first batch."""

    index: int
    start: int
    stop: int
    part: int = 0
    parts: int = 1

    @property
    def length(self) -> int:
        return self.stop - self.start


def window_spans(length: int, window: int, overlap: int) -> list[tuple[int, int]]:
    """Overlapping windows covering ``[0, length)``: each ``window`` long (the last ends at ``length``)."""
    if length <= window:
        return [(0, length)]
    if not 0 <= overlap < window:
        raise ValueError(f"window overlap {overlap} must be in [0, {window})")
    step = window - overlap
    starts = list(range(0, length - window, step)) + [length - window]
    return [(s, s + window) for s in starts]


def shard_by_tokens(tokens: list[int], world: int) -> list[list[int]]:
    """Record indices per rank (torchrun), balanced by tokens: longest first, each to the rank holding the fewest tokens
    so far (ties to the lower rank), every rank's indices in input order. No rank ends more than one record's tokens
    above the mean."""
    loads = [(0, r) for r in range(world)]
    shards: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, rank = heapq.heappop(loads)
        shards[rank].append(i)
        heapq.heappush(loads, (load + tokens[i], rank))
    return [sorted(shard) for shard in shards]


def owner_ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Which residues each window contributes when stitching: every residue is taken from the window
    whose centre is nearest (ties to the earlier one), so no residue comes from a window edge when a
    better-placed window has it. Returns ``[lo, hi)`` per window, covering ``[0, length)`` exactly."""
    bounds = [spans[0][0]]
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        mid = ((s0 + e0) / 2 + (s1 + e1) / 2) / 2  # residue r (centre r + ½) goes left iff r + ½ ≤ mid
        bounds.append(math.floor(mid - 0.5) + 1)
    bounds.append(spans[-1][1])
    return [(bounds[i], bounds[i + 1]) for i in range(len(spans))]


def plan_pieces(records: list[Record], max_residues: int, policy: str = "truncate",
                overlap: int = 256) -> tuple[list[Piece], list[tuple[str, str]]]:
    """Pieces for every record, and (id, warning naming it) per truncated record."""
    if policy not in LONG_POLICIES:
        raise ValueError(f"unknown long-sequence policy {policy!r}: choose one of {LONG_POLICIES}")
    pieces, warnings = [], []
    for i, rec in enumerate(records):
        n = len(rec.sequence)
        if n <= max_residues:
            pieces.append(Piece(i, 0, n))
        elif policy == "truncate":
            pieces.append(Piece(i, 0, max_residues))
            warnings.append((rec.id, f"record {rec.id!r} ({rec.source}): {n} residues truncated to the first "
                                     f"{max_residues}"))
        else:
            spans = window_spans(n, max_residues, overlap)
            pieces.extend(Piece(i, s, e, k, len(spans)) for k, (s, e) in enumerate(spans))
    return pieces, warnings


def plan_batches(pieces: list[Piece], toks_per_batch: int, packed: bool = False) -> list[list[Piece]]:
    """Longest first; each batch's tokens stay within ``toks_per_batch``: ``rows × (longest + 2)`` for a
    padded batch, the sum of ``length + 2`` for a packed one (no padding)."""
    order = sorted(pieces, key=lambda p: (-p.length, p.index, p.part))
    batches: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for p in order:
        if packed:
            used += p.length + 2
            full = used > toks_per_batch
        else:
            full = (len(current) + 1) * ((current[0].length if current else p.length) + 2) > toks_per_batch
        if current and full:
            batches.append(current)
            current, used = [], p.length + 2
        current.append(p)
    if current:
        batches.append(current)
    return batches
