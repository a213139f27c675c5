"""A block's feed-forward half in one persistent launch (esm_turbo.kernels.ffn_step) against its PyTorch reference:
under Triton's interpreter on CPU (three staged launches, small tiles), and on the GPU the one launch with its grid
barriers, against the staged launches and the reference."""

import pytest
import torch

from esm_turbo.kernels import triton_supported

pytestmark = pytest.mark.skipif(not triton_supported(), reason="needs Triton (its interpreter on CPU)")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _inputs(m, d, fd, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * d if strided else d, generator=gen).to(DEV, dtype)[:, :d]
    w1 = (torch.randn(fd, d, generator=gen) / d ** 0.5).to(DEV, dtype)
    b1 = (0.3 * torch.randn(fd, generator=gen)).to(DEV, dtype)
    w2 = (torch.randn(d, fd, generator=gen) / fd ** 0.5).to(DEV, dtype)
    b2 = (0.3 * torch.randn(d, generator=gen)).to(DEV, dtype)
    h = (2 * torch.randn(m, d, generator=gen)).to(DEV, dtype)
    nw = (1 + 0.2 * torch.randn(d, generator=gen)).to(DEV, dtype)
    nb = (0.2 * torch.randn(d, generator=gen)).to(DEV, dtype)
    return h, x, w1, b1, w2, b2, nw, nb


def _launches():
    from esm_turbo.kernels.ffn_step import FfnPlan
    if CUDA:
        return [None, FfnPlan(64, 128, 64, 64, 0, 4, 3, False), FfnPlan(16, 32, 128, 128, 3, 4, 4, True)]
    return [FfnPlan(16, 32, 16, 16, 0, 4, 2, False), FfnPlan(16, 16, 32, 16, 3, 4, 2, False)]


@pytest.mark.parametrize("act,scale,biases", [("gelu", 1.0, True), ("gelu_tanh", 0.5, True), ("gelu", 1.0, False)])
@pytest.mark.parametrize("rows", [5, 48] if not CUDA else [1, 48, 195])
def test_the_feed_forward_matches_its_reference(act, scale, biases, rows):
    """Every row count a step meets (row tiles not filled, F runs not whole steps, strided input rows), each
    launch (the other activations and no biases at one): within the dtype's rounding of the reference (up to the
    order of the float32 sums) and the same on a second launch; the one launch (GPU) equal to the three staged ones;
    the barrier's words left at zero."""
    from esm_turbo.kernels.common import split_counters
    from esm_turbo.kernels.ffn_step import ffn_step, ffn_step_reference
    dtype = torch.float16 if CUDA else torch.float32
    d, fd = (1280, 5120 + 64) if CUDA else (40, 168)
    h, x, w1, b1, w2, b2, nw, nb = _inputs(rows, d, fd, dtype, seed=rows, strided=True)
    if not biases:
        b1 = b2 = nb = None
    s_ref, y_ref = ffn_step_reference(h, x, w1, b1, w2, b2, nw, nb, 1e-5, scale, act)
    for launch in _launches() if biases and scale == 1.0 else _launches()[:1]:
        s, y = ffn_step(h, x, w1, b1, w2, b2, nw, nb, 1e-5, scale, act, launch=launch)
        assert s.dtype == dtype and s.shape == y.shape == (rows, d)
        eps = torch.finfo(dtype).eps
        assert (s.float() - s_ref.float()).abs().max().item() <= 4 * eps * s_ref.float().abs().max().item() + 1e-6
        assert (y.float() - y_ref.float()).abs().max().item() <= 8 * eps * y_ref.float().abs().max().item() + 1e-5
        again = ffn_step(h, x, w1, b1, w2, b2, nw, nb, 1e-5, scale, act, launch=launch)
        assert torch.equal(again[0], s) and torch.equal(again[1], y)
        if CUDA:
            staged = ffn_step(h, x, w1, b1, w2, b2, nw, nb, 1e-5, scale, act, launch=launch, staged=True)
            assert torch.equal(staged[0], s) and torch.equal(staged[1], y)
    assert not split_counters(4, x.device).any()


def test_the_feed_forward_writes_into_buffers_and_checks_its_arguments():
    from esm_turbo.kernels.ffn_step import ffn_step
    dtype = torch.float16 if CUDA else torch.float32
    h, x, w1, b1, w2, b2, nw, nb = _inputs(3, 32, 64, dtype, seed=1)
    out = (torch.empty_like(h), torch.empty_like(h))
    s, y = ffn_step(h, x, w1, b1, w2, b2, nw, nb, 1e-5, out=out)
    assert s is out[0] and y is out[1]
    with pytest.raises(ValueError, match="activation 'swiglu'"):
        ffn_step(h, x, w1, b1, w2, b2, nw, nb, 1e-5, act="swiglu")
    with pytest.raises(ValueError, match="shapes"):
        ffn_step(h, x, w2, b1, w1, b2, nw, nb, 1e-5)


def test_the_launch_plan_fits_the_rows_and_fills_the_grid():
    """Row tiles fitted to the rows (16 up), 128 × 128 tiles from 128 rows, FFN down split into the most runs that
    keep its items within one program a multiprocessor; a given split kept."""
    from esm_turbo.kernels.ffn_step import FfnPlan, plan
    assert plan(1, 1280, 132) == FfnPlan(16, 64, 64, 64, 6)
    assert plan(48, 1280, 132) == FfnPlan(64, 64, 64, 64, 6)
    assert plan(195, 1280, 132) == FfnPlan(128, 128, 128, 64, 6)
    assert plan(256, 2560, 132, FfnPlan(64, 64, 64, 64, 3)) == FfnPlan(64, 64, 64, 64, 3)
    assert plan(256, 2560, 132, FfnPlan(64, 64, 64)).split == 1


@pytest.mark.skipif(not CUDA, reason="the grid barrier needs concurrent programs (CUDA)")
def test_the_feed_forward_replays_in_a_graph():
    """Captured in a CUDA graph and replayed many times over new inputs: each replay the eager launch's output."""
    from esm_turbo.kernels.ffn_step import ffn_step
    h, x, w1, b1, w2, b2, nw, nb = _inputs(48, 1280, 5120, torch.float16, seed=3)
    out = (torch.empty_like(h), torch.empty_like(h))
    ffn_step(h, x, w1, b1, w2, b2, nw, nb, 1e-5, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ffn_step(h, x, w1, b1, w2, b2, nw, nb, 1e-5, out=out)
    for i in range(20):
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = ffn_step(h, x, w1, b1, w2, b2, nw, nb, 1e-5)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), i
