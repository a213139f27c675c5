"""The writer side of :mod:`esm_turbo.embed.pool`: what a writer process runs, importing no more than writing needs
(numpy and h5py for HDF5; torch only to save ``.pt`` files), so it is ready before the first batch is."""

from __future__ import annotations

import os
import queue
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import numpy as np

from .chunk import Chunk


def slot_array(memory: np.ndarray, place: tuple[int, tuple[int, ...]]) -> np.ndarray:
    """The array at ``place`` = (offset in float32 elements, shape) of a slot's float32 ``memory``, as a view."""
    offset, shape = place
    return memory[offset: offset + int(np.prod(shape))].reshape(shape)


@dataclass
class Message:
    """One batch's finished records for a writer: ``ids`` are the batch's first rows. ``arrays``: kind → (offset in
    float32 elements, shape) in ``slot``: ``mean``/``bos`` [nL, S, D], ``tokens`` [nL, M, D] (rows' residues one
    after another), ``logits`` [M, V], ``contacts`` [S, W, W]. ``chunk``: the records themselves instead (windows
    stitched by the loop, or no shared memory)."""

    ids: list[str]
    residues: np.ndarray
    layers: list[int]
    slot: int | None = None
    arrays: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    chunk: Chunk | None = None

    def resolve(self, memory: np.ndarray | None) -> Chunk:
        """The records as a chunk of views into ``memory`` (the slot's float32 array)."""
        if self.chunk is not None:
            return self.chunk
        r, m = len(self.ids), int(self.residues.sum())

        def get(kind):
            return slot_array(memory, self.arrays[kind])
        chunk = Chunk(self.ids, self.residues)
        for kind in ("mean", "bos"):
            if kind in self.arrays:
                arr = get(kind)
                setattr(chunk, kind, {layer: arr[i, :r] for i, layer in enumerate(self.layers)})
        if "tokens" in self.arrays:
            arr = get("tokens")
            chunk.tokens = {layer: arr[i, :m] for i, layer in enumerate(self.layers)}
        if "logits" in self.arrays:
            chunk.logits = get("logits")[:m]
        if "contacts" in self.arrays:
            chunk.contacts = get("contacts")[:r]
        return chunk


def _attach(names: list[str]) -> list[shared_memory.SharedMemory]:
    """The parent's shared memory. This process shares the parent's resource tracker (spawned), so attaching
    registers nothing new, and the parent unlinks the memory when it is done."""
    return [shared_memory.SharedMemory(name=name) for name in names]


def serve(fmt, out, rank, world, tasks, free, results, parent: int) -> None:
    """A writer process: messages in, files out, slots back; ("done", ids) or ("error", line) at the end. The first
    message is the ring: its shared memory's names and the output's metadata."""
    from .writers import make_writer
    shms: list[shared_memory.SharedMemory] = []
    memory: list[np.ndarray] = []
    try:
        writer = make_writer(fmt, out, rank, world)
        if fmt == "h5":
            writer.start(clean=False)
        while True:
            try:
                msg = tasks.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the run was killed: nothing more will come
                    return
                continue
            if msg is None:
                break
            if isinstance(msg, tuple) and msg[0] == "ring":
                writer.meta = msg[2]
                if msg[1] is not None:
                    shms = _attach(msg[1])
                    memory = [np.ndarray((s.size // 4,), dtype=np.float32, buffer=s.buf) for s in shms]
                continue
            writer.write_chunk(msg.resolve(memory[msg.slot] if msg.slot is not None else None))
            if msg.slot is not None:
                free.put(msg.slot)
        results.put(("done", writer.written))
    except BaseException as err:  # noqa: BLE001 - reported to the loop, which stops with it
        results.put(("error", f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err) else ''}"))
    finally:
        memory.clear()
        for shm in shms:
            shm.close()


__all__ = ["Message", "serve", "slot_array"]
