"""How one quantizer's codes sit in the cache: :class:`CodeLayout`, built once by the codec and passed unchanged to
the cache, both ops and both kernels.

One token-head of ``dim`` channels is stored as

* a packed part of ``dim · code_bits / 8`` bytes: ``code`` (index and sign fused, ``2·idx + sign``) when the sign is
  ``combined``, else ``idx``. Channel c's field is its index width wide, + 1 when the sign is combined; each group of 8 channels is one little-endian word of ``code_bits`` bytes
  (``esm_turbo.quant.packing``);
* with a sign ``plane``, one sign bit per channel in a separate part ``sign`` (``dim / 8`` bytes).

Bits are named for what they count: *index bits* (a channel's LUT index), *code bits* (one stored field: the index,
plus the sign when combined) and *all-in bits* (every stored bit of the token-head over its channels, sign plane
included; per-vector norms and sketches of other codecs are counted by the codec, not here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .packing import packed_shifts

#: where a sign residual's bit goes: nowhere (no residual), fused into the code, or its own 1-bit plane
SIGN_KINDS = ("none", "combined", "plane")
#: code widths (index bits + the sign bit) stored fused as one code: they fill whole bytes per group of 8 channels
COMBINED_CODE_BITS = (2, 3, 4)


@dataclass(frozen=True)
class CodeLayout:
    """The stored code of one quantizer (keys or values of one layer), all heads.

    ``dim``: channels per head; ``index_bits``: mean index bits per channel; ``sign``: one of :data:`SIGN_KINDS`;
    ``grid``: code j decodes to the value j (a grid codec: the kernels compute values instead of looking them up);
    ``fields``: the boundaries of a group word's 8 fields (:func:`~esm_turbo.quant.packing.packed_shifts`) when
    every head has the same field widths, which the kernels compile in, else −1 (each head's layout row is read);
    ``equal_widths``: every channel ``index_bits`` wide (no layout tensor needed); ``widest``: bits of the widest
    channel's code (index + sign bit, plane or combined)."""

    dim: int
    index_bits: int
    sign: str = "none"
    grid: bool = False
    fields: int = -1
    equal_widths: bool = True
    widest: int = 0

    def __post_init__(self):
        if self.sign not in SIGN_KINDS:
            raise ValueError(f"unknown sign storage {self.sign!r}: choose one of {SIGN_KINDS}")
        if self.sign == "combined" and self.index_bits + 1 not in COMBINED_CODE_BITS:
            raise ValueError(f"a combined sign needs index bits + 1 in {COMBINED_CODE_BITS}, not {self.index_bits + 1}")

    @classmethod
    def of(cls, dim: int, widths: torch.Tensor, index_bits: int, sign: bool, grid: bool = False) -> "CodeLayout":
        """The layout of per-channel index ``widths`` [H, d] averaging ``index_bits`` (``sign``: a sign residual,
        combined where it fills whole bytes). Reads the widths on the host: build it once, not per step."""
        sign_kind = ("combined" if index_bits + 1 in COMBINED_CODE_BITS else "plane") if sign else "none"
        extra = int(sign_kind == "combined")
        group = widths[:, :8] + extra
        shared = bool((group == group[:1]).all()) and torch.equal(widths, widths[:, :8].repeat(1, dim // 8))
        return cls(dim=dim, index_bits=index_bits, sign=sign_kind, grid=bool(grid),
                   fields=packed_shifts(group[0].tolist()) if shared else -1,
                   equal_widths=bool((widths == index_bits).all()),
                   widest=int(widths.max()) + int(sign))

    @property
    def code_bits(self) -> int:
        """Mean bits of one stored field: the index, + 1 when the sign is combined (bytes of the packed part per
        group of 8 channels)."""
        return self.index_bits + int(self.sign == "combined")

    @property
    def has_sign(self) -> bool:
        return self.sign != "none"

    @property
    def part(self) -> str:
        """Name of the packed part: ``code`` (index and sign fused) or ``idx``."""
        return "code" if self.sign == "combined" else "idx"

    @property
    def sign_part(self) -> str | None:
        """Name of the separate sign-bit part, or None."""
        return "sign" if self.sign == "plane" else None

    @property
    def all_in_bits(self) -> int:
        """Stored bits per channel of the packed part and the sign plane."""
        return self.code_bits + int(self.sign == "plane")

    def part_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Trailing shape and dtype of each stored part, per (token, head)."""
        specs = {self.part: ((self.dim * self.code_bits // 8,), torch.uint8)}
        if self.sign_part:
            specs[self.sign_part] = ((self.dim // 8,), torch.uint8)
        return specs

    def kernel_fields(self) -> int:
        """The kernels' ``FIELDS`` constant: :attr:`fields`, or for equal widths ``code_bits``-bit fields."""
        if self.equal_widths:
            return packed_shifts([self.code_bits] * 8)
        return self.fields

    def per_head(self) -> "CodeLayout":
        """The same layout with its field shifts left to each head's layout row (the kernels' general path)."""
        return replace(self, fields=-1) if not self.equal_widths else self

    # ---- across the ops' boundary (torch.library ops take ints, not objects) ---------------------------
    def to_op(self) -> list[int]:
        return [self.dim, self.index_bits, SIGN_KINDS.index(self.sign), int(self.grid), self.fields,
                int(self.equal_widths), self.widest]

    @classmethod
    def from_op(cls, values: list[int]) -> "CodeLayout":
        dim, index_bits, sign, grid, fields, equal, widest = (int(v) for v in values)
        return cls(dim, index_bits, SIGN_KINDS[sign], bool(grid), fields, bool(equal), widest)


def decode_grid(key: CodeLayout, value: CodeLayout) -> int:
    """The decode kernels' ``GRID``: the widest code's bits when keys and values are both grid codecs (their values
    are computed from the codes), else 0 (looked up in the tables)."""
    return max(key.widest, value.widest) if key.grid and value.grid else 0


class CachedCodes(NamedTuple):
    """One kind's (keys' or values') packed cache of one layer and the codec constants that decode it, as the decode
    attention reference and kernel take it.

    main [B, H, T_cap, d·code_bits/8] uint8 (the ``code`` or ``idx`` part); sign [B, H, T_cap, d/8] uint8 (a sign
    plane) or empty; table [H, d, codes] values of each code (``2·code + sign`` with a sign plane), float16 or
    float32; layout [H, d] int32 field layout of ``main`` or empty (equal widths); rot [H, d, d], offset / scale
    [H, d]: the affine map ``y = (x Πᵀ − offset) / scale``; code: how the codes are stored; slots [B, 1, T_cap, k]
    int32: each token's slot words over all heads (:mod:`esm_turbo.quant.slots`), or None: no slots; perm [H, d]
    int32: where Π permutes each head's channels (the default recipe's keys), the model channel each code channel is
    (``Π[e, perm[e]] = 1``), else None — the kernels may then gather a query instead of rotating it."""

    main: torch.Tensor
    sign: torch.Tensor
    table: torch.Tensor
    layout: torch.Tensor
    rot: torch.Tensor
    offset: torch.Tensor
    scale: torch.Tensor
    code: CodeLayout
    slots: torch.Tensor | None = None
    perm: torch.Tensor | None = None

    def has_slots(self) -> bool:
        return self.slots is not None and self.slots.numel() > 0
