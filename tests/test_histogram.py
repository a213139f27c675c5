import pytest
import torch

from esm_turbo.quant.histogram import HistogramAccumulator

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (run on the GPU machine)")


def _batches(seed: int = 0, groups: int = 6, n: int = 5000, chunks: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(groups, n, generator=gen) * torch.arange(1, groups + 1)[:, None] for _ in range(chunks)]


def test_histogram_counts_and_sums_per_bin_outliers_in_the_edge_bins():
    limits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    hist = HistogramAccumulator(limits, bins=64)
    batches = _batches()
    for b in batches:
        hist.add(b)
    values = torch.cat(batches, 1).double()
    for g in range(limits.numel()):
        pos = ((values[g] + limits[g]) / (2 * limits[g]) * 64).floor().clamp(0, 63).long()
        count = torch.bincount(pos, minlength=64).double()
        sums = torch.zeros(64, dtype=torch.float64).index_add_(0, pos, values[g])
        assert torch.equal(hist.count[g], count)
        assert torch.allclose(hist.sum[g], sums, rtol=1e-12, atol=1e-9)
    x, w = hist.padded()
    assert torch.equal(w, hist.count)
    assert x.device.type == "cpu"
    assert x[0, 0] < -limits[0] and x[0, -1] > limits[0]  # values beyond the limit keep their true sums


@gpu
def test_histogram_on_cuda_matches_the_cpu_and_repeats_exactly():
    """Accumulated on the GPU (calibration keeps activations there): the same counts, the same sums to rounding,
    and the same bits on every run (no atomic float adds), so GPU calibration stays deterministic."""
    limits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) * 3
    runs = []
    for device in ("cpu", "cuda", "cuda"):
        hist = HistogramAccumulator(limits, bins=512, device=device)
        for b in _batches(1, n=200_000):
            hist.add(b.to(device))
        runs.append(hist.padded())
    (x_cpu, w_cpu), (x1, w1), (x2, w2) = runs
    assert torch.equal(w1, w_cpu) and torch.equal(w1, w2)
    assert torch.equal(x1, x2)
    assert torch.allclose(x1, x_cpu, rtol=1e-12, atol=1e-12)


@gpu
def test_calibration_on_cuda_is_deterministic(tmp_path):
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.calibrate import calibrate
    from esm_turbo.testing import stress_esm2
    model = stress_esm2(layers=2, hidden=128, heads=4, seed=0).cuda()
    recs = read_fasta("calibration_data/calibration.fasta")[0][:24]
    paths = [calibrate(model, recs, progress=False).save(tmp_path / f"{i}.safetensors") for i in range(2)]
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_weighted_histogram_counts_a_value_as_often_as_its_weight():
    """Integer weights give what repeating each value that many times gives; a bin's point is the weighted
    mean; weights of another shape are refused."""
    limits = torch.tensor([1.0, 2.0])
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(2, 400, generator=gen)
    weights = torch.randint(0, 4, (2, 400), generator=gen).double()
    weighted = HistogramAccumulator(limits, bins=32)
    weighted.add(values, weights)
    repeated = HistogramAccumulator(limits, bins=32)
    for g in range(2):
        reps = torch.repeat_interleave(values[g], weights[g].long())
        one = HistogramAccumulator(limits[g:g + 1], bins=32)
        one.add(reps[None])
        repeated.count[g], repeated.sum[g] = one.count[0], one.sum[0]
    assert torch.equal(weighted.count, repeated.count)
    assert torch.allclose(weighted.sum, repeated.sum, rtol=1e-12, atol=1e-12)
    x_w, _ = weighted.padded()
    x_r, _ = repeated.padded()
    assert torch.allclose(x_w, x_r, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="do not match"):
        weighted.add(values, weights[:, :10])
