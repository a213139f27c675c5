"""Query-aware key rotations: Jacobi sweeps that trade a little key variance for a much smaller score error.

A key error δk reaches a score as ``⟨q, δk⟩``. Quantizing rotated channel c of ``y = Π k`` with b_c bits costs,
at high rate, ``w_c σ_c² 2^(−2 b_c)`` in expected squared score error, with ``w_c = (Π M Πᵀ)_cc`` (M = E[q qᵀ],
the queries' second moments) and ``σ_c² = (Π Σ Πᵀ)_cc`` (Σ the keys' covariance). Under an optimal allocation
of a fixed bit budget (``esm_turbo.quant.allocation``) the total is proportional to the geometric mean of
``w_c σ_c²``, so the rotation to fit minimises

    J(Π) = Σ_c log (Π M Πᵀ)_cc + log (Π Σ Πᵀ)_cc          over orthogonal Π.

PCA of the keys (``svd``/``svd-scaled``) minimises only the second sum (Hadamard's inequality); the first is
what a peaked head's queries look at. The bound over *all* invertible transforms is
``log det M + log det Σ``; on our stress models PCA sits 0.3–1.0 dB (head_dim 16) and ~2 dB (head_dim 64) above
it, and the orthogonal optimum recovers about two thirds of that — with no change to the kernels or the
checkpoint, which take any orthogonal Π.

The minimiser starts from the PCA basis and runs cyclic Jacobi sweeps: each round rotates d/2 disjoint
channel pairs (a round-robin schedule covers every pair once per sweep) by the angle that minimises J for
that pair — a function of one angle, found on a grid and refined — batched over every head of every layer.
J never increases; sweeps stop when one gains less than ``tol`` per channel.

The query moments are ridged (``M / mean diag M + ridge · I``, default :data:`RIDGE`): the fit weighs directions
by how much the *average* query reads them, and a held-out sequence whose queries read a neglected direction pays
for it. Without the ridge, one of 29 held-out sequences of the head_dim-64 stress model fell to 0.896 decode cos at
3 bits (0.951 with plain PCA); with 0.3 it is 0.958, and at head_dim 16 the turn still lifts the mean and the worst
sequence over PCA. On trained testbeds the tail is held better by unrotated keys, the default (``docs/recipe.md``).
"""

from __future__ import annotations

import math

import torch

#: query-moment ridge of :func:`query_aware` (see the module notes)
RIDGE = 0.3


def round_robin(dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """dim − 1 rounds of dim/2 disjoint pairs (i, j) covering each pair of [0, dim) once (circle method)."""
    if dim % 2:
        raise ValueError(f"round_robin needs an even dimension, got {dim}")
    idx = list(range(dim))
    rounds = []
    for _ in range(dim - 1):
        half = dim // 2
        rounds.append((torch.tensor(idx[:half]), torch.tensor(idx[::-1][:half])))
        idx = [idx[0], idx[-1], *idx[1:-1]]
    return rounds


def _turn_rows(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
    """Rows (i, j) of x [G, d, n] ← (c·x_i + s·x_j, c·x_j − s·x_i); c, s [G, d/2]."""
    xi, xj = x[:, i], x[:, j]
    c, s = c[..., None], s[..., None]
    x[:, i], x[:, j] = c * xi + s * xj, c * xj - s * xi


def _turn_sym(m: torch.Tensor, i: torch.Tensor, j: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
    """m ← G m Gᵀ for the Givens rotations of :func:`_turn_rows` (m [G, d, d] symmetric)."""
    _turn_rows(m, i, j, c, s)
    _turn_rows(m.transpose(1, 2), i, j, c, s)


def _pair_cost(m: torch.Tensor, i: torch.Tensor, j: torch.Tensor, phi: torch.Tensor, floor: float) -> torch.Tensor:
    """log of the two diagonal entries of m after turning pair (i, j) by θ = φ/2, summed: [G, d/2, n] for
    φ [G, d/2, n] or [n]."""
    mii, mjj, mij = (m[:, a, b][..., None] for a, b in ((i, i), (j, j), (i, j)))
    mean, half = (mii + mjj) / 2, (mii - mjj) / 2
    turn = half * torch.cos(phi) + mij * torch.sin(phi)
    return torch.log((mean + turn).clamp_min(0) + floor) + torch.log((mean - turn).clamp_min(0) + floor)


def objective(rot: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """J(Π) / d per group [G] for rot [G,d,d] (rows = channels), query second moments and key covariance [G,d,d],
    each normalised to mean diagonal 1."""
    query, keys = _normalised(query), _normalised(keys)
    w = torch.einsum("gij,gjk,gik->gi", rot.double(), query, rot.double())
    s = torch.einsum("gij,gjk,gik->gi", rot.double(), keys, rot.double())
    return _log_cost(w, s, floor)


def _log_cost(w: torch.Tensor, s: torch.Tensor, floor: float) -> torch.Tensor:
    """Mean over channels of log w_c + log σ_c² [G], from the channels' query weights and key variances [G, d]."""
    return (torch.log(w.clamp_min(0) + floor) + torch.log(s.clamp_min(0) + floor)).mean(-1)


def _normalised(m: torch.Tensor) -> torch.Tensor:
    m = m.double()
    return m / torch.diagonal(m, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-300)[:, None, None]


def query_aware(rot: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, max_sweeps: int = 30,
                tol: float = 1e-4, grid: int = 64, floor: float = 1e-6, ridge: float = RIDGE) -> torch.Tensor:
    """Refine orthogonal rows rot [G, d, d] (e.g. the keys' PCA) to lower :func:`objective` for query second
    moments ``query`` (normalised, plus ``ridge`` · I) and key covariances ``keys`` [G, d, d]. Returns [G, d, d]
    float64, orthogonal rows, on the device of ``rot`` (the sweeps are ~30 small launches per round: a GPU
    runs them in a fraction of a CPU's time; the other inputs are moved there)."""
    rot = rot.detach().double().clone()
    like = dict(dtype=rot.dtype, device=rot.device)
    query = _normalised(query.to(rot.device)) + ridge * torch.eye(rot.shape[-1], **like)
    a = rot @ query @ rot.transpose(1, 2)
    b = rot @ _normalised(keys.to(rot.device)) @ rot.transpose(1, 2)
    phi = torch.arange(grid, **like) * (math.pi / grid)  # φ = 2θ over a half turn (J has period π)
    fine = torch.linspace(-math.pi / grid, math.pi / grid, 17, **like)
    rounds = [(i.to(rot.device), j.to(rot.device)) for i, j in round_robin(rot.shape[-1])]
    def cost_now() -> torch.Tensor:  # J / d of the current rows: a and b hold Π M Πᵀ and Π Σ Πᵀ
        return _log_cost(torch.diagonal(a, dim1=1, dim2=2), torch.diagonal(b, dim1=1, dim2=2), floor)

    last = cost_now()
    for _ in range(max_sweeps):
        for i, j in rounds:
            cost = _pair_cost(a, i, j, phi, floor) + _pair_cost(b, i, j, phi, floor)  # [G, d/2, grid]
            near = phi[cost.argmin(-1)][..., None] + fine  # refine around the best grid angle
            refined = _pair_cost(a, i, j, near, floor) + _pair_cost(b, i, j, near, floor)
            best, at = refined.min(-1)
            angle = torch.where(best < cost[..., 0], near.gather(-1, at[..., None])[..., 0], 0.0) / 2
            c, s = torch.cos(angle), torch.sin(angle)
            _turn_rows(rot, i, j, c, s)
            _turn_sym(a, i, j, c, s)
            _turn_sym(b, i, j, c, s)
        now = cost_now()
        if float((last - now).max()) < tol:
            break
        last = now
    return rot
