"""Pure-PyTorch reference ops (CPU / MPS / CUDA). The Triton kernels in ``esm_turbo.kernels`` match these."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..cache_contract import DecodeCache


def attend(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, prefix_valid: torch.Tensor,
           k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
           return_probs: bool = False):
    """Decode attention of S new tokens over a cached prefix plus themselves (ESM-2 is bidirectional).

    q, k_new, v_new: [B, H, S, d] (q already scaled by d^-1/2 and RoPE'd, as in ESM-2);
    k_prefix, v_prefix: [B, H, T, d]; prefix_valid: [B, T] bool; new_valid: [B, S] bool.
    Returns out [B, H, S, d] (q's dtype) and, if asked, probs [B, H, S, T + S] (float32).
    """
    probs = attention_probs(q, k_prefix, prefix_valid, k_new, new_valid)
    values = torch.cat([v_prefix.float(), v_new.float()], dim=2)
    out = torch.einsum("bhst,bhtd->bhsd", probs, values).to(q.dtype)
    return (out, probs) if return_probs else out


def attention_probs(q: torch.Tensor, k_prefix: torch.Tensor, prefix_valid: torch.Tensor, k_new: torch.Tensor,
                    new_valid: torch.Tensor) -> torch.Tensor:
    """The attention probabilities [B, H, S, T + S] (float32) of :func:`attend`: over the prefix, then the new
    tokens."""
    keys = torch.cat([k_prefix.float(), k_new.float()], dim=2)
    valid = torch.cat([prefix_valid, new_valid], dim=1)  # [B, T+S]
    scores = torch.einsum("bhsd,bhtd->bhst", q.float(), keys)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, S, H·d] (a layer's query and key outputs), cos, sin [B, S, d] → q, k [B, H, S, d] as ESM-2 attends
    with them: q scaled by d ** -0.5, both rotated by transformers' ``apply_rotary_pos_emb``."""
    from transformers.models.esm.modeling_esm import apply_rotary_pos_emb
    shape = (*q.shape[:-1], -1, head_dim)
    q = q.view(shape).transpose(1, 2) * head_dim ** -0.5
    return apply_rotary_pos_emb(q, k.view(shape).transpose(1, 2), cos, sin, unsqueeze_dim=1)


def attend_predicted(q: torch.Tensor, k_prefix: torch.Tensor, r_prefix: torch.Tensor | None, prefix_valid: torch.Tensor,
                     k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor, predictor) -> torch.Tensor:
    """:func:`attend` over a prefix whose values are r̂ + predictor(k̂) (``esm_turbo.quant.predict``), without
    predicting any cached token's values: Σ_t p_t·(f_t W + b) = (Σ_t p_t f_t) W + (Σ_t p_t) b, f_t [D] every head's
    key of token t before the rotary embedding. Per step H·D multiply-adds a cached token against D² for its
    prediction. Shapes as :func:`attend`'s, r_prefix as v_prefix (None: values not stored, no residual); the prefix at
    positions 0..T−1."""
    probs = attention_probs(q, k_prefix, prefix_valid, k_new, new_valid)
    t = k_prefix.shape[2]
    p_prefix = probs[..., :t]  # [B, H, S, T]
    out = torch.einsum("bhsj,bhjd->bhsd", probs[..., t:], v_new.float())
    if r_prefix is not None:  # None: values not stored, nothing coded beside the prediction
        out = out + torch.einsum("bhst,bhtd->bhsd", p_prefix, r_prefix.float())
    pooled = torch.einsum("bhst,btf->bhsf", p_prefix, predictor.features(k_prefix))  # [B, H, S, D]
    return (out + predictor.map_pooled(pooled, p_prefix.sum(-1, keepdim=True))).to(q.dtype)


def decode_attention_reference(q: torch.Tensor, cache: "DecodeCache", layer: int, k_new: torch.Tensor,
                               v_new: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
    """Two-step path: dequantize the whole cached prefix of ``layer``, then attend (a prefix whose values a
    predictor predicts: :func:`attend_predicted`)."""
    codec = cache.codecs[layer]
    if getattr(codec, "needs_positions", False):
        k_hat, r_hat, valid = cache.dequantize(layer, split_values=True)
        return attend_predicted(q, k_hat, r_hat, valid, k_new, v_new, new_valid, codec.predictor)
    k_hat, v_hat, valid = cache.dequantize(layer)
    return attend(q, k_hat, v_hat, valid, k_new, v_new, new_valid)


def teacher_forced_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cached: torch.Tensor,
                             v_cached: torch.Tensor, prefix: int, window: int = 0,
                             k_recent: torch.Tensor | None = None, v_recent: torch.Tensor | None = None,
                             return_probs: bool = False):
    """Every step of a teacher-forced decode at once: what :func:`attend` gives, one token per step.

    Positions < ``prefix`` are the exact prefill (they attend to the prefix only, exactly). Position
    t ≥ ``prefix`` is the step that feeds token t: it attends to the tokens before it as the cache holds them
    (``k_cached``/``v_cached``, the codec's decode of its encode) and to itself exactly; with a recent-token
    ``window`` the last ``window`` tokens before it come back as ``k_recent``/``v_recent`` (their fp16 copies).
    q, k, v, k_cached, v_cached (and the recent ones): [B, H, N, d]. Returns out [B, H, N, d] (float32) and, if
    asked, probs [B, H, N, N] (float32)."""
    n = q.shape[2]
    t = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    in_prefix = t < prefix
    exact = (in_prefix & (j < prefix)) | (~in_prefix & (j == t))  # [N, N]
    recent = ~in_prefix & (j < t) & (j >= t - window) if window else torch.zeros_like(exact)
    cached = ~in_prefix & (j < t) & ~recent
    qf = q.float()

    def scores(keys: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhsd,bhtd->bhst", qf, keys.float()).masked_fill(~where, 0.0)

    s = scores(k, exact) + scores(k_cached, cached)
    if window:
        s = s + scores(k_recent, recent)
    probs = torch.softmax(s.masked_fill(~(exact | cached | recent), float("-inf")), dim=-1)
    out = probs.masked_fill(~exact, 0.0) @ v.float() + probs.masked_fill(~cached, 0.0) @ v_cached.float()
    if window:
        out = out + probs.masked_fill(~recent, 0.0) @ v_recent.float()
    return (out, probs) if return_probs else out
