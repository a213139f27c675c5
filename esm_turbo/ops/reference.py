"""Pure-PyTorch reference ops (CPU / MPS / CUDA). The Triton kernels in ``esm_turbo.kernels`` match these."""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, prefix_valid: torch.Tensor,
           k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
           return_probs: bool = False):
    """Decode attention of S new tokens over a cached prefix plus themselves (ESM-2 is bidirectional).

    q, k_new, v_new: [B, H, S, d] (q already scaled by d^-1/2 and RoPE'd, as in ESM-2);
    k_prefix, v_prefix: [B, H, T, d]; prefix_valid: [B, T] bool; new_valid: [B, S] bool.
    Returns out [B, H, S, d] (q's dtype) and, if asked, probs [B, H, S, T + S] (float32).
    """
    keys = torch.cat([k_prefix.float(), k_new.float()], dim=2)
    values = torch.cat([v_prefix.float(), v_new.float()], dim=2)
    valid = torch.cat([prefix_valid, new_valid], dim=1)  # [B, T+S]
    scores = torch.einsum("bhsd,bhtd->bhst", q.float(), keys)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhst,bhtd->bhsd", probs, values).to(q.dtype)
    return (out, probs) if return_probs else out


def decode_attention_reference(q: torch.Tensor, cache, layer: int, k_new: torch.Tensor,
                               v_new: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
    """Two-step path: dequantize the whole cached prefix of ``layer``, then attend."""
    k_hat, v_hat, valid = cache.dequantize(layer)
    return attend(q, k_hat, v_hat, valid, k_new, v_new, new_valid)
