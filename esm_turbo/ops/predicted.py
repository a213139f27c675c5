"""The fused ops of a cache layer whose values are predicted from its keys (``esm_turbo.quant.predict``): the write
(keys and the values' residual into the packed parts, by the quantize kernel on CUDA) and the decode attention (one
walk over every head's packed keys, ``esm_turbo.kernels.decode.predicted``), each beside its PyTorch reference.

A cached value is r̂ + f W + b, f [H·d] every head's decoded key before the rotary embedding. Attention never predicts
a cached token: Σ_t p_t (r̂_t + f_t W + b) = Σ_t p_t r̂_t + (Σ_t p_t f_t) W + (Σ_t p_t) b
(:func:`esm_turbo.ops.reference.attend_predicted`).
"""

from __future__ import annotations

import weakref

import torch

from ..quant.codec import KVCodec
from ..quant.layout import CachedCodes
from ..quant.predict import rotate_half
from ..quant.rotations import affine_inverse
from . import use_kernels
from .compressed import (cached_codes, cached_values, fused_tables, gather_rows, gathered, pack_layer,
                         quantize_pack_reference)
from .reference import attend_predicted

#: each codec's feature maps (:func:`feature_maps` of its keys), made once and kept while it lives
_MAPS: "weakref.WeakKeyDictionary[KVCodec, tuple[torch.Tensor, torch.Tensor]]" = weakref.WeakKeyDictionary()


def feature_maps(rot: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M [H, 2, d, d], c [H, 2, d]) float32 of a key quantizer's affine map (rot Π [H, d, d], offset o and scale σ
    [H, d]): a decoded key in the affine domain ŷ gives x̂ = ŷ M₀ + c₀ = (ŷ ⊙ σ + o) Π and rotate_half(x̂) = ŷ M₁ + c₁,
    so the walk turns keys back before the rotary embedding from ŷ: f = x̂·cos − rotate_half(x̂)·sin."""
    rot = rot.float()
    both = torch.stack([rot, rotate_half(rot)], 1)  # [H, 2, d, d]
    return ((scale.float()[:, None, :, None] * both).contiguous(),
            torch.einsum("hd,hjde->hje", offset.float(), both).contiguous())


def codec_feature_maps(codec: KVCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`feature_maps` of ``codec``'s keys, made once a codec (rebuilt if it moved device)."""
    cached = _MAPS.get(codec)
    if cached is None or cached[0].device != codec.key.rot.device:
        cached = _MAPS[codec] = feature_maps(codec.key.rot, codec.key.offset, codec.key.scale)
    return cached


def write_predicted(codec: KVCodec, parts: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    pos: torch.Tensor, pages: torch.Tensor | None = None) -> None:
    """k, v [B, H, S, d] of tokens at positions ``pos[b] + j`` into one layer's packed parts (a paged cache's pools
    through ``pages``), the values as their residual after the prediction from the keys *as stored*: the keys are
    packed first (with the values as given, then overwritten), read back and decoded, the prediction subtracted, and
    both packed again (``esm_turbo::quantize_pack``: one Triton launch each on CUDA) — what
    :meth:`KVCodec.encode` stores, whatever the kernel's rounding of a key."""
    if not fused_tables(codec).values_stored:  # the keys alone: nothing of the values is stored
        write_keys(codec, parts, k, pos, pages)
        return
    pack_layer(codec, parts, k, v, pos, pages)
    s = k.shape[2]
    stored = {name[2:]: gather_rows(t, pos, s, pages) for name, t in parts.items() if name.startswith("k.")}
    k_hat = codec.key.decode(stored)
    positions = pos[:, None] + torch.arange(s, device=pos.device)
    pack_layer(codec, parts, k, v.float() - codec.predictor(k_hat, positions), pos, pages)


def write_keys(codec: KVCodec, parts: dict[str, torch.Tensor], k: torch.Tensor, pos: torch.Tensor,
               pages: torch.Tensor | None = None) -> None:
    """k [B, H, S, d] into one layer's key parts at rows ``pos[b] + j``: the quantize kernel's key programs alone on
    CUDA (``quantize_pack_triton(keys_only=True)``), its reference elsewhere."""
    tables = fused_tables(codec)
    key = codec.key
    k_tables = (key.rot, key.offset, key.scale, tables.k_bounds, key.centroids, tables.k_layout)
    k_out = tables.packed(parts, "k")
    if use_kernels(k):
        from ..kernels.quantize import quantize_pack_triton
        halves = (tables.k_rot16, tables.k_rot16)
        quantize_pack_triton(k, k, k_tables, k_tables, k_out, k_out, pos, tables.k_code, tables.k_code, halves,
                             pages=pages, keys_only=True)
    else:
        quantize_pack_reference(k, *k_tables, *k_out, pos, tables.k_code, pages)


def predicted_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
                                  lengths: torch.Tensor, keys: CachedCodes, values: CachedCodes | None, predictor,
                                  pages: torch.Tensor | None = None, block_size: int = 0) -> torch.Tensor:
    """Attention of S new tokens over a packed prefix whose values are r̂ + predictor(k̂), plus themselves: q, k_new,
    v_new [B, H, S, d] (q scaled and post-RoPE), new_valid [B, S], lengths [B]; keys / values as
    :func:`~esm_turbo.ops.compressed.compressed_attention_reference` takes them (no slots; ``values`` None: not
    stored, the residual zero), the cached token at row t at position t. Returns [B, H, S, d] in q's dtype; a query
    with no valid key gets zeros."""
    stored = values is not None
    keys, values = gathered(keys, values if stored else keys, pages)
    k_hat = affine_inverse(cached_values(keys, q.device).float(), keys.rot, keys.offset, keys.scale)
    r_hat = (affine_inverse(cached_values(values, q.device).float(), values.rot, values.offset, values.scale)
             if stored else None)
    valid = torch.arange(k_hat.shape[2], device=lengths.device)[None, :] < lengths[:, None]
    out = attend_predicted(q, k_hat, r_hat, valid, k_new, v_new, new_valid.bool(), predictor)
    any_valid = (valid.any(1) | new_valid.bool().any(1))[:, None, None, None]
    return torch.where(any_valid, out, torch.zeros_like(out))


def predicted_attention_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
                               lengths: torch.Tensor, keys: CachedCodes, values: CachedCodes | None, predictor,
                               pages: torch.Tensor | None = None, block_size: int = 0,
                               maps: tuple[torch.Tensor, torch.Tensor] | None = None,
                               splits: int | None = None) -> torch.Tensor:
    """:func:`predicted_attention_reference`'s contract on the fused walk (CUDA, or CPU under Triton's interpreter):
    queries into the keys' affine domain, the walk, its merge (``kernels.decode.predicted``). ``maps``: the keys'
    :func:`feature_maps` (made here if None); ``splits``: walks a row (None: enough for two waves of the GPU)."""
    from ..kernels.decode.predicted import predicted_merge_triton, predicted_partials_triton
    z = torch.einsum("bhsd,hed->bhse", q.float(), keys.rot.float())
    qt, c0 = z * keys.scale[:, None, :], (z * keys.offset[:, None, :]).sum(-1)
    fmap, fbias = maps if maps is not None else feature_maps(keys.rot, keys.offset, keys.scale)
    partials = predicted_partials_triton(qt, lengths, keys, values, fmap, fbias, predictor.inv_freq, pages,
                                         block_size, splits)
    return predicted_merge_triton(partials, q, k_new, v_new, new_valid, c0, values, predictor.weight,
                                  predictor.bias)


def attend_predicted_compressed(codec: KVCodec, parts: dict[str, torch.Tensor], lengths: torch.Tensor,
                                q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
                                pages: torch.Tensor | None = None, block_size: int = 0) -> torch.Tensor:
    """Decode attention of q [B, H, S, d] over one predicted layer's packed prefix plus the step's own k_new, v_new
    (new_valid [B, S]): the fused walk on CUDA for the shapes it takes (``kernels.decode.predicted.fits``), the
    reference elsewhere. Returns [B, H, S, d] in q's dtype."""
    from ..kernels.decode.predicted import fits
    keys = cached_codes(codec, parts, "k")
    values = cached_codes(codec, parts, "v") if fused_tables(codec).values_stored else None
    if q.is_cuda and fits(q.shape[1], q.shape[3]):
        return predicted_attention_triton(q, k_new, v_new, new_valid, lengths, keys, values, codec.predictor, pages,
                                          block_size, codec_feature_maps(codec))
    return predicted_attention_reference(q, k_new, v_new, new_valid, lengths, keys, values, codec.predictor, pages,
                                         block_size)
