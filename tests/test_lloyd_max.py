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
