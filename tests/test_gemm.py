"""The matrix products with folded epilogues (esm_turbo.kernels.gemm) against their PyTorch reference: under Triton's
interpreter on CPU (small tiles), and on the GPU with the tiles the forward uses (tensor descriptors on Hopper)."""

import dataclasses

import pytest
import torch

from esm_turbo.kernels import triton_supported

pytestmark = pytest.mark.skipif(not triton_supported(), reason="needs Triton (its interpreter on CPU)")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _small_tile():
    from esm_turbo.kernels.gemm import Tile
    return None if CUDA else Tile(16, 32, 16, 2, 4, 2, True)


def _inputs(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEV, dtype)
    b = (0.3 * torch.randn(n, generator=gen)).to(DEV, dtype)
    h = (2 * torch.randn(m, n, generator=gen)).to(DEV, dtype)
    return x, w, b, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []))
@pytest.mark.parametrize("epilogue,scale,form", [("bias", 1.0, "erfc"), ("gelu", 1.0, "erfc"), ("gelu", 1.0, "erf"),
                                                 ("gelu", 1.0, "exp2poly"), ("gelu_tanh", 1.0, "erfc"),
                                                 ("residual", 1.0, "erfc"), ("residual", 0.5, "erfc")])
def test_gemm_epilogues_match_the_reference(dtype, epilogue, scale, form):
    """Every epilogue, M and N not multiples of the tile, K not a multiple of its step: the reference's value up to
    the order of the float32 sums (a last-place difference of the output dtype, or a few in float32). "gelu_tanh"
    computes GELU's tanh form whatever form the tile names."""
    from esm_turbo.kernels.gemm import gemm, gemm_reference, tile_for
    if dtype == torch.float32 and CUDA:
        pytest.skip("the fused path runs fp16/bf16 on the GPU (float32 only under the interpreter)")
    m, n, k = (300, 200, 328) if CUDA else (37, 72, 40)
    x, w, b, h = _inputs(m, n, k, dtype, seed=n + k)
    res = h if epilogue == "residual" else None
    tile = dataclasses.replace(_small_tile() or tile_for(n, k, dtype, epilogue), gelu=form)
    got = gemm(x, w, b, epilogue, res, scale, tile=tile)
    want = gemm_reference(x, w, b, epilogue, res, scale)
    assert got.dtype == want.dtype and got.shape == (m, n)
    tol = 4 * torch.finfo(dtype).eps * want.float().abs().max().item() + 1e-6
    assert (got.float() - want.float()).abs().max().item() <= tol


@pytest.mark.parametrize("parts,programs,maxnreg", [(1, 1, None), (4, 1, None), (4, 2, None), (2, 2, 128)])
@pytest.mark.parametrize("epilogue", ["gelu", "residual"])
def test_gemm_epilogue_parts_and_programs_per_sm(parts, programs, maxnreg, epilogue):
    """The epilogue in 1, 2 or 4 column parts, two persistent programs a multiprocessor and a register cap compute
    what the default launch computes, bit for bit (the same sums in the same order, the same epilogue); a part count
    other than 1, 2 or 4 is refused."""
    from esm_turbo.kernels.gemm import Tile, gemm, tile_for
    dtype = torch.float16
    m, n, k = (300, 520, 328) if CUDA else (37, 72, 40)
    x, w, b, h = _inputs(m, n, k, dtype, seed=7)
    res = h if epilogue == "residual" else None
    base = _small_tile() or tile_for(n, k, dtype, epilogue)
    tile = dataclasses.replace(base, subtile=parts, programs=programs, maxnreg=maxnreg if CUDA else None)
    assert torch.equal(gemm(x, w, b, epilogue, res, tile=tile), gemm(x, w, b, epilogue, res, tile=base))
    with pytest.raises(ValueError, match="epilogue parts"):
        Tile(128, 256, subtile=3)
    assert Tile(subtile=True).subtile == 2 and Tile(subtile=False).subtile == 1


def test_the_rotary_epilogue_needs_whole_heads_in_each_part():
    """The rotary epilogue works on each column part of the tile (bn / subtile columns), which must hold whole heads:
    128-wide heads fit a 128-column tile whole but not in halves; 32-wide heads fit its quarters."""
    from esm_turbo.kernels.gemm import Tile, rope_fits
    assert rope_fits(Tile(128, 128, subtile=1), 128) and not rope_fits(Tile(128, 128, subtile=2), 128)
    assert rope_fits(Tile(128, 128, subtile=4), 32) and not rope_fits(Tile(128, 128, subtile=4), 64)


def _rope_tables(m: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [m, head_dim] float32 of ESM-2's rotary embedding at positions of a few packed sequences."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(n) for n in torch.randint(1, 60, (m,), generator=gen).tolist()])[:m]
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat(2 * [pos.float()[:, None] * inv[None, :]], -1)
    return emb.cos().to(DEV), emb.sin().to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []))
@pytest.mark.parametrize("heads,head_dim", [(5, 16), (2, 32)])
def test_the_rotary_epilogue_is_the_rotary_kernel_after_the_product_bit_for_bit(dtype, heads, head_dim):
    """The q/k/v projection with the rotary embedding in its epilogue (``"rope"``): the queries scaled and queries and
    keys rotated exactly as the product followed by ``rope_packed_triton`` (the same tile, so the same float32 sums;
    the same roundings, no fused multiply-add), the values as the product gives them; and the PyTorch reference's up
    to the order of the sums. Parts straddle the q|k and k|v seams; M is not a multiple of the tile."""
    from esm_turbo.kernels.gemm import Tile, gemm, gemm_reference
    from esm_turbo.kernels.rope import rope_packed_reference, rope_packed_triton
    if dtype == torch.float32 and CUDA:
        pytest.skip("the fused path runs fp16/bf16 on the GPU (float32 only under the interpreter)")
    dim = heads * head_dim
    m = 300 if CUDA else 37
    x, w, b, _ = _inputs(m, 3 * dim, dim, dtype, seed=dim)
    cos, sin = _rope_tables(m, head_dim, seed=heads)
    tile = Tile(128, 128, 64, 3, 8, 8, True) if CUDA else Tile(16, 64, 16, 2, 4, 2, True)
    got = gemm(x, w, b, "rope", tile=tile, rope=(cos, sin))
    plain = gemm(x, w, b, tile=tile)
    q, k = rope_packed_triton(plain, cos, sin, heads)
    assert torch.equal(got[:, :dim], q.flatten(1)) and torch.equal(got[:, dim: 2 * dim], k.flatten(1))
    assert torch.equal(got[:, 2 * dim:], plain[:, 2 * dim:])
    q_ref, k_ref = rope_packed_reference(plain, cos, sin, heads)  # the rotary kernel's own reference
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    want = gemm_reference(x, w, b, "rope", rope=(cos, sin))
    tol = 4 * torch.finfo(dtype).eps * want.float().abs().max().item() + 1e-6
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_the_rotary_epilogue_checks_its_tables_and_tile():
    from esm_turbo.kernels.gemm import Tile, gemm, rope_fits
    dtype = torch.float16 if CUDA else torch.float32
    x, w, b, _ = _inputs(8, 96, 32, dtype, 0)
    cos, sin = _rope_tables(8, 16, 0)
    with pytest.raises(ValueError, match="rope"):
        gemm(x, w, b, "rope")
    with pytest.raises(ValueError, match="rope"):
        gemm(x, w, b, rope=(cos, sin))
    with pytest.raises(ValueError, match="tables"):
        gemm(x, w, b, "rope", rope=(cos[:4], sin[:4]))
    with pytest.raises(ValueError, match="whole"):
        gemm(x, w, b, "rope", tile=Tile(16, 16, 16, 2, 4, 2, True), rope=(cos, sin))  # halves of 8 columns
    assert rope_fits(Tile(bn=256, subtile=True), 64) and not rope_fits(Tile(bn=256, subtile=True), 24)


@pytest.mark.parametrize("epilogue,scale", [("bias", 1.0), ("gelu", 1.0), ("gelu_tanh", 1.0), ("residual", 0.5)])
@pytest.mark.parametrize("split", [1, 2, 4])
def test_split_products_match_the_reference(epilogue, scale, split):
    """A step's few rows split along K (kernels.gemm_split): every epilogue, M and N not multiples of the tile, K
    not a multiple of its step (a run may be empty); the reference's value up to the order of the float32 sums, the
    same on a second launch (partials added in split order), the arrival counts left at zero."""
    from esm_turbo.kernels.common import split_counters
    from esm_turbo.kernels.gemm import gemm, gemm_reference
    from esm_turbo.kernels.gemm_split import SplitTile
    dtype = torch.float16 if CUDA else torch.float32
    m, n, k = (195, 1280, 5128) if CUDA else (37, 72, 72)
    x, w, b, h = _inputs(m, n, k, dtype, seed=split)
    res = h if epilogue == "residual" else None
    tile = SplitTile(64, 128, 64, 4 * split) if CUDA else SplitTile(16, 32, 16, split, 2, 4)
    got = gemm(x, w, b, epilogue, res, scale, split=tile)
    want = gemm_reference(x, w, b, epilogue, res, scale)
    assert got.dtype == want.dtype and got.shape == (m, n)
    tol = 4 * torch.finfo(dtype).eps * want.float().abs().max().item() + 1e-6
    assert (got.float() - want.float()).abs().max().item() <= tol
    assert torch.equal(gemm(x, w, b, epilogue, res, scale, split=tile), got)
    assert not split_counters(1, x.device).any()


@pytest.mark.parametrize("split", [1, 2])
def test_split_rotary_epilogue_is_the_split_product_then_the_rotary_kernel(split):
    """The q/k/v projection split along K with the rotary embedding in its epilogue: bit for bit the same split
    product followed by ``rope_packed_triton`` (the same partial sums in the same order, the same roundings), and the
    reference's up to the order of the sums; a tile that splits heads is refused."""
    from esm_turbo.kernels.gemm import gemm, gemm_reference
    from esm_turbo.kernels.gemm_split import SplitTile
    from esm_turbo.kernels.rope import rope_packed_triton
    dtype = torch.float16 if CUDA else torch.float32
    heads, head_dim = (20, 64) if CUDA else (3, 16)
    dim = heads * head_dim
    m = 195 if CUDA else 21
    x, w, b, _ = _inputs(m, 3 * dim, dim, dtype, seed=split)
    cos, sin = _rope_tables(m, head_dim, seed=split)
    tile = SplitTile(64, 128, 64, 4 * split) if CUDA else SplitTile(16, 32, 16, split, 2, 4)
    got = gemm(x, w, b, "rope", split=tile, rope=(cos, sin))
    plain = gemm(x, w, b, split=tile)
    q, k = rope_packed_triton(plain, cos, sin, heads)
    assert torch.equal(got[:, :dim], q.flatten(1)) and torch.equal(got[:, dim: 2 * dim], k.flatten(1))
    assert torch.equal(got[:, 2 * dim:], plain[:, 2 * dim:])
    want = gemm_reference(x, w, b, "rope", rope=(cos, sin))
    tol = 4 * torch.finfo(dtype).eps * want.float().abs().max().item() + 1e-6
    assert (got.float() - want.float()).abs().max().item() <= tol
    with pytest.raises(ValueError, match="whole"):
        gemm(x, w, b, "rope", split=SplitTile(16, 8, 16, split, 2, 4), rope=(cos, sin))


def test_split_launch_plan():
    """plan(): rows in tiles of 16-64, K split where output tiles alone leave the multiprocessors idle, each run at
    least MIN_K_STEPS steps; a split product with FP8 inputs or row maxima is refused."""
    from esm_turbo.kernels.gemm import gemm
    from esm_turbo.kernels.gemm_split import MIN_K_STEPS, SplitTile, plan
    assert plan(16, 1280, 1280, 132).bm == 16 and plan(195, 1280, 1280, 132).bm == 64
    wide = plan(195, 1280, 5120, 132)
    assert wide.split > 1 and 5120 // wide.bk // wide.split >= MIN_K_STEPS
    assert plan(4096, 5120, 1280, 132).split == 1
    x, w, b, _ = _inputs(8, 32, 32, torch.float32 if not CUDA else torch.float16, seed=0)
    with pytest.raises(ValueError, match="split product"):
        gemm(x, w, b, split=SplitTile(16, 32, 16, 1), row_amax=True)


def test_step_products_take_the_split_kernel_only_up_to_its_row_bound(monkeypatch):
    """step_tile: plan()'s launch for a step's product at up to SPLIT_ROWS rows (0 by default: none) with an
    epilogue the split kernel folds and x and w of one dtype (the rotary epilogue at 64-row tiles in 8 warps); None
    otherwise."""
    from esm_turbo.kernels import gemm_split
    from esm_turbo.kernels.common import num_sms
    dtype = torch.float16 if CUDA else torch.float32
    x, w, _, _ = _inputs(48, 96, 64, dtype, seed=0)
    assert gemm_split.SPLIT_ROWS == 0 and gemm_split.step_tile(x, w, "bias") is None
    monkeypatch.setattr(gemm_split, "SPLIT_ROWS", 48)
    planned = gemm_split.plan(48, 96, 64, num_sms(x.device))
    for epilogue in ("bias", "gelu", "gelu_tanh", "residual"):
        assert gemm_split.step_tile(x, w, epilogue) == planned
    assert planned.bm == 64 and gemm_split.step_tile(x, w, "rope") == dataclasses.replace(planned, warps=8)
    monkeypatch.setattr(gemm_split, "SPLIT_ROWS", 47)
    assert gemm_split.step_tile(x, w, "bias") is None
    monkeypatch.setattr(gemm_split, "SPLIT_ROWS", 256)
    assert gemm_split.step_tile(x, w.double(), "bias") is None


@pytest.mark.parametrize("form,differ", [("erfc", 16), ("exp2poly", 24)])
def test_gelu_rounds_as_the_exact_gelu_on_every_fp16_value(monkeypatch, form, differ):
    """The kernels' GELU (kernels.common.gelu) in its erf forms over every finite fp16 value: the float64 GELU rounded
    to fp16 on all but a handful (erfc 6, exp2poly 19 under the interpreter; the GPU's exp2 is within 2 units of
    float32's last place), none off by more than one unit in the last place."""
    import math

    from esm_turbo.kernels import activation
    monkeypatch.setattr(activation, "GELU_FORM", form)
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    u = bits[torch.isfinite(bits)][:63488].reshape(62, 1024)
    got = activation.activation_triton(u.to(DEV), "gelu").cpu()
    x = u.double()
    want = (0.5 * x * (1 + torch.erf(x / math.sqrt(2)))).half()
    ulp = (torch.nextafter(want.abs(), torch.tensor(math.inf, dtype=torch.float16)).float() - want.float().abs())
    assert (got != want).sum().item() <= differ
    assert ((got.float() - want.float()).abs() <= ulp).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # far below zero: x / inf = -0, as meant
def test_the_tanh_form_of_gelu_is_the_tanh_approximation():
    """GELU's "tanh" form in the FFN-up epilogue, over every finite fp16 value as a product's output (x times the
    identity, no bias): F.gelu(approximate="tanh") to the output's rounding, and within 4.8e-4 of the erf GELU, from
    which it measurably differs."""
    import math

    import torch.nn.functional as F

    from esm_turbo.kernels.gemm import Tile, gemm
    dtype = torch.float16 if CUDA else torch.float32
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    u = bits[torch.isfinite(bits)][:63488].reshape(992, 64)
    x = u.to(DEV, dtype)
    eye = torch.eye(64, device=DEV, dtype=dtype)
    got = gemm(x, eye, torch.zeros(64, device=DEV, dtype=dtype), "gelu",
               tile=dataclasses.replace(_small_tile() or Tile(), gelu="tanh")).cpu().double()
    xd = u.double()
    tanh_form = F.gelu(xd, approximate="tanh")
    exact = 0.5 * xd * (1 + torch.erf(xd / math.sqrt(2)))
    # a few roundings, relative, but in the negative tail scaled by the exponent's size (x / (1 + 2^v), |v| ~ |x|³),
    # and nothing asked below fp16's smallest normal times the output's epsilon
    v = 2.302208198144325 * xd * (1 + 0.044715 * xd * xd)
    eps = torch.finfo(dtype).eps
    tol = 4 * eps * tanh_form.abs() * (1 + v.abs()) + torch.finfo(torch.float16).smallest_normal * eps
    assert ((got - tanh_form).abs() <= tol).all()
    assert ((got - exact).abs() <= 4.8e-4 + tol).all()
    if dtype == torch.float32:  # fine enough to tell the two functions apart
        assert (got - exact).abs().max().item() > 1e-4


def test_gemm_rows_of_zero_and_argument_checks():
    from esm_turbo.kernels.gemm import Tile, gemm
    x, w, b, h = _inputs(8, 16, 16, torch.float32 if not CUDA else torch.float16, 0)
    assert gemm(x[:0], w, b, tile=_small_tile()).shape == (0, 16)
    with pytest.raises(ValueError, match="epilogue"):
        gemm(x, w, b, "relu")
    with pytest.raises(ValueError, match="GELU form"):
        gemm(x, w, b, "gelu", tile=Tile(gelu="sigmoid"))
    with pytest.raises(ValueError, match="residual"):
        gemm(x, w, b, "residual")
    with pytest.raises(ValueError, match="make a product"):
        gemm(x, w[:, :8], b)


def test_fp8_products_scale_then_add_the_bias_and_find_the_row_maxima():
    """e4m3 inputs with row scales (what FastEsm's FP8 path feeds the kernel): bf16 out, the scales applied before the
    bias, and with row_amax each row's largest |output| (the maxima of the bf16 values stored)."""
    from esm_turbo.embed.fp8 import Fp8Weight, quantize_rows
    from esm_turbo.kernels.gemm import Tile, gemm, gemm_reference
    gen = torch.Generator().manual_seed(3)
    m, n, k = (300, 200, 320) if CUDA else (21, 48, 64)
    xq, xs = quantize_rows(torch.randn(m, k, generator=gen).to(DEV))
    wq = Fp8Weight.quantize(torch.randn(n, k, generator=gen).to(DEV))
    b = torch.randn(n, generator=gen).to(DEV, torch.bfloat16)
    if DEV == "cpu" or torch.cuda.get_device_capability() >= (8, 9):
        tile = None if CUDA else Tile(16, 16, 32, 2, 4, 2, False)
        got, amax = gemm(xq, wq.q, b, "gelu", x_scale=xs, w_scale=wq.scale, row_amax=True, tile=tile)
        want = gemm_reference(xq, wq.q, b, "gelu", x_scale=xs, w_scale=wq.scale)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
        assert torch.equal(amax, got.float().abs().amax(1))


def test_activation_quantizes_with_a_known_row_maximum():
    """activation_triton(fp8=True, amax=...) gives the codes and scales of the two-sweep version, in one read."""
    from esm_turbo.kernels.activation import activation_triton
    u = 3 * torch.randn(19, 700, device=DEV, dtype=torch.bfloat16 if CUDA else torch.float32)
    two = activation_triton(u, "none", fp8=True)
    one = activation_triton(u, "none", fp8=True, amax=u.float().abs().amax(1))
    assert torch.equal(one.scale, two.scale) and torch.equal(one.q.float(), two.q.float())
    with pytest.raises(ValueError, match="amax"):
        activation_triton(u, "none", fp8=True, amax=torch.zeros(3, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16])
def test_gelu_row_maxima_from_the_rows_bounds_are_the_maxima_of_gelu(monkeypatch, dtype):
    """The FP8 GELU launch's row maxima from three bounding values a row (GELU_AMAX_FROM_BOUNDS) give the codes and
    scales of GELU evaluated over the whole row, bit for bit: random rows, rows straddling GELU's minimum closely on
    both sides, rows all below it, all between it and zero, all positive, a row of zeros, and rows whose largest |GELU|
    comes from each of the three candidates; dropping the left or the right candidate fails it."""
    from esm_turbo.kernels import activation as A
    gen = torch.Generator().manual_seed(3)
    rows = [3 * torch.randn(700, generator=gen) for _ in range(6)]
    c = A.GELU_ARGMIN
    rows += [c + 0.01 * torch.randn(700, generator=gen), -5 + torch.rand(700, generator=gen) * (5 + c),
             c + torch.rand(700, generator=gen) * (-c), torch.rand(700, generator=gen), torch.zeros(700),
             torch.full((700,), -1.2), torch.full((700,), -0.4), torch.full((700,), 2.0)]
    rows += [torch.cat([torch.full((350,), c - 0.05), torch.full((350,), -0.2)]),   # the left candidate wins
             torch.cat([torch.full((350,), -2.5), torch.full((350,), c + 0.05)]),   # the right one
             torch.cat([torch.full((350,), -1.0), torch.full((350,), 0.3)])]        # the left over a small largest
    u = torch.stack(rows).to(DEV, dtype)
    monkeypatch.setattr(A, "HOLD_ROWS", False)  # the two sweeps, whose first finds the maxima
    got = A.activation_triton(u, "gelu", fp8=True)
    monkeypatch.setattr(A, "GELU_AMAX_FROM_BOUNDS", False)
    want = A.activation_triton(u, "gelu", fp8=True)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.q.float(), want.q.float())
    assert (want.scale > 1.1754943508222875e-38).sum() == len(rows) - 1  # only the row of zeros takes the floor


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "swiglu", "none"])
@pytest.mark.parametrize("width", [700, 1024, 1920])
def test_held_rows_give_the_codes_of_the_two_sweeps(monkeypatch, kind, width):
    """activation_triton(fp8=True) with each row held in registers (HOLD_ROWS: one read of u, its columns in two
    power-of-two chunks, the second masked or absent) gives the codes and scales of the two sweeps bit for bit; GELU's
    tanh form (whose row maxima come from GELU over the row) gives the scales of the reference's quantization."""
    from esm_turbo.kernels import activation as A
    assert A.held_chunks(700) == (512, 256) and A.held_chunks(1024) == (1024, 0) and A.held_chunks(1920) == (1024, 1024)
    gen = torch.Generator().manual_seed(width)
    u = (3 * torch.randn(9, width * (2 if kind == "swiglu" else 1), generator=gen)).to(
        DEV, torch.bfloat16 if CUDA else torch.float32)
    monkeypatch.setattr(A, "GELU_AMAX_FROM_BOUNDS", False)
    monkeypatch.setattr(A, "HOLD_ROWS", False)
    two = A.activation_triton(u, kind, fp8=True)
    monkeypatch.setattr(A, "HOLD_ROWS", True)
    held = A.activation_triton(u, kind, fp8=True)
    assert torch.equal(held.scale, two.scale) and torch.equal(held.q.float(), two.q.float())
    if kind == "gelu_tanh":
        from esm_turbo.embed.fp8 import quantize_rows
        _, scale = quantize_rows(torch.nn.functional.gelu(u.float(), approximate="tanh").to(u.dtype))
        assert torch.allclose(held.scale, scale, rtol=2 * torch.finfo(u.dtype).eps)


def test_the_folded_block_is_as_close_to_fp32_as_the_unfolded_block():
    """FastEsm's fused path with every epilogue folded into the products and with none: under the interpreter (fp32)
    the same hidden states to rounding; on the GPU in fp16 no further from the fp32 model than twice the unfolded
    block is (the flash-attention rule)."""
    from esm_turbo.embed.fast_esm import FastEsm, PackedBatch
    from esm_turbo.testing import stress_esm2
    net = stress_esm2(layers=2, hidden=64, heads=4, seed=4).to(DEV)
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMLEDPVDAFQ", "W" * 40]
    batch = PackedBatch.from_sequences(seqs, DEV)
    want = FastEsm.from_hf(net, fused=False)(batch, [1, 2])
    fast = FastEsm.from_hf(net.half() if CUDA else net, fused=True)
    got = {}
    for folded in (False, True):
        fast.fused_products = folded
        got[folded] = fast(batch, [1, 2])
    for layer in (1, 2):
        ref = want[layer].double()
        err = {f: (got[f][layer].double() - ref).abs().max().item() for f in got}
        if CUDA:
            assert err[True] <= 2 * err[False] + torch.finfo(torch.float16).eps * ref.abs().max().item(), err
        else:
            assert err[True] <= 2e-5 * max(1.0, ref.abs().max().item()), err
