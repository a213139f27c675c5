"""The KV cache contract: what the decode engine (``esm_turbo.model.engine``, ``esm_turbo.model.attention``) and the
ops (``esm_turbo.ops``) may read and call on a cache, and nothing else (``tests/test_contracts.py`` holds them to it).
The contiguous :class:`~esm_turbo.cache.KVCache` and the :class:`~esm_turbo.paged.PagedKVCache` keep it.

Shapes, once (B rows, H heads, d head_dim, S new tokens a step, L layers)::

    k, v        : [B, H, S, d]  post-RoPE keys / values of the S new tokens of each row
    valid       : [B, S] bool   which of them are real (a ragged prefill)
    counts      : [B] long      how many of the S are committed per row (or one int for all)
    lengths     : [B] long      committed tokens per row, on the cache's device
    parts[l]    : {name: [B, H, capacity, *shape]} per layer, one per codec part (``codec.part_specs()``), a token
                  part (``codec.token_parts()``, e.g. slots) [B, 1, capacity, *shape]; a paged cache's are pools
                  [slots, H or 1, block, *shape] read through :meth:`DecodeCache.pages`

A step writes every layer (``write``), attends, and ``commit`` makes its tokens visible; a step that is not committed
(a peek) leaves the cache as it was. Attention reads the cache and never writes it: the engine writes, before
attending where ``attends_from_storage(layer)`` says the stored buffer is attended in place (an uncompressed cache on
CUDA), after otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .cache import MemoryReport
    from .quant.codec import KVCodec


@runtime_checkable
class DecodeCache(Protocol):
    """A batched, ragged KV cache over per-layer codecs (see the module's shapes)."""

    codecs: list[KVCodec]  # one per layer
    heads: int
    head_dim: int
    device: torch.device
    batch_size: int  # B
    capacity: int  # positions a row holds now (grows as rows grow, except under a captured step)
    lengths: torch.Tensor  # [B] long
    parts: list[dict[str, torch.Tensor]]  # per layer
    fused: list[bool]  # per layer: written and read by the fused ops (Triton on CUDA), else the PyTorch reference
    contiguous: bool  # rows stored as [B, H, capacity, ·] buffers (False: pools read through block tables)

    @property
    def num_layers(self) -> int: ...

    @property
    def length_bound(self) -> int:
        """An upper bound on every row's length, kept on the host (read without waiting on the device)."""

    # ---- a step ---------------------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Encode k, v [B, H, S, d] of ``layer`` at positions ``lengths[b] + j``, not yet visible."""

    def commit(self, counts: torch.Tensor | int) -> None:
        """``lengths += counts``: the written tokens become visible."""

    def attends_from_storage(self, layer: int) -> bool:
        """Whether attention reads the step's own tokens from the stored buffer (written first, committed or not)."""

    def pages(self) -> tuple[torch.Tensor | None, int]:
        """(block table [B, blocks] int32, block size) that attention reads the parts through; (None, 0) when
        contiguous."""

    def shared_prefix(self) -> tuple[int, torch.Tensor | None]:
        """(tokens, leads [B] int32 or None): the tokens at the start of every row that it holds in the same blocks as
        its lead row (forks of one scaffold share a lead; None: row 0 leads every row); (0, None) when contiguous.
        Attention may read them once for the rows of a lead."""

    def dequantize(self, layer: int,
                   split_values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The reference path: (K̂ [B, H, T, d], V̂ [B, H, T, d], valid [B, T] bool), T = the longest row;
        ``split_values``: V̂ less the codec's value prediction from K̂ (``KVCodec.decode_split``; None where the
        values are not stored and nothing exact lies over them)."""

    # ---- rows -----------------------------------------------------------------------------------------------
    def truncate(self, n: torch.Tensor | int) -> None:
        """Roll each row back by ``n`` tokens ([B] or one int), never below zero."""

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep ``rows`` (repeats fork them); B becomes ``len(rows)``."""

    def prefill_groups(self, width: int) -> list[list[int]]:
        """The rows a prefill of ``width`` tokens writes together (all of them unless a device budget splits them)."""

    def view(self, rows: list[int]) -> RowsView:
        """A cache over some rows, stepped alone and given back (:class:`RowsView`)."""

    # ---- CUDA-graph capture ---------------------------------------------------------------------------------
    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more positions a row now (the buffers of a captured step cannot grow; a paged cache
        takes each row's blocks for them now and keeps them, so its block tables stay as they are)."""

    def rewind_bound(self, bound: int) -> None:
        """Put :attr:`length_bound` back to ``bound`` (a capture records a step without running it)."""

    def claim(self, tokens: int) -> None:
        """Count ``tokens`` more a row on the host for a replayed step that commits them."""

    @property
    def storage_version(self) -> object:
        """Changes whenever the buffers or block tables a step reads and writes may be replaced (growth, select, a
        block taken, copied or moved): a captured step replays only while it stays the same."""

    # ---- accounting -----------------------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Every byte held, against FP32 and FP16."""


@runtime_checkable
class RowsView(DecodeCache, Protocol):
    """Some rows of a cache, stepped alone (:meth:`DecodeCache.view`): it shares the parent's storage and codecs,
    owns its lengths and batch size, and hands its rows' new lengths back with :meth:`give_back`."""

    def give_back(self) -> None:
        """The rows' lengths (and any blocks they took) back into the parent cache."""


__all__ = ["DecodeCache", "RowsView"]
