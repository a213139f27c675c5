"""The codec contract (``esm_turbo.quant.codec.Quantizer`` and ``FusedQuantizer``): a quantizer of a class of its
own, that keeps ``FusedQuantizer``, runs on the fused ops (their references here, the Triton kernels on CUDA) and
agrees there with its own ``decode``; the registered methods' quantizers keep ``Quantizer``."""

import pytest
import torch
from torch import nn

from esm_turbo.cache import KVCache
from esm_turbo.ops import attend_compressed, decode_attention_reference, fused_supported
from esm_turbo.ops.compressed import write_compressed
from esm_turbo.quant.codec import FusedQuantizer, KVCodec, Quantizer, keeps_fused_contract
from esm_turbo.quant.layout import CodeLayout
from esm_turbo.quant.packing import field_layout
from esm_turbo.quant.registry import MethodRequest, build_codecs
from esm_turbo.quant.rotations import affine_forward, affine_inverse
from esm_turbo.quant.tables import lookup_codes, lut_code_parts
from esm_turbo.testing import random_turbo_codec

CUDA = torch.cuda.is_available()


class UniformQuantizer(nn.Module):
    """Evenly spaced levels on [−1, 1] after a per-channel scale, no rotation, no sign residual: nothing of
    :class:`~esm_turbo.quant.codec.VectorQuantizer`, only the contract."""

    def __init__(self, heads: int, dim: int, bits: int, spread: float = 2.5):
        super().__init__()
        self.heads, self.dim, self.bits = heads, dim, bits
        self.register_buffer("rot", torch.eye(dim).expand(heads, dim, dim).clone())
        self.register_buffer("offset", torch.zeros(heads, dim))
        self.register_buffer("scale", torch.full((heads, dim), spread))
        levels = torch.linspace(-1, 1, 2**bits)
        self.register_buffer("centroids", levels.expand(heads, dim, -1).clone())
        self.register_buffer("widths", torch.full((heads, dim), bits, dtype=torch.long))

    def code_layout(self) -> CodeLayout:
        return CodeLayout.of(self.dim, self.widths, self.bits, sign=False)

    def layout(self) -> torch.Tensor:
        return field_layout(self.widths)

    def code_values(self) -> torch.Tensor:
        return self.centroids.half()

    def fused_ready(self) -> bool:
        return True

    def part_specs(self):
        return self.code_layout().part_specs()

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = affine_forward(x, self.rot, self.offset, self.scale)
        return lut_code_parts(y, self.centroids, self.layout(), self.bits, sign=False, combined=False)[0]

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        y = lookup_codes(self.code_values(), parts["idx"], None, self.layout(), self.bits).float()
        return affine_inverse(y, self.rot, self.offset, self.scale)


def _codec(device) -> KVCodec:
    return KVCodec(UniformQuantizer(2, 16, 3), UniformQuantizer(2, 16, 2, spread=2.0)).to(device)


def test_a_quantizer_of_its_own_class_keeps_the_fused_contract():
    codec = _codec("cpu")
    assert isinstance(codec.key, FusedQuantizer) and isinstance(codec.key, Quantizer)
    assert keeps_fused_contract(codec.key) and keeps_fused_contract(random_turbo_codec(2, 16).key)
    assert fused_supported(codec) and fused_supported(codec, need_kernel_shape=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA,
                                                                                        reason="needs CUDA"))])
def test_its_fused_writes_and_attention_are_its_own_decode(device):
    """The fused write stores the codec's own encoding byte for byte; the fused attention over it equals the
    two-step path through the codec's own ``decode`` (within the flash-attention rule on CUDA)."""
    gen = torch.Generator().manual_seed(0)
    codec, batch, t = _codec(device), 3, 24
    k = (torch.randn(batch, 2, t, 16, generator=gen) * 2).to(device)
    v = torch.randn(batch, 2, t, 16, generator=gen).to(device)
    cache = KVCache([codec], batch, capacity=t + 4, device=device)
    assert cache.fused[0] == (device == "cuda")  # the cache writes it with the Triton kernel on CUDA
    parts = {name: torch.zeros_like(buf) for name, buf in cache.parts[0].items()}
    write_compressed(codec, parts, k, v, cache.lengths)
    for name, val in codec.encode(k, v).items():
        assert torch.equal(parts[name][:, :, :t], val), name
    cache.write(0, k, v)
    cache.commit(torch.tensor([t, 7, 0], device=device))
    q = torch.randn(batch, 2, 1, 16, generator=gen).to(device) * 0.5
    k_new, v_new = (torch.randn(batch, 2, 1, 16, generator=gen).to(device) for _ in range(2))
    valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
    fused = attend_compressed(codec, cache.parts[0], cache.lengths, q, k_new, v_new, valid)
    two_step = decode_attention_reference(q, cache, 0, k_new, v_new, valid)
    exact = decode_attention_reference(q.double(), cache, 0, k_new.double(), v_new.double(), valid)
    rule = 2 * (two_step.double() - exact).abs().max().item() + 1e-5
    assert (fused.double() - exact).abs().max().item() <= rule


def test_the_registered_methods_keep_the_quantizer_contract():
    req = MethodRequest(heads=2, dim=16, layers=1)
    for method, fused in (("dense", False), ("fp8", False), ("turboquant", False)):
        codec = build_codecs(method, req)[0][0]
        assert isinstance(codec.key, Quantizer) and isinstance(codec.value, Quantizer), method
        assert fused_supported(codec) is fused, method  # dense and fp8 store values; TurboQuant per-vector norms


def test_the_protocol_check_sees_what_python_3_12_sees():
    """From Python 3.12 a Protocol's ``isinstance`` looks members up with ``inspect.getattr_static``, which cannot see
    module buffers: every member the Protocols state must be found that way on a calibrated quantizer (else the fused
    path is never chosen there)."""
    import inspect
    q = random_turbo_codec(2, 16).key
    for protocol in (Quantizer, FusedQuantizer):
        members = {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))
        for name in members:
            inspect.getattr_static(q, name)  # raises AttributeError where 3.12's isinstance would fail
