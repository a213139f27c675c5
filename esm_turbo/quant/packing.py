"""Bit packing of quantizer indices and sign bits along the last dimension, into uint8 bytes.

Names say the byte layout (cf. hqq's ``pack_3bit_32``):

* ``pack_1bit_u8``: 8 values per byte, value ``j`` of a byte at bit ``j`` (LSB first).
* ``pack_2bit_u8``: 4 values per byte, value ``j`` at bits ``2j..2j+1``.
* ``pack_3bit_u8x3``: 8 values in 3 bytes: the 24-bit little-endian word ``Σ v_j << 3j``.
* ``pack_4bit_u8``: 2 values per byte, value 0 in the low nibble.
* ``pack_8bit_u8``: one value per byte.

All packers take ``[..., n]`` integer tensors with values in ``[0, 2**bits)`` and ``n`` a multiple
of 8, and return ``[..., n * bits // 8]`` uint8; each unpacker inverts its packer exactly.
"""

from __future__ import annotations

import torch

from .lloyd_max import check_bits


def _check(x: torch.Tensor, bits: int) -> None:
    if x.shape[-1] % 8:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of 8; cannot pack {bits}-bit values")
    if x.dtype.is_floating_point or x.dtype == torch.bool and bits != 1:
        raise TypeError(f"expected an integer tensor of {bits}-bit codes, got {x.dtype}")


def _pack_lsb_first(x: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    groups = x.to(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, device=x.device, dtype=torch.uint8)
    return (groups << shifts).sum(-1, dtype=torch.uint8)


def _unpack_lsb_first(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    vals = (packed.unsqueeze(-1) >> shifts) & mask
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def pack_1bit_u8(x: torch.Tensor) -> torch.Tensor:
    """[..., n] in {0,1} (or bool) → [..., n/8] uint8."""
    _check(x, 1)
    return _pack_lsb_first(x, 1)


def unpack_1bit_u8(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/8] uint8 → [..., n] uint8 in {0,1}."""
    return _unpack_lsb_first(packed, 1)


def pack_2bit_u8(x: torch.Tensor) -> torch.Tensor:
    """[..., n] in [0,4) → [..., n/4] uint8."""
    _check(x, 2)
    return _pack_lsb_first(x, 2)


def unpack_2bit_u8(packed: torch.Tensor) -> torch.Tensor:
    return _unpack_lsb_first(packed, 2)


def pack_4bit_u8(x: torch.Tensor) -> torch.Tensor:
    """[..., n] in [0,16) → [..., n/2] uint8."""
    _check(x, 4)
    return _pack_lsb_first(x, 4)


def unpack_4bit_u8(packed: torch.Tensor) -> torch.Tensor:
    return _unpack_lsb_first(packed, 4)


def pack_8bit_u8(x: torch.Tensor) -> torch.Tensor:
    _check(x, 8)
    return x.to(torch.uint8)


def unpack_8bit_u8(packed: torch.Tensor) -> torch.Tensor:
    return packed


def pack_3bit_u8x3(x: torch.Tensor) -> torch.Tensor:
    """[..., n] in [0,8) → [..., 3n/8] uint8: each group of 8 values becomes 3 little-endian bytes."""
    _check(x, 3)
    groups = x.to(torch.int32).reshape(*x.shape[:-1], x.shape[-1] // 8, 8)
    shifts = torch.arange(0, 24, 3, device=x.device, dtype=torch.int32)  # value j of 8 at bit 3j
    word = (groups << shifts).sum(-1, dtype=torch.int32)  # [..., n/8], 24 bits used
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return out.to(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] * 3 // 8)


def unpack_3bit_u8x3(packed: torch.Tensor) -> torch.Tensor:
    """[..., 3n/8] uint8 → [..., n] uint8 in [0,8)."""
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    shifts = torch.arange(0, 24, 3, device=packed.device, dtype=torch.int32)
    vals = (word.unsqueeze(-1) >> shifts) & 7
    return vals.to(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] // 3 * 8)


_PACKERS = {1: (pack_1bit_u8, unpack_1bit_u8), 2: (pack_2bit_u8, unpack_2bit_u8),
            3: (pack_3bit_u8x3, unpack_3bit_u8x3), 4: (pack_4bit_u8, unpack_4bit_u8),
            8: (pack_8bit_u8, unpack_8bit_u8)}


def pack_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit codes along the last dim with the packer of that width."""
    return _PACKERS[check_bits(bits)][0](x)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`; returns uint8 codes."""
    return _PACKERS[check_bits(bits)][1](packed)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` values of ``bits`` bits occupy once packed (n a multiple of 8)."""
    if n % 8:
        raise ValueError(f"{n} values is not a multiple of 8")
    return n * check_bits(bits) // 8


# ---- per-channel field widths ---------------------------------------------------------------------
#
# A quantizer with a bit allocation gives each channel c of a head its own code width f_c, with every group
# of 8 channels summing to 8·W bits: the group is one W-byte little-endian word (W ≤ 8), channel 8g + r at
# bit ``shift = Σ_{r' < r} f_{8g+r'}``. Equal widths give exactly the layout of the packers above.

def field_layout(widths: torch.Tensor) -> torch.Tensor:
    """Per-channel field widths [..., d] (groups of 8 summing to the same 8·W ≤ 64 bits) → layout [..., d]
    int32 ``shift | mask << 8``, what the kernels and :func:`unpack_fields` read."""
    total = widths.reshape(*widths.shape[:-1], -1, 8).sum(-1)
    if widths.shape[-1] % 8 or bool((total != total.reshape(-1)[0]).any()) or int(total.reshape(-1)[0]) > 64:
        raise ValueError(f"field widths must fill groups of 8 channels with the same ≤ 64 bits, got group sums "
                         f"{sorted(set(total.reshape(-1).tolist()))}")
    return layout_of(widths)


def layout_of(widths: torch.Tensor) -> torch.Tensor:
    """:func:`field_layout` without its checks (which read the host: none under a CUDA graph capture)."""
    w = widths.to(torch.int32)
    groups = w.reshape(*w.shape[:-1], -1, 8)
    shift = (groups.cumsum(-1) - groups).reshape(w.shape)  # (cumsum widens to int64)
    return (shift | (((1 << w) - 1) << 8)).to(torch.int32)


def pack_fields(x: torch.Tensor, layout: torch.Tensor, width: int) -> torch.Tensor:
    """Codes x [..., H, T, d] under a layout [H, d] (:func:`field_layout`) of ``width`` bits per value on
    average (W) → [..., H, T, d·W/8] uint8."""
    _check(x, 8)
    nbytes = check_bits(width)
    shift = (layout & 255).to(torch.int64).unsqueeze(-2)  # [H, 1, d]
    word = (x.to(torch.int64) << shift).reshape(*x.shape[:-1], x.shape[-1] // 8, 8).sum(-1)  # fields apart
    out = torch.stack([(word >> (8 * i)) & 255 for i in range(nbytes)], dim=-1)
    return out.to(torch.uint8).reshape(*x.shape[:-1], -1)


def unpack_fields(packed: torch.Tensor, layout: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_fields`: [..., H, T, d·W/8] uint8 → codes [..., H, T, d] int64."""
    nbytes = check_bits(width)
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], packed.shape[-1] // nbytes, nbytes)
    word = b[..., 0]
    for i in range(1, nbytes):
        word = word | (b[..., i] << (8 * i))
    shift = (layout & 255).to(torch.int64).unsqueeze(-2)
    mask = (layout >> 8).to(torch.int64).unsqueeze(-2)
    word = word.repeat_interleave(8, dim=-1)
    return (word >> shift) & mask


def packed_shifts(widths: list[int]) -> int:
    """The field boundaries of a group word of 8 field ``widths``, packed 6 bits each: boundary j (the shift of
    field j; j = 8: the word's width) at bit 6j. A layout that a kernel compiles in."""
    return sum(sum(widths[:j]) << (6 * j) for j in range(9))
