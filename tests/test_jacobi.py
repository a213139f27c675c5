import pytest
import torch

from esm_turbo.quant.jacobi import objective, query_aware, round_robin
from esm_turbo.quant.rotations import CovarianceAccumulator, build_rotation


def _moments(seed: int, heads: int = 3, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query second moments and key covariances [H, d, d] whose bases disagree, and the keys' PCA rows."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(heads, dim, dim, generator=g, dtype=torch.float64)
    b = torch.randn(heads, dim, dim, generator=g, dtype=torch.float64) * torch.logspace(0, -1.5, dim, dtype=torch.float64)
    query, keys = a @ a.transpose(1, 2) / dim, b @ b.transpose(1, 2)
    pca = torch.linalg.eigh(keys)[1].flip(-1).transpose(1, 2)
    return query, keys, pca


@pytest.mark.parametrize("dim", [2, 8, 16, 24])
def test_round_robin_meets_every_pair_once(dim):
    pairs = [tuple(sorted(p)) for i, j in round_robin(dim) for p in zip(i.tolist(), j.tolist())]
    assert len(pairs) == len(set(pairs)) == dim * (dim - 1) // 2
    for i, j in round_robin(dim):  # each round turns disjoint pairs, so they can be turned at once
        assert len(set(i.tolist()) | set(j.tolist())) == dim
    with pytest.raises(ValueError, match="even"):
        round_robin(7)


@pytest.mark.parametrize("seed", [0, 1])
def test_query_aware_rotation_lowers_the_score_error_bound(seed):
    query, keys, pca = _moments(seed)
    rot = query_aware(pca, query, keys, ridge=0.0)
    eye = torch.eye(rot.shape[-1], dtype=rot.dtype)
    assert (rot @ rot.transpose(1, 2) - eye).abs().max() < 1e-12
    before, after = objective(pca, query, keys), objective(rot, query, keys)
    bound = (torch.linalg.slogdet(query / torch.diagonal(query, dim1=1, dim2=2).mean(-1)[:, None, None])[1]
             + torch.linalg.slogdet(keys / torch.diagonal(keys, dim1=1, dim2=2).mean(-1)[:, None, None])[1]) / 16
    assert torch.all(after < before - 0.01)  # every head gains
    assert torch.all(after >= bound - 1e-9)  # no orthogonal Π beats the best invertible transform (Hadamard)
    assert torch.equal(rot, query_aware(pca, query, keys, ridge=0.0))  # deterministic
    # the ridge (default) turns less: between PCA and the unridged fit on the unridged objective
    ridged = objective(query_aware(pca, query, keys), query, keys)
    assert torch.all(ridged < before) and torch.all(ridged > after)


def test_isotropic_queries_keep_the_pca_basis():
    """With E[q qᵀ] ∝ I the query term does not depend on Π, and the keys' PCA already minimises the rest."""
    _, keys, pca = _moments(2)
    query = 3.0 * torch.eye(16, dtype=torch.float64).expand(3, 16, 16)
    rot = query_aware(pca, query, keys)
    assert torch.allclose(objective(rot, query, keys), objective(pca, query, keys), atol=1e-9)
    assert torch.allclose(rot.abs(), pca.abs(), atol=1e-6)


def test_svd_query_needs_query_statistics():
    stats = CovarianceAccumulator(2, 8)
    stats.add(torch.randn(2, 40, 8))
    with pytest.raises(ValueError, match="query statistics"):
        build_rotation("svd-query", 2, 8, stats=stats)
    queries = CovarianceAccumulator(2, 8)
    queries.add(torch.randn(2, 40, 8) * torch.linspace(3, 0.1, 8))
    aff = build_rotation("svd-query", 2, 8, stats=stats, queries=queries)
    # centred and scaled like svd-scaled: unit variance per channel in the calibration data
    y = aff.second_moments(stats) - ((torch.einsum("hij,hj->hi", aff.rot.double(), stats.sum / stats.count[:, None])
                                      .float() - aff.offset) / aff.scale) ** 2
    torch.testing.assert_close(y, torch.ones_like(y), atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_query_aware_on_cuda_matches_the_cpu_and_repeats_exactly():
    """Calibration runs the sweeps on the model's device: the same objective as on the CPU (the rotations may
    part at near-ties of the angle search) and the same bits on every run."""
    query, keys, pca = _moments(0, heads=8, dim=32)
    cpu = query_aware(pca, query, keys)
    runs = [query_aware(pca.cuda(), query, keys) for _ in range(2)]
    assert runs[0].device.type == "cuda" and torch.equal(runs[0], runs[1])
    assert torch.allclose(objective(runs[0].cpu(), query, keys), objective(cpu, query, keys), rtol=0, atol=1e-7)
