"""Decode steps through FastEsm's fused blocks (esm_turbo.model.fused_step) against the steps through transformers'
layers: the same logits and hidden states (kernels under Triton's interpreter on CPU, within the flash-attention
rule's spirit on CUDA in fp16), the same cache after committed steps, and the path chosen only where it applies."""

import pytest
import torch

from esm_turbo.bench.synthetic import default_codec
from esm_turbo.kernels.ffn_step import ffn_step
from esm_turbo.model.engine import TurboEsm
from esm_turbo.testing import stress_esm2, stress_esmc

SEQS = ["MKTAYIAKQRQISFVKSHFSRQ", "MKVLAAGIVGLLLA", "GSHMSE"]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _needs_triton():
    from esm_turbo.kernels import triton_supported
    if not triton_supported():
        pytest.skip("needs Triton (the kernels run under its interpreter on CPU)")


def _codec(layer, heads, dim):
    return default_codec(heads, dim, seed=layer)


def _steps(engine, fused: bool, cache, steps: int = 3, paged: bool = False):
    """Logits and hidden states of a peek step and of ``steps`` committed ones (a mask, then residues, the last two
    rows fed two tokens of which the last row's second is padding), and the cache's lengths after."""
    engine.fused_step = fused
    session = engine.session(cache, capacity=64, paged=paged, block_size=8)
    session.start(SEQS)
    outs = [session.step(torch.full((3, 1), 32, device=DEV), commit=False)]
    for i in range(steps):
        outs.append(session.step(torch.full((3, 2), 5 + i, device=DEV), counts=torch.tensor([2, 2, 1], device=DEV)))
    return outs, session.lengths.clone(), session


@pytest.mark.parametrize("make,cache,ffn_rows,split_rows",
                         [(stress_esm2, "fp32", 0, 0), (stress_esm2, _codec, 0, 0), (stress_esmc, _codec, 0, 0),
                          (stress_esm2, _codec, 256, 0), (stress_esm2, _codec, 0, 256)],
                         ids=["esm2-fp32-cache", "esm2-turbo", "esmc-turbo", "esm2-turbo-ffn-one-launch",
                              "esm2-turbo-split-k"])
def test_fused_step_gives_the_layers_outputs(make, cache, ffn_rows, split_rows, monkeypatch):
    """Also with each block's feed-forward half in one launch (kernels.ffn_step, opt-in by its row bound), and with
    its plain products split along K (kernels.gemm_split, opt-in by its row bound)."""
    _needs_triton()
    import esm_turbo.kernels.ffn_step as ffn
    import esm_turbo.kernels.gemm_split as gemm_split
    monkeypatch.setattr(ffn, "FFN_STEP_ROWS", ffn_rows)
    monkeypatch.setattr(gemm_split, "SPLIT_ROWS", split_rows)
    calls, splits = [], []
    monkeypatch.setattr(ffn, "ffn_step", lambda *a, **k: calls.append(1) or ffn_step(*a, **k))
    split_gemm = gemm_split.split_gemm
    monkeypatch.setattr(gemm_split, "split_gemm", lambda *a, **k: splits.append(a[4]) or split_gemm(*a, **k))
    torch.manual_seed(0)
    engine = TurboEsm(make(layers=2, seed=1).to(DEV).float())
    want, lengths, _ = _steps(engine, False, cache)
    got, got_lengths, _ = _steps(engine, True, cache)
    assert torch.equal(got_lengths, lengths)
    assert bool(calls) == (ffn_rows > 0)
    assert set(splits) == ({"rope", "gelu", "residual"} if split_rows else set())
    for a, b in zip(want, got):
        assert torch.allclose(b.logits, a.logits, atol=1e-4, rtol=1e-4), (b.logits - a.logits).abs().max()
        assert torch.allclose(b.hidden, a.hidden, atol=1e-4, rtol=1e-4), (b.hidden - a.hidden).abs().max()


def test_fused_step_on_a_paged_session():
    _needs_triton()
    engine = TurboEsm(stress_esm2(layers=2, seed=2).to(DEV).float())
    want, _, _ = _steps(engine, False, _codec, steps=2, paged=True)
    got, _, session = _steps(engine, True, _codec, steps=2, paged=True)
    for a, b in zip(want, got):
        assert torch.allclose(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    session.fork(2)  # forks share blocks: both copies of a row step alike
    out = session.step(torch.full((6, 1), 7, device=DEV))
    assert torch.allclose(out.logits[0], out.logits[1], atol=1e-5)
    some = {}
    for fused in (False, True):  # some rows alone, as a design loop steps a group
        engine.fused_step = fused
        some[fused] = session.step(torch.full((2, 1), 8, device=DEV), rows=[1, 4], commit=False).logits
    assert torch.allclose(some[True], some[False], atol=1e-4, rtol=1e-4)


def test_fused_step_applies_only_where_it_should():
    from esm_turbo.model.fused_step import fused_step_applies
    engine = TurboEsm(stress_esm2(layers=1, seed=0))
    assert not fused_step_applies(engine, probed=False)  # CPU: transformers' layers unless forced
    engine.fused_step = True
    assert fused_step_applies(engine, probed=False)
    assert not fused_step_applies(engine, probed=True)  # a probe watches transformers' layers
    from esm_turbo.weights import WeightQuantConfig, quantize_model
    quantized = TurboEsm(quantize_model(stress_esm2(layers=1, seed=0), WeightQuantConfig(bits=4)))
    assert quantized.quantized_weights and not quantized.dense_weights  # 4-bit linears on their own kernels
    from esm_turbo.weights.model import block_linears
    stand_in = stress_esm2(layers=1, seed=0)
    _, parent, attr = block_linears(stand_in)[-1]
    setattr(parent, attr, _StandIn(getattr(parent, attr)))  # a linear that is neither nn.Linear nor 4-bit
    stand_in = TurboEsm(stand_in)
    assert not stand_in.dense_weights and not stand_in.quantized_weights
    assert TurboEsm(stress_esmc(layers=1, seed=0)).dense_weights
    if torch.cuda.is_available():
        engine = TurboEsm(stress_esm2(layers=1, seed=0).cuda().half())
        assert fused_step_applies(engine, probed=False)
        assert not fused_step_applies(TurboEsm(stress_esm2(layers=1, seed=0).cuda()), probed=False)  # fp32
        stand_in.model.cuda().half()
        assert not fused_step_applies(stand_in, probed=False)


class _StandIn(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _quantized(make, seed: int, layers: int = 2):
    from esm_turbo.weights import WeightQuantConfig, quantize_model
    return quantize_model(make(layers=layers, seed=seed), WeightQuantConfig(bits=4, group=32))


def _4bit_kernels(monkeypatch, counts: dict | None = None):
    """The 4-bit linears on their kernels on CPU too (Triton's interpreter), counting the rotation launches."""
    import esm_turbo.kernels.weights as kw
    import esm_turbo.weights.fusion as fusion
    import esm_turbo.weights.linear as linear
    import esm_turbo.weights.step as step
    for module in (linear, fusion, step):
        monkeypatch.setattr(module, "use_kernels", lambda _: True)
    if counts is not None:
        for name in ("rotate_triton", "norm_rotate_triton"):
            counts[name] = 0
            monkeypatch.setattr(kw, name, lambda *a, _n=name, _f=getattr(kw, name):
                                counts.__setitem__(_n, counts[_n] + 1) or _f(*a))


@pytest.mark.parametrize("make", [stress_esm2, stress_esmc])
@pytest.mark.parametrize("kernels", [False, True], ids=["pytorch", "4-bit-kernels"])
def test_fused_step_over_4bit_weights_gives_the_layers_outputs(make, kernels, monkeypatch):
    """4-bit weights: the fused blocks' products (StepProducts at a step's rows) against the 4-bit linears in
    transformers' layers, on the compressed cache, in fp32: the PyTorch paths, or (``kernels``) the 4-bit kernels
    under Triton's interpreter on CPU. On the kernels, ESM-2's fused step rotates in the LayerNorms' launches for
    QKV and FFN up: one rotation launch a product only for the attention output and FFN down."""
    _needs_triton()
    counts = {}
    if kernels:
        _4bit_kernels(monkeypatch, counts)
    engine = TurboEsm(_quantized(make, seed=4).to(DEV).float())
    assert engine.quantized_weights
    want, lengths, _ = _steps(engine, False, _codec)
    counts.update({name: 0 for name in counts})
    got, got_lengths, _ = _steps(engine, True, _codec)
    assert torch.equal(got_lengths, lengths)
    for a, b in zip(want, got):
        assert torch.allclose(b.logits, a.logits, atol=2e-4, rtol=2e-4), (b.logits - a.logits).abs().max()
    if kernels and make is stress_esm2:  # 4 steps of 2 layers
        assert counts == {"rotate_triton": 4 * 2 * 2, "norm_rotate_triton": 4 * 2 * 2}, counts


@pytest.mark.parametrize("kernels", [False, True], ids=["pytorch", "4-bit-kernels"])
def test_step_product_matches_its_linears(kernels, monkeypatch):
    """A StepProduct's every epilogue against its linears' own forwards, one linear and three stacked (on the 4-bit
    kernels too, under Triton's interpreter on CPU)."""
    if kernels:
        _needs_triton()
        _4bit_kernels(monkeypatch)
    from esm_turbo.kernels.gemm import epilogue_reference
    from esm_turbo.weights.step import step_products
    net = _quantized(stress_esm2, seed=5, layers=1).to(DEV)
    layer = net.esm.encoder.layer[0]
    qkv, out, up, down = step_products((layer.attention.self.query, layer.attention.self.key,
                                        layer.attention.self.value, layer.attention.output.dense,
                                        layer.intermediate.dense, layer.output.dense))
    assert qkv.shape == (3 * net.config.hidden_size, net.config.hidden_size)
    x = torch.randn(5, net.config.hidden_size, device=DEV)
    members = [layer.attention.self.query, layer.attention.self.key, layer.attention.self.value]
    with torch.no_grad():
        want = torch.cat([m(x) for m in members], dim=-1)
        assert torch.allclose(qkv(x), want, atol=1e-4, rtol=1e-4)
        dense = out.linears[0]
        y, h = dense(x), torch.randn(5, dense.out_features, device=DEV)
        for epilogue, scale in (("gelu", 1.0), ("residual", 1.0), ("residual", 0.5)):
            got = out(x, epilogue, residual=h, residual_scale=scale)
            assert torch.allclose(got, epilogue_reference(y, epilogue, h, scale), atol=1e-4, rtol=1e-4), epilogue


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 kernels and CUDA graphs need a GPU")
@pytest.mark.parametrize("make", [stress_esm2, stress_esmc])
@pytest.mark.parametrize("quantized", [False, True, "dependent"], ids=["dense", "4-bit", "4-bit-dependent-launches"])
def test_fused_fp16_step_within_the_layers_rounding_and_replays(make, quantized, monkeypatch):
    """In fp16 the fused blocks round where transformers' layers round elsewhere: both are held against an fp32 step
    (twice the layers' error, plus an ulp); a captured step replays the eager one bit for bit. 4-bit weights: the
    same codes in both (the fp32 step's linears on the same kernels). ``dependent``: the products on the register-fed
    kernel, every code requested before it waits for the rotation before it, the rotations and products chained as
    programmatic dependent launches (sm_90; elsewhere plain launches). The replay checked follows one of other
    tokens, so it is not the graph's buffers holding the right values from before that passes it."""
    if quantized == "dependent":
        from esm_turbo.kernels.weights import matmul, rotate
        monkeypatch.setattr(matmul, "LAUNCH_OVERRIDES", dict(pdl=1, mma=1, mma_upfront=1))
        monkeypatch.setattr(rotate, "EARLY_DEPENDENTS", 2)

    def build():
        return _quantized(make, seed=3, layers=4) if quantized else make(layers=4, seed=3)
    ref_engine = TurboEsm(build().cuda())  # fp32 weights: the reference
    ref, _, _ = _steps(ref_engine, False, "fp32", steps=2)
    half = TurboEsm(build().cuda().half())
    layers, _, _ = _steps(half, False, "fp16", steps=2)
    fused, _, session = _steps(half, None, "fp16", steps=2)
    for r, a, b in zip(ref, layers, fused):
        err_layers = (a.hidden - r.hidden).abs().max().item()
        err_fused = (b.hidden - r.hidden).abs().max().item()
        assert err_fused <= 2 * err_layers + 1e-3 * r.hidden.abs().max().item(), (err_fused, err_layers)
    tokens = torch.full((3, 1), 9, device="cuda")
    eager = session.step(tokens, commit=False)
    step = session.capture_step(tokens)
    step.replay(torch.full((3, 1), 5, device="cuda"))  # other values in the graph's buffers: a launch that read its
    replay = step.replay(tokens)  # input before the one before had written it would show
    assert torch.equal(replay.logits, eager.logits)
