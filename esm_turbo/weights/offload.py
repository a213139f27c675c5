"""The residual pass of a quantized model held in pinned host memory and streamed to the device a layer ahead.

A checkpoint quantized with ``--residual`` has two passes per linear; the second (its codes and scales, as many bytes
as the first) corrects the first's error. :func:`offload_residual` moves every block linear's second-pass codes and
scales into one pinned host buffer per transformer layer and leaves on the device only ``slots`` buffers of the
largest layer's bytes. The linears' ``codes1`` / ``scales1`` become views of the slot of their layer (layer i uses
slot i mod slots). When a layer's first linear reads its residual (:meth:`ResidualOffload.ready`, called by
``QuantizedLinear`` and ``SharedInput``), the compute stream waits for that layer's copy, and the copy of the next
layer (the first again after the last, for the next forward) is queued on a copy stream behind everything queued so
far, so it overlaps this layer's compute. A layer's query, key and value lie side by side, as ``SharedInput`` stacks
them. Device bytes of the residual: ``slots`` × the largest layer's, instead of every layer's.

On CPU (and MPS) the copies are plain copies, in order: the same views and results, no overlap.
"""

from __future__ import annotations

import torch

from ..errors import EsmTurboError
from .linear import QuantizedLinear

#: byte alignment of each tensor within a layer's buffer
ALIGN = 16


class ResidualOffload:
    """Host copies of the residual passes of ``units`` (lists of :class:`QuantizedLinear`, in the order a forward
    uses them, one list a transformer layer) and ``slots`` device buffers they are copied into."""

    def __init__(self, units: list[list[QuantizedLinear]], device: torch.device, slots: int = 2):
        if slots < 2:
            raise ValueError(f"offloading takes at least 2 device slots (one computing, one copying), got {slots}")
        self.device, self.units = torch.device(device), units
        self.slots = min(slots, len(units))
        self._unit_of: dict[int, int] = {}
        self._layout: list[list[tuple[QuantizedLinear, str, int, int, torch.dtype, tuple]]] = []
        self.host: list[torch.Tensor] = []
        pin = self.device.type == "cuda"
        for u, members in enumerate(units):
            at, items = 0, []
            for lin in members:
                self._unit_of[id(lin)] = u
            for group in _groups(members):  # a SharedInput's members side by side, as it stacks them
                for name in ("codes1", "scales1"):
                    at = -(-at // ALIGN) * ALIGN
                    for lin in group:
                        t = getattr(lin, name)
                        items.append((lin, name, at, t.numel() * t.element_size(), t.dtype, tuple(t.shape)))
                        at += t.numel() * t.element_size()
            buf = torch.empty(at, dtype=torch.uint8, pin_memory=pin)
            for lin, name, start, size, _, _ in items:
                buf[start:start + size].copy_(getattr(lin, name).detach().cpu().contiguous().view(-1)
                                              .view(torch.uint8))
            self.host.append(buf)
            self._layout.append(items)
        width = max(b.numel() for b in self.host)
        self.slot = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.slots)]
        self.device = self.slot[0].device  # with its index ("cuda" → "cuda:0"), as moved tensors report theirs
        self._held = [-1] * self.slots  # the unit each slot holds (or is being copied into)
        self._copied: list[torch.cuda.Event | None] = [None] * self.slots
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        for members in units:  # the linears' residual buffers: views of their unit's slot
            for lin in members:
                lin.offload = self
                self.bind(lin, moved=False)

    def bind(self, linear: QuantizedLinear, moved: bool = True) -> None:
        """Point ``linear``'s residual buffers at its layer's slot (again after ``.to()`` replaced them: a
        ``QuantizedLinear`` calls this from its ``_apply``, ``moved``). Refused if it moved off the slots' device."""
        if moved and linear.codes0.device != self.device:
            raise ValueError(f"a linear whose residual pass is offloaded to {self.device} was moved to "
                             f"{linear.codes0.device}: offload the model again on the new device")
        unit = self._unit_of[id(linear)]
        slot = self.slot[unit % self.slots]
        for lin, name, start, size, dtype, shape in self._layout[unit]:
            if lin is linear:
                setattr(lin, name, slot[start:start + size].view(dtype).view(shape))

    @property
    def device_bytes(self) -> int:
        """Bytes the residual passes hold on the device: the slots."""
        return sum(s.numel() for s in self.slot)

    @property
    def host_bytes(self) -> int:
        """Bytes of the residual passes in (pinned) host memory, padding included."""
        return sum(b.numel() for b in self.host)

    def _issue(self, unit: int) -> None:
        """Queue the copy of ``unit`` into its slot, behind everything queued on the current stream so far (which
        includes the slot's previous unit's work)."""
        s = unit % self.slots
        src, dst = self.host[unit], self.slot[s][:self.host[unit].numel()]
        if self._copy_stream is None:
            dst.copy_(src)
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            self._copied[s] = event
        self._held[s] = unit

    def stacked(self, members: list[QuantizedLinear], name: str) -> torch.Tensor:
        """``members``' (a ``SharedInput``'s) ``name`` buffers as one tensor stacked along the rows: a view of the slot
        they lie side by side in."""
        first, last = getattr(members[0], name), getattr(members[-1], name)
        nbytes = last.data_ptr() + last.numel() * last.element_size() - first.data_ptr()
        if nbytes != sum(getattr(m, name).numel() * first.element_size() for m in members):
            raise ValueError(f"the offloaded {name} of these linears are not side by side")
        slot = self.slot[self._unit_of[id(members[0])] % self.slots]
        start = first.data_ptr() - slot.data_ptr()
        return slot[start:start + nbytes].view(first.dtype).view(-1, *first.shape[1:])

    def ready(self, linear: QuantizedLinear) -> None:
        """Before ``linear`` reads its residual: its layer's copy is waited for (queued now if it was not), and the
        next layer's is queued."""
        unit = self._unit_of[id(linear)]
        s = unit % self.slots
        if self._held[s] != unit:
            self._issue(unit)
        if self._copied[s] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied[s])
        nxt = (unit + 1) % len(self.units)
        if self._held[nxt % self.slots] != nxt:
            self._issue(nxt)


def offload_residual(model, device: torch.device | str, slots: int = 2) -> ResidualOffload:
    """Move ``model`` (an ``EsmForMaskedLM`` with :class:`QuantizedLinear` block linears of two passes, on any device,
    already in the dtype it runs in) to ``device`` with its residual passes in pinned host memory
    (:class:`ResidualOffload`, kept as ``model.residual_offload``); the first passes and everything else on ``device``.
    Refused for a model without a residual pass."""
    units = [[m for m in layer.modules() if isinstance(m, QuantizedLinear) and m.passes > 1]
             for layer in model.esm.encoder.layer]  # in the order a forward uses them
    units = [members for members in units if members]
    if not units:
        raise EsmTurboError("the model has no residual pass to offload: quantize it with `esm-turbo quantize-weights "
                            "--residual`")
    offload = ResidualOffload(units, device, slots)
    model.to(device)  # the residual views are on the device already: moved as they are (``bind``)
    model.residual_offload = offload
    return offload


def _groups(members: list[QuantizedLinear]) -> list[list[QuantizedLinear]]:
    """``members`` in groups: each ``SharedInput``'s members together (in its order), every other linear alone."""
    out, seen = [], set()
    for lin in members:
        if id(lin) in seen:
            continue
        group = lin.shared.members if lin.shared is not None else [lin]
        out.append(group)
        seen.update(id(m) for m in group)
    return out
