"""Values predicted from the keys (AQUA-KV's idea, taken further): a layer's values are coded as what an affine map of
the token's decoded keys of *every* head, turned back to before the rotary embedding, does not predict.

Why it works: in ESM-2 a token's keys of all heads are one square projection of the layer's input (H·d = the hidden
size) and its values another, so before the rotary embedding the values are an affine function of the keys; a map
fitted on decoded keys explains 0.998–1.000 of the values' variance on the trained testbeds, and the value codec
spends its bits on the rest (``docs/recipe.md``). The map is a constant of the layer (D×D, D = H·d), not bytes a
token; encoding and decoding both apply it to the *decoded* keys, so they agree exactly whatever its precision.

Shapes: keys k̂ [..., H, T, d] of tokens at ``positions`` (long, broadcast against [..., T]; default 0..T−1, a
row read from its start), features [..., T, D] (head-major: channel h·d + c), values [..., H, T, d].
"""

from __future__ import annotations

import torch
from torch import nn


def rotary_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., T, d] of the rotary embedding at ``positions`` [..., T] (transformers' ESM-2 and ESM C
    convention: the frequencies repeated over the two halves of a head)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] → [−x₂, x₁] of the two halves of the last dim (transformers' rotary convention)."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def unrope(k: torch.Tensor, positions: torch.Tensor | None, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys k [..., H, T, d] at ``positions`` ([..., T] or [T]; None: 0..T−1) turned back by the inverse
    rotation: k·cos − rotate_half(k)·sin, float32."""
    t = k.shape[-2]
    if positions is None:
        positions = torch.arange(t, device=k.device)
    cos, sin = rotary_angles(positions.to(k.device), inv_freq)  # [..., T, d]
    if cos.dim() > 2:  # [B, T, d] → [B, 1, T, d]: one angle a token, every head
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    k = k.float()
    return k * cos - rotate_half(k) * sin


#: the channels (heads × d) a program of the fused scores walk decodes a token (``kernels.decode.predicted``): a map
#: within groups of that many heads' channels lets it pool the features as it scores
WALK_CHANNELS = 128


def walk_group(dim: int) -> int:
    """The heads of d = ``dim`` channels that the fused scores walk takes together: :data:`WALK_CHANNELS` / d of them,
    at least 1, at most 8 (8 at heads of 16, 2 at heads of 64, 1 at heads of 128)."""
    return max(1, min(8, WALK_CHANNELS // dim))


def group_size(spec: str | int, heads: int, dim: int) -> int | None:
    """The consecutive heads whose keys predict a head's values under ``calibrate --predict-group`` ``spec``: None
    for "all" (every head's), :func:`walk_group` for "walk", else the number given (at most ``heads``); a one-line
    error for anything else."""
    text = str(spec).strip().lower()
    if text == "all":
        return None
    if text == "walk":
        return min(heads, walk_group(dim))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"predict_group {spec!r}: give all, walk or a number of heads ≥ 1")
    return min(heads, int(text))


def cross_group(heads: int, group: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[H, H] bool: whether heads i and j lie in different groups of ``group`` consecutive heads (the last group the
    rest)."""
    head = torch.arange(heads, device=device)
    return (head[:, None] // group) != (head[None, :] // group)


def within_groups(weight: torch.Tensor, heads: int, dim: int, group: int) -> torch.Tensor:
    """``weight`` [H·d, H·d] with every entry outside the diagonal blocks of ``group`` heads zeroed: a map that takes
    each head's values from its group's features alone (as ``PredictorFit.solve(group=...)`` fits one)."""
    apart = cross_group(heads, group, weight.device)[:, None, :, None]
    return weight.view(heads, dim, heads, dim).masked_fill(apart, 0).reshape(weight.shape)


def head_group(weight: torch.Tensor, heads: int, dim: int) -> int:
    """The fewest heads G (1 ≤ G ≤ H) such that ``weight`` [H·d, H·d] maps each group of G consecutive heads'
    features (the last group the rest) to that group's values alone: every entry outside those diagonal blocks
    exactly zero, as ``PredictorFit.solve(group=G)`` leaves them. One device-to-host copy of [H, H] flags."""
    coupled = weight.detach().reshape(heads, dim, heads, dim).abs().amax(dim=(1, 3)).cpu() > 0  # [H, H]
    for g in range(1, heads):
        if not coupled[cross_group(heads, g)].any():
            return g
    return heads


class ValuePredictor(nn.Module):
    """v ≈ f(k̂) W + b per token, f(k̂) [.., D] = every head's decoded key before the rotary embedding; ``weight``
    [D, D] and ``bias`` [D] (float16 buffers, applied in float32), ``inv_freq`` [d/2] (float32): the model's rotary
    frequencies. ``explained``: the share of the calibration values' variance the fit predicted (None when loaded);
    ``group``: the fewest consecutive heads whose keys alone each head's values are predicted from (the map
    block-diagonal in blocks of ``group`` heads, :func:`head_group`; ``heads`` for a map over every head)."""

    explained: float | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, inv_freq: torch.Tensor, heads: int, dim: int):
        super().__init__()
        width = heads * dim
        if tuple(weight.shape) != (width, width) or tuple(bias.shape) != (width,) or inv_freq.numel() != dim // 2:
            raise ValueError(f"value predictor: expected weight [{width}, {width}], bias [{width}], inv_freq "
                             f"[{dim // 2}]; got {list(weight.shape)}, {list(bias.shape)}, {list(inv_freq.shape)}")
        self.heads, self.dim = heads, dim
        self.register_buffer("weight", weight.to(torch.float16).contiguous())
        self.register_buffer("bias", bias.to(torch.float16).contiguous())
        self.register_buffer("inv_freq", inv_freq.float().clone())
        self.group = head_group(self.weight, heads, dim)

    def features(self, k_hat: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """k̂ [..., H, T, d] → [..., T, D]: every head's key of the token before the rotary embedding."""
        pre = unrope(k_hat, positions, self.inv_freq)
        return pre.transpose(-3, -2).flatten(-2)

    def forward(self, k_hat: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """k̂ [..., H, T, d] → predicted values [..., H, T, d] float32."""
        return self.from_features(self.features(k_hat, positions))

    def from_features(self, feats: torch.Tensor) -> torch.Tensor:
        """:meth:`features` [..., T, D] → predicted values [..., H, T, d] float32 (the map and the bias)."""
        pred = feats @ self.weight.float() + self.bias.float()  # [..., T, D]
        return pred.unflatten(-1, (self.heads, self.dim)).transpose(-3, -2)

    def map_pooled(self, pooled: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """Σ_t p_t·prediction_t per head from the pooled features: ``pooled`` [..., H, S, D] = Σ_t p_{h,t} f_t and
        ``mass`` [..., H, S, 1] = Σ_t p_{h,t} → [..., H, S, d]: head h's output columns of the map only."""
        w = self.weight.float().view(self.heads * self.dim, self.heads, self.dim)  # column h·d + c of the map
        return torch.einsum("...hsf,fhd->...hsd", pooled, w) + mass * self.bias.float().view(self.heads, 1, self.dim)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim={self.dim}"


class Unstored(nn.Module):
    """The value quantizer of a layer whose values are not stored at all: its predictor's prediction from the keys is
    the value (``calibrate --bits 2 --predict-values``; in ESM-2 the values are an affine function of the keys before
    the rotary embedding, so the keys' codes carry them). It keeps one zero-width part a token (``none``, [..., H, T,
    0] uint8: no bytes) so that the caches and the codec contract see a value part of the right shape; it decodes to
    zeros (the residual)."""

    bits = 0

    def __init__(self, heads: int, dim: int):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.register_buffer("_device_anchor", torch.zeros(0))

    def part_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"none": ((0,), torch.uint8)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [..., H, T, d] → {"none": [..., H, T, 0]}."""
        return {"none": torch.zeros(*x.shape[:-1], 0, dtype=torch.uint8, device=x.device)}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """→ zeros [..., H, T, d] float32 (nothing was coded)."""
        none = parts["none"]
        return torch.zeros(*none.shape[:-1], self.dim, device=none.device)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim={self.dim}"


def stores_values(codec) -> bool:
    """Whether ``codec`` stores its values (every codec but one whose values are :class:`Unstored`)."""
    return not isinstance(codec.value, Unstored)


class PredictorFit:
    """Least squares of a layer's values on :meth:`ValuePredictor.features` of its decoded keys, accumulated over
    batches in float64 (the normal equations, [D + 1]², never the tokens)."""

    def __init__(self, heads: int, dim: int, inv_freq: torch.Tensor, device: torch.device | str = "cpu"):
        self.heads, self.dim, self.inv_freq = heads, dim, inv_freq.float().to(device)
        width = heads * dim + 1
        self.gram = torch.zeros(width, width, dtype=torch.float64, device=device)
        self.cross = torch.zeros(width, heads * dim, dtype=torch.float64, device=device)
        self.energy = torch.zeros(heads * dim, dtype=torch.float64, device=device)  # Σ v² a channel
        self.count = 0

    def add(self, k_hat: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        """k̂, v [B, H, S, d] of tokens at positions 0..S−1 of each row; valid [B, S] bool: the tokens counted."""
        x = unrope(k_hat, None, self.inv_freq).transpose(1, 2).flatten(2)[valid]  # [N, D]
        y = v.float().transpose(1, 2).flatten(2)[valid]
        x = torch.cat([x, torch.ones_like(x[:, :1])], 1).double()
        self.gram += x.T @ x
        self.cross += x.T @ y.double()
        self.energy += y.double().pow(2).sum(0)
        self.count += x.shape[0]

    def solve(self, ridge: float = 1e-6, group: int | None = None) -> ValuePredictor:
        """The fitted :class:`ValuePredictor` (a ridge of ``ridge`` × the features' mean energy keeps a rank-deficient
        layer solvable). ``group``: each head's values from the keys of its group of ``group`` consecutive heads alone
        (the map block-diagonal, a block a group; ``tools/predicted_values_study.py --groups``); None: every head's."""
        if self.count == 0:
            raise ValueError("value predictor: no tokens to fit on")
        width = self.gram.shape[0]
        reg = ridge * float(self.gram.diagonal()[:-1].mean().clamp_min(1e-30))
        gram = self.gram + reg * torch.eye(width, dtype=self.gram.dtype, device=self.gram.device)
        gram[-1, -1] = self.gram[-1, -1]  # the bias is not shrunk
        if group is None:
            sol = torch.linalg.solve(gram, self.cross)  # [D + 1, D]
        else:
            sol = torch.zeros_like(self.cross)
            for first in range(0, self.heads, group):
                cols = torch.arange(first * self.dim, min(first + group, self.heads) * self.dim, device=sol.device)
                rows = torch.cat([cols, cols.new_tensor([width - 1])])  # the group's features and the bias
                sol[rows[:, None], cols] = torch.linalg.solve(gram[rows][:, rows], self.cross[rows][:, cols])
        pred = ValuePredictor(sol[:-1].float(), sol[-1].float(), self.inv_freq, self.heads, self.dim)
        pred.explained = self.explained(sol)
        return pred

    def explained(self, sol: torch.Tensor) -> float:
        """The share of the values' variance (about their means, over the fitted tokens) that ``sol`` [D + 1, D]
        predicts: 1 − Σ residual² / Σ (v − v̄)²."""
        residual = (self.energy.sum() - 2 * (sol * self.cross).sum() + (sol * (self.gram @ sol)).sum()).clamp_min(0)
        total = self.energy.sum() - self.cross[-1].pow(2).sum() / self.count
        return float(1 - residual / total.clamp_min(1e-30))
