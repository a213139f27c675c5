"""Writers in processes of their own, fed through shared host memory, so neither HDF5 nor ``torch.save`` holds the
embedding loop's interpreter lock.

The loop copies each batch's outputs from the GPU straight into a *slot* of a ring of shared-memory buffers
(registered with CUDA as pinned memory, so the copies are queued like any other), then hands a writer process a
small :class:`Message` naming the slot. The writer builds the records (:class:`~esm_turbo.embed.chunk.Chunk`), writes
them and gives the slot back. The loop only waits when every slot is still being written.

Where shared memory is short (a container's 64 MB ``/dev/shm``), slots are ordinary pinned memory and messages carry
their arrays (a copy per batch, no more).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time
import types
from multiprocessing import get_context
from multiprocessing import shared_memory

import numpy as np
import torch

from ..errors import EsmTurboError
from .chunk import Chunk
from .writer_process import Message, serve

_CTX = get_context("spawn")  # children import only what writing needs, and never touch CUDA


class HostRing:
    """``slots`` host buffers of ``nbytes`` each (pinned for CUDA copies when ``pin``): shared memory, or plain
    tensors where ``shared`` is False (default: shared where /dev/shm has twice the room)."""

    def __init__(self, nbytes: int, slots: int, pin: bool, shared: bool | None = None):
        self.nbytes = max(4096, (nbytes + 4095) // 4096 * 4096)
        self.shared = _shm_room() >= 2 * self.nbytes * slots if shared is None else shared
        self.shms: list[shared_memory.SharedMemory] = []
        self.tensors: list[torch.Tensor] = []
        self.pinned: list[int] = []
        for _ in range(slots):
            if self.shared:
                shm = shared_memory.SharedMemory(create=True, size=self.nbytes)
                self.shms.append(shm)
                t = torch.frombuffer(shm.buf, dtype=torch.float32)
                if pin and int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), self.nbytes, 0)) == 0:
                    self.pinned.append(t.data_ptr())  # else pageable: copies wait for the device, still correct
            else:
                t = torch.empty(self.nbytes // 4, dtype=torch.float32, pin_memory=pin)
            self.tensors.append(t)

    def names(self) -> list[str] | None:
        return [s.name for s in self.shms] if self.shared else None

    def view(self, slot: int, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        n = int(np.prod(shape))
        return self.tensors[slot][offset: offset + n].view(shape)

    def close(self) -> None:
        for ptr in self.pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.pinned.clear()
        self.tensors.clear()
        for shm in self.shms:
            shm.unlink()
            try:
                shm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with the process
                pass
        self.shms.clear()


def _shm_room() -> int:
    try:
        st = os.statvfs("/dev/shm")
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


class WriterPool:
    """``workers`` processes, each with a writer (:func:`~esm_turbo.embed.writers.make_writer`) of its own.

    Start them early (:meth:`start`: their imports overlap the model's loading), give them the ring and the output's
    ``meta`` once the batches are planned (:meth:`set_ring`), then per batch :meth:`acquire` a slot, fill it,
    :meth:`submit` its message. :meth:`close` waits for every write and returns the ids written; a writer's error stops the run with its message.
    """

    def __init__(self, fmt: str, out, rank: int = 0, world: int = 1, meta: dict | None = None, workers: int = 1):
        self.fmt, self.out, self.rank, self.world, self.meta = fmt, str(out), rank, world, meta
        self.workers = 1 if fmt == "h5" else max(1, workers)  # one part numbering per rank
        self.ring: HostRing | None = None
        self.wait_s = 0.0
        self._next = 0
        self._procs: list = []

    def start(self) -> "WriterPool":
        self._tasks = [_CTX.Queue() for _ in range(self.workers)]
        self._free, self._results = _CTX.Queue(), _CTX.Queue()
        self._procs = [_CTX.Process(target=serve, daemon=True, name=f"esm-turbo-writer-{i}",
                                    args=(self.fmt, self.out, self.rank, self.world, self._tasks[i], self._free,
                                          self._results, os.getpid()))
                       for i in range(self.workers)]
        with _bare_main():
            for p in self._procs:
                p.start()
        return self

    def set_ring(self, nbytes: int, pin: bool, slots: int | None = None) -> None:
        self.ring = HostRing(nbytes, slots or self.workers + 2, pin)
        for q in self._tasks:
            q.put(("ring", self.ring.names(), self.meta))
        for slot in range(len(self.ring.tensors)):
            self._free.put(slot)

    def acquire(self) -> int:
        """A free slot (waiting, and counting the wait, while every slot is being written)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        start = time.perf_counter()
        while True:
            try:
                slot = self._free.get(timeout=0.5)
                self.wait_s += time.perf_counter() - start
                return slot
            except queue.Empty:
                self._check()

    def submit(self, msg: Message) -> None:
        if msg.slot is not None and not self.ring.shared:  # no shared memory: the arrays travel in the message
            chunk = _copied(msg.resolve(self.ring.tensors[msg.slot].numpy()))
            self._free.put(msg.slot)
            msg = Message(msg.ids, msg.residues, msg.layers, chunk=chunk)
        self._tasks[self._next % self.workers].put(msg)
        self._next += 1
        self._check()

    def _check(self) -> None:
        try:
            kind, value = self._results.get_nowait()
        except queue.Empty:
            kind = None
        if kind == "error":
            self.abort()
            raise EsmTurboError(f"writing {self.out}: {value}")
        if kind == "done":
            self._results.put((kind, value))  # read again by close()
        dead = [p for p in self._procs if not p.is_alive() and p.exitcode not in (0, None)]
        if dead:
            self.abort()
            raise EsmTurboError(f"writing {self.out}: a writer process ended (exit {dead[0].exitcode})")

    def close(self) -> list[str]:
        """Every message written; the ids written, in no particular order."""
        start = time.perf_counter()
        for q in self._tasks:
            q.put(None)
        written: list[str] = []
        done = 0
        while done < self.workers:
            try:
                kind, value = self._results.get(timeout=0.5)
            except queue.Empty:
                self._check()
                continue
            if kind == "error":
                self.abort()
                raise EsmTurboError(f"writing {self.out}: {value}")
            written += value
            done += 1
        for p in self._procs:
            p.join()
        self.wait_s += time.perf_counter() - start
        if self.ring is not None:
            self.ring.close()
        return written

    def abort(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
        if self.ring is not None:
            self.ring.close()
            self.ring = None


def _copied(chunk: Chunk) -> Chunk:
    out = Chunk(chunk.ids, chunk.residues)
    for kind in ("mean", "bos", "tokens"):
        setattr(out, kind, {k: np.array(v) for k, v in getattr(chunk, kind).items()})
    out.logits = None if chunk.logits is None else np.array(chunk.logits)
    out.contacts = None if chunk.contacts is None else np.array(chunk.contacts)
    return out


@contextlib.contextmanager
def _bare_main():
    """Children started inside see a ``__main__`` with no file: a spawned child would otherwise import the
    command's whole entry module (torch.compile and all) before it can write a byte."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


__all__ = ["HostRing", "Message", "WriterPool"]
