"""Where a cache layer's work runs, decided once when the cache is built (:func:`kernel_path`): the fused ops
(Triton kernels on CUDA) for the codecs they cover, else the PyTorch reference (two steps: decode, then attend).

Set ``ESM_TURBO_FORCE_REFERENCE=1`` (or call :func:`force_reference` before building a cache) to use the reference
everywhere.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..cache_contract import DecodeCache

_FORCE_REFERENCE = False
#: names re-exported from the submodules, imported on first use (the switch below must stay light: FastEsm asks it)
_LAZY = {"attend_compressed": "compressed", "fused_supported": "compressed", "gather_blocks": "compressed",
         "scatter_rows": "compressed", "write_compressed": "compressed", "write_dense": "compressed",
         "attend": "reference", "decode_attention_reference": "reference"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def force_reference(flag: bool = True) -> None:
    """Force (or stop forcing) the PyTorch reference path, also on CUDA."""
    global _FORCE_REFERENCE
    _FORCE_REFERENCE = bool(flag)


def use_kernels(where: torch.Tensor | torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``where`` (a tensor or a device): CUDA, a supported Triton, and
    the reference not forced."""
    if _FORCE_REFERENCE or os.environ.get("ESM_TURBO_FORCE_REFERENCE", "0") not in ("", "0"):
        return False
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    if device.type != "cuda":
        return False
    from ..kernels import triton_available
    return triton_available()


def capturing(where: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream while ``where`` lives on CUDA: reading a device
    value on the host (``int(lengths.max())``) is refused then."""
    return where.is_cuda and torch.cuda.is_current_stream_capturing()


def predicted_walk() -> bool:
    """Whether caches of values predicted from the keys take the fused walk (``esm_turbo.ops.predicted``) on CUDA: yes
    (tied to its reference on an H100, 4.7-6.6x the PyTorch path's speed, results/studies/predicted_kernels_h100.txt)
    unless ``ESM_TURBO_PREDICTED_WALK=0``."""
    return os.environ.get("ESM_TURBO_PREDICTED_WALK", "1") not in ("", "0")


def kernel_path(codec, device: torch.device) -> bool:
    """Whether a cache layer of ``codec`` on ``device`` runs the fused ops (writes and decode attention): the one
    place this is decided, when a cache is built (``KVCache.fused``)."""
    from .compressed import fused_supported
    if getattr(codec, "predictor", None) is not None and not predicted_walk():
        return False
    return use_kernels(device) and fused_supported(codec, need_kernel_shape=True)


def decode_attention(q: torch.Tensor, cache: "DecodeCache", layer: int, k_new: torch.Tensor, v_new: torch.Tensor,
                     new_valid: torch.Tensor, memo: dict | None = None) -> torch.Tensor:
    """Attention of new tokens over the compressed prefix of ``layer`` plus themselves. It reads and never writes:
    the caller writes the new tokens (uncommitted) when the step commits, and always first where
    ``cache.attends_from_storage(layer)`` (an uncompressed GPU cache, attended in place with them).

    q, k_new, v_new: [B, H, S, d]; new_valid: [B, S] bool. Returns [B, H, S, d]. ``memo``: one dict per step, shared
    by its layers (what does not change between them is computed once).
    """
    from .compressed import attend_compressed
    from .reference import decode_attention_reference
    if cache.attends_from_storage(layer):
        return attend_dense(q, cache, layer, new_valid, memo)
    if cache.fused[layer]:
        return attend_compressed(cache.codecs[layer], cache.parts[layer], cache.lengths, q, k_new, v_new, new_valid,
                                 *cache.pages(), *cache.shared_prefix())
    return decode_attention_reference(q, cache, layer, k_new, v_new, new_valid)


def attend_dense(q: torch.Tensor, cache: "DecodeCache", layer: int, new_valid: torch.Tensor,
                 memo: dict | None = None) -> torch.Tensor:
    """An uncompressed (fp16/bf16/fp32) cache on GPU, its S new tokens already written after each row's prefix
    (uncommitted): SDPA over the stored buffer in place — the baseline the compressed cache is measured against,
    with no copy of the cache. The mask [B, 1, 1, T_cap] of what each row sees is the same in every layer of a step:
    made once where a ``memo`` is shared by them, additive (0 where seen, −inf elsewhere) in the cache's dtype, as
    SDPA turns a boolean mask into on every call (two fills and a select a layer, on the GPU)."""
    parts = cache.parts[layer]
    keys, values = parts["k.x"], parts["v.x"]
    key = ("dense_visible", keys.shape[2], keys.dtype)
    mask = None if memo is None else memo.get(key)
    if mask is None:
        pos = torch.arange(keys.shape[2], device=q.device)[None, :]
        rel = pos - cache.lengths[:, None]  # [B, T_cap]: position relative to the new tokens
        new_ok = torch.gather(new_valid, 1, rel.clamp(0, new_valid.shape[1] - 1))
        seen = ((rel < 0) | ((rel < new_valid.shape[1]) & new_ok))[:, None, None, :]
        mask = torch.zeros(seen.shape, dtype=keys.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
        if memo is not None:
            memo[key] = mask
    out = torch.nn.functional.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask, scale=1.0)
    return out.to(q.dtype)


__all__ = ["attend", "attend_compressed", "attend_dense", "capturing", "decode_attention", "decode_attention_reference",
           "force_reference", "fused_supported", "gather_blocks", "kernel_path", "predicted_walk", "scatter_rows",
           "use_kernels",
           "write_compressed", "write_dense"]
