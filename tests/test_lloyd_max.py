import numpy as np
import pytest

from esm_turbo.quant.lloyd_max import check_bits, lloyd_max, lloyd_max_weighted


def test_gaussian_known_values():
    r2 = lloyd_max(2)
    np.testing.assert_allclose(r2.centroids, [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    assert r2.mse == pytest.approx(0.1175, abs=1e-4)
    r3 = lloyd_max(3)
    np.testing.assert_allclose(r3.centroids[4:], [0.2451, 0.7560, 1.3440, 2.1520], atol=2e-4)
    assert r3.mse == pytest.approx(0.03454, abs=1e-5)
    assert lloyd_max(4).mse == pytest.approx(0.00950, abs=2e-5)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_sphere_density_approaches_gaussian_scaled(bits):
    # a coordinate of a random unit vector in d=128 is ≈ N(0, 1/d)
    d = 128
    sph = lloyd_max(bits, "sphere", d)
    assert sph.mse * d == pytest.approx(lloyd_max(bits).mse, rel=0.03)
    assert sph.mse * d < lloyd_max(bits).mse  # bounded support: slightly lighter tails


def test_weighted_lloyd_is_deterministic_and_matches_density():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(400_000)
    a = lloyd_max_weighted(x, np.ones_like(x), 3)
    b = lloyd_max_weighted(x.copy(), np.ones_like(x), 3)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    np.testing.assert_allclose(a.centroids, lloyd_max(3).centroids, atol=0.03)
    # weights act as repetitions
    vals, counts = np.unique(np.round(x, 2), return_counts=True)
    c = lloyd_max_weighted(vals, counts, 3)
    # Lloyd's optimum is flat: compare the distortion reached, not the centroids
    assert c.mse == pytest.approx(a.mse, rel=0.03)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unsupported bit width"):
        check_bits(5)
    with pytest.raises(ValueError, match="NaN"):
        lloyd_max_weighted(np.array([0.0, np.nan]), np.ones(2), 2)
    with pytest.raises(ValueError, match="zero points"):
        lloyd_max_weighted(np.array([1.0]), np.zeros(1), 2)


def test_half_cell_sums_match_a_pass_over_the_points():
    """Prefix-sum cell statistics equal a pass over every point: nearest level #{boundaries < x} (a point on a
    boundary in the lower cell), halves split at the centroid (r < 0 | r ≥ 0), zero weights ignored."""
    import torch
    from esm_turbo.quant.lloyd_max import SortedPoints, midpoints
    gen = torch.Generator().manual_seed(3)
    centroids = torch.tensor([[-1.0, 0.0, 0.5, 2.0], [-3.0, -2.0, 1.0, 4.0]], dtype=torch.float64)
    ties = torch.cat([centroids, 0.5 * (centroids[:, 1:] + centroids[:, :-1])], 1)  # on levels and boundaries
    x = torch.cat([torch.randn(2, 40, generator=gen, dtype=torch.float64) * 2, ties, ties], 1)
    w = torch.rand(x.shape, generator=gen, dtype=torch.float64)
    w[:, ::7] = 0.0
    perm = torch.randperm(x.shape[1], generator=gen)
    mass, abs_r, sq_r = SortedPoints(x[:, perm], w[:, perm]).half_cells(centroids)
    idx = torch.searchsorted(midpoints(centroids).contiguous(), x)  # per point, a pass over all of them
    r = x - centroids.gather(1, idx)
    for g in range(2):
        for k in range(4):
            for half, side in enumerate((r[g] < 0, r[g] >= 0)):
                sel = (idx[g] == k) & side
                want = (w[g][sel].sum(), (w[g][sel] * r[g][sel].abs()).sum(), (w[g][sel] * r[g][sel] ** 2).sum())
                got = (mass[g, k, half], abs_r[g, k, half], sq_r[g, k, half])
                assert all(abs(float(a - b)) < 1e-12 for a, b in zip(got, want)), (g, k, half, got, want)
