"""Decode steps through FastEsm's fused blocks (esm_turbo.model.fused_step) against the steps through transformers'
layers: the same logits and hidden states (kernels under Triton's interpreter on CPU, within the flash-attention
rule's spirit on CUDA in fp16), the same cache after committed steps, and the path chosen only where it applies."""

import pytest
import torch

from esm_turbo.bench.synthetic import default_codec
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


@pytest.mark.parametrize("make,cache", [(stress_esm2, "fp32"), (stress_esm2, _codec), (stress_esmc, _codec)],
                         ids=["esm2-fp32-cache", "esm2-turbo", "esmc-turbo"])
def test_fused_step_gives_the_layers_outputs(make, cache):
    _needs_triton()
    torch.manual_seed(0)
    engine = TurboEsm(make(layers=2, seed=1).to(DEV).float())
    want, lengths, _ = _steps(engine, False, cache)
    got, got_lengths, _ = _steps(engine, True, cache)
    assert torch.equal(got_lengths, lengths)
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
    assert not quantized.dense_weights  # 4-bit linears step on their own kernels, in transformers' layers
    from esm_turbo.bench.weights import _Free
    from esm_turbo.weights.model import block_linears
    stand_in = stress_esm2(layers=1, seed=0)
    _, parent, attr = block_linears(stand_in)[-1]
    setattr(parent, attr, _Free(getattr(parent, attr).out_features))  # bench weights' linear that costs nothing
    assert not TurboEsm(stand_in).dense_weights and TurboEsm(stress_esmc(layers=1, seed=0)).dense_weights
    if torch.cuda.is_available():
        engine = TurboEsm(stress_esm2(layers=1, seed=0).cuda().half())
        assert fused_step_applies(engine, probed=False)
        assert not fused_step_applies(TurboEsm(stress_esm2(layers=1, seed=0).cuda()), probed=False)  # fp32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 kernels and CUDA graphs need a GPU")
@pytest.mark.parametrize("make", [stress_esm2, stress_esmc])
def test_fused_fp16_step_within_the_layers_rounding_and_replays(make):
    """In fp16 the fused blocks round where transformers' layers round elsewhere: both are held against an fp32 step
    (twice the layers' error, plus an ulp); a captured step replays the eager one bit for bit."""
    net = make(layers=4, seed=3).cuda()
    ref_engine = TurboEsm(net)  # fp32 weights: the reference
    ref, _, _ = _steps(ref_engine, False, "fp32", steps=2)
    half = TurboEsm(make(layers=4, seed=3).cuda().half())
    layers, _, _ = _steps(half, False, "fp16", steps=2)
    fused, _, session = _steps(half, None, "fp16", steps=2)
    for r, a, b in zip(ref, layers, fused):
        err_layers = (a.hidden - r.hidden).abs().max().item()
        err_fused = (b.hidden - r.hidden).abs().max().item()
        assert err_fused <= 2 * err_layers + 1e-3 * r.hidden.abs().max().item(), (err_fused, err_layers)
    tokens = torch.full((3, 1), 9, device="cuda")
    eager = session.step(tokens, commit=False)
    replay = session.capture_step(tokens).replay()
    assert torch.equal(replay.logits, eager.logits)
