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
from ..quant.predict import rotary_angles
from ..quant.rotations import affine_inverse
from . import use_kernels
from .compressed import (cached_codes, cached_values, fused_tables, gather_rows, gathered, pack_layer,
                         quantize_pack_reference)
from .reference import attend_predicted

#: each codec's walk tables (:func:`walk_tables` of its keys and predictor), made once and kept while it lives
_TABLES: "weakref.WeakKeyDictionary[KVCodec, tuple[torch.Tensor, torch.Tensor]]" = weakref.WeakKeyDictionary()
#: each predictor's rotary table (:func:`rotary_table`; a module, hashed by identity: a tensor key would be compared
#: element by element)
_ROTARY: "weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()


def walk_tables(perm: torch.Tensor | None, offset: torch.Tensor, scale: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ftab [H, 4, d] float32, w2 [2, H·d, H·d] in weight's dtype) of a key quantizer whose rotation is a permutation
    π (``perm`` [H, d], integer, as ``quant.rotations.key_permutation`` gives it and ``FusedTables.k_perm`` and
    ``CachedCodes.perm`` hold it; None for any other rotation), its offset o and scale σ [H, d] and the predictor's
    map ``weight`` [H·d, H·d]. A decoded key ŷ gives x̂ = (ŷ ⊙ σ + o) Π:
    u = ŷ ⊙ σ + o in code order, x̂_π(j) = u_j. f = x̂·cos − rotate_half(x̂)·sin, so Σ_t p_t f_t W =
    (Σ p u⊙cos(tω')) W₀ + (Σ p u⊙sin(tω')) W₁ with ω'_j the frequency of channel π(j), W₀'s row j = W's row π(j) and
    W₁'s row j = ±W's row π(j)'s rotate_half partner (+ for π(j) in the second half): ftab holds σ, o and the index
    of ω' among the d/2 frequencies (π(j) mod d/2, exact in float32) a code channel, and o Π (the offsets in the
    model's channel order: a query's constant q · o Π); w2 W₀ and W₁."""
    if perm is None:
        raise ValueError("walk_tables: the keys' rotation is not a permutation of each head's channels")
    pi = perm.long()
    heads, d = pi.shape
    base = torch.arange(heads, device=pi.device)[:, None] * d
    freq = (pi % (d // 2)).float()
    natural = torch.empty_like(offset, dtype=torch.float32).scatter_(1, pi, offset.float())  # o Π: o_c at π(c)
    ftab = torch.stack([scale.float(), offset.float(), freq, natural], 1).contiguous()
    rows, partner = (base + pi).reshape(-1), (base + (pi + d // 2) % d).reshape(-1)
    sign = torch.where(pi >= d // 2, 1.0, -1.0).reshape(-1, 1).to(pi.device)
    w = weight.float()
    return ftab, torch.stack([w[rows], sign * w[partner]]).to(weight.dtype).contiguous()


def rotary_table(predictor, length: int) -> torch.Tensor:
    """[L, d/2, 2] float32 (L ≥ ``length``, on the device of ``predictor.inv_freq``): the rotary embedding's cos and
    sin at positions 0..L−1 and each of its d/2 frequencies, computed as ``quant.predict.rotary_angles`` computes them
    (so the fused walk's factors are the reference's), for the pooling walk to read instead of evaluating them. Kept
    a predictor (``quant.predict.ValuePredictor``; rebuilt when a longer one or another device is asked for), at
    least 1,024 rows and a power of two."""
    inv_freq = predictor.inv_freq
    cached = _ROTARY.get(predictor)
    if cached is not None and cached.shape[0] >= length and cached.device == inv_freq.device:
        return cached
    rows = max(1024, 1 << max(0, int(length) - 1).bit_length())
    cos, sin = rotary_angles(torch.arange(rows, device=inv_freq.device), inv_freq)
    half = inv_freq.numel()
    table = _ROTARY[predictor] = torch.stack([cos[:, :half], sin[:, :half]], -1).contiguous()
    return table


def codec_walk_tables(codec: KVCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`walk_tables` of ``codec``'s keys and predictor, made once a codec (rebuilt if it moved device)."""
    cached = _TABLES.get(codec)
    if cached is None or cached[0].device != codec.key.rot.device:
        key, pred = codec.key, codec.predictor
        perm = fused_tables(codec).k_perm  # made once with the codec's tables
        cached = _TABLES[codec] = walk_tables(perm, key.offset, key.scale, pred.weight)
    return cached


def write_predicted(codec: KVCodec, parts: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    pos: torch.Tensor, pages: torch.Tensor | None = None) -> None:
    """k, v [B, H, S, d] of tokens at positions ``pos[b] + j`` into one layer's packed parts (a paged cache's pools
    through ``pages``), the values as their residual after the prediction from the keys *as stored*: the keys are
    packed first, read back (:func:`stored_features`), the prediction subtracted, and the residual packed (the
    quantize kernel's programs of one kind a launch on CUDA; with slots, keys and residual packed together, as
    ``esm_turbo::quantize_pack`` writes both kinds' slots) — what :meth:`KVCodec.encode` stores, whatever the
    kernel's rounding of a key."""
    write_part(codec, parts, k, "k", pos, pages)
    if not fused_tables(codec).values_stored:  # the keys alone: nothing of the values is stored
        return
    s = k.shape[2]
    residual = v.float() - codec.predictor.from_features(stored_features(codec, parts, pos, s, pages))
    if codec.slots:
        pack_layer(codec, parts, k, residual, pos, pages)
    else:
        write_part(codec, parts, residual, "v", pos, pages)


def stored_features(codec: KVCodec, parts: dict[str, torch.Tensor], pos: torch.Tensor, s: int,
                    pages: torch.Tensor | None = None) -> torch.Tensor:
    """f [B, S, H·d] float32 (``ValuePredictor.features``) of the keys one layer's packed parts hold at positions
    ``pos[b] + j`` (j < s; a paged cache's pools through ``pages``): one launch of
    ``kernels.decode.predicted.predicted_features_triton`` on CUDA where the keys' rotation permutes their channels,
    else read back and decoded by the codec (the same values and roundings)."""
    tables = fused_tables(codec)
    if use_kernels(pos) and tables.k_perm is not None:
        from ..kernels.decode.predicted import positions_held, predicted_features_triton
        keys = cached_codes(codec, parts, "k")
        trig = rotary_table(codec.predictor, positions_held(keys, pages)[1])
        return predicted_features_triton(keys, pos, s, codec_walk_tables(codec)[0], trig, pages)
    stored = {name[2:]: gather_rows(t, pos, s, pages) for name, t in parts.items() if name.startswith("k.")}
    positions = pos[:, None] + torch.arange(s, device=pos.device)
    return codec.predictor.features(codec.key.decode(stored), positions)


def write_part(codec: KVCodec, parts: dict[str, torch.Tensor], x: torch.Tensor, kind: str, pos: torch.Tensor,
               pages: torch.Tensor | None = None) -> None:
    """x [B, H, S, d] into one layer's parts of ``kind`` ('k' or 'v') at rows ``pos[b] + j``, no slots: the quantize
    kernel's programs of that kind alone on CUDA (``quantize_pack_triton(one_kind=True)``), its reference elsewhere."""
    tables = fused_tables(codec)
    q = codec.key if kind == "k" else codec.value
    bounds, layout, code, rot16 = ((tables.k_bounds, tables.k_layout, tables.k_code, tables.k_rot16) if kind == "k"
                                   else (tables.v_bounds, tables.v_layout, tables.v_code, tables.v_rot16))
    x_tables = (q.rot, q.offset, q.scale, bounds, q.centroids, layout)
    out = tables.packed(parts, kind)
    if use_kernels(x):
        from ..kernels.quantize import quantize_pack_triton
        quantize_pack_triton(x, x, x_tables, x_tables, out, out, pos, code, code, (rot16, rot16), pages=pages,
                             one_kind=True)
    else:
        quantize_pack_reference(x, *x_tables, *out, pos, code, pages)


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
                               tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                               splits: int | None = None, grouped: bool | None = None,
                               launch: dict | None = None) -> torch.Tensor:
    """:func:`predicted_attention_reference`'s contract on the fused walk (CUDA, or CPU under Triton's interpreter),
    for keys whose rotation is a permutation (``keys.perm``): the two walks (the first gathers and scales the queries
    into the keys' affine domain itself) and their merge (``kernels.decode.predicted``), three launches; two where
    the predictor's map lies within the scores walk's groups of heads over the keys alone (``grouped``, None: as
    ``kernels.decode.predicted.one_pass`` says; ``launch``: the one-pass walk's tile and warps). ``tables``:
    :func:`walk_tables` (made here if None); ``splits``: walks a row (None: enough for two waves of the GPU)."""
    from ..kernels.decode.predicted import one_pass, positions_held, predicted_merge_triton, predicted_partials_triton
    ftab, w2 = tables if tables is not None else walk_tables(keys.perm, keys.offset, keys.scale, predictor.weight)
    trig = rotary_table(predictor, positions_held(keys, pages, block_size)[1])
    grouped = one_pass(predictor, q.shape[1], q.shape[3], values is not None) if grouped is None else grouped
    partials = predicted_partials_triton(q, lengths, keys, values, ftab, trig, pages, block_size, splits, grouped,
                                         launch)
    return predicted_merge_triton(partials, q, k_new, v_new, new_valid, ftab, values, w2, predictor.bias)


def attend_predicted_compressed(codec: KVCodec, parts: dict[str, torch.Tensor], lengths: torch.Tensor,
                                q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
                                pages: torch.Tensor | None = None, block_size: int = 0) -> torch.Tensor:
    """Decode attention of q [B, H, S, d] over one predicted layer's packed prefix plus the step's own k_new, v_new
    (new_valid [B, S]): the fused walk on CUDA for the shapes it takes (``kernels.decode.predicted.fits``), the
    reference elsewhere. Returns [B, H, S, d] in q's dtype."""
    from ..kernels.decode.predicted import fits
    keys = cached_codes(codec, parts, "k")
    values = cached_codes(codec, parts, "v") if fused_tables(codec).values_stored else None
    if q.is_cuda and fits(q.shape[1], q.shape[3]):  # a permutation of the keys' channels: fused_supported
        return predicted_attention_triton(q, k_new, v_new, new_valid, lengths, keys, values, codec.predictor, pages,
                                          block_size, codec_walk_tables(codec))
    return predicted_attention_reference(q, k_new, v_new, new_valid, lengths, keys, values, codec.predictor, pages,
                                         block_size)
