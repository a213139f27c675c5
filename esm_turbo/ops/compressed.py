"""Ops on the packed cache, registered with ``torch.library`` so torch.compile and CUDA graphs capture
them whole: ``esm_turbo::quantize_pack`` (encode new K or V straight into the cache) and
``esm_turbo::compressed_attention`` (decode attention that reads the cache packed).

Each op has a pure-PyTorch reference here (CPU/MPS, or forced) and a Triton implementation in
``esm_turbo.kernels`` with the same signature. :func:`fused_supported` says which codecs they cover:
calibrated or Hadamard LUT quantizers without per-vector norms, 1–4 bits, residual ``sign`` or
``none``. Anything else (QJL, TurboQuant norms, dense caches) takes the two-step reference path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.codec import KVCodec, VectorQuantizer, lut_bounds, lut_code_parts
from ..quant.packing import unpack_1bit_u8, unpack_bits
from ..quant.rotations import affine_forward

FUSED_BITS = (1, 2, 3, 4)


def fused_supported(codec: KVCodec, need_kernel_shape: bool = False) -> bool:
    """True if both quantizers of ``codec`` fit the fused ops (and, with ``need_kernel_shape``, the
    Triton kernels' shape rule: head_dim/8 a power of two, i.e. d ∈ {16, 32, 64, 128, ...})."""
    if getattr(codec, "window", 0):
        return False
    for q in (codec.key, codec.value):
        if not isinstance(q, VectorQuantizer) or q.normalize or q.residual not in ("none", "sign"):
            return False
        if q.bits not in FUSED_BITS:
            return False
        if need_kernel_shape and (q.dim // 8) & (q.dim // 8 - 1):
            return False
    return True


def code_table(q: VectorQuantizer) -> torch.Tensor:
    """[H, n_codes] float32 values of a fused code: ``2·idx + sign → c[idx] + ε₁ | c[idx] − ε₀`` with a sign
    residual, ``idx → c[idx]`` without."""
    if q.residual != "sign":
        return q.centroids.contiguous()
    lo = q.centroids - q.eps[..., 0]
    hi = q.centroids + q.eps[..., 1]
    return torch.stack([lo, hi], dim=-1).reshape(q.heads, -1).contiguous()


@dataclass
class StoredCodes:
    """How one quantizer's codes sit in the cache: the packed part (``code`` or ``idx``), its width in
    bits, and the separate sign-bit part (``sign``) or None."""

    part: str
    bits: int
    sign_part: str | None

    @classmethod
    def of(cls, q: VectorQuantizer) -> "StoredCodes":
        if q.combined_sign:
            return cls("code", q.bits + 1, None)
        return cls("idx", q.bits, "sign" if q.residual == "sign" else None)


@dataclass
class FusedTables:
    """Per-layer constants of the fused ops, derived once from a codec.

    wq [H, d+1, d]: ``qt = q @ wqᵀ`` gives ``[q̃ | c0]``; k_tab / v_tab [H, codes]; k_bounds / v_bounds
    [H, K-1]; k_codes / v_codes: where the packed codes are stored.
    """

    wq: torch.Tensor
    k_tab: torch.Tensor
    v_tab: torch.Tensor
    k_bounds: torch.Tensor
    v_bounds: torch.Tensor
    k_codes: StoredCodes
    v_codes: StoredCodes

    def packed(self, parts: dict[str, torch.Tensor], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, sign bits or an empty tensor) of ``kind`` ('k' or 'v') in a layer's cache parts."""
        codes = self.k_codes if kind == "k" else self.v_codes
        main = parts[f"{kind}.{codes.part}"]
        return main, parts[f"{kind}.{codes.sign_part}"] if codes.sign_part else main.new_empty(0)


def fused_tables(codec: KVCodec) -> FusedTables:
    """Cached on the codec (its buffers are fixed once calibrated); rebuilt if it moved device."""
    cached = getattr(codec, "_fused_tables", None)
    key, value = codec.key, codec.value
    if cached is not None and cached.wq.device == key.rot.device:
        return cached
    scaled = key.rot * key.scale[:, :, None]  # row e of Π times scale_e
    c0_row = torch.einsum("he,hed->hd", key.offset, key.rot)[:, None, :]
    tables = FusedTables(wq=torch.cat([scaled, c0_row], dim=1).contiguous(), k_tab=code_table(key),
                         v_tab=code_table(value), k_bounds=lut_bounds(key.centroids),
                         v_bounds=lut_bounds(value.centroids), k_codes=StoredCodes.of(key),
                         v_codes=StoredCodes.of(value))
    codec._fused_tables = tables
    return tables


# ---- references (same contracts as the Triton kernels) ----------------------------------------------

def scatter_rows(buf: torch.Tensor, val: torch.Tensor, pos: torch.Tensor) -> None:
    """buf [B, H, T_cap, *] ← val [B, H, S, *] at rows ``pos[b] + j`` of each sequence."""
    rows = torch.arange(val.shape[0], device=val.device)[:, None]
    at = pos[:, None] + torch.arange(val.shape[2], device=val.device)  # [B, S]
    buf[rows, :, at] = val.transpose(1, 2)  # advanced indices split by a slice put [B, S] first


def quantize_pack_reference(x: torch.Tensor, rot: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor,
                            bounds: torch.Tensor, centroids: torch.Tensor, idx_out: torch.Tensor,
                            sign_out: torch.Tensor, pos: torch.Tensor, bits: int, combine: bool) -> None:
    """Encode x [B,H,S,d] (rot [H,d,d], offset/scale [H,d], centroids [H,K] of ``bits`` bits, bounds
    [H,K-1] unused here) at rows pos[b] + j of the cache parts: ``combine`` → idx_out holds codes
    ``2·idx + sign`` of bits+1 bits; else idx_out [B,H,T_cap,d·bits/8] and sign_out [B,H,T_cap,d/8]
    (or empty: no residual)."""
    parts, _ = lut_code_parts(affine_forward(x, rot, offset, scale), centroids, bits,
                              sign=combine or sign_out.numel() > 0, combined=combine)
    scatter_rows(idx_out, parts["code" if combine else "idx"], pos)
    if "sign" in parts:
        scatter_rows(sign_out, parts["sign"], pos)


def _decode_codes(idx: torch.Tensor, sign: torch.Tensor, tab: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed [B,H,T,*] → affine-domain values [B,H,T,d] through the code table [H, codes]."""
    codes = unpack_bits(idx, bits).long()
    if sign.numel():
        codes = 2 * codes + unpack_1bit_u8(sign).long()
    heads = torch.arange(tab.shape[0], device=tab.device)[None, :, None, None]
    return tab[heads, codes]


def compressed_attention_reference(qt: torch.Tensor, k_idx: torch.Tensor, k_sign: torch.Tensor,
                                   v_idx: torch.Tensor, v_sign: torch.Tensor, k_tab: torch.Tensor,
                                   v_tab: torch.Tensor, lengths: torch.Tensor, yk_new: torch.Tensor,
                                   yv_new: torch.Tensor, new_valid: torch.Tensor, v_scale: torch.Tensor,
                                   v_offset: torch.Tensor, k_bits: int, v_bits: int) -> torch.Tensor:
    """Attention of S new tokens over the packed prefix plus themselves, in the affine domain.

    qt [B,H,S,d+1] = [q̃ | c0]; k_idx/v_idx [B,H,T_cap,d·bits/8] uint8 packed codes of k_bits/v_bits
    bits; k_sign/v_sign [B,H,T_cap,d/8] uint8 separate sign bits (or empty); tabs [H, codes] indexed by
    the code (``2·code + sign`` when sign bits are separate); lengths [B] (valid prefix rows); yk_new/yv_new [B,H,S,d] new
    keys/values in their codec's affine domain; new_valid [B,S]; v_scale/v_offset [H,d].
    Returns the output in V's rotated domain [B,H,S,d] float32 (multiply by Π_v to finish); a query
    with no valid key gets zeros.
    """
    k_hat = _decode_codes(k_idx, k_sign, k_tab, k_bits)
    v_hat = _decode_codes(v_idx, v_sign, v_tab, v_bits)
    t = k_hat.shape[2]
    keys = torch.cat([k_hat, yk_new.float()], dim=2)
    values = torch.cat([v_hat, yv_new.float()], dim=2)
    valid = torch.cat([torch.arange(t, device=lengths.device)[None, :] < lengths[:, None], new_valid.bool()], 1)
    q, c0 = qt[..., :-1], qt[..., -1:]
    scores = torch.einsum("bhsd,bhtd->bhst", q, keys) + c0
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    any_valid = valid.any(dim=1)[:, None, None, None]
    probs = torch.softmax(scores.masked_fill(~any_valid, 0.0), dim=-1)
    out = torch.einsum("bhst,bhtd->bhsd", probs, values) * v_scale[:, None, :] + v_offset[:, None, :]
    return torch.where(any_valid, out, torch.zeros_like(out))


# ---- custom ops -------------------------------------------------------------------------------------

def _kernels_for(t: torch.Tensor) -> bool:
    from . import use_kernels
    return use_kernels(t)


@torch.library.custom_op("esm_turbo::quantize_pack", mutates_args=("idx_out", "sign_out"))
def quantize_pack(x: torch.Tensor, rot: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor,
                  bounds: torch.Tensor, centroids: torch.Tensor, idx_out: torch.Tensor, sign_out: torch.Tensor,
                  pos: torch.Tensor, bits: int, combine: bool) -> None:
    if _kernels_for(x):
        from ..kernels.quantize import quantize_pack_triton
        quantize_pack_triton(x.contiguous(), rot, offset, scale, bounds, centroids, idx_out, sign_out,
                             pos, bits, combine)
    else:
        quantize_pack_reference(x, rot, offset, scale, bounds, centroids, idx_out, sign_out, pos, bits, combine)


@quantize_pack.register_fake
def _quantize_pack_fake(x, rot, offset, scale, bounds, centroids, idx_out, sign_out, pos, bits, combine) -> None:
    return None


@torch.library.custom_op("esm_turbo::compressed_attention", mutates_args=())
def compressed_attention(qt: torch.Tensor, k_idx: torch.Tensor, k_sign: torch.Tensor, v_idx: torch.Tensor,
                         v_sign: torch.Tensor, k_tab: torch.Tensor, v_tab: torch.Tensor, lengths: torch.Tensor,
                         yk_new: torch.Tensor, yv_new: torch.Tensor, new_valid: torch.Tensor,
                         v_scale: torch.Tensor, v_offset: torch.Tensor, k_bits: int, v_bits: int) -> torch.Tensor:
    args = (qt, k_idx, k_sign, v_idx, v_sign, k_tab, v_tab, lengths, yk_new, yv_new, new_valid,
            v_scale, v_offset, k_bits, v_bits)
    if _kernels_for(qt):
        from ..kernels.decode import compressed_attention_triton
        return compressed_attention_triton(*args)
    return compressed_attention_reference(*args)


@compressed_attention.register_fake
def _compressed_attention_fake(qt, k_idx, k_sign, v_idx, v_sign, k_tab, v_tab, lengths, yk_new, yv_new,
                               new_valid, v_scale, v_offset, k_bits, v_bits) -> torch.Tensor:
    return yk_new.new_empty(yk_new.shape, dtype=torch.float32)


# ---- layer-level entry points -----------------------------------------------------------------------

def write_compressed(codec: KVCodec, parts: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                     pos: torch.Tensor) -> None:
    """Quantize-and-pack k, v [B,H,S,d] into one layer's cache parts at rows ``pos[b] + j``."""
    tables = fused_tables(codec)
    for kind, q, x, bounds in (("k", codec.key, k, tables.k_bounds), ("v", codec.value, v, tables.v_bounds)):
        main, sign = tables.packed(parts, kind)
        quantize_pack(x, q.rot, q.offset, q.scale, bounds, q.centroids, main, sign, pos, q.bits, q.combined_sign)


def attend_compressed(codec: KVCodec, parts: dict[str, torch.Tensor], lengths: torch.Tensor,
                      q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      new_valid: torch.Tensor) -> torch.Tensor:
    """Decode attention of q [B,H,S,d] over one layer's packed prefix (``lengths`` [B] rows) plus the
    step's own k_new/v_new [B,H,S,d] (new_valid [B,S]). Returns [B,H,S,d] in q's dtype."""
    tables = fused_tables(codec)
    key, value = codec.key, codec.value
    qt = torch.einsum("bhsd,hed->bhse", q.float(), tables.wq).contiguous()
    yk = key.to_affine(k_new).contiguous()
    yv = value.to_affine(v_new).contiguous()
    k_codes, k_sign = tables.packed(parts, "k")
    v_codes, v_sign = tables.packed(parts, "v")
    out_rot = compressed_attention(qt, k_codes, k_sign, v_codes, v_sign, tables.k_tab, tables.v_tab,
                                   lengths, yk, yv, new_valid.to(torch.uint8).contiguous(), value.scale,
                                   value.offset, tables.k_codes.bits, tables.v_codes.bits)
    return torch.einsum("bhse,hed->bhsd", out_rot, value.rot).to(q.dtype)
