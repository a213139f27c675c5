"""Quantized weights: the codec, the linear, the whole model, its checkpoint, and every place a model is taken."""

import copy

import pytest
import torch

from esm_turbo import FastEsm, TurboEsm, calibrate, esm2_config, load_esm, read_fasta
from esm_turbo.cli import main
from esm_turbo.errors import CheckpointError
from esm_turbo.testing import flash_rule, stress_esm2
from esm_turbo.weights import (QuantizedLinear, WeightQuantConfig, is_quantized_dir, load_quantized, quantize_model,
                               save_quantized, weight_memory)
from esm_turbo.weights.codec import group_size
from esm_turbo.weights.model import estimate_bytes


#: a whole block or step chains the kernels (norm and rotation, products with fp32 epilogues), each rounding where the
#: PyTorch path rounds elsewhere: its logits' error is held to this many times the PyTorch path's own in the same dtype
#: (2 for a single kernel; a fused 2-layer fp16 model measured 2.7 on an H100)
CHAINED = 4.0


def _linear(m=48, n=96, seed=0, outlier=True):
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(n, m)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(m, n, generator=gen) / n**0.5)
        if outlier:  # an input channel 30x the rest: the rotation spreads it over its group
            lin.weight[:, 5] *= 30
        lin.bias.copy_(torch.randn(m, generator=gen))
    return lin


@pytest.mark.parametrize("bits", [2, 3, 4])
@torch.no_grad()
def test_quantized_linear_error_falls_with_bits_and_the_residual_pass(bits):
    lin = _linear()
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    ref = lin(x)
    errors = []
    for residual in (False, True):
        q = QuantizedLinear.from_linear(lin, WeightQuantConfig(bits=bits, group=32, residual=residual), seed=3)
        out = q(x)
        # the rotated-input forward is the original-domain weight's product
        assert torch.allclose(out, x @ q.dequantize().T + lin.bias, atol=1e-4, rtol=1e-4)
        errors.append(float((out - ref).norm() / ref.norm()))
    assert errors[1] < errors[0] / 2  # the residual pass removes most of the first pass's error
    assert errors[0] < {2: 0.25, 3: 0.13, 4: 0.08}[bits], errors  # Lloyd-Max on near-Gaussian values


def test_the_rotation_spreads_an_outlier_channel():
    lin = _linear()
    q = QuantizedLinear.from_linear(lin, WeightQuantConfig(bits=4, group=32), seed=0)
    err = (q.dequantize() - lin.weight).pow(2).sum(0)  # per input channel
    assert err[5] / err.mean() < 10  # without the rotation, the 30x channel would take nearly all of it


def test_group_sizes_and_config_checks():
    assert group_size(320, 128) == 64 and group_size(1280, 128) == 128 and group_size(480, 128) == 32
    with pytest.raises(ValueError, match="power of two"):
        WeightQuantConfig(group=48)
    with pytest.raises(ValueError, match="2-4 bits"):
        WeightQuantConfig(bits=8)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    base = stress_esm2(layers=2, hidden=64, heads=4, seed=0)
    model = quantize_model(copy.deepcopy(base), WeightQuantConfig(bits=4, group=32), source="stress")
    out = tmp_path_factory.mktemp("w") / "q"
    save_quantized(model, out)
    return base, model, out


def test_a_quantized_model_round_trips_and_stays_close(quantized):
    base, model, out = quantized
    assert is_quantized_dir(out) and len(model.weight_quant["quantized"]) == 2 * 6
    ids = torch.randint(4, 24, (2, 30), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = load_quantized(out)(input_ids=ids).logits
    assert torch.equal(want, got)  # the checkpoint holds exactly the quantized model
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    for layer, original in zip(model.esm.encoder.layer, base.esm.encoder.layer):
        q, ref = layer.attention.self.query, original.attention.self.query
        with torch.no_grad():
            assert float((q(x) - ref(x)).norm() / ref(x).norm()) < 0.15  # 4-bit Lloyd-Max: ~10% RMS
    loaded = load_esm(out, dtype=torch.float16)  # anywhere a model is taken
    q = loaded.esm.encoder.layer[0].attention.self.query
    assert isinstance(q, QuantizedLinear) and q.scales0.dtype == torch.float16 and q.bias.dtype == torch.float16


def test_memory_is_counted_whole(quantized):
    _, model, _ = quantized
    mem = weight_memory(model)
    linear_params = 2 * (4 * 64 * 64 + 2 * 64 * 256)
    codes = linear_params // 2  # 4 bits
    scales = 2 * linear_params // 32
    codebooks = 2 * 6 * 16 * 2
    assert mem["quantized_linear_bytes"] == codes + scales + codebooks
    assert mem["fp16_bytes"] == 2 * sum(p.numel() for p in stress_esm2(layers=2, hidden=64, heads=4).parameters())
    small = estimate_bytes(model.config, WeightQuantConfig(bits=4, group=32))
    assert small == mem  # counted on a meta-device shell, as on the model itself
    big = estimate_bytes(esm2_config("15B"), WeightQuantConfig(bits=4, group=32))
    assert big["total_bytes"] < 9e9 and big["ratio_vs_fp16"] <= 0.30  # ESM-2 15B fits a 24 GB GPU


def test_truncated_or_foreign_checkpoints_are_refused(quantized, tmp_path):
    _, _, out = quantized
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((out / "config.json").read_bytes())
    (bad / "weights.safetensors").write_bytes((out / "weights.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="not a readable"):
        load_quantized(bad)


def test_fast_embed_and_the_kv_cache_run_on_quantized_weights(quantized):
    _, model, out = quantized
    fast = FastEsm.from_pretrained(out, dtype=torch.float32, device="cpu")
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMLEDPVDAFQ"]
    emb = fast.embed(seqs, layers=[2])["mean"][2]
    from esm_turbo.model.alphabet import encode
    tokens, mask = encode(seqs, add_eos=True)
    with torch.no_grad():
        hidden = model.esm(input_ids=tokens, attention_mask=mask, output_hidden_states=True).last_hidden_state
    for i, s in enumerate(seqs):
        want = hidden[i, 1:len(s) + 1].mean(0)
        assert torch.allclose(emb[i], want, atol=1e-4), (emb[i] - want).abs().max()
    records = read_fasta("calibration_data/calibration.fasta")[0][:8]
    cal = calibrate(model, records, progress=False)
    session = TurboEsm(model, cal).session()
    session.start(seqs[:1])
    assert torch.isfinite(session.step(["A"]).logits).all()
    base, _, _ = quantized  # a KV calibration of the fp16 weights does not fit the quantized model's K and V
    with pytest.raises(CheckpointError, match="made for another model"):
        TurboEsm(model, calibrate(base, records, progress=False))


def test_cli_quantize_weights(tmp_path, capsys):
    from esm_turbo.testing import save_stress_model
    src = save_stress_model(tmp_path / "m", fair_esm_pt=False, layers=2, hidden=64, heads=4)
    out = tmp_path / "q"
    assert main(["quantize-weights", "--model", str(src), "--out", str(out), "--bits", "3", "--quiet"]) == 0
    assert "to 3 bits" in capsys.readouterr().out and is_quantized_dir(out)
    assert main(["quantize-weights", "--model", str(src), "--out", str(out), "--quiet"]) == 2  # not a new folder
    assert "not empty" in capsys.readouterr().err
    assert main(["quantize-weights", "--model", str(src), "--out", str(tmp_path / "g"), "--group", "48"]) == 2
    assert "--group 48" in capsys.readouterr().err and not (tmp_path / "g").exists()


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
@pytest.mark.parametrize("n,group,batch", [(96, 32, 5), (256, 128, 3), (320, 64, 17), (1280, 32, 1), (512, 32, 2)])
@pytest.mark.parametrize("gemv", [False, True, "ahead"])
def test_weight_kernel_matches_its_reference(n, group, batch, gemv):
    """The fused 4-bit dequantize-and-multiply kernels (Triton's interpreter on CPU, the codebook gathered; compiled
    on a GPU, looked up in registers), the tensor-core tiles and the CUDA-core one (also with its codes requested a
    tile ahead), against the PyTorch reference, under the flash-attention rule in the kernel's dtype: the error against
    fp64 at most twice that of the PyTorch product in that dtype."""
    from esm_turbo.kernels.weights import matmul_triton
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = QuantizedLinear.from_linear(_linear(80, n, seed=n), WeightQuantConfig(bits=4, group=group), seed=1)
    x = torch.randn(batch, n, generator=torch.Generator().manual_seed(batch))
    args = [t.to(device) for t in (q.codes0, q.scales0, q.codebook0)]
    ref64 = x.double() @ q.rotated_weight(torch.float64).T
    dtype = torch.float16 if device == "cuda" else torch.float32
    pt = x.to(device, dtype) @ q.rotated_weight(dtype).to(device).T  # the PyTorch product in the kernel's dtype
    out = matmul_triton(x.to(device, dtype), *args, config=dict(gemv=bool(gemv), gemv_ahead=gemv == "ahead"))
    err, err_pt, bound = flash_rule(out, ref64, pt)
    assert err <= bound, (err, err_pt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the register-fed tensor-core kernel is PTX (CUDA only)")
@pytest.mark.parametrize("n,group,batch,words,split,ahead,regs", [
    (512, 32, 1, 4, 1, 1, None), (512, 128, 5, 2, 2, 0, None), (1024, 64, 9, 4, 4, 1, None),
    (256, 32, 16, 2, 1, 0, None), (2048, 32, 12, 4, 2, 1, None), (1280, 32, 3, 4, 4, 1, None),
    (576, 32, 7, 4, 1, 1, None), (2048, 32, 16, 4, 1, 1, 96), (1024, 64, 9, 4, 4, 1, 128),
    (2560, 32, 16, 4, 1, "upfront", 168), (2560, 32, 5, 4, 4, "upfront", None), (1280, 32, 12, 4, 2, "upfront", 96),
    (2560, 32, 9, 4, 1, "upfront pdl", None), (10240, 32, 16, 4, 4, "upfront pdl", None)])
@torch.no_grad()
def test_register_fed_tensor_core_kernel_matches_its_reference(n, group, batch, words, split, ahead, regs):
    """The register-fed tensor-core kernel (up to 16 rows; 2 or 4 code words a lane; the input channels split over
    programs, the last to arrive finishing; codes requested a step ahead or all before the walk, also as a
    programmatic dependent launch; a register cap) against the PyTorch reference in fp64, with the earlier pass and the
    bias added once, twice in a row (the split's arrival counts left zero), and three parts of one input in one
    launch (each its own codebook and rotated input), under the flash-attention rule against the same sums computed
    by PyTorch in fp16."""
    from esm_turbo.kernels.common import split_counters
    from esm_turbo.kernels.weights import matmul_triton
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(n + batch)
    qs = [QuantizedLinear.from_linear(_linear(80, n, seed=n + p), WeightQuantConfig(bits=4, group=group), seed=p)
          for p in range(3)]
    x = torch.randn(3, batch, n, generator=gen)
    prev, bias = torch.randn(batch, 240, generator=gen), torch.randn(240, generator=gen)
    want = torch.cat([x[p].double() @ q.rotated_weight(torch.float64).T for p, q in enumerate(qs)], 1)
    want += prev.double() + bias.double()
    half = torch.float16
    products = [x[p].to(dev, half) @ q.rotated_weight(half).to(dev).T for p, q in enumerate(qs)]
    pt = torch.cat(products, 1) + prev.to(dev, half) + bias.to(dev, half)  # PyTorch in fp16
    walk = str(ahead).split()  # "upfront": every step's codes requested before the walk; "pdl": a dependent launch
    cfg = dict(gemv=False, mma=True, mma_words=words, mma_split=split, mma_ahead=1 if walk[0].isalpha() else ahead,
               mma_maxnreg=regs, mma_upfront="upfront" in walk, pdl="pdl" in walk)
    stack = [torch.cat([getattr(q, k) for q in qs]).to(dev) for k in ("codes0", "scales0", "codebook0")]
    for _ in range(2):
        out = matmul_triton(x.to(dev, half), *stack, config=cfg, prev=prev.to(dev), bias=bias.to(dev))
        err, err_pt, bound = flash_rule(out, want, pt)
        assert out.shape == (batch, 240) and err <= bound, (err, err_pt)
    one = matmul_triton(x[0].to(dev, half), *(t.to(dev) for t in (qs[0].codes0, qs[0].scales0, qs[0].codebook0)),
                        config=cfg)
    err, err_pt, bound = flash_rule(one, want[:, :80] - prev[:, :80].double() - bias[:80].double(), products[0])
    assert err <= bound, (err, err_pt)
    assert not split_counters(240 // 16, dev).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch and L2 prefetch are CUDA")
@pytest.mark.parametrize("mma,upfront", [(True, False), (False, False), (True, True)])
@torch.no_grad()
def test_dependent_launches_and_prefetch_keep_a_chain_of_products_exact(mma, upfront):
    """A chain of 4-bit products in one CUDA graph, each one's input the one before's output (a step's order), with
    every launch a programmatic dependent launch whose codes are prefetched into L2 (``upfront``: and every code
    requested) before it waits: bit for bit the chain launched plainly (register-fed and tile kernels; split over
    programs). Before the replay every product's output holds NaN, so a launch that reads its input before the one
    before has written it shows (stale values from an earlier run would match)."""
    from esm_turbo.kernels.weights import matmul_triton
    dev = torch.device("cuda")
    qs = [QuantizedLinear.from_linear(_linear(512, 512, seed=s), WeightQuantConfig(bits=4, group=32), seed=s)
          for s in range(6)]
    ws = [tuple(getattr(q, k).to(dev) for k in ("codes0", "scales0", "codebook0")) for q in qs]
    gen = torch.Generator().manual_seed(0)
    xa, xb = (torch.randn(12, 512, generator=gen).to(dev, torch.float16) for _ in range(2))
    x0 = xa.clone()
    outs = {}
    for flags in (False, True):
        cfg = dict(gemv=False, mma=mma, mma_split=2, split=2, pdl=flags, prefetch=flags, mma_upfront=upfront and flags)

        def chain():
            hs = [x0]
            for w in ws:
                hs.append(matmul_triton(hs[-1], *w, config=cfg, prev=hs[-1], out_dtype=torch.float16))
            return hs[1:]
        x0.copy_(xa)
        chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hs = chain()
        x0.copy_(xb)  # the replay reads the new input
        for h in hs:
            h.fill_(float("nan"))
        graph.replay()
        outs[flags] = hs[-1].clone()
    assert outs[True].isfinite().all() and torch.equal(outs[True], outs[False])


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
def test_register_fed_kernel_launch_divides_the_channels():
    """The register-fed kernel's launch shrinks (code words a lane, then split, then warps) until the input channels
    are whole chunks that divide evenly over the programs and warps; the rules take it for larger layers only, and it
    refuses inputs it cannot take (not fp16, over 16 rows, part tiles, scale groups under a lane's 32 channels)."""
    from esm_turbo.kernels.weights import launch_config
    from esm_turbo.kernels.weights_mma import mma_fits, mma_launch
    assert mma_launch(10240, 4, 4, 4) == (4, 4, 4)
    assert mma_launch(1280, 4, 4, 4) == (4, 2, 1)  # 10 chunks of 128: 20 of 64 over 4 warps
    assert mma_launch(5120, 4, 4, 4) == (4, 2, 4)
    assert mma_launch(320, 4, 4, 1) == (1, 2, 1)  # 5 chunks of 64
    assert mma_launch(576, 4, 4, 1) == (1, 2, 1)  # 9 chunks of 64, not 4 of 128 (which leave 64 channels out)
    assert launch_config(16, 7680, 2560)["mma"] and not launch_config(16, 1280, 1280)["mma"]
    assert launch_config(4, 3840, 1280)["mma"] and not launch_config(1, 7680, 2560)["mma"]
    assert not launch_config(64, 20480, 5120)["mma"]
    x, words = torch.zeros(1, 16, 512, dtype=torch.float16), torch.zeros(64, 64, dtype=torch.int32)
    assert mma_fits(x, words, 64, 512, 64, 32) and not mma_fits(x, words, 64, 512, 64, 16)
    assert not mma_fits(x.float(), words, 64, 512, 64, 32) and not mma_fits(x, words, 40, 512, 40, 32)
    assert not mma_fits(torch.zeros(1, 17, 512, dtype=torch.float16), words, 64, 512, 64, 32)


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
@pytest.mark.parametrize("split,ahead", [(1, 0), (2, 0), (4, 1), (2, 1), (8, 1)])
def test_weight_kernel_splits_the_input_channels(split, ahead):
    """The tensor-core kernel with its input channels split over programs (a float32 partial sum each; the last
    program of a tile to arrive adds them) gives the unsplit result, the earlier pass and the bias added once, and
    leaves its arrival counts zero for the next launch; also with the codes requested a tile ahead."""
    from esm_turbo.kernels.common import split_counters
    from esm_turbo.kernels.weights import matmul_reference, matmul_triton
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = QuantizedLinear.from_linear(_linear(48, 512, seed=3), WeightQuantConfig(bits=4, group=32), seed=1)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).to(device)
    args = [t.to(device) for t in (q.codes0, q.scales0, q.codebook0)]
    prev, bias = torch.randn(3, 48, device=device), torch.randn(48, device=device)
    want = matmul_reference(x, *args) + prev + bias
    cfg = dict(gemv=False, split=split, block_k=64, ahead=ahead)
    for _ in range(2):  # the second launch finds the counts the first left
        out = matmul_triton(x, *args, config=cfg, prev=prev, bias=bias, out_dtype=torch.float32)
        assert out.shape == (3, 48) and (out - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert not split_counters(1, torch.device(device)).any()


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
@pytest.mark.parametrize("n,group,residual", [(96, 32, True), (256, 128, False), (1280, 32, False)])
@pytest.mark.parametrize("batch", [1, 5, 40])
@torch.no_grad()
def test_the_linear_on_the_kernels_matches_its_pytorch_path(monkeypatch, n, group, residual, batch):
    """QuantizedLinear's kernel path (Triton's interpreter on CPU; compiled on a GPU): up to KERNEL_ROWS rows the
    matmul kernel rotates the input itself and chains the passes and the bias through its epilogue; past it the
    dequantize kernel turns the weight back to the original domain for one matmul. Both against the PyTorch path in
    fp64, under the flash-attention rule against the PyTorch path in the kernel's dtype."""
    import esm_turbo.weights.linear as linear
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    q = QuantizedLinear.from_linear(_linear(80, n, seed=n), WeightQuantConfig(bits=4, group=group, residual=residual),
                                    seed=1)
    x = torch.randn(batch, n, generator=torch.Generator().manual_seed(batch))
    want = x.double() @ q.dequantize(torch.float64).T + q.bias.double()  # the PyTorch path, in fp64
    w_torch = q.dequantize(torch.float32)
    q = q.to(device, dtype)
    monkeypatch.setattr(linear, "use_kernels", lambda _: False)
    pt = q(x.to(device, dtype))
    monkeypatch.setattr(linear, "use_kernels", lambda _: True)
    out = q(x.to(device, dtype))
    assert out.dtype == dtype and out.shape == (batch, 80)
    err, err_pt, bound = flash_rule(out, want, pt)
    assert err <= bound, (err, err_pt)
    w = q.dequantize(torch.float32).cpu()  # the dequantize kernel against the PyTorch path
    assert (w - w_torch).abs().max().item() <= (1e-6 if dtype == torch.float32 else 1e-3) * w_torch.abs().max().item()


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
@pytest.mark.parametrize("residual", [False, True])
@torch.no_grad()
def test_query_key_and_value_are_one_launch_and_each_its_own_linear(monkeypatch, tmp_path, residual):
    """A layer's query, key and value bound by fuse_blocks: on the kernel path (Triton's interpreter on
    CPU; compiled on a GPU) the first call computes all three in one rotate and one matmul launch, the next two take
    their outputs without a launch, and each equals its own linear's PyTorch path; the members' buffers are views of
    the stacks, and the model saves and reloads unchanged."""
    import esm_turbo.kernels.weights as kw
    import esm_turbo.weights.linear as linear
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    base = stress_esm2(layers=1, hidden=64, heads=4, seed=0)
    model = quantize_model(base, WeightQuantConfig(bits=4, group=32, residual=residual), source="stress")
    inner = model.esm.encoder.layer[0].attention.self
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    want = [x.double() @ m.dequantize(torch.float64).T + m.bias.double() for m in (inner.query, inner.key, inner.value)]
    model.to(device, dtype)
    assert inner.query.shared is inner.key.shared is inner.value.shared is not None
    monkeypatch.setattr(linear, "use_kernels", lambda _: True)
    launches = []
    monkeypatch.setattr(kw, "matmul_triton", lambda *a, _f=kw.matmul_triton, **k: launches.append(1) or _f(*a, **k))
    xs = x.to(device, dtype)
    monkeypatch.setattr(linear, "use_kernels", lambda _: False)
    pts = [inner.query(xs), inner.key(xs), inner.value(xs)]  # each linear's PyTorch path in the kernels' dtype
    monkeypatch.setattr(linear, "use_kernels", lambda _: True)
    got = [inner.value(xs), inner.query(xs), inner.key(xs)]
    assert len(launches) == 1 + residual  # one launch a pass, for all three
    for out, ref, pt in zip([got[1], got[2], got[0]], want, pts):
        err, err_pt, bound = flash_rule(out, ref, pt)
        assert out.shape == (2, 3, 16 * 4) and err <= bound, (err, err_pt)
    stack = inner.query.shared._stacks["codes0"]
    assert inner.key.codes0.data_ptr() == stack[64:].data_ptr()  # a view, not a second copy
    inner.key(xs.clone())  # another input: computed again
    assert len(launches) == 2 + 2 * residual
    assert torch.allclose(inner.key(xs, add=xs), got[2] + xs)  # a block's input added to a member's output
    save_quantized(model.float().cpu(), tmp_path / "q")
    again = load_quantized(tmp_path / "q").esm.encoder.layer[0].attention.self
    assert torch.equal(again.key.codes0, inner.key.codes0.cpu()) and again.key.shared is not None


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
@pytest.mark.parametrize("parts,batch", [(1, 3), (3, 16)])
def test_norm_and_rotation_in_one_launch_match_layer_norm_then_rotation(parts, batch):
    """``norm_rotate_triton`` (a LayerNorm and the input rotation of each consumer, one launch) against
    ``F.layer_norm`` then ``rotate_triton``: the normalized rows and every part's rotation."""
    from esm_turbo.kernels.weights import norm_rotate_triton, rotate_triton, sign_matrix
    from esm_turbo.weights.codec import rotation
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(batch)
    n = 320
    x = (torch.randn(batch, n, generator=gen) * 4 + 1).to(device, dtype)
    w, b = (torch.rand(n, generator=gen) + 0.5).to(device, dtype), torch.randn(n, generator=gen).to(device, dtype)
    turns = [sign_matrix(rotation(32, seed).T.to(device)) for seed in range(parts)]
    turn = (torch.stack([s for s, _ in turns]), turns[0][1]) if parts > 1 else turns[0]
    y, x_rot = norm_rotate_triton(x, w, b, 1e-5, turn)
    want = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
    pt = torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5)  # PyTorch in the kernel's dtype
    err, err_pt, bound = flash_rule(y, want, pt)
    assert y.dtype == dtype and err <= bound, (err, err_pt)

    def turned(t, dt):  # each part's rotation of 32-channel groups, in PyTorch
        mats = [(s * c).to(dt) for s, c in turns]
        return torch.stack([(t.to(dt).view(batch, -1, 32) @ m).view(batch, n) for m in mats]).squeeze(0)
    assert x_rot.shape == ((parts, batch, n) if parts > 1 else (batch, n))
    err, err_pt, bound = flash_rule(x_rot, turned(want, torch.float64), turned(pt, dtype))
    assert err <= bound, (err, err_pt)
    assert (x_rot.float() - rotate_triton(y, turn).float()).abs().max().item() <= bound


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
@pytest.mark.parametrize("gemv", [False, True])
def test_gelu_in_the_weight_kernels_epilogue(gemv):
    """``matmul_triton(..., gelu=True)``: ESM-2's GELU of (x Ŵᵀ + bias) from the kernel's epilogue, against
    transformers' gelu of the reference's product."""
    from transformers.models.esm.modeling_esm import gelu

    from esm_turbo.kernels.weights import matmul_triton
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    q = QuantizedLinear.from_linear(_linear(80, 256, seed=3), WeightQuantConfig(bits=4, group=32), seed=1)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(device)
    args = [t.to(device) for t in (q.codes0, q.scales0, q.codebook0)]
    want = gelu(x.double().cpu() @ q.rotated_weight(torch.float64).T + q.bias.double())
    pt = gelu(x.to(dtype) @ q.rotated_weight(dtype).to(device).T + q.bias.to(device, dtype))  # PyTorch in dtype
    out = matmul_triton(x.to(dtype), *args, config=dict(gemv=gemv), bias=q.bias.to(device, dtype), gelu=True)
    err, err_pt, bound = flash_rule(out, want, pt)
    assert err <= bound, (err, err_pt)
    assert (want < 0).any()  # the activation's negative side is reached


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
@pytest.mark.parametrize("residual", [False, True])
@torch.no_grad()
def test_a_quantized_block_folds_its_small_work_into_its_launches(monkeypatch, tmp_path, residual):
    """``fuse_blocks`` on the kernel path (Triton's interpreter on CPU): each layer's two LayerNorms normalize and
    rotate their consumers' input in one launch each (no rotation launch of their own for q/k/v and FFN up), FFN up
    applies the GELU and the attention output and FFN down add the residual in their epilogues; the logits are the
    PyTorch path's. The fused modules keep the model's state dict names, and a saved model loads fused again."""
    import esm_turbo.kernels.weights as kw
    import esm_turbo.weights.fusion as fusion
    import esm_turbo.weights.linear as linear
    from esm_turbo.weights.fusion import GeluIntermediate, NormThenRotate, ResidualOutput
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    base = stress_esm2(layers=2, hidden=64, heads=4, seed=0)
    names = list(base.state_dict())
    model = quantize_model(base, WeightQuantConfig(bits=4, group=32, residual=residual), source="stress")
    model64 = copy.deepcopy(model).to(device, torch.float64)
    model.to(device, dtype)
    layer = model.esm.encoder.layer[0]
    assert isinstance(layer.attention.LayerNorm, NormThenRotate) and isinstance(layer.LayerNorm, NormThenRotate)
    assert isinstance(layer.intermediate, GeluIntermediate) and layer.intermediate.dense.activation == "gelu"
    assert isinstance(layer.attention.output, ResidualOutput) and isinstance(layer.output, ResidualOutput)
    ids = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 2]], device=device)
    monkeypatch.setattr(linear, "use_kernels", lambda _: False)
    monkeypatch.setattr(fusion, "use_kernels", lambda _: False)
    ref, pt = model64(input_ids=ids).logits, model(input_ids=ids).logits  # the PyTorch path in fp64 and in dtype
    calls = {"rotate_triton": 0, "norm_rotate_triton": 0}
    for name in calls:
        monkeypatch.setattr(kw, name, lambda *a, _n=name, _f=getattr(kw, name):
                            calls.__setitem__(_n, calls[_n] + 1) or _f(*a))
    prevs = []
    monkeypatch.setattr(kw, "matmul_triton", lambda *a, _f=kw.matmul_triton, **k: prevs.append(
        k.get("prev") is not None) or _f(*a, **k))
    monkeypatch.setattr(linear, "use_kernels", lambda _: True)
    monkeypatch.setattr(fusion, "use_kernels", lambda _: True)
    got = model(input_ids=ids).logits
    assert calls == {"rotate_triton": 4, "norm_rotate_triton": 4}  # a layer: O and FFN down; q/k/v and FFN up
    # a layer's launches: q/k/v, O + the block's input, FFN up, FFN down + the block's input (each pass after the
    # first adds the one before)
    assert prevs == 2 * ([False, True, False, True] if not residual else [False, True, True, True] * 2)
    err, err_pt, bound = flash_rule(got, ref, pt, times=CHAINED)
    assert err <= bound, (err, err_pt)
    assert [n for n in model.state_dict() if "LayerNorm" in n] == [n for n in names if "LayerNorm" in n]
    save_quantized(model.float().cpu(), tmp_path / "q")
    again = load_quantized(tmp_path / "q").esm.encoder.layer[1]
    assert isinstance(again.LayerNorm, NormThenRotate) and isinstance(again.intermediate, GeluIntermediate)
    assert torch.equal(again.LayerNorm.weight, model.esm.encoder.layer[1].LayerNorm.weight.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused decode step runs on CUDA")
@torch.no_grad()
def test_a_quantized_decode_step_on_the_fused_path_replays_as_a_cuda_graph(monkeypatch):
    """A design-loop step of a 4-bit model on CUDA (RoPE kernel, LayerNorms that rotate, GELU in FFN up's epilogue,
    q/k/v in one launch): its logits are the PyTorch path's, and a captured step replays to the eager step's."""
    import esm_turbo.weights.fusion as fusion
    import esm_turbo.weights.linear as linear
    from esm_turbo import ops
    model = quantize_model(stress_esm2(layers=2, hidden=128, heads=4, seed=0),
                           WeightQuantConfig(bits=4, group=32), source="stress").cuda().half()
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "MKVLAAGIVGLLLAAAGCSSS"]
    tokens = torch.full((4, 1), 5, device="cuda")

    def session(net=model, cache="fp16"):
        s = TurboEsm(net).session(cache, capacity=64)
        s.start(seqs)
        s.fork(2)
        return s

    fused = session()
    eager = fused.step(tokens, commit=False).logits
    replay = fused.capture_step(tokens).replay().logits
    assert torch.allclose(replay, eager, atol=1e-3)
    for module in (linear, fusion, ops):
        monkeypatch.setattr(module, "use_kernels", lambda _: False)
    pt = session().step(tokens, commit=False).logits  # the PyTorch path in fp16, and in fp32
    ref = session(copy.deepcopy(model).float(), "fp32").step(tokens, commit=False).logits
    err, err_pt, bound = flash_rule(eager, ref, pt, times=CHAINED)
    assert err <= bound, (err, err_pt)


@torch.no_grad()
def test_a_random_stand_in_is_built_without_an_fp16_copy():
    """``random_model``: the shape's quantized model straight from random codes (what measures a model too large
    to quantize here): its bytes are the estimate's, it runs, and its rotary frequencies are ESM-2's; without a
    quantization, the same shape with plain linears."""
    from esm_turbo.weights.model import random_model
    config = esm2_config("8M")
    model = random_model(config, "cpu", dtype=torch.float32)
    assert weight_memory(model) == estimate_bytes(config, WeightQuantConfig())
    linear = model.esm.encoder.layer[0].attention.self.query
    assert isinstance(linear, QuantizedLinear) and linear.codes0.float().std() > 50  # random bytes
    from transformers import EsmForMaskedLM
    reference = EsmForMaskedLM(config)
    for (name, want), (_, got) in zip(reference.named_buffers(), model.named_buffers()):
        if name.endswith("inv_freq"):
            assert torch.allclose(got, want), name
    out = model(input_ids=torch.tensor([[0, 5, 6, 7, 2]])).logits
    assert out.shape == (1, 5, config.vocab_size) and torch.isfinite(out).all()
    plain = random_model(config, "cpu", quant=None, dtype=torch.float32)
    assert isinstance(plain.esm.encoder.layer[0].attention.self.query, torch.nn.Linear)
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in reference.parameters())
    assert torch.isfinite(plain(input_ids=torch.tensor([[0, 5, 6, 7, 2]])).logits).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: pinned host memory and a copy stream"))])
@torch.no_grad()
def test_the_residual_pass_offloaded_to_host_memory_gives_the_same_model(device):
    """``offload_residual``: the second passes in host memory, the device holding two layer slots; the logits equal
    the resident model's (every layer's residual copied in before it is read, forward after forward, q/k/v still one
    stack); the memory count says what is where; an offloaded model is not saved."""
    from esm_turbo.weights.model import random_model
    from esm_turbo.weights.offload import offload_residual
    config = stress_esm2(layers=4, hidden=64, heads=4).config
    dtype = torch.float16 if device == "cuda" else torch.float32
    resident = random_model(config, "cpu", WeightQuantConfig(bits=4, group=32, residual=True), dtype=dtype, seed=3)
    for name, t in resident.named_buffers():  # distinct residual codes per layer, so a stale slot would show
        if name.endswith("codes1"):
            t.copy_(torch.randint(0, 256, t.shape, generator=torch.Generator().manual_seed(len(name) + t.numel()),
                                  dtype=torch.uint8))
    offloaded = copy.deepcopy(resident)
    resident.to(device)
    offload = offload_residual(offloaded, device)
    tokens = torch.randint(4, 24, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    want = resident(tokens).logits
    for _ in range(2):
        got = offloaded(tokens).logits
        assert torch.equal(got, want) if device == "cpu" else torch.allclose(got, want, atol=2e-3, rtol=2e-3)
    layer = offloaded.esm.encoder.layer[1]
    assert layer.attention.self.query.codes1.device.type == torch.device(device).type
    assert layer.attention.self.query.codes1.data_ptr() == offload.slot[1].data_ptr()  # layer 1: slot 1
    shared = layer.attention.self.query.shared
    if shared._stacks is not None:
        assert shared._stacks["codes1"].data_ptr() == layer.attention.self.query.codes1.data_ptr()
    per_layer = offload.host[0].numel()
    assert offload.device_bytes == 2 * per_layer and offload.host_bytes == 4 * per_layer
    mem, full = weight_memory(offloaded), weight_memory(resident)
    assert mem["host_bytes"] == 4 * per_layer
    assert full["quantized_linear_bytes"] - mem["quantized_linear_bytes"] == 2 * per_layer  # padding: none here
    with pytest.raises(ValueError, match="offloaded"):
        save_quantized(offloaded, "unused")
    with pytest.raises(ValueError, match="no residual pass"):
        offload_residual(random_model(config, "cpu", WeightQuantConfig(bits=4, group=32)), device)


def test_cli_embeds_with_the_residual_pass_offloaded(tmp_path, capsys):
    """``esm-turbo embed --offload-residual`` on a checkpoint quantized with ``--residual`` writes what the resident
    model writes; on a checkpoint without a residual pass it is refused in one line before any work."""
    from esm_turbo.testing import save_stress_model
    src = save_stress_model(tmp_path / "m", fair_esm_pt=False, layers=2, hidden=64, heads=4)
    fasta = tmp_path / "x.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nGSHMLEDPVAGQ\n")
    q, plain = tmp_path / "q", tmp_path / "p"
    assert main(["quantize-weights", "--model", str(src), "--out", str(q), "--residual", "--quiet"]) == 0
    assert main(["quantize-weights", "--model", str(src), "--out", str(plain), "--quiet"]) == 0
    outs = []
    for i, extra in enumerate(([], ["--offload-residual"])):
        outs.append(tmp_path / f"o{i}")
        assert main(["embed", str(fasta), "--model", str(q), "-o", str(outs[-1]), "--nogpu", "--quiet",
                     *extra]) == 0
    for name in ("a", "b"):
        want, got = (torch.load(o / f"{name}.pt") for o in outs)
        assert torch.equal(want["mean_representations"][2], got["mean_representations"][2])
    capsys.readouterr()
    assert main(["embed", str(fasta), "--model", str(plain), "-o", str(tmp_path / "o2"), "--nogpu",
                 "--offload-residual"]) == 2
    err = capsys.readouterr().err
    assert "no residual pass" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "o2").exists()


def _run_ptx(text: str, regs: dict) -> dict:
    """A model of the PTX subset the codebook look-up uses (mov, shl, shr, and, prmt in its default mode, lop3 with
    table 0xD8): runs ``text`` over 32-bit ``regs`` (names or $n → int) and returns them."""
    def prmt(a, b, sel):
        src = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
        out = 0
        for i in range(4):
            s = (sel >> (4 * i)) & 15
            byte = (255 if src[s & 7] & 128 else 0) if s & 8 else src[s & 7]
            out |= byte << (8 * i)
        return out

    ops = {"mov.b32": lambda a: a, "shl.b32": lambda a, b: (a << b) & 0xFFFFFFFF, "shr.b32": lambda a, b: a >> b,
           "and.b32": lambda a, b: a & b, "prmt.b32": prmt,
           "lop3.b32": lambda a, b, c, lut: ((b & c) | (a & ~c)) & 0xFFFFFFFF if lut == 0xD8 else None}
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line:
            continue
        op, rest = line.split(None, 1)
        dst, *args = [a.strip() for a in rest.split(",")]
        regs[dst] = ops[op](*[regs[a] if a in regs else int(a, 0) for a in args])
    return regs


@pytest.mark.skipif(not __import__("esm_turbo.kernels", fromlist=["triton_supported"]).triton_supported(),
                    reason="triton >= 3.5 is not installed")
def test_ptx_codebook_lookup_decodes_every_code_in_every_position():
    """The PTX look-up both weight kernels share (kernels.weights.lookup_word), run on a model of its instructions:
    every code 0–15 in every nibble of a word, and random words, decode to the codebook entry's fp16 bits, in code
    order as fp16 pairs (codes 0–1, 2–3, 4–5, 6–7), for a codebook with entries of both signs."""
    import numpy as np

    from esm_turbo.kernels.weights import lookup_word
    cb = torch.linspace(-2.5, 3.0, 16).half()
    cb[3] = -0.0
    bits = [int(b) & 0xFFFF for b in cb.view(torch.int16)]
    lo, hi = [b & 255 for b in bits], [b >> 8 for b in bits]
    tab = [sum(v << (8 * i) for i, v in enumerate(part[4 * j: 4 * j + 4])) for part in (lo, hi) for j in range(4)]
    text = lookup_word("word", ["p0", "p1", "p2", "p3"], [f"t{i}" for i in range(8)])
    words = [[(c + k) % 16 for k in range(8)] for c in range(16)]  # every code in every position
    words += np.random.default_rng(0).integers(0, 16, (200, 8)).tolist()
    for codes in words:
        regs = _run_ptx(text, {"word": sum(c << (4 * i) for i, c in enumerate(codes))}
                        | {f"t{i}": t for i, t in enumerate(tab)})
        got = [regs[f"p{i // 2}"] >> (16 * (i % 2)) & 0xFFFF for i in range(8)]
        assert got == [bits[c] for c in codes], codes
