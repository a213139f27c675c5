"""Values predicted from every head's decoded keys before the rotary embedding (esm_turbo.quant.predict): the
un-rotation, the fit, the codec that codes the residual, the caches' positions, calibration and its checkpoint."""

import warnings

import pytest
import torch

from esm_turbo.quant.predict import PredictorFit, ValuePredictor, rotary_angles, unrope, within_groups

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rope(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys k [B, H, T, d] at positions [B, T] rotated as ESM-2 rotates them (transformers' apply_rotary_pos_emb,
    through esm_turbo's reference of a layer's rotary step)."""
    from esm_turbo.ops.reference import rope_reference
    cos, sin = rotary_angles(positions, inv_freq)
    flat = k.transpose(1, 2).flatten(2)
    return rope_reference(flat, flat, cos, sin, k.shape[-1])[1]


def _affine_keys_and_values(seed: int, tokens: int, heads: int = 4, dim: int = 16):
    """Post-RoPE keys [2, H, T, d] at positions 0..T−1 whose values are exactly an affine map of every head's keys
    before the rotary embedding (as in ESM-2, where both are projections of the same input), and that map."""
    g = torch.Generator().manual_seed(seed)
    width = heads * dim
    pre = torch.randn(2, tokens, width, generator=g)
    w, b = torch.randn(width, width, generator=g) / width ** 0.5, torch.randn(width, generator=g)
    v = (pre @ w + b).unflatten(-1, (heads, dim)).transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    positions = torch.arange(tokens)[None].expand(2, -1)
    k = _rope(pre.unflatten(-1, (heads, dim)).transpose(1, 2), positions, inv_freq)
    return k, v, w, b, inv_freq


def test_unrope_turns_transformers_rotary_embedding_back_at_any_position():
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(2, 3, 5, 16, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    post = _rope(pre, positions, inv_freq)
    assert (post - pre).abs().max() > 0.1  # it did rotate
    assert torch.allclose(unrope(post, positions, inv_freq), pre, atol=1e-5)
    # positions of one row for every row, and none (0..T−1)
    assert torch.allclose(unrope(post[:1], positions[0], inv_freq), pre[:1], atol=1e-5)
    assert torch.allclose(unrope(post[:1], None, inv_freq), pre[:1], atol=1e-5)


def test_the_fit_recovers_values_that_are_an_affine_map_of_the_keys_before_rope():
    k, v, w, b, inv_freq = _affine_keys_and_values(1, 200)
    fit = PredictorFit(4, 16, inv_freq)
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[1, 150:] = False  # padding is not counted
    fit.add(k, v, valid)
    assert fit.count == 350
    pred = fit.solve()
    assert isinstance(pred, ValuePredictor) and pred.weight.shape == (64, 64)
    # fp16-rounded weights: the residual is small against the values, not zero
    res = (pred(k) - v)[:, :, :150]
    assert res.pow(2).mean() < 1e-4 * v.pow(2).mean()
    # from post-RoPE keys as they are (no un-rotation), the same fit explains far less
    naive = torch.linalg.lstsq(torch.cat([k.transpose(1, 2).flatten(2)[0], torch.ones(200, 1)], 1),
                               v.transpose(1, 2).flatten(2)[0]).solution
    res_naive = torch.cat([k.transpose(1, 2).flatten(2)[0], torch.ones(200, 1)], 1) @ naive \
        - v.transpose(1, 2).flatten(2)[0]
    assert res_naive.pow(2).mean() > 100 * res.pow(2).mean()


def test_a_fit_over_groups_of_heads_maps_each_group_from_its_own_keys():
    k, v, _, _, inv_freq = _affine_keys_and_values(1, 200)
    fit = PredictorFit(4, 16, inv_freq)
    fit.add(k, v, torch.ones(2, 200, dtype=torch.bool))
    grouped = fit.solve(group=2).weight.float().view(2, 32, 2, 32)  # [feature group, ·, value group, ·]
    assert grouped[0, :, 1].abs().max() == 0 and grouped[1, :, 0].abs().max() == 0
    assert grouped[0, :, 0].abs().max() > 0 and grouped[1, :, 1].abs().max() > 0
    assert torch.equal(fit.solve(group=4).weight, fit.solve().weight)  # one group of every head: the full map
    assert fit.solve(group=2).explained < fit.solve().explained


def test_a_predictor_knows_the_groups_of_heads_its_map_keeps_apart():
    """ValuePredictor.group: the fewest consecutive heads whose keys alone each head's values come from (what the
    one-pass walk asks, kernels.decode.predicted.one_pass); a fit over groups of G heads gives G (the last group
    short), a full map every head, one coupling across a boundary the next grouping that holds it."""
    from esm_turbo.kernels.decode.predicted import one_pass, score_heads
    k, v, _, _, inv_freq = _affine_keys_and_values(1, 200)
    fit = PredictorFit(4, 16, inv_freq)
    fit.add(k, v, torch.ones(2, 200, dtype=torch.bool))
    assert fit.solve(group=2).group == 2 and fit.solve(group=1).group == 1 and fit.solve().group == 4
    inv = 1.0 / (10000 ** (torch.arange(0, 8).float() / 8))
    w = torch.zeros(5 * 16, 5 * 16)
    for h in range(5):
        w[h * 16:(h + 1) * 16, (h // 2) * 32:(h // 2) * 32 + 16] = 1.0  # heads 0-1, 2-3, 4 (a short last group)
    assert ValuePredictor(w, torch.zeros(80), inv, 5, 16).group == 2
    w[2 * 16, 16 * 1] = 0.5  # head 2's features into head 1's values: groups of two no longer hold
    pred = ValuePredictor(w, torch.zeros(80), inv, 5, 16)
    assert pred.group == 4
    assert score_heads(5, 16) == 8 and one_pass(pred, 5, 16)
    assert score_heads(20, 64) == 2 and not one_pass(ValuePredictor(torch.ones(80, 80), torch.zeros(80), inv, 5,
                                                                    16), 20, 64)


def test_a_predictor_refuses_tables_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"expected weight \[64, 64\]"):
        ValuePredictor(torch.zeros(64, 32), torch.zeros(64), torch.zeros(8), 4, 16)


def _predicted_codec(seed: int = 0, heads: int = 4, dim: int = 16, slots: int = 0, permuted_keys: bool = True):
    """A random codec (esm_turbo.testing) whose values are coded as what a random predictor leaves; its keys' rotation
    a permutation, as the default recipe calibrates (or a Haar rotation)."""
    from esm_turbo.quant.codec import KVCodec
    from esm_turbo.testing import random_turbo_codec
    base = random_turbo_codec(heads, dim, seed=seed, permuted_keys=permuted_keys)
    g = torch.Generator().manual_seed(seed + 100)
    width = heads * dim
    pred = ValuePredictor(torch.randn(width, width, generator=g) / width, 0.1 * torch.randn(width, generator=g),
                          1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), heads, dim)
    return KVCodec(base.key, base.value, slots=slots, predictor=pred)


@pytest.mark.parametrize("slots", [0, 1])
def test_the_codec_codes_the_residual_and_adds_the_prediction_back(slots):
    """decode(encode(k, v)) of a predicted codec: its keys are the plain codec's; its values are the prediction
    from those decoded keys plus the value quantizer's decode of the residual, at the positions given."""
    from esm_turbo.quant.codec import KVCodec
    codec = _predicted_codec(slots=slots)
    plain = KVCodec(codec.key, codec.value, slots=slots)
    assert codec.needs_positions and not plain.needs_positions
    # no bytes a token; the map is a constant of the layer, fp16 (and the rotary frequencies in fp32)
    assert codec.token_bytes(4) == plain.token_bytes(4)
    assert codec.constant_nbytes() - plain.constant_nbytes() == 64 * 64 * 2 + 64 * 2 + 8 * 4
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 4, 6, 16, generator=g)
    positions = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5]])
    parts = codec.encode(k, v, positions)
    k_hat, v_hat = codec.decode(parts, positions)
    k_plain, _ = plain.decode(plain.encode(k, v))
    assert torch.equal(k_hat, k_plain) and torch.equal(codec.coded_keys(k), k_hat)
    pred = codec.predictor(k_hat, positions)
    residual = plain.decode(plain.encode(k, v - pred))[1]
    assert torch.allclose(v_hat, pred + residual, atol=1e-6)
    # read at other positions, the values come back wrong: the positions are part of the code
    assert (codec.decode(parts)[1] - v_hat)[0].abs().max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_caches_write_a_predicted_codec_at_each_rows_positions(fused, paged, device, monkeypatch):
    """A row written in steps (a prefill, then single tokens, ragged lengths after a select) decodes as the codec
    decodes the whole row from position 0, on the PyTorch path and through the fused write (``write_predicted``:
    the quantize kernel on CUDA, its reference elsewhere), which a CUDA cache takes when the walk is opted into
    (unless ``ESM_TURBO_PREDICTED_WALK=0``); with slots it does not."""
    from esm_turbo import ops
    from esm_turbo.cache import KVCache
    from esm_turbo.ops.compressed import fused_supported
    from esm_turbo.paged import PagedKVCache
    codec = _predicted_codec().to(device)
    assert fused_supported(codec, need_kernel_shape=True)
    assert not fused_supported(_predicted_codec(slots=1))
    monkeypatch.setenv("ESM_TURBO_PREDICTED_WALK", "0")
    assert not ops.kernel_path(codec, torch.device(device))  # turned off
    monkeypatch.delenv("ESM_TURBO_PREDICTED_WALK", raising=False)  # on by default

    def make(c):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            made = (PagedKVCache([c], 2, capacity=8, device=device, block_size=4) if paged
                    else KVCache([c], 2, capacity=8, device=device))
        return made, any("PyTorch path" in str(w.message) for w in caught)

    cache, warned = make(codec)
    assert not warned and cache.fused == [device == "cuda"]
    assert make(_predicted_codec(slots=1).to(device))[1] == (device == "cuda")
    cache.fused = [fused]
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 4, 11, 16, generator=g).to(device), torch.randn(2, 4, 11, 16, generator=g).to(device)
    cache.append([k[:, :, :5]], [v[:, :, :5]])
    for t in range(5, 9):
        cache.append([k[:, :, t:t + 1]], [v[:, :, t:t + 1]])
    k_hat, v_hat, valid = cache.dequantize(0)
    want = codec.decode(codec.encode(k[:, :, :9], v[:, :, :9]))
    assert bool(valid.all())
    assert torch.allclose(k_hat, want[0], atol=1e-6) and torch.allclose(v_hat, want[1], atol=1e-5)
    cache.truncate(torch.tensor([2, 0], device=device))  # rows now 7 and 9 tokens long: the next token's position
    cache.append([k[:, :, 9:10]], [v[:, :, 9:10]])
    k_hat, v_hat, valid = cache.dequantize(0)
    row0 = torch.cat([k[:1, :, :7], k[:1, :, 9:10]], 2), torch.cat([v[:1, :, :7], v[:1, :, 9:10]], 2)
    want0 = codec.decode(codec.encode(*row0))
    assert torch.allclose(v_hat[:1, :, :8], want0[1], atol=1e-5)
    want1 = codec.decode(codec.encode(k[1:, :, :10], v[1:, :, :10]))
    assert torch.allclose(v_hat[1:], want1[1], atol=1e-5)


@pytest.mark.slow
def test_a_calibration_with_predicted_values_codes_them_closer_and_keeps_them_through_its_checkpoint(
        stress_model, tmp_path):
    """calibrate(predict_values=True) at 3.0 bits all-in: every layer gets a predictor, the values of held-out
    sequences come back closer than the plain recipe's (the keys unchanged), the decode through the cache comes
    closer to the fp32 cache's, and the checkpoint (format 6) rebuilds the same codecs; a checkpoint missing a
    predictor table is refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from esm_turbo import Calibration, TurboEsm, calibrate
    from esm_turbo.errors import CheckpointError
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.calibrate import _run, token_batches
    from esm_turbo.model.evaluate import evaluate
    from esm_turbo.model.recipe import recipe
    recs = read_fasta("calibration_data/calibration.fasta")[0][:16]
    ev = read_fasta("calibration_data/evaluation.fasta")[0][::8]
    plain = calibrate(stress_model, recs, recipe("default", index_bits=2), progress=False)
    pred = calibrate(stress_model, recs, recipe("default", index_bits=2, predict_values=True), progress=False)
    assert all(c.predictor is not None for c in pred.codecs) and all(c.predictor is None for c in plain.codecs)
    assert pred.codecs[0].bytes_per_token() == plain.codecs[0].bytes_per_token()  # the same bits a token
    err = torch.zeros(2, 2, dtype=torch.float64)

    def record(layer, q, k, v, valid):
        for i, cal in enumerate((plain, pred)):
            k_hat, v_hat = cal.codecs[layer].decode(cal.codecs[layer].encode(k, v))
            m = valid[:, None, :, None]
            err[i, 0] += ((k_hat - k) * m).pow(2).sum()
            err[i, 1] += ((v_hat - v) * m).pow(2).sum()

    _run(TurboEsm(stress_model), token_batches(ev, 4096), record, "", False)
    assert torch.allclose(err[0, 0], err[1, 0])  # the keys are the plain recipe's
    assert err[1, 1] < 0.5 * err[0, 1]  # values at least twice closer
    a, b = (evaluate(TurboEsm(stress_model, cal), ev, max_steps=12, progress=False)["overall"]
            for cal in (plain, pred))
    assert b["decode_cos_mean"] > a["decode_cos_mean"] and b["decode_cos_worst_seq"] > a["decode_cos_worst_seq"]
    path = pred.save(tmp_path / "cal.safetensors")
    with safe_open(str(path), framework="pt") as fh:
        import json
        assert json.loads(fh.metadata()["esm_turbo"])["format_version"] == 6
        tensors = {n: fh.get_tensor(n) for n in fh.keys()}
    back = Calibration.load(path)
    assert back.config.predict_values
    k, v = (torch.randn(1, 4, 9, 16, generator=torch.Generator().manual_seed(s)) for s in (7, 8))
    positions = torch.arange(3, 12)
    x, y = pred.codecs[1].encode(k, v, positions), back.codecs[1].encode(k, v, positions)
    assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)
    assert all(torch.equal(p, q) for p, q in zip(pred.codecs[1].decode(x, positions),
                                                   back.codecs[1].decode(y, positions)))
    del tensors["layers.1.predict.weight"]
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
    save_file(tensors, str(tmp_path / "cut.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match="layer 1: value predictor tables missing"):
        Calibration.load(tmp_path / "cut.safetensors")


def test_predicted_values_refuse_a_shared_lut_and_a_rotary_they_would_not_undo(stress_model):
    from types import SimpleNamespace

    from esm_turbo import TurboEsm, calibrate
    from esm_turbo.errors import EsmTurboError
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.calibrate import check_rotary
    from esm_turbo.model.recipe import recipe
    recs = read_fasta("calibration_data/calibration.fasta")[0][:2]
    with pytest.raises(EsmTurboError, match="separate K and V LUTs"):
        calibrate(stress_model, recs, recipe("shared-lut", predict_values=True), progress=False)
    engine = TurboEsm(stress_model)
    check_rotary(engine)  # ESM-2's own passes
    rotary = engine.rotary

    class Scaled(torch.nn.Module):  # a scaled rotary (as some long-context variants): not what unrope undoes
        inv_freq = rotary.inv_freq

        def forward(self, x, positions):
            return tuple(0.5 * t for t in rotary(x, positions))

    fake = SimpleNamespace(rotary=Scaled(), heads=engine.heads, head_dim=engine.head_dim, device=engine.device)
    with pytest.raises(EsmTurboError, match="not the standard one"):
        check_rotary(fake)
    fake.rotary = torch.nn.Module()
    with pytest.raises(EsmTurboError, match="no inv_freq"):
        check_rotary(fake)


def test_an_esmc_calibration_predicts_its_values_too():
    """ESM C's keys pass a LayerNorm before the rotary embedding, so the prediction is not exact there; the fit and
    the codec still run (the rotary convention checked) and code the values of the stand-in at least twice closer
    than the plain recipe (14x when written)."""
    from esm_turbo import TurboEsm, calibrate
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.calibrate import _run, token_batches
    from esm_turbo.model.recipe import recipe
    from esm_turbo.testing import stress_esmc
    model = stress_esmc(layers=2)
    recs = read_fasta("calibration_data/calibration.fasta")[0][:6]
    cals = [calibrate(model, recs, recipe("default", index_bits=2, predict_values=p), progress=False)
            for p in (False, True)]
    err = [0.0, 0.0]

    def record(layer, q, k, v, valid):
        for i, cal in enumerate(cals):
            err[i] += float(((cal.codecs[layer].decode(cal.codecs[layer].encode(k, v))[1] - v)
                             * valid[:, None, :, None]).pow(2).sum())

    _run(TurboEsm(model), token_batches(read_fasta("calibration_data/evaluation.fasta")[0][:4], 4096), record, "",
         False)
    assert err[1] < 0.5 * err[0]


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("unstored", [False, True])
def test_reference_attention_adds_the_prediction_once_a_row_as_predicting_every_value_would(window, unstored):
    """decode_attention_reference over a predicted codec (Σ p·f mapped once) equals attention over the fully decoded
    values, with a KIVI window laid over the recent tokens too; the split values are V̂ less the prediction (None
    where the values are not stored and no window lies over them: no zero residual built)."""
    from esm_turbo.cache import KVCache
    from esm_turbo.ops.reference import attend, decode_attention_reference
    from esm_turbo.quant.codec import KVCodec
    from esm_turbo.quant.predict import Unstored
    base = _predicted_codec()
    value = Unstored(base.value.heads, base.value.dim) if unstored else base.value
    codec = KVCodec(base.key, value, window=window, predictor=base.predictor)
    cache = KVCache([codec], 3, capacity=4, device="cpu")
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(3, 4, 12, 16, generator=g), torch.randn(3, 4, 12, 16, generator=g)
    cache.append([k], [v], counts=torch.tensor([12, 7, 10]))
    q, k_new, v_new = (torch.randn(3, 4, 2, 16, generator=g) for _ in range(3))
    new_valid = torch.tensor([[True, True], [True, False], [True, True]])
    got = decode_attention_reference(q, cache, 0, k_new, v_new, new_valid)
    k_hat, v_hat, valid = cache.dequantize(0)
    want = attend(q, k_hat, v_hat, valid, k_new, v_new, new_valid)
    assert torch.allclose(got, want, atol=1e-5)
    k_split, r_hat, valid_split = cache.dequantize(0, split_values=True)
    assert torch.equal(k_split, k_hat) and torch.equal(valid_split, valid)
    if unstored and not window:
        assert r_hat is None and torch.allclose(codec.predictor(k_hat), v_hat, atol=1e-5)
    else:
        assert torch.allclose(r_hat + codec.predictor(k_hat), v_hat, atol=1e-5)


def _predicted_cache(heads: int, dim: int, lengths: list[int], block_size: int = 0, seed: int = 0,
                     device: str = "cpu", unstored: bool = False, **codec_args):
    """A one-layer cache on ``device`` (paged with ``block_size``) of a random predicted codec (``esm_turbo.testing``'s
    ``random_turbo_codec`` with ``codec_args``; ``unstored``: values not stored) holding ragged random keys and
    values written at their positions (on CUDA by the fused write); the keys' rotation a permutation, as calibrated
    by the default recipe (the fused walk's condition)."""
    from esm_turbo.quant.predict import Unstored
    from esm_turbo.cache import KVCache
    from esm_turbo.paged import PagedKVCache
    from esm_turbo.quant.codec import KVCodec
    from esm_turbo.testing import random_turbo_codec
    base = random_turbo_codec(heads, dim, seed=seed, **{"permuted_keys": True, **codec_args})
    g = torch.Generator().manual_seed(seed + 100)
    width = heads * dim
    pred = ValuePredictor(torch.randn(width, width, generator=g) / width, 0.1 * torch.randn(width, generator=g),
                          1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), heads, dim)
    codec = KVCodec(base.key, Unstored(heads, dim) if unstored else base.value, predictor=pred).to(device)
    t = max(lengths)
    cache = (PagedKVCache([codec], len(lengths), capacity=t + 4, device=device, block_size=block_size) if block_size
             else KVCache([codec], len(lengths), capacity=t + 4, device=device))
    k = (torch.randn(len(lengths), heads, t, dim, generator=g) * 2).to(device)
    v = torch.randn(len(lengths), heads, t, dim, generator=g).to(device)
    cache.append([k], [v], counts=torch.tensor(lengths, device=device))
    return codec, cache


def _walk_args(codec, cache, s: int, block_size: int, codec_args: dict, predictor=None) -> tuple:
    """The arguments of predicted_attention_reference / _triton for one step of ``s`` new tokens a row over
    ``cache``'s one layer (``_predicted_cache``): random queries and new keys and values, the last new token of row 0
    invalid and, where the last row holds nothing, all of its (``s`` > 1); the layer's packed codes (no values where
    ``codec_args`` asked none stored), ``predictor`` (default the codec's) and the block table."""
    from esm_turbo.ops.compressed import cached_codes
    heads, dim = codec.key.heads, codec.key.dim
    lengths, device = cache.lengths, cache.lengths.device
    g = torch.Generator().manual_seed(9)
    b = len(lengths)
    q = (torch.randn(b, heads, s, dim, generator=g) * dim ** -0.5 * 3).to(device)
    k_new, v_new = (torch.randn(b, heads, s, dim, generator=g).to(device) for _ in range(2))
    new_valid = torch.ones(b, s, dtype=torch.bool, device=device)
    if s > 1:
        new_valid[0, -1] = False
        new_valid[-1] = bool(lengths[-1] > 0)  # a row with nothing to attend to: zeros
    parts = cache.pool.dev[0] if block_size else cache.parts[0]
    pages = cache.pages() if block_size else (None, 0)
    keys = cached_codes(codec, parts, "k")
    values = None if codec_args.get("unstored") else cached_codes(codec, parts, "v")
    return q, k_new, v_new, new_valid, lengths, keys, values, predictor or codec.predictor, *pages


@pytest.mark.parametrize("heads,dim,lengths,s,block_size,splits,codec_args", [
    (4, 16, [37, 5], 1, 0, 2, {}),
    (4, 16, [37, 0], 2, 8, 3, {}),  # a row with nothing cached nor new to attend to, paged
    (6, 32, [20, 33], 1, 16, None, {"grid": True}),  # the default's grid codes
    (2, 64, [40, 17], 1, 0, None, {"residual": "none", "shared": False}),  # a layout row a head
    (20, 32, [19, 6], 1, 0, None, {"grid": True}),  # 150M's heads: five chunks of four feature heads
    (20, 64, [23, 9, 1], 1, 0, 2, {}),  # 650M's heads: ten chunks of two
    (2, 128, [9, 4], 1, 0, None, {}),  # 15B's width: one chunk of two feature heads beside 16 query heads
    (20, 16, [30, 7], 1, 0, None, {"unstored": True}),  # values not stored: the keys alone
    (20, 64, [12, 5], 2, 16, 2, {"unstored": True}),
    (40, 64, [21, 6], 1, 0, None, {"grid": True}),  # 3B's heads: 64 query heads, twenty chunks of two
    (40, 128, [5], 1, 0, None, {"unstored": True}),  # 15B's: a head a chunk
    (4, 16, [300, 70], 1, 0, 3, {}),  # splits of two score tiles, the tiles' maxima growing along a row
    (20, 32, [150, 9], 1, 16, 2, {"unstored": True, "grid": True}),  # paged, a split of three score tiles
])
def test_the_fused_walk_over_predicted_values_matches_its_reference(heads, dim, lengths, s, block_size, splits,
                                                                     codec_args):
    """predicted_attention_triton (Triton's interpreter on CPU, the kernel on CUDA) against
    predicted_attention_reference: keys of every head decoded once a tile, the pooled features, the splits merged
    with the step's own tokens (the pooled products' inputs in fp16, as flash attention's P·V)."""
    import triton
    from esm_turbo.kernels.decode.predicted import feature_chunk, fits
    from esm_turbo.ops.predicted import predicted_attention_reference, predicted_attention_triton
    assert fits(heads, dim)
    assert feature_chunk(heads, dim) == {(20, 16): (8, 3), (20, 32): (4, 5), (20, 64): (2, 10), (40, 64): (2, 20),
                                         (40, 128): (1, 40)}.get((heads, dim), (triton.next_power_of_2(heads), 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codec, cache = _predicted_cache(heads, dim, lengths, block_size, device=device, **codec_args)
    args = _walk_args(codec, cache, s, block_size, codec_args)
    new_valid = args[3]
    want = predicted_attention_reference(*args)
    got = predicted_attention_triton(*args, splits=splits)
    if not new_valid[-1].any():
        assert not want[-1].any() and not got[-1].any()
    assert torch.allclose(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("heads,dim,group,lengths,s,block_size,splits,codec_args", [
    (20, 16, 8, [70, 7], 1, 0, 2, {}),  # 8M's heads in the scores walk's groups of eight, the last group short
    (4, 16, 2, [37, 0], 2, 8, 3, {}),  # groups within one walk group; a row with nothing to attend to, paged
    (20, 32, 4, [130, 6], 1, 16, None, {"grid": True, "unstored": True}),  # 150M's: groups of four, paged
    (20, 64, 2, [23, 9, 1], 1, 0, 2, {"unstored": True}),  # 650M's: pairs, the keys alone
    (20, 64, 1, [40, 17], 1, 0, None, {"grid": True}),  # a head's own keys alone
    (2, 128, 1, [9, 4], 1, 0, None, {}),  # 15B's width: a head a walk group
])
def test_the_one_pass_walk_over_a_grouped_predictor_matches_its_reference(heads, dim, group, lengths, s, block_size,
                                                                        splits, codec_args, monkeypatch):
    """A predictor whose map keeps within the scores walk's groups of heads (PredictorFit.solve(group=G), G dividing
    128 / d): one walk that scores and pools its group's features (no pooling walk, no weights written) and its
    merge — what predicted_attention_triton takes for the keys alone, and on request with a coded residual — against
    predicted_attention_reference and against the two walks (Triton's interpreter on CPU, the kernels on CUDA)."""
    from esm_turbo.kernels.decode import predicted as kernels
    from esm_turbo.ops.predicted import predicted_attention_reference, predicted_attention_triton
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codec, cache = _predicted_cache(heads, dim, lengths, block_size, device=device, **codec_args)
    pred = ValuePredictor(30 * within_groups(codec.predictor.weight.float(), heads, dim, group),
                          codec.predictor.bias.float(), codec.predictor.inv_freq, heads, dim)
    assert pred.group == group and kernels.one_pass(pred, heads, dim) and not kernels.one_pass(pred, heads, dim, True)
    args = _walk_args(codec, cache, s, block_size, codec_args, pred)
    new_valid = args[3]
    want = predicted_attention_reference(*args)
    two = predicted_attention_triton(*args, splits=splits, grouped=False)
    monkeypatch.setattr(kernels, "_pool_kernel", _NoLaunch())
    got = predicted_attention_triton(*args, splits=splits, grouped=True)  # a coded residual too: asked for
    scale = want.abs().max().item()
    assert torch.allclose(got, want, atol=2e-3 * scale, rtol=0)
    assert torch.allclose(got, two, atol=1e-3 * scale, rtol=0)
    if not new_valid[-1].any():
        assert not got[-1].any()


class _NoLaunch:
    """A kernel that must not be launched: indexing it (``kernel[grid]``) fails."""

    def __getitem__(self, grid):
        raise AssertionError(f"a launch of a kernel that the path must not take (grid {grid})")


@pytest.mark.parametrize("heads,dim,block_size,codec_args", [
    (4, 16, 0, {}),
    (6, 32, 4, {"grid": True}),  # paged, grid codes
    (20, 64, 0, {"residual": "none", "shared": False}),  # a layout row a head
])
def test_the_write_reads_back_its_keys_features_in_one_launch_as_the_codec_decodes_them(heads, dim, block_size,
                                                                                        codec_args):
    """predicted_features_triton (Triton's interpreter on CPU, the kernel on CUDA): the new tokens' keys as the cache
    holds them, decoded, turned back from their rotation and the rotary embedding — the features the write predicts
    the values from — equal ValuePredictor.features of the codec's own decode at each row's positions (bit for bit
    on CPU: the same operations, no contraction)."""
    from esm_turbo.kernels.decode.predicted import predicted_features_triton
    from esm_turbo.ops.compressed import cached_codes, gather_rows
    from esm_turbo.ops.predicted import codec_walk_tables, rotary_table
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codec, cache = _predicted_cache(heads, dim, [13, 7], block_size, device=device, **codec_args)
    parts = cache.pool.dev[0] if block_size else cache.parts[0]
    pages = cache.pages()[0] if block_size else None
    pos, s = torch.tensor([10, 4], device=device), 3  # the last three tokens of each row
    stored = {name[2:]: gather_rows(t, pos, s, pages) for name, t in parts.items() if name.startswith("k.")}
    want = codec.predictor.features(codec.key.decode(stored), pos[:, None] + torch.arange(s, device=device))
    keys = cached_codes(codec, parts, "k")
    trig = rotary_table(codec.predictor, 64)
    assert rotary_table(codec.predictor, 64) is trig  # kept a predictor
    got = predicted_features_triton(keys, pos, s, codec_walk_tables(codec)[0], trig, pages)
    assert got.shape == want.shape == (2, s, heads * dim)
    assert torch.allclose(got, want, atol=1e-6 * want.abs().max().item(), rtol=0)
    if device == "cpu":
        assert torch.equal(got, want)


@pytest.mark.parametrize("block_size", [0, 4])
def test_the_fused_write_packs_keys_and_residual_a_kind_a_launch_as_the_reference_path(block_size, monkeypatch):
    """write_predicted with the kernels on (Triton's interpreter on CPU, the kernels on CUDA): the keys' programs of
    the quantize kernel, the features read back in one launch, then the values' programs alone on the residual;
    the bytes the reference path writes (but where a rounding flips a value on a boundary), contiguous and paged."""
    from esm_turbo.ops import predicted
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 4, 3, 16, generator=g).to(device) for _ in range(2))
    pos = torch.tensor([10, 4], device=device)
    written = []
    for kernels in (False, True):
        codec, cache = _predicted_cache(4, 16, [13, 7], block_size, device=device)
        parts = cache.pool.dev[0] if block_size else cache.parts[0]
        pages = cache.pages()[0] if block_size else None
        monkeypatch.setattr(predicted, "use_kernels", lambda x, on=kernels: on)
        predicted.write_predicted(codec, parts, k, v, pos, pages)
        written.append({name: t.clone() for name, t in parts.items()})
    for name, want in written[0].items():
        got = written[1][name]
        assert got.any() and (got != want).float().mean() < 2e-3, name

def test_the_fused_walk_refuses_heads_it_cannot_hold():
    """Layers past what a program holds (pooled sums of more than 64 query heads of 128), widths that are no power of
    two (35M's heads of 24) and keys whose rotation is not a permutation of their channels are read on the PyTorch
    path, with slots too; every other ESM-2 head shape takes the walks (3B's and 15B's 40 heads too)."""
    from esm_turbo.kernels.decode.predicted import fits
    from esm_turbo.ops.compressed import fused_supported
    assert fits(20, 16) and fits(20, 32) and fits(20, 64) and fits(40, 64) and fits(40, 128) and fits(8, 32)
    assert not fits(80, 128) and not fits(20, 24) and not fits(16, 8)
    assert fused_supported(_predicted_codec(heads=20, dim=16), need_kernel_shape=True)
    assert fused_supported(_predicted_codec(heads=40, dim=64), need_kernel_shape=True)
    assert not fused_supported(_predicted_codec(heads=20, dim=16, permuted_keys=False), need_kernel_shape=True)
    assert not fused_supported(_predicted_codec(heads=20, dim=24), need_kernel_shape=True)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("stored", [True, False])
@pytest.mark.parametrize("group", ["all", "walk"])
def test_a_gpu_session_over_predicted_values_steps_in_the_fused_kernels_as_on_the_pytorch_path(stored, paged, group,
                                                                                                 monkeypatch):
    """A session calibrated with predict_values (the residual coded at 3.0 bits, or the keys alone at 2.0; from every
    head's keys, or from the walk's groups of heads: the keys alone then in one pass), on CUDA: the fused write and
    walk (prefill, then steps; a paged session too) give the PyTorch path's logits, and a captured step replays the
    eager one."""
    from esm_turbo import TurboEsm, calibrate
    from esm_turbo.fasta import Record
    from esm_turbo.model.recipe import recipe
    from esm_turbo.testing import fused_and_reference_steps, stress_esm2
    monkeypatch.setenv("ESM_TURBO_PREDICTED_WALK", "1")
    model = stress_esm2(layers=2, hidden=256, heads=16, seed=0).cuda()
    recs = [Record(f"s{i}", "MKTAYIAKQRQISFVKSHFSRQ" * 3, "x", "") for i in range(4)]
    widths = dict(index_bits=2) if stored else dict(key_index_bits=3, value_index_bits=0)
    cal = calibrate(model, recs, recipe("default", predict_values=True, predict_group=group, **widths),
                    progress=False)
    if group == "walk":  # the keys alone in one pass: no pooling walk
        from esm_turbo.kernels.decode import predicted
        assert all(c.predictor.group == 8 for c in cal.codecs)
        if not stored:
            monkeypatch.setattr(predicted, "_pool_kernel", _NoLaunch())
    fused, reference = fused_and_reference_steps(TurboEsm(model, cal), paged=paged)
    assert (fused - reference).abs().mean() < 2e-3 and (fused - reference).abs().max() < 0.1


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_values_not_stored_come_back_as_the_prediction_from_the_keys(fused, paged):
    """A codec whose values are not stored (``Unstored``: no value bytes a token) writes the keys alone (the PyTorch
    path, or the fused write's keys-only pack) and decodes each value as the prediction from the decoded keys at its
    position; attention over it adds no residual."""
    from esm_turbo.ops.reference import attend, decode_attention_reference
    from esm_turbo.quant.predict import Unstored
    codec, cache = _predicted_cache(4, 16, [9, 6], block_size=4 if paged else 0, unstored=True)
    assert isinstance(codec.value, Unstored) and codec.bytes_per_token() == codec.key.code_layout().all_in_bits * 2
    assert cache.memory_report().bits_per_value == codec.key.code_layout().all_in_bits / 2
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 4, 5, 16, generator=g)
    cache.fused = [fused]
    cache.append([k], [v])
    k_hat, v_hat, valid = cache.dequantize(0)
    positions = torch.stack([torch.arange(9, 14), torch.arange(6, 11)])
    want_k = codec.coded_keys(k)
    assert torch.allclose(k_hat[0, :, 9:14], want_k[0], atol=1e-6)
    assert torch.allclose(v_hat[1, :, 6:11], codec.predictor(want_k, positions)[1], atol=1e-5)
    q, k_new, v_new = (torch.randn(2, 4, 1, 16, generator=g) for _ in range(3))
    ones = torch.ones(2, 1, dtype=torch.bool)
    got = decode_attention_reference(q, cache, 0, k_new, v_new, ones)
    assert torch.allclose(got, attend(q, k_hat, v_hat, valid, k_new, v_new, ones), atol=1e-5)


def test_a_keys_alone_budget_calibrates_and_auto_keeps_the_keys_widths(stress_model):
    """--bits 2 with predict_values stores the keys alone (3 + sign, values not stored: 2.0 bits all-in); --preset
    auto over it calibrates every candidate at those widths (keys-first would repeat the default) and keeps one;
    slots or narrowed layers over values not stored are refused in one line."""
    from esm_turbo import calibrate
    from esm_turbo.cache import KVCache
    from esm_turbo.errors import EsmTurboError
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.holdout import calibrate_held_out
    from esm_turbo.model.recipe import for_budget, recipe
    from esm_turbo.quant.predict import Unstored
    cfg = for_budget(recipe("default", predict_values=True), 2, layers=4, heads=4, dim=16)
    assert (cfg.key_index_bits, cfg.value_index_bits) == (3, 0)
    at3, at4 = (for_budget(recipe("default", predict_values=True), b, 4, 4, 16).resolved() for b in (3, 4))
    assert (at3.key_index_bits, at3.value_index_bits) == (4, 0)  # 2.5 bits: keys take at most 4 index bits
    assert (at4.key_index_bits, at4.value_index_bits) == (4, 2)  # a split again
    esmc3 = for_budget(recipe("default", predict_values=True), 3, 4, 4, 16, family="esmc").resolved()
    assert esmc3.value_index_bits > 0  # ESM C: the residual coded at 3 bits (it measured better there)
    recs = read_fasta("calibration_data/calibration.fasta")[0][:10]
    held = calibrate_held_out(stress_model, recs, cfg, preset="auto", holdout=0.3, progress=False)
    assert set(held.candidates) == {"default", "query-keys", "no-rotation"}
    cal = held.calibration
    assert all(isinstance(c.value, Unstored) for c in cal.codecs)
    assert KVCache(cal.codecs, 1, capacity=1, device="cpu").memory_report().bits_per_value == 2.0
    with pytest.raises(EsmTurboError, match="values not stored"):
        calibrate(stress_model, recs, recipe("default", predict_values=True, key_index_bits=3, value_index_bits=0,
                                             slots=1), progress=False)
    with pytest.raises(ValueError, match="needs predict_values"):
        recipe("default", key_index_bits=3, value_index_bits=0).resolved()


def test_the_keys_alone_fit_the_keys_tables_of_a_plain_calibration_and_no_value_tables(stress_model, monkeypatch):
    """Values not stored: calibrate fits the keys' tables alone (one quantizer a layer, no value tables), and they
    are the tables a plain calibration at those key widths fits (the keys do not depend on the values' fit)."""
    from esm_turbo import calibrate
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model import calibrate as calibrate_module
    from esm_turbo.model.recipe import recipe
    recs = read_fasta("calibration_data/calibration.fasta")[0][:6]
    fitted = []
    real_fit = calibrate_module.fit_quantizer

    def counting_fit(*args, **kwargs):
        fitted.append(args[2].bits)
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "fit_quantizer", counting_fit)
    alone = calibrate(stress_model, recs, recipe("default", predict_values=True, key_index_bits=3, value_index_bits=0),
                      progress=False)
    assert fitted == [3] * len(alone.codecs)
    plain = calibrate(stress_model, recs, recipe("default", key_index_bits=3, value_index_bits=3), progress=False)
    for a, b in zip(alone.codecs, plain.codecs):
        sa, sb = a.key.state_dict(), b.key.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def test_a_calibration_over_groups_of_heads_keeps_its_groups_through_the_checkpoint(stress_model, tmp_path):
    """calibrate(predict_values, predict_group="2"): every layer's map keeps pairs of heads apart (ValuePredictor.group
    2, so the CUDA walk takes one pass at heads of 16), explains less than the full map's but most of the values, and
    comes back from its checkpoint with the same groups; "walk" groups as the scores walk does; a group without
    predict_values, or one that is no group, is refused in one line."""
    from esm_turbo import Calibration, calibrate
    from esm_turbo.errors import EsmTurboError
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.recipe import recipe
    recs = read_fasta("calibration_data/calibration.fasta")[0][:6]
    full = calibrate(stress_model, recs, recipe("default", index_bits=2, predict_values=True), progress=False)
    paired = calibrate(stress_model, recs, recipe("default", index_bits=2, predict_values=True, predict_group="2"),
                       progress=False)
    assert [c.predictor.group for c in paired.codecs] == [2] * 4 and all(c.predictor.group == 4 for c in full.codecs)
    explained = paired.meta["value_prediction_explained"], full.meta["value_prediction_explained"]
    assert all(0.5 < a < b for a, b in zip(*explained))
    back = Calibration.load(paired.save(tmp_path / "paired.safetensors"))
    assert back.config.predict_group == "2" and [c.predictor.group for c in back.codecs] == [2] * 4
    walk = calibrate(stress_model, recs, recipe("default", index_bits=2, predict_values=True, predict_group="walk",
                                                max_tokens=2000), progress=False)
    assert all(c.predictor.group == 4 for c in walk.codecs)  # 128 / 16 = 8 heads a walk group: all four here
    with pytest.raises(EsmTurboError, match="predict_group 2: grouping the heads .* needs predict_values"):
        calibrate(stress_model, recs, recipe("default", predict_group="2"), progress=False)
    with pytest.raises(EsmTurboError, match="predict_group 'pairs': give all, walk or a number of heads"):
        calibrate(stress_model, recs, recipe("default", predict_values=True, predict_group="pairs"), progress=False)
