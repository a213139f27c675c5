"""The copy of one contiguous buffer into another on the multiprocessors (esm_turbo.kernels.copy) against
``Tensor.copy_``: bit for bit, under Triton's interpreter on CPU and on the GPU; misshapen buffers refused."""

import pytest
import torch

from esm_turbo.kernels import triton_supported

pytestmark = pytest.mark.skipif(not triton_supported(), reason="needs Triton (its interpreter on CPU)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("nbytes", [64, 4096 * 4, 4096 * 4 * 3 + 192])  # one program, exactly one, a partial last
def test_copy_gives_the_source_bit_for_bit(nbytes):
    from esm_turbo.kernels.copy import copy_words_triton
    gen = torch.Generator().manual_seed(nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(DEV)
    dst = torch.zeros_like(src)
    want = dst.clone().copy_(src)
    assert copy_words_triton(dst, src) is dst
    assert torch.equal(dst, want)
    halves = torch.randn(nbytes // 2, generator=gen).to(DEV, torch.float16)  # any dtype, as its bytes
    out = torch.empty_like(halves)
    assert torch.equal(copy_words_triton(out, halves).view(torch.int16), halves.view(torch.int16))


def test_copy_refuses_buffers_it_cannot_copy_in_words():
    from esm_turbo.kernels.copy import copy_words_triton
    src = torch.zeros(128, dtype=torch.uint8, device=DEV)
    for dst, bad in ((torch.zeros(64, dtype=torch.uint8, device=DEV), src[:64 + 8]),  # sizes differ
                     (torch.zeros(100, dtype=torch.uint8, device=DEV), src[:100]),  # not a multiple of 64 bytes
                     (torch.zeros(64, dtype=torch.uint8, device=DEV), src[8:72])):  # misaligned
        with pytest.raises(ValueError, match="must be contiguous, alike"):
            copy_words_triton(dst, bad)
