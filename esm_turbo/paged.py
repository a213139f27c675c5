"""A paged KV cache: each layer's compressed parts live in fixed-size blocks of a shared pool, each sequence is a list
of block ids, and blocks are reference-counted, so forks share their prefix.

Contract (shapes once)::

    pool part   : [N_blocks, H, block_size, *part_shape]   one per codec part per layer (ids shared by all layers)
    tables[b]   : list of block ids, position t of row b at (tables[b][t // block_size], t % block_size)
    refs[i]     : how many rows' tables hold block i (0: free)

``select`` / ``fork`` copy tables, never data. A write into a block other rows also hold copies that block first
(copy-on-write, every layer at once), so siblings never see each other's tokens. ``truncate`` frees the blocks a row
no longer reaches. Reading gathers a row's blocks in order: the PyTorch reference path (dequantize, then attend)
runs on that view, so outputs equal :class:`~esm_turbo.cache.KVCache`'s exactly. Block bookkeeping is on the host.
"""

from __future__ import annotations

import torch

from .cache import KVCache, MemoryReport
from .quant.codec import KVCodec

BLOCK_SIZE = 64


class PagedKVCache(KVCache):
    """:class:`~esm_turbo.cache.KVCache`'s interface over a pool of reference-counted blocks."""

    contiguous = False

    def __init__(self, codecs: list[KVCodec], batch_size: int, capacity: int = 64,
                 device: torch.device | str | None = None, block_size: int = BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if any(getattr(c, "window", 0) for c in codecs):
            raise ValueError("a paged cache holds no recent-token windows (KIVI); use the contiguous cache")
        self.block_size = block_size
        self.blocks = max(1, -(-max(int(capacity), 1) // block_size) * batch_size)
        super().__init__(codecs, batch_size, capacity, device)
        self.fused = [False] * len(codecs)  # reads go through the gathered view (the reference path)
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self.refs: list[int] = [0] * self.blocks
        self.free: list[int] = list(range(self.blocks - 1, -1, -1))

    # ---- storage ---------------------------------------------------------------------------------
    def _alloc(self, codec: KVCodec, batch: int, capacity: int) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(self.blocks, self.heads, self.block_size, *shape, dtype=dtype, device=self.device)
                for name, (shape, dtype) in codec.part_specs().items()}

    def _alloc_ring(self, codec: KVCodec, batch: int) -> None:
        return None

    def _grow_pool(self) -> None:
        extra = self.blocks
        for layer, codec in enumerate(self.codecs):
            for name, (shape, dtype) in codec.part_specs().items():
                fresh = torch.zeros(extra, self.heads, self.block_size, *shape, dtype=dtype, device=self.device)
                self.parts[layer][name] = torch.cat([self.parts[layer][name], fresh])
        self.refs += [0] * extra
        self.free = list(range(self.blocks + extra - 1, self.blocks - 1, -1)) + self.free
        self.blocks += extra

    def _take(self) -> int:
        if not self.free:
            self._grow_pool()
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def _own(self, row: int, index: int) -> int:
        """Block ``index`` of ``row``, made this row's alone (allocated, or copied if shared)."""
        table = self.tables[row]
        while len(table) <= index:
            table.append(self._take())
        block = table[index]
        if self.refs[block] > 1:  # copy-on-write, every layer
            fresh = self._take()
            for layer in self.parts:
                for buf in layer.values():
                    buf[fresh] = buf[block]
            self._drop(block)
            table[index] = block = fresh
        return block

    # ---- KVCache's interface ----------------------------------------------------------------------
    def _ensure_capacity(self, needed: int) -> None:
        self.capacity = max(self.capacity, needed)  # blocks are taken as rows reach them

    def set_lengths(self, length: int) -> None:
        raise NotImplementedError("set_lengths fills a contiguous cache's buffers; a paged cache is written")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Encode S new tokens of ``layer`` at positions ``lengths[b] + j`` (not yet committed)."""
        self._check_kv(layer, k, v)
        s = k.shape[2]
        self._ensure_capacity(self._max_bound + s)
        self._written = s
        starts = self.lengths.tolist()
        slots = [self._own(b, (start + j) // self.block_size) for b, start in enumerate(starts) for j in range(s)]
        block = torch.tensor(slots, dtype=torch.long, device=self.device).view(self.batch_size, s)
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(s, device=self.device)[None, :]
        offset = pos % self.block_size
        for name, val in self.codecs[layer].encode(k, v).items():  # val [B, H, S, *shape]
            self.parts[layer][name][block, :, offset] = val.transpose(1, 2).to(self.parts[layer][name].dtype)

    def commit(self, counts: torch.Tensor | int) -> None:
        """Make the written tokens visible; blocks taken for tokens not committed (a ragged step) are released."""
        super().commit(counts)
        self._release_past_ends()

    def truncate(self, n: torch.Tensor | int) -> None:
        """Roll back the last ``n`` tokens of each row; blocks a row no longer reaches are released."""
        super().truncate(n)
        self._release_past_ends()

    def _release_past_ends(self) -> None:
        for row, length in enumerate(self.lengths.tolist()):
            keep = -(-length // self.block_size)
            for block in self.tables[row][keep:]:
                self._drop(block)
            del self.tables[row][keep:]

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep rows ``rows`` (may repeat: forking): the tables are copied and their blocks shared, no data moves."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        if rows.dim() != 1 or rows.numel() == 0:
            raise ValueError("select needs a non-empty 1-D list of row indices")
        if bool(((rows < 0) | (rows >= self.batch_size)).any()):
            raise IndexError(f"row index out of range for a batch of {self.batch_size}")
        tables = [list(self.tables[r]) for r in rows.tolist()]
        for table in tables:
            for block in table:
                self.refs[block] += 1
        for table in self.tables:
            for block in table:
                self._drop(block)
        self.tables = tables
        self.lengths = self.lengths.index_select(0, rows)
        self.ring_hi = self.ring_hi.index_select(0, rows)
        self.batch_size = rows.numel()

    def block_table(self, upto: int | None = None) -> torch.Tensor:
        """[B, ceil(upto / block_size)] long: each row's block ids (past a row's end: its last block, or 0)."""
        t = int(self.lengths.max()) if upto is None else upto
        width = max(1, -(-t // self.block_size))
        padded = [(table + [table[-1] if table else 0] * width)[:width] for table in self.tables]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def layer_parts(self, layer: int, upto: int | None = None) -> dict[str, torch.Tensor]:
        """The stored parts of one layer gathered through the block tables: [B, H, upto, *part_shape]."""
        t = int(self.lengths.max()) if upto is None else upto
        table = self.block_table(t)
        out = {}
        for name, pool in self.parts[layer].items():
            rows = pool[table]  # [B, nb, H, block, *shape]
            rows = rows.transpose(1, 2).reshape(self.batch_size, self.heads, -1, *pool.shape[3:])
            out[name] = rows[:, :, :t]
        return out

    def memory_report(self) -> MemoryReport:
        """Every block held counted once (a block is whole even when a row fills part of it), the block tables at
        4 bytes an entry; ``shared_saved_bytes``: what the rows would hold more if each had its own blocks."""
        per_part = {name: buf[0, :, 0].numel() * buf.element_size() for name, buf in self.parts[0].items()}
        per_token = sum(c.bytes_per_token() for c in self.codecs) * self.heads // self.num_layers
        block_bytes = per_token * self.num_layers * self.block_size
        held = sum(1 for r in self.refs if r > 0)
        referenced = sum(len(t) for t in self.tables)
        table_bytes = 4 * referenced
        values_per_token = 2 * self.heads * self.head_dim
        return MemoryReport(
            layers=self.num_layers, heads=self.heads, head_dim=self.head_dim,
            bytes_per_token_per_layer=per_token, part_bytes_per_token_per_layer=per_part,
            tokens=int(self.lengths.sum()), used_bytes=held * block_bytes + table_bytes,
            allocated_bytes=self.blocks * block_bytes + table_bytes,
            constant_bytes=sum(c.constant_nbytes() for c in self.codecs),
            fp32_bytes_per_token_per_layer=4 * values_per_token,
            fp16_bytes_per_token_per_layer=2 * values_per_token,
            shared_saved_bytes=(referenced - held) * block_bytes)


__all__ = ["BLOCK_SIZE", "PagedKVCache"]
