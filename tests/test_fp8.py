"""FP8 matrix products for FastEsm: the e4m3 rounding, the PyTorch reference, the model converted, the GPU path
against the reference (skipped without FP8 tensor cores), and the command refusing fp8 where it cannot run."""

import pytest
import torch
import torch.nn.functional as F

from esm_turbo.cli import main
from esm_turbo.embed.fast_esm import FastEsm, PackedBatch
from esm_turbo.embed.fp8 import E4M3_MAX, Fp8Weight, fp8_linear, fp8_linear_reference, fp8_supported, quantize_rows
from esm_turbo.testing import plant_product_outliers

SEQS = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "GSHMLEDPVDAFQ" * 4, "MKV"]
FP8_GPU = torch.cuda.is_available() and fp8_supported("cuda")


def test_weights_round_to_e4m3_per_output_channel():
    w = torch.randn(48, 64) * torch.logspace(-2, 2, 48)[:, None]  # rows of very different sizes
    q = Fp8Weight.quantize(w)
    assert q.q.dtype == torch.float8_e4m3fn and q.scale.shape == (48,)
    assert torch.allclose(q.q.float().abs().amax(1), torch.full((48,), E4M3_MAX))  # each row's largest hits 448
    err = (q.dequantize() - w).abs()
    # e4m3: 3 mantissa bits (half a step ≤ 1/16 of the value), subnormals below 2**-6 in steps of 2**-9
    assert (err <= w.abs() / 16 + q.scale[:, None] * 2 ** -10 + 1e-12).all()
    assert q.nbytes() == 48 * 64 + 48 * 4


def test_the_product_is_the_dequantized_product_in_fp32():
    x, w, b = torch.randn(37, 64), torch.randn(80, 64), torch.randn(80)
    wq = Fp8Weight.quantize(w)
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs) @ wq.dequantize().t() + b
    assert torch.allclose(fp8_linear_reference(x, wq, b), want)
    assert torch.equal(fp8_linear(x, wq, b), fp8_linear_reference(x, wq, b))  # off FP8 GPUs: the reference
    cos = F.cosine_similarity(fp8_linear(x, wq, b), F.linear(x, w, b), dim=-1)
    assert cos.min() > 0.995


def test_a_model_in_fp8_stays_close_to_fp32_also_with_outlier_channels(stress_dir):
    """On the random-weight stress model (which amplifies every rounding: bf16 keeps 0.9995 there); the trained
    testbeds' figures are scripts/fp8_fidelity.py's."""
    batch = PackedBatch.from_sequences(SEQS)
    ref = FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cpu")
    h32 = ref(batch)[ref.num_layers]
    planted = plant_product_outliers(FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cpu"),
                                     channels=2)
    assert torch.allclose(planted(batch)[ref.num_layers], h32, atol=1e-4, rtol=1e-4)  # function preserved
    assert (planted.blocks[-1].attn_norm.weight.abs().max() / ref.blocks[-1].attn_norm.weight.abs().max()) > 50
    for model in (FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cpu").to_fp8(), planted.to_fp8()):
        assert model.is_fp8 and model.embed_tokens.weight.dtype == torch.bfloat16
        assert all(b.qkv.weight is None and b.fp8[0].q.dtype == torch.float8_e4m3fn for b in model.blocks)
        h8 = model(batch)[model.num_layers]
        assert h8.dtype == torch.bfloat16
        cos = F.cosine_similarity(h8.float(), h32, dim=-1)
        assert cos.mean() > 0.98 and cos.min() > 0.7
        assert model.logits(h8).shape == (h8.shape[0], 33)


def test_outliers_planted_into_esmc_preserve_its_function():
    """ESM C's LayerNorms and products carry no biases and its query and key have LayerNorms of their own: the
    planting scales what is there and the model computes what it did."""
    from esm_turbo.testing import stress_esmc
    fast = FastEsm.from_hf(stress_esmc(layers=3, hidden=128, heads=2, seed=3), fused=False)
    batch = PackedBatch.from_sequences(SEQS)
    before = fast(batch)[fast.num_layers]
    gain = fast.blocks[-1].attn_norm.weight.abs().max()
    plant_product_outliers(fast, channels=2)
    assert torch.allclose(fast(batch)[fast.num_layers], before, atol=1e-4, rtol=1e-4)
    assert fast.blocks[-1].attn_norm.weight.abs().max() / gain > 50


def test_fp8_is_refused_where_there_are_no_fp8_tensor_cores(stress_dir, tmp_path, capsys):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQ\n")
    out = tmp_path / "o.h5"
    assert main(["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--dtype", "fp8", "--nogpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dtype fp8 needs a GPU with FP8 tensor cores" in err[0] and not out.exists()
    assert main(["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--dtype", "fp8", "--include",
                 "contacts"]) == 2
    assert "contacts need" in capsys.readouterr().err
    assert main(["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--fp8-keep", "0"]) == 2
    assert "--fp8-keep names blocks kept out of FP8: it goes with --dtype fp8" in capsys.readouterr().err
    if FP8_GPU:  # blocks checked against the model's before any work
        assert main(["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--dtype", "fp8",
                     "--fp8-keep", "9"]) == 2
        assert "--fp8-keep 9: the model has blocks 0" in capsys.readouterr().err and not out.exists()
    if not FP8_GPU:
        with pytest.raises(Exception, match="FP8 tensor cores"):
            FastEsm.from_pretrained(stress_dir, dtype="fp8", device="cpu")


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 tensor cores")
def test_scaled_mm_matches_the_reference_on_the_gpu():
    torch.manual_seed(0)
    for n, k, m in ((1, 320, 960), (37, 1280, 5120), (4096, 5120, 1280)):
        x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w, b = Fp8Weight.quantize(torch.randn(m, k, device="cuda")), torch.randn(m, device="cuda", dtype=torch.bfloat16)
        got, want = fp8_linear(x, w, b).float(), fp8_linear_reference(x, w, b).float()
        # the same e4m3 products summed in another order, then rounded to bf16 (2**-8 relative)
        assert ((got - want).abs() <= want.abs() * 2 ** -7 + 1e-2 * want.abs().max()).all()


def test_blocks_kept_out_of_fp8_run_their_products_in_bf16(stress_dir):
    """to_fp8(keep=...) leaves the named blocks' products in bf16 (the rest in e4m3), and the forward runs them so:
    with every block kept it is the bf16 model's."""
    batch = PackedBatch.from_sequences(SEQS)
    model = FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cpu").to_fp8(keep=(0, -1))
    assert model.blocks[0].fp8 is None and model.blocks[-1].fp8 is None and model.blocks[1].fp8 is not None
    assert model.blocks[0].qkv.weight.dtype == torch.bfloat16
    n = len(model.blocks)
    every = FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cpu").to_fp8(keep=tuple(range(n)))
    bf16 = FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cpu").to_dtype(torch.bfloat16)
    assert not every.is_fp8 and torch.equal(every(batch)[n], bf16(batch)[n])
    assert model(batch)[n].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="blocks 0"):
        FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cpu").to_fp8(keep=(n,))


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("keep", [(0,), (0, -1), (1,)])
def test_the_fused_forward_with_blocks_kept_in_bf16_matches_the_reference(stress_dir, keep):
    """Blocks in bf16 among FP8 ones on the fused path (each LayerNorm hands the next block its input in the form its
    products take; blocks replayed only while block and next keep block 2's forms) against the reference path."""
    batch = PackedBatch.from_sequences(SEQS, device="cuda")
    fused = FastEsm.from_pretrained(stress_dir, dtype=torch.bfloat16, device="cuda").to_fp8(keep=keep)
    ref = FastEsm.from_pretrained(stress_dir, dtype=torch.bfloat16, device="cuda", fused=False).to_fp8(keep=keep)
    full = FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cuda", fused=False)
    c = full(batch)[full.num_layers].float()
    miss_ref = 1 - F.cosine_similarity(ref(batch)[ref.num_layers].float(), c, dim=-1).min()
    for graphs in (False, True):
        fused.block_graphs = graphs
        a = fused(batch)[fused.num_layers].float()
        assert 1 - F.cosine_similarity(a, c, dim=-1).min() <= 2 * miss_ref + 1e-4, (keep, graphs)


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 tensor cores")
def test_the_fused_fp8_forward_matches_the_reference_forward(stress_dir):
    """The fused path (inputs quantized in the kernels before each product) is as close to fp32 as the reference path
    (quantize_rows before each product), token by token."""
    batch = PackedBatch.from_sequences(SEQS, device="cuda")
    fused = FastEsm.from_pretrained(stress_dir, dtype="fp8", device="cuda")
    ref = FastEsm.from_pretrained(stress_dir, dtype="fp8", device="cuda", fused=False)
    full = FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cuda", fused=False)
    a, b, c = (m(batch)[m.num_layers].float() for m in (fused, ref, full))
    miss_fused = 1 - F.cosine_similarity(a, c, dim=-1).min()
    miss_ref = 1 - F.cosine_similarity(b, c, dim=-1).min()
    assert miss_fused <= 2 * miss_ref + 1e-4, (miss_fused, miss_ref)


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("kind", ["none", "gelu", "swiglu"])
def test_fused_quantization_gives_the_reference_codes(kind):
    """activation_triton(fp8=True): the e4m3 codes and row scales quantize_rows makes of the reference activation
    (the activation itself may differ by one bf16 rounding, which moves a code by at most one step)."""
    from esm_turbo.embed.fast_esm import activation
    from esm_turbo.kernels.activation import activation_triton
    torch.manual_seed(0)
    u = 3 * torch.randn(300, 2 * 2500, device="cuda", dtype=torch.bfloat16)
    got = activation_triton(u, kind, fp8=True)
    # gelu: one rounding of the float32 value, as F.gelu (the reference path's op-by-op erf formula rounds after
    # every op); swiglu: silu(gate) rounded, then the product rounded, as the reference
    ref = {"none": u, "gelu": F.gelu(u), "swiglu": activation(u, "swiglu")}[kind]
    rq, rs = quantize_rows(ref)
    assert torch.allclose(got.scale, rs, rtol=2 ** -7)
    assert (got.q.float() == rq.float()).float().mean() > 0.995
    step = rq.float().abs() * 2 ** -3 + 2 ** -9  # one e4m3 step (subnormals: 2**-9)
    assert ((got.q.float() * got.scale - rq.float() * rs).abs() <= 1.01 * step * rs).all()


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 tensor cores")
def test_layer_norm_hands_the_next_product_its_e4m3_input():
    from esm_turbo.kernels.norm import add_layer_norm_reference, add_layer_norm_triton
    torch.manual_seed(0)
    h, y = (torch.randn(513, 1280, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = (1 + 0.3 * torch.randn(1280, device="cuda")).bfloat16()
    b = (0.1 * torch.randn(1280, device="cuda")).bfloat16()
    s, x = add_layer_norm_triton(h, y, w, b, 1e-5, 0.5, fp8=True)
    s_ref, x_ref = add_layer_norm_reference(h, y, w, b, 1e-5, 0.5)
    rq, rs = quantize_rows(x_ref)
    assert torch.equal(s, s_ref)
    assert torch.allclose(x.scale, rs, rtol=2 ** -7) and (x.q.float() == rq.float()).float().mean() > 0.99
