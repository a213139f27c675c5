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


def _slot_codec(slots: int = 1, heads: int = 4, dim: int = 16):
    from esm_turbo.quant.codec import KVCodec
    from esm_turbo.testing import random_turbo_codec
    base = random_turbo_codec(heads, dim, 2, 2, seed=3)
    return base, KVCodec(base.key, base.value, slots=slots)


def test_a_codec_with_slots_stores_them_once_per_token_and_decodes_each_tokens_worst_values_back():
    from esm_turbo.quant.slots import apply_slots, pick_slots
    base, codec = _slot_codec(2)
    k, v = (torch.randn(3, 4, 7, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    parts = codec.encode(k, v)
    assert parts["k.slots"].shape == (3, 1, 7, 2) and parts["v.slots"].shape == (3, 1, 7, 2)
    assert codec.token_parts() == {"k.slots", "v.slots"} and codec.part_heads("k.slots", 4) == 1
    assert codec.token_bytes(4) == base.token_bytes(4) + 2 * 2 * 4  # two int32 slots a kind, once a token
    assert codec.bytes_per_token() == base.bytes_per_token()
    k_hat, v_hat = codec.decode(parts)
    for q, x, x_hat, plain in ((codec.key, k, k_hat, base.decode(base.encode(k, v))[0]),
                               (codec.value, v, v_hat, base.decode(base.encode(k, v))[1])):
        y, y_hat = q.to_affine(x), q.decode_affine({n[2:]: t for n, t in base.encode(k, v).items()
                                                    if n.startswith("k." if q is codec.key else "v.")})
        want = q.from_affine(apply_slots(y_hat, pick_slots(y, y_hat, q.scale, 2)))
        assert torch.allclose(x_hat, want, atol=1e-6)
        assert float((x_hat - x).pow(2).sum()) < float((plain - x).pow(2).sum())  # the slots mend what they picked


def test_slots_refuse_quantizers_without_an_affine_domain():
    from esm_turbo.quant.codec import DenseQuantizer, KVCodec
    with pytest.raises(ValueError, match="affine domain"):
        KVCodec(DenseQuantizer(2, 8), DenseQuantizer(2, 8), slots=1)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
def test_caches_hold_the_slot_parts_per_token_and_count_their_bytes(paged, device):
    """A contiguous and a paged cache over a codec with slots: the token parts allocated for one head, the decode of
    what was written equal to the codec's own (on CUDA the fused kernel wrote it: equal but where rounding flips a
    value on a bound), and the memory report counting the slots' bytes once a token."""
    from esm_turbo.cache import KVCache
    from esm_turbo.paged import PagedKVCache
    _, codec = _slot_codec(1)
    codec = codec.to(device)
    cache = (PagedKVCache([codec, codec], 2, capacity=40, device=device, block_size=16) if paged
             else KVCache([codec, codec], 2, capacity=40, device=device))
    assert cache.fused == [device == "cuda"] * 2
    k, v = (torch.randn(2, 4, 20, 16, generator=torch.Generator().manual_seed(s)).to(device) for s in (5, 6))
    for layer in (0, 1):
        cache.write(layer, k, v)
    cache.commit(20)
    parts = cache.layer_parts(1, 20)
    assert parts["k.slots"].shape == (2, 1, 20, 1)
    got = codec.decode(parts)
    want = codec.decode(codec.encode(k, v))
    for a, b in zip(got, want):
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            assert ((a - b).abs() > 1e-3).float().mean() < 0.01 and (a - b).abs().mean() < 1e-3
    report = cache.memory_report()
    assert report.bytes_per_token_per_layer == codec.token_bytes(4)
    assert report.part_bytes_per_token_per_layer["k.slots"] == 4
    if paged:  # whole blocks of 16 (two a row) and 4 bytes a table entry
        assert report.used_bytes == 2 * 2 * 16 * 2 * codec.token_bytes(4) + 4 * 4
        assert cache.pool.layout.row_bytes == 16 * 2 * codec.token_bytes(4)  # a block as the host tier moves it
    else:
        assert report.used_bytes == 2 * 20 * 2 * codec.token_bytes(4)


@pytest.mark.parametrize("device", DEVICES)
def test_the_host_tier_moves_slot_parts_with_their_blocks(device):
    """A paged cache under a device budget of a few blocks, rows stepped one at a time: every row decodes as an
    unbudgeted cache's, the slot parts moved out and back with their blocks (the block-move kernel on CUDA)."""
    from esm_turbo.paged import PagedKVCache
    _, codec = _slot_codec(1)
    cs = [codec.to(device)] * 2
    block = 4
    small = PagedKVCache(cs, 1, capacity=4, device=device, block_size=block,
                         device_budget_bytes=6 * block * sum(c.token_bytes(4) for c in cs))
    free = PagedKVCache(cs, 1, capacity=4, device=device, block_size=block)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 1, 4, 6, 16, generator=gen).to(device)
    for cache in (small, free):
        cache.append(list(kv[0]), list(kv[1]))
        cache.select([0, 0, 0, 0])
    for step in range(8):
        row = step % 4
        kv = torch.randn(2, 2, 1, 4, 3, 16, generator=gen).to(device)
        for cache in (small, free):
            view = cache.view([row])
            view.append(list(kv[0]), list(kv[1]))
            view.give_back()
    assert small.pool.moved["out"] > 0 and small.pool.moved["in"] > 0
    for row in range(4):
        for cache in (small, free):
            view = cache.view([row])
            got = view.layer_parts(1, int(view.lengths[0]))
            view.give_back()
            if cache is small:
                mine = {n: t.clone() for n, t in got.items()}
        assert all(torch.equal(mine[n], got[n]) for n in got)


@pytest.mark.slow
def test_a_session_over_codecs_with_slots_decodes_closer_to_fp32(stress_model):
    """evaluate() over the stress model's default calibration (4.0 bits all-in), with one slot a token and kind: the
    attention error of the layers falls, the decode through the cache (prefill, then teacher-forced steps) comes
    closer to the fp32 cache's on average and in the worst sequence, and the memory report counts the slots."""
    from esm_turbo import TurboEsm, calibrate
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.evaluate import evaluate
    from esm_turbo.model.recipe import recipe
    from esm_turbo.quant.codec import KVCodec
    recs = read_fasta("calibration_data/calibration.fasta")[0][:16]
    ev = read_fasta("calibration_data/evaluation.fasta")[0][::8]
    cal = calibrate(stress_model, recs, recipe("default", index_bits=3), progress=False)
    engine = TurboEsm(stress_model, cal)
    plain = evaluate(engine, ev, max_steps=12, progress=False)
    slotted = evaluate(engine, ev, cache=lambda i, h, d: KVCodec(cal.codecs[i].key, cal.codecs[i].value, slots=1),
                       max_steps=12, progress=False)
    a, b = plain["overall"], slotted["overall"]  # (0.99359, 0.98894) -> (0.99398, 0.98964) when written
    assert b["decode_cos_mean"] > a["decode_cos_mean"] and b["decode_cos_worst_seq"] > a["decode_cos_worst_seq"]
    assert sum(slotted["layers"]["attn_rel_err"]) < sum(plain["layers"]["attn_rel_err"])
    heads, dim = cal.codecs[0].key.heads, cal.codecs[0].key.dim
    assert slotted["memory"]["bytes_per_token_per_layer"] == plain["memory"]["bytes_per_token_per_layer"] + 8
    assert abs(slotted["memory"]["bits_per_value"] - plain["memory"]["bits_per_value"] - 64 / (2 * heads * dim)) < 1e-9


def test_a_calibration_with_slots_keeps_them_through_its_checkpoint(stress_model, tmp_path):
    """calibrate(recipe(..., slots=1)) makes codecs with one slot a token and kind; the checkpoint stores the recipe,
    and Calibration.load rebuilds the same codecs (the same parts, the same decode)."""
    from esm_turbo import Calibration, calibrate
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.recipe import recipe
    recs = read_fasta("calibration_data/calibration.fasta")[0][:8]
    cal = calibrate(stress_model, recs, recipe("default", slots=1, slot_rank="relative"), progress=False)
    assert all(c.slots == 1 and c.relative_slots for c in cal.codecs)
    back = Calibration.load(cal.save(tmp_path / "cal.safetensors"))
    assert back.config.slots == 1 and all(c.slots == 1 and c.relative_slots for c in back.codecs)
    k, v = (torch.randn(1, 4, 9, 16, generator=torch.Generator().manual_seed(s)) for s in (7, 8))
    a, b = cal.codecs[2].encode(k, v), back.codecs[2].encode(k, v)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(x, y) for x, y in zip(cal.codecs[2].decode(a), back.codecs[2].decode(b)))


def test_caches_run_one_slot_in_the_fused_kernels_and_say_where_more_run_on_the_pytorch_path(monkeypatch):
    """Where the kernels run, a codec with one slot a token takes the fused path quietly; with two, the PyTorch path,
    said once."""
    import warnings

    from esm_turbo import ops
    from esm_turbo.cache import KVCache
    _, one = _slot_codec(1)
    _, two = _slot_codec(2)
    monkeypatch.setattr(ops, "use_kernels", lambda device: True)  # as on a GPU with Triton
    with pytest.warns(UserWarning, match="slot"):
        cache = KVCache([two], 1, capacity=4, device="cpu")
    assert cache.fused == [False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KVCache([one], 1, capacity=4, device="cpu").fused == [True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_a_gpu_session_over_slots_steps_in_the_fused_kernels_as_on_the_pytorch_path():
    """A session over codecs with one slot a token, on CUDA: the fused quantize and decode kernels write and read the
    slots (prefill, then steps) and give the PyTorch path's logits; a captured step replays the eager one."""
    from esm_turbo import TurboEsm, calibrate
    from esm_turbo.fasta import Record
    from esm_turbo.model.recipe import recipe
    from esm_turbo.testing import fused_and_reference_steps, stress_esm2
    model = stress_esm2(layers=2, hidden=128, heads=4, seed=0).cuda()
    recs = [Record(f"s{i}", "MKTAYIAKQRQISFVKSHFSRQ" * 3, "x", "") for i in range(4)]
    cal = calibrate(model, recs, recipe("default", slots=1), progress=False)
    fused, reference = fused_and_reference_steps(TurboEsm(model, cal))
    assert (fused - reference).abs().mean() < 2e-3 and (fused - reference).abs().max() < 0.1


def test_a_calibration_narrows_its_least_sensitive_layers_to_pay_for_slots(stress_model, tmp_path):
    """narrow_layers=1 with one slot: the layer whose decode fidelity drops least one index bit narrower takes the
    narrower recipe's codec (3.0 bits all-in: keys-first 3 and 1), the others the recipe's; the memory report counts
    each layer's own bytes exactly; the checkpoint keeps each layer's widths; fewer layers than asked is refused."""
    from esm_turbo import Calibration, calibrate
    from esm_turbo.cache import KVCache
    from esm_turbo.errors import EsmTurboError
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.recipe import recipe
    recs = read_fasta("calibration_data/calibration.fasta")[0][:6]
    cal = calibrate(stress_model, recs, recipe("default", slots=1, narrow_layers=1), progress=False)
    sens = cal.meta["layer_sensitivity"]
    chosen = cal.meta["narrowed_layers"]
    assert len(sens) == 4 and len(chosen) == 1 and sens[chosen[0]] == min(sens)
    bits = [(c.key.bits, c.value.bits) for c in cal.codecs]
    assert bits[chosen[0]] == (3, 1) and all(b == (3, 3) for i, b in enumerate(bits) if i != chosen[0])
    assert cal.meta["layer_index_bits"] == [list(b) for b in bits]
    report = KVCache(cal.codecs, 1, capacity=2, device="cpu").memory_report()
    heads, dim = 4, 16
    token = 3 * (2 * heads * dim * 4 // 8 + 8) + (2 * heads * dim * 3 // 8 + 8)  # bytes: codes + two slot words
    assert report.bytes_per_token == token and abs(report.bits_per_value - 8 * token / (4 * 2 * heads * dim)) < 1e-12
    back = Calibration.load(cal.save(tmp_path / "cal.safetensors"))
    assert [(c.key.bits, c.value.bits) for c in back.codecs] == bits
    k, v = (torch.randn(1, 4, 9, 16, generator=torch.Generator().manual_seed(s)) for s in (7, 8))
    i = chosen[0]
    a, b = cal.codecs[i].encode(k, v), back.codecs[i].encode(k, v)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(EsmTurboError, match="fewer than"):
        calibrate(stress_model, recs, recipe("default", narrow_layers=4), progress=False)


def test_a_four_bit_budget_adds_a_slot_only_at_heads_of_16():
    """--bits 4 gives a slot a token (paid for by narrowed layers) at head_dim 16, where it mends the worst tokens,
    and the uniform recipe at wider heads, where it mends little and costs the fused decode more time a bit."""
    from esm_turbo.model.recipe import SLOT_MAX_HEAD_DIM, for_budget, recipe
    base = recipe("default")
    small = for_budget(base, 4, layers=6, heads=20, dim=SLOT_MAX_HEAD_DIM)
    assert (small.slots, small.narrow_layers, small.slot_rank) == (1, 1, "relative")  # holds with outliers planted
    kept = for_budget(base, 4, layers=6, heads=20, dim=SLOT_MAX_HEAD_DIM, keep=frozenset({"slot_rank"}))
    assert kept.slot_rank == "absolute"  # --slot-rank given: the user's
    predicted = for_budget(recipe("default", predict_values=True), 4, layers=6, heads=20, dim=SLOT_MAX_HEAD_DIM)
    assert (predicted.slots, predicted.narrow_layers) == (0, 0)  # keys-first widths instead (split "auto")
    assert (predicted.resolved().key_index_bits, predicted.resolved().value_index_bits) == (4, 2)
    for dim in (32, 64, 128):
        wide = for_budget(base, 4, layers=33, heads=20, dim=dim)
        assert (wide.slots, wide.narrow_layers) == (0, 0)
        assert (wide.key_index_bits, wide.value_index_bits) == (small.key_index_bits, small.value_index_bits)
