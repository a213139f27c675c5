import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esm_turbo.quant.packing import pack_bits, packed_nbytes, unpack_bits


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 3, 4, 8]), lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
       groups=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_roundtrip_any_shape(bits, lead, groups, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 2**bits, (*lead, 8 * groups), generator=g)
    p = pack_bits(x, bits)
    assert p.dtype == torch.uint8
    assert p.shape == (*lead, groups * bits)
    assert p.shape[-1] == packed_nbytes(8 * groups, bits)
    assert torch.equal(unpack_bits(p, bits), x.to(torch.uint8))


@pytest.mark.parametrize("d", [16, 24, 32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_esm_head_dims_large(d, bits):
    x = torch.randint(0, 2**bits, (64, 20, 33, d))
    assert torch.equal(unpack_bits(pack_bits(x, bits), bits), x.to(torch.uint8))


def test_3bit_layout_is_24bit_little_endian():
    x = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    word = sum(int(v) << (3 * i) for i, v in enumerate(x[0]))
    assert pack_bits(x, 3).tolist() == [[word & 255, (word >> 8) & 255, word >> 16]]


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits(torch.zeros(3, 12, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="unsupported bit width"):
        pack_bits(torch.zeros(8, dtype=torch.long), 5)
    with pytest.raises(TypeError, match="integer"):
        pack_bits(torch.zeros(8), 2)
