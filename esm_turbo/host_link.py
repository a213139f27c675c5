"""Moving a paged cache's blocks over the host link (the host tier of :class:`~esm_turbo.paged.BlockPool`).

A block lives on the host as one row of bytes (every layer's and part's slot side by side,
:class:`~esm_turbo.ops.blocks.BlockLayout`) in pinned chunks; on the device, in the pool's per-layer buffers. A move
goes through device staging buffers of whole blocks: a copy over the link of each run of adjacent host rows, and one
scatter into the pool's buffers (or gather from them) a staging fill.

On CUDA the copies over the link run on a stream of their own for each direction (:data:`COPY_STREAMS`), through two
staging buffers taken in turn: a fill's copy runs beside the scatter or gather of the fill before it, and a step's
copies to the host (blocks written since they came in) beside its copies back. The pool's buffers are only touched on
the current stream, so the step that reads the blocks still runs after them; the host never waits. What the streams
must order among themselves, :class:`HostLink` tracks: a host row is read back only after the copy that wrote it, and
written again only after the copies that read it before.
"""

from __future__ import annotations

import torch

from .io import to_device_queued
from .ops.blocks import BlockLayout

#: the link's copies on a stream of their own each way (CUDA); False: every copy and scatter queued on the current
#: stream, one after another
COPY_STREAMS = True
#: the most bytes of device staging a move holds at once (whole blocks; two buffers of half as much each where the
#: copies run on their own streams)
STAGE_BYTES = 256 * 2**20


def host_runs(host_slots: list[int], per_chunk: int) -> list[tuple[int, int, int]]:
    """(first index, first host slot, length) of each run of ``host_slots`` that are consecutive within one chunk
    of ``per_chunk`` slots."""
    runs: list[list[int]] = []
    for i, h in enumerate(host_slots):
        if runs and h == runs[-1][1] + runs[-1][2] and h % per_chunk:
            runs[-1][2] += 1
        else:
            runs.append([i, h, 1])
    return [tuple(r) for r in runs]


def _over_link(host: list[torch.Tensor], per_chunk: int, stage: torch.Tensor, host_slots: list[int],
               to_device: bool) -> None:
    """Queue the copies between host rows ``host_slots`` (of chunks ``host`` [per_chunk, row_bytes], pinned) and
    ``stage`` rows 0…n-1 [≥ n, row_bytes] on the current stream, a run of adjacent host rows one copy."""
    for i, h, n in host_runs(host_slots, per_chunk):
        rows = host[h // per_chunk][h % per_chunk:h % per_chunk + n]
        if to_device:
            stage[i:i + n].copy_(rows, non_blocking=True)
        else:
            rows.copy_(stage[i:i + n], non_blocking=True)


class HostLink:
    """The copies of one pool over the host link, and what their streams must wait for.

    ``out_events``: the copies to the host still in flight, by batch number, and ``host_batch`` the batch that last
    wrote each host row (a copy back of that row waits for it); ``in_done``: the last copy from the host (a copy to
    the host, which may write rows that copy read before they were freed, waits for it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams: dict[bool, torch.cuda.Stream] = {}
        self.out_events: dict[int, torch.cuda.Event] = {}
        self.host_batch: dict[int, int] = {}
        self.batches = 0
        self.in_done: torch.cuda.Event | None = None

    def streamed(self) -> bool:
        """Whether the copies run on streams of their own (:data:`COPY_STREAMS`, CUDA)."""
        return COPY_STREAMS and self.device.type == "cuda"

    def _stream(self, to_device: bool) -> torch.cuda.Stream:
        if to_device not in self.streams:
            self.streams[to_device] = torch.cuda.Stream(self.device)
        return self.streams[to_device]

    def move(self, layout: BlockLayout, pools: list[dict[str, torch.Tensor]], host: list[torch.Tensor],
             per_chunk: int, dev_slots: list[int], host_slots: list[int], to_device: bool) -> None:
        """Copy blocks between device slots ``dev_slots`` of ``pools`` (per layer, per part) and host rows
        ``host_slots`` of ``host`` (pairwise), queued: a staging buffer-full of whole blocks at a time."""
        row = layout.row_bytes
        streamed = self.streamed()
        per = max(1, min(len(dev_slots), STAGE_BYTES // (2 if streamed else 1) // row))
        fills = [slice(s, s + per) for s in range(0, len(dev_slots), per)]
        stages = [torch.empty(per, row, dtype=torch.uint8, device=self.device) for _ in fills[:2 if streamed else 1]]
        slots = to_device_queued(dev_slots, self.device)
        if not streamed:
            for fill in fills:
                if not to_device:
                    layout.move(pools, stages[0], slots[fill], to_pool=False)
                _over_link(host, per_chunk, stages[0], host_slots[fill], to_device)
                if to_device:
                    layout.move(pools, stages[0], slots[fill], to_pool=True)
            return
        cur, link = torch.cuda.current_stream(self.device), self._stream(to_device)
        link.wait_stream(cur)  # the staging buffers as allocated, and the pool as queued so far
        self._order(link, host_slots, to_device)
        done: list[torch.cuda.Event | None] = [None, None]  # each staging buffer's last use on the other side
        for j, fill in enumerate(fills):
            stage = stages[j % 2]
            if to_device:
                if done[j % 2] is not None:
                    link.wait_event(done[j % 2])  # that buffer's scatter into the pool
                with torch.cuda.stream(link):
                    _over_link(host, per_chunk, stage, host_slots[fill], True)
                cur.wait_event(link.record_event())
                layout.move(pools, stage, slots[fill], to_pool=True)
                done[j % 2] = cur.record_event()
            else:
                if done[j % 2] is not None:
                    cur.wait_event(done[j % 2])  # that buffer's copy to the host
                layout.move(pools, stage, slots[fill], to_pool=False)
                link.wait_event(cur.record_event())
                with torch.cuda.stream(link):
                    _over_link(host, per_chunk, stage, host_slots[fill], False)
                done[j % 2] = link.record_event()
        for stage in stages:
            stage.record_stream(link)  # the allocator hands them out again only after the link's copies
        self._finished(link, host_slots, to_device)

    def _order(self, link: torch.cuda.Stream, host_slots: list[int], to_device: bool) -> None:
        """Make ``link`` wait for the other direction's copies that touch the same host rows: a copy back waits for
        the copy out that wrote its rows (the latest of them: one stream's events complete in order), a copy out
        for the last copy back (its rows may be ones that copy read, freed since)."""
        if to_device:
            pending = {self.host_batch.get(h) for h in host_slots} & self.out_events.keys()
            if pending:
                link.wait_event(self.out_events[max(pending)])
        elif self.in_done is not None:
            link.wait_event(self.in_done)

    def _finished(self, link: torch.cuda.Stream, host_slots: list[int], to_device: bool) -> None:
        if to_device:
            self.in_done = link.record_event()
            return
        self.out_events = {b: e for b, e in self.out_events.items() if not e.query()}
        self.batches += 1
        self.out_events[self.batches] = link.record_event()
        for h in host_slots:
            self.host_batch[h] = self.batches


__all__ = ["COPY_STREAMS", "STAGE_BYTES", "HostLink", "host_runs"]
