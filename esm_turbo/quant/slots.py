"""Slots: a side list of fixed size beside a codec's codes (PyTorch reference).

Each token keeps, for each kind (keys, values), its ``k`` values whose coding error is largest over all its heads
and channels, as a correction in the codes' own affine domain ``y = (x Πᵀ − offset) / scale``
(:meth:`~esm_turbo.quant.codec.VectorQuantizer.to_affine`): the decoded ŷ plus δ = y − ŷ at that value gives y
again (to δ's fp16 rounding). The error ranked is each value's share of the token's squared error in the original
domain, ``scale · |y − ŷ|`` (Π is orthogonal), or with ``relative`` ``|y − ŷ|``, in units of its channel's scale.
Picked in the affine domain, a slot is read where a fused decode kernel reads the codes: the key's correction adds
``q̃[c] · δ`` to the token's score (q̃ the query in the keys' domain), the value's adds ``p · δ`` to the value sum's
channel c, before either is mapped back.

Layout: one int32 per slot, ``[..., T, k]`` per kind: bits 31…16 the value's index among the token's H·d values
(head · d + channel), bits 15…0 the fp16 bits of δ. A zero word is a correction of 0 to value 0, so a zeroed
buffer reads as no slots. Bytes: 4·k per token and kind (:func:`slot_bits`).
"""

from __future__ import annotations

import torch

#: the stored word of one slot
SLOT_DTYPE = torch.int32
#: slots a token and kind the fused kernels write and read (more: the PyTorch path)
KERNEL_SLOTS = 1
#: a token's values (heads × head_dim) must fit the index's 15 bits (the word stays non-negative)
MAX_VALUES = 1 << 15


def slot_bits(k: int, heads: int, dim: int) -> float:
    """Stored bits a value that ``k`` slots a token add to one kind: 32·k over the token's H·d values."""
    return 32.0 * k / (heads * dim)


def check_slot_values(heads: int, dim: int) -> None:
    """Refuse tokens of more values (``heads`` × ``dim``) than a slot's 15-bit index holds."""
    if heads * dim > MAX_VALUES:
        raise ValueError(f"slots index a token's values in 15 bits: {heads} heads × {dim} > {MAX_VALUES}")


def slot_errors(y: torch.Tensor, y_hat: torch.Tensor, scale: torch.Tensor, relative: bool = False) -> torch.Tensor:
    """What slots rank: y, y_hat [..., H, T, d] (float32, the affine domain), scale [H, d]. Returns [..., H, T, d]:
    ``scale · |y − ŷ|``, or with ``relative`` ``|y − ŷ|``."""
    err = (y - y_hat).abs()
    return err if relative else err * scale[:, None, :].to(err.dtype)


def pick_slots(y: torch.Tensor, y_hat: torch.Tensor, scale: torch.Tensor, k: int,
               relative: bool = False) -> torch.Tensor:
    """Each token's ``k`` largest :func:`slot_errors` over its H·d values, as slot words [..., T, k] int32 (the
    index and the fp16 δ = y − ŷ there). y, y_hat: [..., H, T, d] float32; scale: [H, d]."""
    *lead, heads, tokens, dim = y.shape
    check_slot_values(heads, dim)
    if k <= 0:
        return torch.zeros(*lead, tokens, 0, dtype=SLOT_DTYPE, device=y.device)
    err = slot_errors(y, y_hat, scale, relative).transpose(-3, -2).reshape(*lead, tokens, heads * dim)
    idx = err.topk(min(k, heads * dim), dim=-1).indices  # [..., T, k]
    delta = (y - y_hat).transpose(-3, -2).reshape(*lead, tokens, heads * dim).gather(-1, idx)
    bits = delta.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (idx.to(torch.int32) << 16) | bits


def unpack_slots(slots: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot words [..., T, k] → (head, channel) long and δ float32, each [..., T, k]."""
    index = (slots >> 16).long()
    delta = (slots & 0xFFFF).to(torch.int16).view(torch.float16).float()
    return index // dim, index % dim, delta


def apply_slots(y_hat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """ŷ [..., H, T, d] with each slot's δ added at its value: [..., H, T, d] float32 (a new tensor)."""
    *lead, heads, tokens, dim = y_hat.shape
    if slots.shape[-1] == 0:
        return y_hat.float()
    flat = y_hat.float().transpose(-3, -2).reshape(*lead, tokens, heads * dim).clone()
    index = (slots >> 16).long()
    flat.scatter_add_(-1, index, unpack_slots(slots, dim)[2])
    return flat.reshape(*lead, tokens, heads, dim).transpose(-3, -2)


__all__ = ["KERNEL_SLOTS", "MAX_VALUES", "SLOT_DTYPE", "apply_slots", "check_slot_values", "pick_slots", "slot_bits",
           "slot_errors", "unpack_slots"]
