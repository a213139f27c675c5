import math

import pytest
import torch

from esm_turbo.quant.codec import KVCodec, VectorQuantizer, dense_codec, oblivious_codec
from esm_turbo.quant.validate import validate_codec


@pytest.mark.parametrize("bits,target", [(2, 0.117), (3, 0.034), (4, 0.0095)])
def test_turboquant_mse_on_d128_within_bounds(bits, target):
    row = validate_codec(bits, 128, n=4096)
    assert row["mse"] == pytest.approx(target, rel=0.05)
    assert row["mse_lower_bound"] <= row["mse"] <= row["mse_upper_bound"]
    assert row["within_bounds"]


@pytest.mark.parametrize("bits", [2, 3])
def test_qjl_makes_inner_products_unbiased(bits):
    row = validate_codec(bits, 64, n=8192, seed=1)
    # plain Lloyd-Max shrinks towards the centroids: ⟨x, x̂⟩ < 1 by about the MSE
    assert row["ip_bias"] < -10 * row["ip_bias_stderr"]
    assert row["ip_bias"] == pytest.approx(-row["mse"], rel=0.1)
    # QJL's sketch of the residual removes the bias (within 4 standard errors)
    assert abs(row["ip_bias_qjl"]) < 4 * row["ip_bias_stderr_qjl"]


def test_sign_residual_reduces_error_and_bits_are_exact():
    x = torch.randn(2, 4, 300, 32)
    errs, bits = {}, {}
    for res in ("none", "sign", "qjl"):
        q = VectorQuantizer.oblivious(4, 32, 3, "hadamard", res, seed=0)
        errs[res] = float(((q.decode(q.encode(x)) - x) ** 2).mean())
        bits[res] = q.bits_per_value()
    assert errs["sign"] < 0.4 * errs["none"]
    # 3 index bits + 1 sign bit + a 16-bit norm per 32 values: 4.5, not "3.125"
    assert bits == {"none": 3.5, "sign": 4.5, "qjl": 3 + 0.5 + 1 + 0.5}


def test_codec_part_bytes_match_tensors():
    codec = oblivious_codec(4, 64, 3, residual="sign")
    parts = codec.encode(torch.randn(2, 4, 5, 64), torch.randn(2, 4, 5, 64))
    for name, (shape, dtype) in codec.part_specs().items():
        assert parts[name].shape == (2, 4, 5, *shape) and parts[name].dtype == dtype
    total = sum(p.numel() * p.element_size() for p in parts.values())
    assert total == codec.bytes_per_token() * 2 * 4 * 5


def test_dense_codec_is_lossless():
    c = dense_codec(2, 16)
    k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    k2, v2 = c.decode(c.encode(k, v))
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="multiple of 8"):
        VectorQuantizer(2, 20, 3)
    with pytest.raises(ValueError, match="unsupported bit width"):
        VectorQuantizer(2, 16, 5)
    q = VectorQuantizer.oblivious(2, 16, 3)
    bad = torch.randn(1, 2, 3, 16)
    bad[0, 1, 2, 3] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        q.encode(bad)
    with pytest.raises(TypeError, match="floating-point"):
        q.encode(torch.zeros(1, 2, 3, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expected shape \[\.\.\., 2 heads"):
        q.encode(torch.randn(1, 3, 3, 16))
    with pytest.raises(ValueError, match="on meta but the codec is on cpu"):
        q.encode(torch.randn(1, 2, 3, 16, device="meta"))
    with pytest.raises(ValueError, match="needs calibration"):
        VectorQuantizer.oblivious(2, 16, 3, rotation="svd")
    assert isinstance(KVCodec(q, q).constant_nbytes(), int)
