"""A paged KV cache: each layer's compressed parts live in fixed-size blocks of a shared pool, each sequence is a list
of block ids, and blocks are reference-counted, so forks share their prefix.

Contract (shapes once)::

    device pool : [N_slots, H, block_size, *part_shape]   one per codec part per layer (a slot: the same in all)
    tables[b]   : list of block ids; position t of row b is in block tables[b][t // block_size], at t % block_size
    refs[i]     : how many rows' tables hold block i (0: free)

``select`` / ``fork`` copy tables, never data. A write into a block other rows also hold copies that block first
(copy-on-write, every layer at once), so siblings never see each other's tokens. ``commit`` / ``truncate`` release
the blocks past each row's end. Reads go through a block table of device slots (:meth:`PagedKVCache.pages`): the fused
decode kernel takes it with the pool, and the PyTorch reference path gathers a row's blocks in order through it, so
outputs equal :class:`~esm_turbo.cache.KVCache`'s.

With a device budget (``device_budget_bytes``) the pool holds at most that many bytes of blocks on the device; the
least recently used blocks that the rows being read or written do not need move to host memory and come back when a
row needs them (:class:`BlockPool`: whole blocks as rows of pinned memory, copied in runs through a staging buffer).
:meth:`PagedKVCache.view` gives a cache over some of the rows (a step that touches a subset), sharing the pool.

Block bookkeeping is on the host and never waits for the device (``host_lengths`` mirrors ``lengths``; index tensors
travel through pinned memory): a step costs host work only for rows that reach a new or shared block. The device
block tables are kept until a table or a slot changes (``BlockPool.epoch``); a step's new tokens are written straight
into the blocks through them (the quantize kernel reads a block table as the decode kernel does).
"""

from __future__ import annotations

import torch

from . import ops
from .cache import ROOM_USED_UP, KVCache, MemoryReport, new_positions, per_layer, token_bytes
from .errors import EsmTurboError
from .host_link import HostLink
from .io import to_device_queued
from .ops.blocks import BLOCK_SIZE, BlockLayout, part_heads
from .quant.codec import KVCodec

#: bytes of one pinned host chunk of the host tier (whole blocks)
HOST_CHUNK_BYTES = 256 * 2**20


#: the fewest rows a lead (a scaffold's forks) on average for :meth:`PagedKVCache.shared_prefix` to report what they
#: share: with fewer, a group of queries spans so many leads that reading the prefix once a lead saves little
MIN_ROWS_A_LEAD = 4


class BlockPool:
    """Reference-counted blocks of every layer's parts, each in a device slot or, over the budget, a host slot.

    On the host a block is one row of bytes (every layer's and part's slot side by side, :class:`BlockLayout`) in
    pinned chunks of :data:`HOST_CHUNK_BYTES`, so blocks with adjacent host slots cross the link in one copy. Moves go
    through device staging buffers (:class:`~esm_turbo.host_link.HostLink`: on CUDA the copies over the link on
    streams of their own, the pool's buffers touched on the current stream): the host never waits for them, and the
    step that reads the blocks runs after them."""

    def __init__(self, specs: list[dict], heads: int, block_size: int, device: torch.device, slots: int,
                 device_slots: int | None = None):
        self.specs, self.heads, self.block_size, self.device = specs, heads, block_size, device
        self.limit = device_slots  # None: no budget
        if self.limit is not None and self.limit < 1:
            raise EsmTurboError("the device budget holds less than one cache block; raise gpu_budget_gib")
        slots = max(1, slots if self.limit is None else min(slots, self.limit))
        self.dev = self._zeros(slots, device)
        self.layout = BlockLayout(specs, heads, block_size)
        self.per_chunk = max(1, HOST_CHUNK_BYTES // self.layout.row_bytes)  # host slots a pinned chunk holds
        self.link = HostLink(device)
        self.host: list[torch.Tensor] = []  # chunks [per_chunk, row_bytes] uint8
        self.refs: list[int] = []
        self.slot: list[int] = []  # device slot of each block, -1 while on the host
        self.host_slot: list[int] = []
        self.last_use: list[int] = []
        self.free_ids: list[int] = []
        self.free_slots = list(range(slots - 1, -1, -1))
        self.free_host: list[int] = []
        self.moved = {"in": 0, "out": 0}  # blocks copied to the device, and to the host
        self.clock = 0
        self.epoch = 0  # bumped whenever a held block's slot or contents may change under a cached block table

    def _zeros(self, n: int, device) -> list[dict[str, torch.Tensor]]:
        return [{name: torch.zeros(n, part_heads(entry, self.heads), self.block_size, *entry[0], dtype=entry[1],
                                   device=device)
                 for name, entry in spec.items()} for spec in self.specs]

    @property
    def slots(self) -> int:
        return next(iter(self.dev[0].values())).shape[0]

    @property
    def host_slots(self) -> int:
        return len(self.host) * self.per_chunk

    def held(self) -> tuple[int, int]:
        """(blocks on the device, blocks on the host) that rows hold."""
        live = [i for i, r in enumerate(self.refs) if r > 0]
        return sum(self.slot[i] >= 0 for i in live), sum(self.slot[i] < 0 for i in live)

    # ---- slots ---------------------------------------------------------------------------------------
    def _grow_device(self) -> None:
        """More zeroed device slots (doubling, up to the budget), in place of the old buffers (the dicts and the
        list stay the same objects: a cache's ``parts`` is ``pool.dev``)."""
        n = self.slots
        extra = n if self.limit is None else min(n, self.limit - n)
        grown = self._zeros(n + extra, self.device)
        for layer, bufs in zip(self.dev, grown):
            for name in layer:
                bufs[name][:n].copy_(layer[name])
                layer[name] = bufs[name]
        self.free_slots = list(range(n + extra - 1, n - 1, -1)) + self.free_slots
        self.epoch += 1  # the slots stay, the buffers are new (a captured step holds the old ones)

    def _grow_host(self) -> None:
        """More host slots (at least as many as there are, and as the device holds), in new pinned chunks."""
        n = self.host_slots
        chunks = -(-max(n, self.slots, 1) // self.per_chunk)
        pin = self.device.type == "cuda"
        self.host += [torch.empty(self.per_chunk, self.layout.row_bytes, dtype=torch.uint8, pin_memory=pin)
                      for _ in range(chunks)]
        self.free_host = list(range(self.host_slots - 1, n - 1, -1)) + self.free_host

    def reserve(self, n: int, keep: set[int]) -> None:
        """At least ``n`` free device slots: the pool grows up to its budget, then the least recently used blocks not
        in ``keep`` move to the host, all in one batch."""
        while len(self.free_slots) < n and (self.limit is None or self.slots < self.limit):
            self._grow_device()
        short = n - len(self.free_slots)
        if short <= 0:
            return
        movable = sorted((i for i, s in enumerate(self.slot) if s >= 0 and self.refs[i] > 0 and i not in keep),
                         key=lambda i: self.last_use[i])
        if len(movable) < short:
            raise EsmTurboError(f"a step needs more cache blocks on the device than its budget holds ({self.limit} "
                                f"blocks of {self.block_size} tokens): raise gpu_budget_gib or step fewer rows")
        self._to_host(movable[:short])

    def _copy(self, dev_slots: list[int], host_slots: list[int], to_device: bool) -> None:
        """Copy blocks between device slots and host slots (pairwise), queued (:meth:`HostLink.move`)."""
        self.link.move(self.layout, self.dev, self.host, self.per_chunk, dev_slots, host_slots, to_device)

    def _to_host(self, blocks: list[int]) -> None:
        """Move device ``blocks`` to the host. A block whose host copy is current (brought back and not written since,
        :meth:`written`) only gives up its device slot; the others are copied (:meth:`_copy`), to adjacent host
        slots in the order given."""
        dirty = [b for b in blocks if self.host_slot[b] < 0]
        if dirty:
            while len(self.free_host) < len(dirty):
                self._grow_host()
            hosts = sorted(self.free_host.pop() for _ in dirty)
            self._copy([self.slot[b] for b in dirty], hosts, to_device=False)
            for block, h in zip(dirty, hosts):
                self.host_slot[block] = h
            self.moved["out"] += len(dirty)
        for block in blocks:
            self.free_slots.append(self.slot[block])
            self.slot[block] = -1
        self.epoch += 1

    def written(self, blocks) -> None:
        """``blocks`` (on the device) are about to change: their host copies, if any, are stale and let go."""
        for block in blocks:
            if self.host_slot[block] >= 0:
                self.free_host.append(self.host_slot[block])
                self.host_slot[block] = -1

    def _to_device(self, blocks: list[int], keep: set[int]) -> None:
        """Bring host ``blocks`` back to device slots (others may leave for them), in host-slot order (runs copy in
        one piece, :meth:`_copy`). Their host copies stay (current until written)."""
        self.reserve(len(blocks), keep)
        blocks = sorted(blocks, key=lambda b: self.host_slot[b])
        slots = [self.free_slots.pop() for _ in blocks]
        self._copy(slots, [self.host_slot[b] for b in blocks], to_device=True)
        for block, slot in zip(blocks, slots):
            self.slot[block] = slot
        self.moved["in"] += len(blocks)
        self.epoch += 1

    # ---- blocks --------------------------------------------------------------------------------------
    def take(self, keep: set[int]) -> int:
        """A new block (one reference), on the device."""
        self.reserve(1, keep)
        slot = self.free_slots.pop()
        if self.free_ids:
            block = self.free_ids.pop()
            self.refs[block], self.slot[block], self.host_slot[block] = 1, slot, -1
        else:
            block = len(self.refs)
            self.refs.append(1)
            self.slot.append(slot)
            self.host_slot.append(-1)
            self.last_use.append(0)
        self.last_use[block] = self.clock
        return block

    def share(self, block: int) -> None:
        """One more holder of ``block`` (a forked row's table)."""
        self.refs[block] += 1

    def shared(self, block: int) -> bool:
        """Whether more than one row holds ``block`` (it is copied before a write: copy-on-write)."""
        return self.refs[block] > 1

    def tables_changed(self) -> None:
        """A block table changed: every block table cached against :attr:`epoch` is stale."""
        self.epoch += 1

    def drop(self, block: int) -> None:
        """One holder fewer; the block is freed (device and host slots) with its last."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.slot[block] >= 0:
                self.free_slots.append(self.slot[block])
            if self.host_slot[block] >= 0:
                self.free_host.append(self.host_slot[block])
            self.slot[block] = self.host_slot[block] = -1
            self.free_ids.append(block)
            self.epoch += 1

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src``'s data into block ``dst`` for each (src, dst) of ``pairs`` (both on the device), every
        layer and part in one gather-scatter."""
        if not pairs:
            return
        src = to_device_queued([self.slot[a] for a, _ in pairs], self.device)
        dst = to_device_queued([self.slot[b] for _, b in pairs], self.device)
        for layer in self.dev:
            for buf in layer.values():
                buf.index_copy_(0, dst, buf.index_select(0, src))
        self.epoch += 1

    def resident(self, blocks: set[int]) -> None:
        """Bring ``blocks`` to the device (others may move to the host) and mark them used now."""
        if self.limit is None:  # every block is on the device
            return
        self.clock += 1
        away = [b for b in blocks if self.slot[b] < 0]
        if away:
            self._to_device(away, blocks)
        for block in blocks:
            self.last_use[block] = self.clock

    def slots_of(self, blocks: torch.Tensor) -> torch.Tensor:
        """Device slots of resident ``blocks`` (a CPU tensor, any shape, long), on the device (queued)."""
        if not self.slot:
            return torch.zeros(blocks.shape, dtype=torch.long, device=self.device)
        return to_device_queued(torch.tensor(self.slot, dtype=torch.long)[blocks], self.device)


class PagedKVCache(KVCache):
    """:class:`~esm_turbo.cache.KVCache`'s interface over a pool of reference-counted blocks."""

    contiguous = False

    def __init__(self, codecs: list[KVCodec], batch_size: int, capacity: int = 64,
                 device: torch.device | str | None = None, block_size: int = BLOCK_SIZE,
                 device_budget_bytes: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if any(getattr(c, "window", 0) for c in codecs):
            raise ValueError("a paged cache holds no recent-token windows (KIVI); use the contiguous cache")
        self.block_size = block_size
        super().__init__(codecs, batch_size, capacity, device)
        block_bytes = token_bytes(codecs, self.heads) * block_size
        limit = None if device_budget_bytes is None else int(device_budget_bytes // block_bytes)
        blocks = -(-max(int(capacity), 1) // block_size) * batch_size
        specs = [{n: (shape, dt, c.part_heads(n, self.heads)) for n, (shape, dt) in c.part_specs().items()}
                 for c in codecs]  # token parts stored for one head
        self.pool = BlockPool(specs, self.heads, block_size, self.device, blocks, limit)
        self.parts = self.pool.dev
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self.host_lengths = [0] * batch_size  # ``lengths`` on the host: block bookkeeping never waits for the device
        self._tables: tuple[int, dict[int, torch.Tensor]] = (-1, {})  # (epoch, {width: [B, width] slots})
        self._scaffolds: tuple | None = None  # (epoch, blocks shared with the leads, leads on the device) once asked
        self._reach: list[int] | None = None  # positions each row's blocks are held up to (reserve), else None
        self._new_step()

    def _new_step(self) -> None:
        """Forget the step's write rows (the lengths changed). Block tables on the device stay while the pool's epoch
        does (every change of a table or a slot bumps it)."""
        self._writes: tuple[int, int] | None = None  # (epoch, S) when the step's blocks were made ready
        self._shared: tuple[int, int] | None = None  # (epoch, shared tokens) once asked in this step

    def _alloc(self, codec: KVCodec, batch: int, capacity: int) -> dict:
        return {}  # the pool holds the parts

    def prefill_groups(self, width: int) -> list[list[int]]:
        """Rows prefilled together: all, or under a device budget as many as its blocks hold (at least one)."""
        if self.pool.limit is None:
            return super().prefill_groups(width)
        size = max(1, self.pool.limit // -(-width // self.block_size))
        return [list(range(i, min(i + size, self.batch_size))) for i in range(0, self.batch_size, size)]

    def view(self, rows: list[int]) -> "PagedRows":
        """Rows ``rows`` (distinct) as a cache of their own (:class:`PagedRows`): a step on it reads and writes only
        their blocks; its :meth:`PagedRows.give_back` returns their lengths here."""
        if len(set(rows)) != len(rows) or not rows:
            raise ValueError("a view needs distinct rows, at least one")
        if min(rows) < 0 or max(rows) >= self.batch_size:
            raise IndexError(f"row index out of range for a batch of {self.batch_size}")
        return PagedRows(self, rows)

    # ---- blocks of rows ----------------------------------------------------------------------------
    def _mine(self) -> set[int]:
        return {b for table in self.tables for b in table}

    def _own(self, row: int, index: int, keep: set[int], copies: list[tuple[int, int]]) -> int:
        """Block ``index`` of ``row``, made this row's alone: taken, or if shared a fresh block whose copy of the
        shared one is queued in ``copies`` (copy-on-write, every layer; :meth:`BlockPool.copy_blocks`)."""
        table = self.tables[row]
        while len(table) <= index:
            table.append(self.pool.take(keep))
            keep.add(table[-1])
            self.pool.tables_changed()
        block = table[index]
        if self.pool.shared(block):
            fresh = self.pool.take(keep | {block})
            keep.add(fresh)
            copies.append((block, fresh))
            self.pool.drop(block)  # still held by another row: its data stays until the copy below
            table[index] = block = fresh
            self.pool.tables_changed()
        return block

    def _release_past_ends(self) -> None:
        for row, length in enumerate(self.host_lengths):
            keep = -(-max(length, self._reach[row] if self._reach else 0) // self.block_size)
            if len(self.tables[row]) > keep:
                for block in self.tables[row][keep:]:
                    self.pool.drop(block)
                del self.tables[row][keep:]
                self.pool.tables_changed()

    # ---- KVCache's interface ----------------------------------------------------------------------
    def _ensure_capacity(self, needed: int) -> None:
        self.capacity = max(self.capacity, needed)  # blocks are taken as rows reach them

    def set_lengths(self, length: int) -> None:
        raise NotImplementedError("set_lengths fills a contiguous cache's buffers; a paged cache is written")

    def _table(self, width: int) -> torch.Tensor:
        """[B, width] int32 on the device: each row's blocks' device slots (past a row's end its last block's, or 0),
        the rows' blocks brought to the device first; kept while the pool's epoch stays."""
        if self._tables[0] != self.pool.epoch:
            if self.pool.limit is not None:
                self.pool.resident(self._mine())
            self._tables = (self.pool.epoch, {})
        tables = self._tables[1]
        if width not in tables:
            tables[width] = self.pool.slots_of(self.block_table(width)).clamp_(min=0).to(torch.int32)
        return tables[width]

    def _width(self, extra: int = 0) -> int:
        """Blocks a table needs for the longest row plus ``extra`` tokens (at least one), and while blocks are
        reserved (:meth:`reserve`) for the farthest reach: one table, the same tensor, for every step within it."""
        reach = max(self._reach) if self._reach else 0
        return max(1, -(-(max(max(self.host_lengths) + extra, reach)) // self.block_size))

    # ---- CUDA-graph capture ----------------------------------------------------------------------
    @property
    def storage_version(self) -> object:
        """The pool's epoch (every block taken, copied, moved or freed, every table changed, the pool grown) with
        the cache's own version (select): a captured step replays while it stays."""
        return self._version, self.pool.epoch

    def reserve(self, tokens: int) -> None:
        """Take every row's blocks for ``tokens`` more positions now (copying a shared block it would write) and
        keep them until a select: steps within the reach write through block tables that no longer change, so a
        CUDA graph captures them. Refused under a device budget (blocks move between steps)."""
        if self.pool.limit is not None:
            raise RuntimeError("capture_step: a paged cache under a device budget (gpu_budget_gib) moves blocks "
                               "between steps; step it eagerly")
        bs, keep, copies = self.block_size, self._mine(), []
        reach = [n + int(tokens) for n in self.host_lengths]
        if self._reach:
            reach = [max(a, b) for a, b in zip(reach, self._reach)]
        self.pool.reserve(sum(max(0, -(-r // bs) - len(t)) for r, t in zip(reach, self.tables)), keep)
        for row, (start, end) in enumerate(zip(self.host_lengths, reach)):
            for index in range(start // bs, -(-end // bs)):
                self._own(row, index, keep, copies)
        self.pool.copy_blocks(copies)
        self._reach = reach
        self._ensure_capacity(max(reach))
        self._new_step()

    def rewind_bound(self, bound: int) -> None:
        """:attr:`length_bound` and each row's host length back by what a capture counted past ``bound`` (a captured
        paged step commits every token of every row)."""
        back = self._max_bound - int(bound)
        self.host_lengths = [n - back for n in self.host_lengths]
        super().rewind_bound(bound)
        self._new_step()

    def claim(self, tokens: int) -> None:
        """Count ``tokens`` more a row (host lengths too) for a replayed committing step; refused past the reach
        reserved before the capture."""
        if not self._reach or any(n + tokens > r for n, r in zip(self.host_lengths, self._reach)):
            raise RuntimeError(ROOM_USED_UP)  # the rows' own reach: the shared bound may run past a rolled-back row
        self.host_lengths = [n + tokens for n in self.host_lengths]
        self._max_bound += tokens
        self._new_step()

    def shared_prefix(self) -> tuple[int, torch.Tensor | None]:
        """(tokens, leads): each row's lead is the first row whose first block is its own (forks of one scaffold share
        a lead); tokens, those at the start of every row that it holds in the same blocks as its lead, before the rows
        write apart. Decode attention may read them once for the rows of a lead (``esm_turbo.kernels.decode.shared``).
        ``leads`` [B] int32 on the device, None where row 0 leads every row. (0, None) where rows share nothing or
        too little to pay: fewer than :data:`MIN_ROWS_A_LEAD` rows a lead. Host work once an epoch (B·blocks
        comparisons), the lengths' bound once a step."""
        epoch = self.pool.epoch
        if self._scaffolds is None or self._scaffolds[0] != epoch:
            self._scaffolds = (epoch, *self._leads())
        _, blocks, leads = self._scaffolds
        if self._shared is None or self._shared[0] != epoch:
            self._shared = (epoch, min(blocks * self.block_size, min(self.host_lengths)) if blocks else 0)
        return self._shared[1], leads if self._shared[1] else None

    def _leads(self) -> tuple[int, torch.Tensor | None]:
        """(blocks every row holds in common with its lead, the leads on the device or None where all are row 0);
        (0, None) where rows share too little (:meth:`shared_prefix`)."""
        first_of: dict[int, int] = {}
        leads: list[int] = []
        common: dict[int, int] = {}
        for row, table in enumerate(self.tables):
            if not table:
                return 0, None
            lead = first_of.setdefault(table[0], row)
            leads.append(lead)
            ref = self.tables[lead]
            n = min(common.get(lead, len(ref)), len(table))
            if table[:n] != ref[:n]:
                n = next(i for i in range(n) if table[i] != ref[i])
            common[lead] = n
        if len(leads) < MIN_ROWS_A_LEAD * len(common):
            return 0, None
        on_device = None if not any(leads) else to_device_queued(leads, self.device, torch.int32)
        return min(common.values()), on_device

    def pages(self) -> tuple[torch.Tensor, int]:
        """(pages [B, ceil(max length / block_size)] int32 on the device, block_size): what the fused decode kernel
        reads the pool through (:meth:`_table`)."""
        return self._table(self._width()), self.block_size

    def _write_table(self, s: int) -> torch.Tensor:
        """[B, width] int32 on the device: the block table (:meth:`_table`) the step's S tokens of each row are written
        through, blocks taken as rows reach them, a shared block copied first (every layer). Once a step: the first
        layer's write decides for all. Only rows reaching a new or shared block cost host work."""
        if self._writes != (self.pool.epoch, s):
            bs, starts = self.block_size, self.host_lengths
            wanted = [(b, i) for b, start in enumerate(starts) for i in range(start // bs, (start + s - 1) // bs + 1)]
            need = [(b, i) for b, i in wanted if i >= len(self.tables[b]) or self.pool.shared(self.tables[b][i])]
            if need or self.pool.limit is not None:
                keep = self._mine()
                self.pool.resident(keep)
                self.pool.reserve(len(need), keep)  # one batch of moves to the host, if any
                copies: list[tuple[int, int]] = []
                owned = [self._own(b, i, keep, copies) for b, i in wanted]
                self.pool.copy_blocks(copies)
                self.pool.written(owned)
            self._writes = (self.pool.epoch, s)
        return self._table(self._width(s))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Encode S new tokens of ``layer`` at positions ``lengths[b] + j`` (not yet committed) straight into the
        blocks, through the block table: by the fused quantize kernel where the layer runs it, else the codec."""
        self._check_kv(layer, k, v)
        s = k.shape[2]
        self._ensure_capacity(self._max_bound + s)
        self._written = s
        table = self._write_table(s)
        codec = self.codecs[layer]
        if self.fused[layer]:
            ops.write_compressed(codec, self.pool.dev[layer], k, v, self.lengths, table)
            return
        for name, val in codec.encode(k, v, **new_positions(codec, self.lengths, s)).items():  # [B, H, S, *shape]
            buf = self.pool.dev[layer][name]
            ops.scatter_rows(buf, val.to(buf.dtype), self.lengths, table)

    def commit(self, counts: torch.Tensor | int) -> None:
        """Make the written tokens visible; blocks taken for tokens not committed (a ragged step) are released."""
        super().commit(counts)
        self._mirror(counts)
        self._release_past_ends()
        self._new_step()

    def _mirror(self, added: torch.Tensor | int | None) -> None:
        """Bring ``host_lengths`` up to ``lengths`` after ``added`` tokens each (an int: no wait for the device),
        else read back."""
        if isinstance(added, int):
            self.host_lengths = [n + added for n in self.host_lengths]
        else:
            self.host_lengths = self.lengths.tolist()

    def truncate(self, n: torch.Tensor | int) -> None:
        """Roll back the last ``n`` tokens of each row; blocks a row no longer reaches are released."""
        super().truncate(n)
        self._mirror(None)
        self._release_past_ends()
        self._new_step()

    def _select_storage(self, rows: torch.Tensor) -> None:
        """:meth:`select`'s rows: the tables are copied and their blocks shared, no data moves."""
        tables = [list(self.tables[r]) for r in rows.tolist()]
        for table in tables:
            for block in table:
                self.pool.share(block)
        for table in self.tables:
            for block in table:
                self.pool.drop(block)
        self.tables = tables
        self.host_lengths = [self.host_lengths[r] for r in rows.tolist()]
        self._reach = None  # the rows' reserved blocks are shared now: a write copies them as usual
        self._release_past_ends()
        self.pool.tables_changed()
        self._new_step()

    def block_table(self, width: int | None = None) -> torch.Tensor:
        """[B, width] long (default ceil(max length / block_size)): each row's block ids (past a row's end: its last
        block, or 0)."""
        width = self._width() if width is None else width
        padded = [(table + [table[-1] if table else 0] * width)[:width] for table in self.tables]
        return torch.tensor(padded, dtype=torch.long)

    def layer_parts(self, layer: int, upto: int | None = None) -> dict[str, torch.Tensor]:
        """The stored parts of one layer gathered through the block tables: [B, H, upto, *part_shape] (default: max
        length; while a CUDA graph is captured, every block the table holds, the reserved reach: the readers mask by
        ``lengths``)."""
        pages, _ = self.pages()
        reach = pages.shape[1] * self.block_size
        t = upto if upto is not None else reach if ops.capturing(self.lengths) else int(self.lengths.max())
        if reach < t:  # past every row's end: padded with each row's last block
            extra = -(-t // self.block_size) - pages.shape[1]
            pages = torch.cat([pages, pages[:, -1:].expand(-1, extra)], dim=1)
        return {name: ops.gather_blocks(pool, pages)[:, :, :t] for name, pool in self.pool.dev[layer].items()}

    def memory_report(self) -> MemoryReport:
        """Every block held counted once (a block is whole even when a row fills part of it), the block tables at
        4 bytes an entry; ``host_bytes``: the blocks moved to host memory (in ``used_bytes`` too);
        ``shared_saved_bytes``: what the rows would hold more if each had its own blocks."""
        per_part = {name: buf[0, :, 0].numel() * buf.element_size() for name, buf in self.pool.dev[0].items()}
        per_token = token_bytes(self.codecs, self.heads)
        block_bytes = per_token * self.block_size
        on_device, on_host = self.pool.held()
        referenced = sum(len(t) for t in self.tables)
        table_bytes = 4 * referenced
        host_slots = self.pool.host_slots
        values_per_token = 2 * self.heads * self.head_dim
        return MemoryReport(
            layers=self.num_layers, heads=self.heads, head_dim=self.head_dim,
            bytes_per_token_per_layer=per_layer(per_token, self.num_layers), part_bytes_per_token_per_layer=per_part,
            tokens=int(self.lengths.sum()), used_bytes=(on_device + on_host) * block_bytes + table_bytes,
            allocated_bytes=(self.pool.slots + host_slots) * block_bytes + table_bytes,
            constant_bytes=sum(c.constant_nbytes() for c in self.codecs),
            fp32_bytes_per_token_per_layer=4 * values_per_token,
            fp16_bytes_per_token_per_layer=2 * values_per_token,
            shared_saved_bytes=(referenced - on_device - on_host) * block_bytes, host_bytes=on_host * block_bytes,
            bytes_per_token=per_token)


class PagedRows(PagedKVCache):
    """Some rows of a :class:`PagedKVCache`, as a cache of their own for a step.

    Shared with the parent, by design: the block pool (and so every block's data, the host tier and the epoch), the
    codecs, and each of these rows' block-table *list* (a block the step takes or copies on write lands in the
    parent's table too). The view's own: its lengths (a copy of the rows'), its batch size, its pending write and
    its cached block tables. :meth:`give_back` returns the lengths to the parent's rows."""

    def __init__(self, parent: PagedKVCache, rows: list[int]):  # noqa: D107 - no PagedKVCache.__init__: nothing is made
        self.__dict__.update(parent.__dict__)  # every setting and shared structure of the parent …
        self.parent, self.rows = parent, list(rows)
        self.tables = [parent.tables[r] for r in rows]  # … the same list objects, per row
        self.lengths = parent.lengths[to_device_queued(self.rows, parent.device)]  # … and copies of these
        self.host_lengths = [parent.host_lengths[r] for r in rows]
        self._reach = [parent._reach[r] for r in rows] if parent._reach else None
        self.batch_size = len(rows)
        self._written = 0
        self._tables = (-1, {})
        self._scaffolds = None
        self._new_step()

    def give_back(self) -> None:
        """The rows' lengths (and any growth) back into the parent, after the step."""
        parent = self.parent
        parent.lengths[to_device_queued(self.rows, parent.device)] = self.lengths
        for row, length in zip(self.rows, self.host_lengths):
            parent.host_lengths[row] = length
        parent._max_bound = max(parent._max_bound, self._max_bound)
        parent.capacity = max(parent.capacity, self.capacity)
        parent._new_step()


__all__ = ["BLOCK_SIZE", "MIN_ROWS_A_LEAD", "BlockPool", "PagedKVCache", "PagedRows"]
