"""Per-head orthogonal rotations Π (applied to post-RoPE keys, optionally to values).

Convention: a row vector ``x`` [..., d] is rotated as ``y = x @ Π.T``; ``Π`` has orthonormal rows.

Kinds:

* ``identity``;
* ``haar``: a seeded Haar-random orthogonal matrix (QR of a Gaussian with the sign fix);
* ``hadamard``: randomized Hadamard ``H·D/√n`` with random signs D, applied in O(d log d) by a fast
  Walsh-Hadamard transform; a head_dim that is not a power of two (ESM-2 35M: 24) is split into
  power-of-two blocks after a seeded permutation;
* ``svd``: the paper's head-wise SVD/PCA rotation — the right singular vectors of the calibration
  activations, rows sorted by decreasing energy. It does *not* equalise variance: it concentrates
  energy in the leading components;
* ``svd-scaled``: PCA followed by per-component centring and scaling to unit variance (an affine
  step stored beside Π, see :class:`AffineStats`);
* ``svd-query`` (keys): ``svd-scaled`` with the PCA basis refined for the queries that read the keys — the
  orthogonal Π minimising the score error of a bit-allocated quantizer (``esm_turbo.quant.jacobi``); needs the
  queries' statistics too.

PCA is fitted from activations streamed in chunks through :class:`CovarianceAccumulator`, which
keeps only ``XᵀX``, ``Σx`` and a count per head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .jacobi import query_aware

ROTATION_KINDS = ("identity", "haar", "hadamard", "svd", "svd-scaled", "svd-query")
#: kinds fitted from calibration statistics (the others are seeded)
FITTED_KINDS = ("svd", "svd-scaled", "svd-query")


def key_permutation(rot: torch.Tensor) -> torch.Tensor | None:
    """π [H, d] (int64): the model channel each code channel is when the rotation ``rot`` [H, d, d] permutes each
    head's channels (the default recipe's keys: "identity", channels reordered by their widths); None for any other
    rotation."""
    r = rot.float()
    pi = r.argmax(-1)
    return pi if torch.equal(r, torch.nn.functional.one_hot(pi, r.shape[-1]).to(r.dtype)) else None


def check_rotation_kind(kind: str) -> str:
    if kind not in ROTATION_KINDS:
        raise ValueError(f"unknown rotation {kind!r}: choose one of {ROTATION_KINDS}")
    return kind


def haar_orthogonal(dim: int, seed: int, count: int = 1) -> torch.Tensor:
    """[count, dim, dim] float32 Haar-random orthogonal matrices from a seeded CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(count, dim, dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.to(torch.float32)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform along the last dim (a power of two), O(n log n)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    h = 1
    y = x.reshape(-1, n)
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(*lead, n)


def _pow2_block(dim: int) -> int:
    return dim & -dim  # largest power of two dividing dim


class RandomizedHadamard:
    """Seeded randomized Hadamard rotation of size ``dim``: permute, flip signs, blockwise FWHT/√n."""

    def __init__(self, dim: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.dim = dim
        self.block = _pow2_block(dim)
        self.signs = torch.randint(0, 2, (dim,), generator=gen).to(torch.float32) * 2 - 1
        self.perm = (torch.randperm(dim, generator=gen) if self.block != dim
                     else torch.arange(dim))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] → Π x in O(dim log dim)."""
        y = (x[..., self.perm.to(x.device)] * self.signs.to(x.device, x.dtype))
        y = y.reshape(*x.shape[:-1], self.dim // self.block, self.block)
        return (fwht(y) / math.sqrt(self.block)).reshape(x.shape)

    def matrix(self) -> torch.Tensor:
        """[dim, dim] float32 Π with ``apply(x) == x @ Π.T``."""
        return self.apply(torch.eye(self.dim)).T.contiguous()


def hadamard_rotations(dim: int, seed: int, count: int) -> torch.Tensor:
    """[count, dim, dim] randomized Hadamard matrices, one seed per head (seed + i)."""
    return torch.stack([RandomizedHadamard(dim, seed + i).matrix() for i in range(count)])


class CovarianceAccumulator:
    """Streams per-head second moments of activations: XᵀX [H, d, d], Σx [H, d], count [H] (float64).

    ``add`` takes chunks [..., H, T, d] with an optional validity mask [..., T] (True = real token),
    so padded batches never contaminate the statistics and no chunk needs to be kept.
    """

    def __init__(self, heads: int, dim: int):
        self.xtx = torch.zeros(heads, dim, dim, dtype=torch.float64)
        self.sum = torch.zeros(heads, dim, dtype=torch.float64)
        self.count = torch.zeros(heads, dtype=torch.float64)
        self.max_norm = torch.zeros(heads, dtype=torch.float64)

    def add(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        heads, dim = self.sum.shape
        x = x.detach().to(torch.float64)
        if valid is not None:
            x = x * valid.to(x.dtype).unsqueeze(-2).unsqueeze(-1)
        flat = x.movedim(-3, 0).reshape(heads, -1, dim)  # [H, N, d]
        n = (valid.sum() if valid is not None else torch.tensor(flat.shape[1])).to(torch.float64)
        self.xtx += torch.einsum("hni,hnj->hij", flat, flat).cpu()
        self.sum += flat.sum(1).cpu()
        self.count += n.cpu()
        self.max_norm = torch.maximum(self.max_norm, flat.norm(dim=-1).amax(-1).cpu())

    def mean(self) -> torch.Tensor:
        """[H, d] float64: E[x]."""
        if torch.any(self.count == 0):
            raise ValueError("no calibration tokens were seen for at least one head")
        return self.sum / self.count[:, None]

    def moments(self, centered: bool) -> torch.Tensor:
        """[H, d, d] float64: the covariance (``centered``) or the second moments E[x xᵀ]."""
        mean = self.mean()
        return self.xtx / self.count[:, None, None] - (mean[:, :, None] * mean[:, None, :] if centered else 0.0)

    def pca(self, centered: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (Π [H,d,d] float32 with rows = principal directions by decreasing energy,
        mean [H,d] in the rotated basis, per-component std [H,d] in the rotated basis)."""
        mat, second, mean = self.moments(centered), self.moments(centered=False), self.mean()
        evals, evecs = torch.linalg.eigh(mat)  # ascending
        evecs = evecs.flip(-1)
        # deterministic sign: largest-magnitude entry of each direction positive
        idx = evecs.abs().argmax(dim=1, keepdim=True)
        evecs = evecs * torch.sign(torch.gather(evecs, 1, idx))
        rot = evecs.transpose(-1, -2).contiguous()  # rows are directions
        rmean = torch.einsum("hij,hj->hi", rot, mean)
        rvar = torch.einsum("hij,hjk,hik->hi", rot, second, rot) - (rmean**2 if centered else 0.0)
        std = rvar.clamp_min(1e-12).sqrt()
        return rot.to(torch.float32), rmean.to(torch.float32), std.to(torch.float32)


def affine_forward(x: torch.Tensor, rot: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, T, d] → y = (x Π_hᵀ - offset_h) / scale_h (rot [H,d,d], offset/scale [H,d]), in float32
    or the tables' wider dtype."""
    y = torch.einsum("...htd,hed->...hte", x.to(torch.promote_types(rot.dtype, torch.float32)), rot)
    return (y - offset[:, None, :]) / scale[:, None, :]


def affine_inverse(y: torch.Tensor, rot: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`affine_forward`."""
    return torch.einsum("...hte,hed->...htd", y * scale[:, None, :] + offset[:, None, :], rot)


@dataclass
class AffineStats:
    """Per-head transform around Π: ``y = (x @ Π.T - offset) / scale``. Shapes: rot [H,d,d],
    offset [H,d], scale [H,d] (all float32)."""

    rot: torch.Tensor
    offset: torch.Tensor
    scale: torch.Tensor
    stored: torch.Tensor | None = None  # [H, d(d+1)/2] fp16 reflectors of a fitted rot (rot: their rebuild, reordered)
    order: torch.Tensor | None = None  # [H, d] long: the channel order (rows of the built rotation kept)

    def permuted(self, order: torch.Tensor) -> "AffineStats":
        """The same transform with its output channels of head h in ``order[h]`` (composes with an order)."""
        base = self.order.to(order.device).gather(1, order) if self.order is not None else order

        def rows(t: torch.Tensor) -> torch.Tensor:
            idx = order.to(t.device)
            return t.gather(1, idx.view(*idx.shape, *[1] * (t.dim() - 2)).expand(*idx.shape, *t.shape[2:]))

        return AffineStats(rows(self.rot), rows(self.offset), rows(self.scale), self.stored, base.cpu())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return affine_forward(x, self.rot.to(x.device), self.offset.to(x.device), self.scale.to(x.device))

    def second_moments(self, stats: CovarianceAccumulator) -> torch.Tensor:
        """E[y_i²] [H, d] of the affine outputs, from streamed statistics."""
        rot, off, sc = self.rot.double(), self.offset.double(), self.scale.double()
        second, mean = stats.moments(centered=False), stats.mean()
        diag = torch.einsum("hij,hjk,hik->hi", rot, second, rot)
        rmean = torch.einsum("hij,hj->hi", rot, mean)
        return ((diag - 2 * off * rmean + off**2) / sc**2).clamp_min(0).float()


def to_reflectors(rot: torch.Tensor) -> torch.Tensor:
    """[H, d, d] orthogonal rows Π → [H, d(d+1)/2] fp16: the Householder vectors of a QR of Πᵀ = QR
    (``torch.geqrf``; the strictly lower triangle row by row, unit diagonal implied), then the signs of R's
    diagonal (±1: Π = R Qᵀ). Half the bytes of Π in fp16; :func:`from_reflectors` rebuilds it."""
    a, _ = torch.geqrf(rot.detach().cpu().double().transpose(-1, -2))
    dim = rot.shape[-1]
    rows, cols = torch.tril_indices(dim, dim, offset=-1)
    signs = torch.where(torch.diagonal(a, dim1=-2, dim2=-1) < 0, -1.0, 1.0)
    return torch.cat([a[..., rows, cols], signs], dim=-1).half().contiguous()


def identity_reflectors(heads: int, dim: int) -> torch.Tensor:
    """[H, d(d+1)/2] fp16: no reflection and positive signs, what :func:`from_reflectors` rebuilds as the identity."""
    out = torch.zeros(heads, dim * (dim + 1) // 2, dtype=torch.float16)
    out[:, -dim:] = 1.0
    return out


def from_reflectors(stored: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`to_reflectors`: [H, d(d+1)/2] → [H, d, d] float32 rows, orthonormal to rounding whatever
    the stored values (each factor is the reflection ``I − 2vvᵀ/‖v‖²`` of its own fp16 vector; a zero vector is
    no reflection, so the identity rebuilds exactly). Deterministic (float64, CPU)."""
    if stored.shape[-1] != dim * (dim + 1) // 2:
        raise ValueError(f"{stored.shape[-1]} reflector entries for head_dim {dim} (want {dim * (dim + 1) // 2})")
    stored = stored.detach().cpu().double()
    a = torch.zeros(*stored.shape[:-1], dim, dim, dtype=torch.float64)
    rows, cols = torch.tril_indices(dim, dim, offset=-1)
    a[..., rows, cols] = stored[..., :-dim]
    norm2 = (a * a).sum(-2)  # [H, d] squared norm below the implied unit diagonal
    tau = torch.where(norm2 > 0, 2.0 / (1.0 + norm2), torch.zeros_like(norm2))
    q = torch.linalg.householder_product(a, tau)
    signs = torch.where(stored[..., -dim:] < 0, -1.0, 1.0)  # any non-negative entry reads as +1
    return (q.transpose(-1, -2) * signs[..., None]).float().contiguous()


def build_rotation(kind: str, heads: int, dim: int, seed: int = 0, stats: CovarianceAccumulator | None = None,
                   queries: CovarianceAccumulator | None = None) -> AffineStats:
    """The per-head transform of a given kind. Fitted kinds need streamed key ``stats`` (``svd-query`` the
    ``queries``' too)."""
    return build_rotations(kind, heads, dim, [seed], [stats], [queries])[0]


def build_rotations(kind: str, heads: int, dim: int, seeds: list[int],
                    stats: list[CovarianceAccumulator | None], queries: list[CovarianceAccumulator | None] | None = None,
                    device: torch.device | str = "cpu") -> list[AffineStats]:
    """:func:`build_rotation` for several layers at once (``svd-query`` refines all their heads in one batch,
    on ``device``; the rotations returned are on the CPU)."""
    check_rotation_kind(kind)
    zeros = torch.zeros(heads, dim)
    ones = torch.ones(heads, dim)
    if kind == "identity":
        return [AffineStats(torch.eye(dim).expand(heads, dim, dim).clone(), zeros, ones) for _ in seeds]
    if kind == "haar":
        return [AffineStats(haar_orthogonal(dim, seed, heads), zeros, ones) for seed in seeds]
    if kind == "hadamard":
        return [AffineStats(hadamard_rotations(dim, seed, heads), zeros, ones) for seed in seeds]
    if any(s is None for s in stats):
        raise ValueError(f"rotation {kind!r} is fitted from data: calibration statistics are required")
    rots = torch.stack([s.pca(centered=kind != "svd")[0] for s in stats])  # [L, H, d, d]
    if kind == "svd-query":
        if queries is None or any(q is None for q in queries):
            raise ValueError("rotation 'svd-query' is fitted from keys and queries: query statistics are required")
        flat = query_aware(rots.flatten(0, 1).to(device), torch.cat([q.moments(centered=False) for q in queries]),
                           torch.cat([s.moments(centered=True) for s in stats]))
        rots = flat.cpu().view(rots.shape)
    out = []
    for rot, layer_stats in zip(rots, stats):
        stored = to_reflectors(rot)
        rot = from_reflectors(stored, dim)  # what a checkpoint stores rebuilds exactly this
        if kind == "svd":
            out.append(AffineStats(rot, zeros, ones, stored))
            continue
        # centre and scale each component, its statistics re-derived in the snapped basis
        snapped = AffineStats(rot, zeros, ones)
        mean = torch.einsum("hij,hj->hi", rot.double(), layer_stats.mean()).float()
        var = (snapped.second_moments(layer_stats) - mean**2).clamp_min(1e-12)
        out.append(AffineStats(rot, mean, var.sqrt(), stored))
    return out
