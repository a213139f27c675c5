"""The slots' reference (esm_turbo.quant.slots): each token's k worst-coded values over all its heads, as a
correction in the codes' affine domain."""

import pytest
import torch

from esm_turbo.quant.slots import MAX_VALUES, apply_slots, pick_slots, slot_bits, slot_errors, unpack_slots


def _case(seed: int = 0, lead=(2,), heads: int = 3, tokens: int = 5, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(*lead, heads, tokens, dim, generator=g)
    y_hat = y + 0.1 * torch.randn(*lead, heads, tokens, dim, generator=g)
    scale = torch.rand(heads, dim, generator=g) + 0.5
    return y, y_hat, scale


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("relative", [False, True])
def test_slots_mend_each_tokens_largest_errors_and_nothing_else(k, relative):
    y, y_hat, scale = _case()
    slots = pick_slots(y, y_hat, scale, k, relative)
    assert slots.shape == (2, 5, k) and slots.dtype == torch.int32 and bool((slots >= 0).all())
    mended = apply_slots(y_hat, slots)
    err = slot_errors(y, y_hat, scale, relative)  # [2, H, T, d]
    per_token = err.transpose(-3, -2).reshape(2, 5, -1)
    want = torch.zeros_like(per_token, dtype=torch.bool).scatter_(-1, per_token.topk(k, dim=-1).indices, True)
    want = want.reshape(2, 5, 3, 8).transpose(-3, -2)
    # the picked values come back to fp16's rounding of δ, every other value is untouched
    assert torch.equal(mended[~want], y_hat[~want])
    delta = (y - y_hat)[want]
    assert torch.allclose(mended[want], y_hat[want] + delta.half().float(), atol=0, rtol=0)
    assert bool(((mended - y)[want].abs() <= delta.abs() * 2 ** -10 + 1e-7).all())


def test_slot_words_hold_the_index_and_the_signed_correction():
    y = torch.zeros(1, 4, 2, 64)
    y_hat = y.clone()
    y_hat[0, 3, 1, 63] = 1.5  # δ = -1.5 at head 3, channel 63 of token 1
    y_hat[0, 0, 0, 5] = -0.25  # δ = +0.25 at head 0, channel 5 of token 0
    slots = pick_slots(y, y_hat, torch.ones(4, 64), 1)
    head, chan, delta = unpack_slots(slots, 64)
    assert head[0, :, 0].tolist() == [0, 3] and chan[0, :, 0].tolist() == [5, 63]
    assert delta[0, :, 0].tolist() == [0.25, -1.5]
    assert torch.equal(apply_slots(y_hat, slots), y)


def test_zeroed_slot_words_read_as_no_correction_and_ranking_follows_the_scale():
    y, y_hat, scale = _case(1)
    assert torch.equal(apply_slots(y_hat, torch.zeros(2, 5, 2, dtype=torch.int32)), y_hat)
    assert torch.equal(apply_slots(y_hat, pick_slots(y, y_hat, scale, 0)), y_hat)
    # one channel's scale large enough makes it the worst error of every token, absolute but not relative
    scale = torch.ones(3, 8)
    scale[1, 2] = 1e4
    head, chan, _ = unpack_slots(pick_slots(y, y_hat, scale, 1), 8)
    assert bool((head == 1).all() and (chan == 2).all())
    head, chan, _ = unpack_slots(pick_slots(y, y_hat, scale, 1, relative=True), 8)
    assert not bool(((head == 1) & (chan == 2)).all())


def test_slots_refuse_tokens_of_more_values_than_the_index_holds_and_count_their_bits():
    y = torch.zeros(1, 2, 1, MAX_VALUES)
    with pytest.raises(ValueError, match="15 bits"):
        pick_slots(y, y, torch.ones(2, MAX_VALUES), 1)
    assert slot_bits(1, 20, 16) == 32 / 320 and slot_bits(2, 20, 64) == 64 / 1280
