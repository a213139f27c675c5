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


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_field_layout_generalises_the_fixed_packers(bits):
    """Equal widths give the fixed-width packers' bytes exactly; unequal widths (groups of 8 channels of the
    same total) round-trip, and a layout whose groups differ is refused."""
    from esm_turbo.quant.packing import field_layout, pack_fields, unpack_fields
    x = torch.randint(0, 2**bits, (2, 3, 5, 16), generator=torch.Generator().manual_seed(bits))
    lay = field_layout(torch.full((3, 16), bits))
    assert torch.equal(pack_fields(x, lay, bits), pack_bits(x, bits))
    assert torch.equal(unpack_fields(pack_bits(x, bits), lay, bits), x)
    widths = torch.tensor([[bits + 1, bits - 1] * 4 + [bits] * 8, [0, 2 * bits] + [bits] * 6 + [bits] * 8, [bits] * 16])
    widths = widths.clamp_max(8)
    widths[:, :8] = torch.where(widths[:, :8].sum(-1, keepdim=True) == 8 * bits, widths[:, :8], bits)
    lay = field_layout(widths)
    y = torch.randint(0, 1 << 16, x.shape, generator=torch.Generator().manual_seed(1)) % (1 << widths)[:, None, :]
    assert torch.equal(unpack_fields(pack_fields(y, lay, bits), lay, bits), y)
    with pytest.raises(ValueError, match="groups of 8"):
        field_layout(torch.tensor([[bits] * 8 + [bits + 1] + [bits] * 7]))
