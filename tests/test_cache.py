import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esm_turbo.cache import KVCache
from esm_turbo.quant.codec import dense_codec
from esm_turbo.quant.fit import oblivious_codec

L, H, D = 2, 2, 16

ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 5), st.lists(st.integers(0, 5), min_size=3, max_size=3)),
    st.tuples(st.just("truncate"), st.integers(0, 4)),
    st.tuples(st.just("select"), st.lists(st.integers(0, 2), min_size=3, max_size=3)),
), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(ops=ops, seed=st.integers(0, 1000))
def test_cache_matches_uncompressed_mirror(ops, seed):
    g = torch.Generator().manual_seed(seed)
    comp = KVCache([oblivious_codec(H, D, 4, residual="sign", seed=i) for i in range(L)], 3, capacity=2)
    mirror = KVCache([dense_codec(H, D) for _ in range(L)], 3, capacity=2)
    for op in ops:
        if op[0] == "append":
            s, counts = op[1], torch.tensor([min(c, op[1]) for c in op[2]])
            ks = [torch.randn(3, H, s, D, generator=g) for _ in range(L)]
            vs = [torch.randn(3, H, s, D, generator=g) for _ in range(L)]
            comp.append(ks, vs, counts)
            mirror.append(ks, vs, counts)
        elif op[0] == "truncate":
            comp.truncate(op[1])
            mirror.truncate(op[1])
        else:
            comp.select(op[1])
            mirror.select(op[1])
        assert torch.equal(comp.lengths, mirror.lengths)
    for layer in range(L):
        k1, v1, valid1 = comp.dequantize(layer)
        k2, v2, valid2 = mirror.dequantize(layer)
        assert torch.equal(valid1, valid2)
        m = valid1[:, None, :, None].expand_as(k2)
        if m.any():
            rel_k = ((k1 - k2)[m] ** 2).mean() / (k2[m] ** 2).mean()
            rel_v = ((v1 - v2)[m] ** 2).mean() / (v2[m] ** 2).mean()
            # the 4-bit + sign codec's error is ~1% on average but noisy over a few tokens; a structural
            # mistake (wrong row, position or order) gives ~200% (two independent Gaussians)
            assert rel_k < 0.1 and rel_v < 0.1


def test_memory_report_is_exact():
    cache = KVCache([oblivious_codec(H, D, 3, residual="sign", seed=i) for i in range(L)], 2, capacity=8)
    cache.append([torch.randn(2, H, 5, D)] * L, [torch.randn(2, H, 5, D)] * L, torch.tensor([5, 3]))
    rep = cache.memory_report()
    # per token per layer: K and V each: 3-bit idx (6 B) + sign (2 B) + fp16 norm (2 B), per head
    assert rep.bytes_per_token_per_layer == 2 * H * (6 + 2 + 2)
    assert rep.allocated_bytes == sum(t.numel() * t.element_size() for layer in cache.parts for t in layer.values())
    assert rep.allocated_bytes == cache.capacity * 2 * L * rep.bytes_per_token_per_layer
    assert rep.used_bytes == 8 * L * rep.bytes_per_token_per_layer
    assert rep.ratio_vs_fp32 == pytest.approx(4 * 2 * H * D / rep.bytes_per_token_per_layer)
    assert rep.ratio_vs_fp16 == pytest.approx(rep.ratio_vs_fp32 / 2)
    assert rep.bits_per_value == pytest.approx(5.0)


def test_cache_bad_inputs():
    cache = KVCache([dense_codec(H, D)], 2)
    with pytest.raises(ValueError, match=r"expected \[B=2, H=2, S, d=16\]"):
        cache.write(0, torch.randn(3, H, 1, D), torch.randn(3, H, 1, D))
    with pytest.raises(IndexError, match="layer 3 out of range"):
        cache.write(3, torch.randn(2, H, 1, D), torch.randn(2, H, 1, D))
    with pytest.raises(IndexError, match="row index out of range"):
        cache.select([0, 5])


def test_a_cache_warns_when_its_head_width_takes_the_pytorch_path(monkeypatch):
    """Where the fused GPU kernels run (``ops.use_kernels``), a cache whose heads they cannot take (an eighth of the
    head width not a power of two: ESM-2 35M's heads of 24) says in one line that it is written and read on the
    PyTorch path; heads of 16 say nothing, nor an uncompressed cache at heads of 24 (attended by SDPA)."""
    import warnings

    from esm_turbo import ops
    from esm_turbo.testing import random_turbo_codec
    monkeypatch.setattr(ops, "use_kernels", lambda where: True)
    with pytest.warns(UserWarning, match="heads of 24 channels are written and read on the PyTorch path"):
        cache = KVCache([random_turbo_codec(2, 24, seed=0)], 1, capacity=8)
    assert cache.fused == [False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = KVCache([random_turbo_codec(2, 16, seed=0)], 1, capacity=8)
        KVCache([dense_codec(2, 24, torch.float16)], 1, capacity=8)
    assert cache.fused == [True]
