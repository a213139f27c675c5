"""The product with its epilogue in warps of its own (esm_turbo.kernels.gemm_ws) against its PyTorch reference on a
compute-capability 9.0 GPU, and gemm()'s fallback to its own kernel where that one does not run."""

import pytest
import torch

from esm_turbo.kernels import triton_supported

pytestmark = pytest.mark.skipif(not triton_supported(), reason="needs Triton (its interpreter on CPU)")


def _hopper() -> bool:
    from esm_turbo.kernels.gemm_ws import available
    return available()


def _inputs(m, n, k, dtype, dev, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dev, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dev, dtype)
    b = (0.3 * torch.randn(n, generator=gen)).to(dev, dtype)
    return x, w, b


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("epilogue", ["gelu", "bias"])
@pytest.mark.parametrize("m,n,k", [(300, 520, 328), (1000, 5120, 1280), (64, 256, 64), (4096, 2560, 640)])
def test_ws_gemm_matches_the_reference(dtype, epilogue, m, n, k):
    """M and N not multiples of the tile (and smaller than one), K not a multiple of its step, a tile per
    multiprocessor and several: the reference's value up to the order of the float32 sums, as close as the folded
    kernel of kernels.gemm comes; with and without a bias."""
    if not _hopper():
        pytest.skip("needs compute capability 9.0 and Triton's Gluon")
    from esm_turbo.kernels.gemm import gemm, gemm_reference
    from esm_turbo.kernels.gemm_ws import ws_gemm
    x, w, b = _inputs(m, n, k, dtype, "cuda", seed=m + n + k)
    for bias in (b, None):
        want = gemm_reference(x, w, bias, epilogue).float()
        folded = gemm(x, w, bias, epilogue).float()
        got = ws_gemm(x, w, bias, epilogue)
        assert got.dtype == dtype and got.shape == (m, n)
        eps = torch.finfo(dtype).eps * want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= 2 * (folded - want).abs().max().item() + eps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m,n,k", [(300, 520, 336), (1000, 5120, 1280), (300, 520, 328)])
def test_ws_gemm_in_e4m3_matches_the_reference(m, n, k):
    """e4m3 inputs with row and column scales, GELU, bf16 out and each row's largest |value|: the reference's value
    as closely as the folded kernel of kernels.gemm comes, and the rows' maxima those of the output itself. Rows of
    a K not a multiple of 16 bytes (TMA's alignment): ws_gemm refuses in one line, gemm() with the WsTile runs them
    in its own kernel."""
    if not _hopper():
        pytest.skip("needs compute capability 9.0 and Triton's Gluon")
    from esm_turbo.embed.fp8 import Fp8Weight, quantize_rows
    from esm_turbo.kernels.gemm import gemm, gemm_reference
    from esm_turbo.kernels.gemm_ws import WS_FP8, ws_gemm
    gen = torch.Generator().manual_seed(m)
    xq, xs = quantize_rows(torch.randn(m, k, generator=gen).cuda())
    wq = Fp8Weight.quantize((torch.randn(n, k, generator=gen) / k ** 0.5).cuda())
    b = (0.1 * torch.randn(n, generator=gen)).cuda().to(torch.bfloat16)
    want = gemm_reference(xq, wq.q, b, "gelu", x_scale=xs, w_scale=wq.scale).float()
    folded, _ = gemm(xq, wq.q, b, "gelu", x_scale=xs, w_scale=wq.scale, row_amax=True)
    if k % 16:
        with pytest.raises(ValueError, match="16-byte aligned"):
            ws_gemm(xq, wq.q, b, "gelu", WS_FP8, x_scale=xs, w_scale=wq.scale)
        routed, _ = gemm(xq, wq.q, b, "gelu", tile=WS_FP8, x_scale=xs, w_scale=wq.scale, row_amax=True)
        assert torch.equal(routed, folded)
        return
    got, amax = ws_gemm(xq, wq.q, b, "gelu", WS_FP8, x_scale=xs, w_scale=wq.scale, row_amax=True)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    eps = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= 2 * (folded.float() - want).abs().max().item() + eps
    assert torch.equal(amax, got.float().abs().amax(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m,dim", [(300, 1280), (1000, 640)])
def test_ws_gemm_with_the_rotary_epilogue_matches_the_reference(fp8, m, dim):
    """The q/k/v projection with the queries scaled and queries and keys rotated in the epilogue warps, heads of 64
    (at 640 wide a tile holds query and key heads both): the reference's value as closely as the folded kernel of
    kernels.gemm comes; the values untouched but for the product's rounding."""
    if not _hopper():
        pytest.skip("needs compute capability 9.0 and Triton's Gluon")
    from esm_turbo.embed.fp8 import Fp8Weight, quantize_rows
    from esm_turbo.kernels.gemm import Tile, gemm, gemm_reference
    from esm_turbo.kernels.gemm_ws import WS_FP8, WsTile, ws_gemm
    gen = torch.Generator().manual_seed(m + dim)
    x = torch.randn(m, dim, generator=gen).cuda()
    w = (torch.randn(3 * dim, dim, generator=gen) / dim ** 0.5).cuda()
    pos = torch.randint(0, 1000, (m, 1), generator=gen).float()
    angles = pos * (10000 ** (-torch.arange(0, 64, 2).float() / 64))[None, :]
    rope = tuple(torch.cat([f(angles)] * 2, 1).cuda() for f in (torch.cos, torch.sin))
    if fp8:
        xq, xs = quantize_rows(x)
        wq = Fp8Weight.quantize(w)
        b = (0.1 * torch.randn(3 * dim, generator=gen)).cuda().to(torch.bfloat16)
        args, scales, tile, dtype = (xq, wq.q, b), dict(x_scale=xs, w_scale=wq.scale), WS_FP8, torch.bfloat16
    else:
        b = (0.1 * torch.randn(3 * dim, generator=gen)).cuda().half()
        args, scales, tile, dtype = (x.half(), w.half(), b), {}, WsTile(), torch.float16
    want = gemm_reference(*args, "rope", rope=rope, **scales).float()
    folded = gemm(*args, "rope", rope=rope, tile=Tile(128, 256, 128 if fp8 else 64, 3, 8, 8, True), **scales)
    got = ws_gemm(*args, "rope", tile, rope=rope, **scales)
    assert got.dtype == dtype and got.shape == (m, 3 * dim)
    eps = torch.finfo(dtype).eps * want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= 2 * (folded.float() - want).abs().max().item() + eps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ws_tiles_in_the_table_run_through_gemm():
    """A WsTile handed to gemm() (as kernels.gemm.TILES may list one) runs ws_gemm: the same bits."""
    if not _hopper():
        pytest.skip("needs compute capability 9.0 and Triton's Gluon")
    from esm_turbo.kernels.gemm import gemm
    from esm_turbo.kernels.gemm_ws import WsTile, ws_gemm
    x, w, b = _inputs(700, 1024, 256, torch.float16, "cuda", seed=3)
    tile = WsTile(stages=2)
    assert torch.equal(gemm(x, w, b, "gelu", tile=tile), ws_gemm(x, w, b, "gelu", tile))
    # 64-row tiles in one warp group of products, four epilogue warps: the same values to fp16's rounding
    small = WsTile(bm=64, warps=4, stages=4, epi_warps2=2, epi_regs=128)
    want = ws_gemm(x, w, b, "gelu", tile).float()
    got = ws_gemm(x, w, b, "gelu", small).float()
    assert (got - want).abs().max().item() <= torch.finfo(torch.float16).eps * want.abs().max().item()
    # epilogue partitions of one warp and one: the same bits as two and one
    assert torch.equal(ws_gemm(x, w, b, "gelu", WsTile(epi_warps=1)), ws_gemm(x, w, b, "gelu", tile))
    # GELU's tanh form: what the folded kernel computes in that form (to fp16's rounding), not the erf GELU
    from esm_turbo.kernels.gemm import Tile
    tanh = ws_gemm(x, w, b, "gelu", WsTile(gelu="tanh")).float()
    folded = gemm(x, w, b, "gelu", tile=Tile(gelu="tanh")).float()
    assert (tanh - folded).abs().max().item() <= 2 * torch.finfo(torch.float16).eps * folded.abs().max().item()
    assert not torch.equal(tanh, want)


def test_a_ws_tile_falls_back_to_the_folded_kernel_where_it_cannot_run():
    """Off a compute-capability 9.0 GPU (here: the CPU under Triton's interpreter) or for an epilogue it does not
    take, gemm() with a WsTile computes what its own default tile computes; ws_gemm itself refuses in one line."""
    from esm_turbo.kernels.gemm import default_tile, gemm
    from esm_turbo.kernels.gemm_ws import WsTile, available, ws_gemm
    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    assert not available("cpu")
    x, w, b = _inputs(37, 72, 40, torch.float32, "cpu", seed=1)
    h = torch.randn(37, 72)
    for epilogue, res in (("gelu", None), ("residual", h)):
        got = gemm(x, w, b, epilogue, res, tile=WsTile())
        want = gemm(x, w, b, epilogue, res, tile=default_tile(72, 40, torch.float32))
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="compute-capability 9.0"):
        ws_gemm(x, w, b)
    assert WsTile().shared_bytes() == (3 * (128 + 256) * 64 + 128 * 256) * 2  # 208 KiB of an H100's 227
    with pytest.raises(ValueError, match="multiple of 8"):  # the handed tile's swizzle repeats every 8 rows
        WsTile(epi_m=4)
    from esm_turbo.kernels.gemm import rope_fits  # the rotary epilogue takes a head an epilogue chunk
    assert rope_fits(WsTile(), 64) and not rope_fits(WsTile(), 32) and rope_fits(WsTile(epi_n=32), 32)
    assert WsTile(bn=128, bk=128, stages=4).shared_bytes(1) == 4 * 256 * 128 + 128 * 128 * 4  # 192 KiB
    # the second epilogue partition takes a third (rounded) of the 16 row chunks beside two warps, half beside one
    assert WsTile().chunk_split() == 11 and WsTile(epi_warps=1).chunk_split() == 8
    with pytest.raises(ValueError, match="at least one warp"):
        WsTile(epi_warps2=0)
    from esm_turbo.kernels.gemm_ws import launch_constants  # the form of GELU goes to the kernel as its code
    assert launch_constants(WsTile(gelu="tanh"), 1, True, False, False, 132)["GELU"] == 2
    assert launch_constants(WsTile(), 1, True, False, False, 132)["GELU"] == 1
    with pytest.raises(ValueError, match="GELU form 'gauss'"):
        WsTile(gelu="gauss")
