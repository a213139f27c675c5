"""Mean pooling of a packed batch's segments (esm_turbo.kernels.segment): the Triton kernel against its reference
and against float64, under Triton's interpreter on CPU and on the GPU; FastEsm.pool on top of it."""

import pytest
import torch

from esm_turbo.kernels import triton_supported
from esm_turbo.kernels.segment import segment_mean_reference

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _segments():
    lengths = [1, 3, 31, 32, 33, 200, 0, 70]  # one and several row chunks, an empty segment
    bounds = torch.tensor([0] + lengths).cumsum(0)
    return lengths, bounds[:-1], bounds[1:]


def test_reference_is_the_mean_of_each_segment():
    lengths, starts, ends = _segments()
    h = torch.randn(sum(lengths), 130, dtype=torch.float64)
    got = segment_mean_reference(h, starts, ends)
    for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
        want = h[a:b].mean(0).float() if b > a else torch.zeros(130)
        assert torch.allclose(got[i], want, atol=1e-6)


@pytest.mark.skipif(not triton_supported(), reason="needs Triton (its interpreter on CPU)")
@pytest.mark.parametrize("dtype", [torch.float32] if not CUDA else [torch.float16, torch.bfloat16, torch.float32])
def test_triton_segment_mean_matches_the_reference(dtype):
    """Rows strided (a column slice of a wider tensor), 130 columns (two column blocks, the second partial); within
    float32 summation error of the float64 mean, and the same result twice."""
    from esm_turbo.kernels.segment import segment_mean_triton
    lengths, starts, ends = _segments()
    wide = torch.randn(sum(lengths), 200, generator=torch.Generator().manual_seed(0)).to(DEV, dtype)
    h = wide[:, 10:140]
    starts32, ends32 = starts.to(DEV, torch.int32), ends.to(DEV, torch.int32)
    got = segment_mean_triton(h, starts32, ends32)
    want = segment_mean_reference(h.double(), starts.to(DEV), ends.to(DEV))
    assert (got.double() - want).abs().max().item() < 1e-5
    assert torch.equal(got, segment_mean_triton(h, starts32, ends32))
