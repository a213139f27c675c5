"""Calibration: stream post-RoPE K and V of ESM-2 over FASTA sets and fit the TurboESM tables.

Two passes over the sequences, never holding activations:

1. per (layer, head): XᵀX, Σx, count for K and for V → rotations Π (svd / svd-scaled / seeded); with bit
   allocation or ``svd-query`` keys also the queries' second moments (how much each key channel's error moves
   the scores; ``svd-query`` turns the keys' PCA basis to lower that score error, ``esm_turbo.quant.jacobi``);
2. per (layer, head, channel): a histogram with exact per-bin sums of the rotated (and centred and
   scaled) values → weighted Lloyd-Max LUTs and sign-residual magnitudes (with bit allocation: at every
   width, and each channel's width chosen by ``esm_turbo.quant.allocation``); with ``attention_weight`` a,
   each token counts (1 − a) + a · (the attention it receives in that layer and head);
3. only for ``value_rotation="auto"``: each head's values are quantized with both candidate codecs
   (unrotated, and svd-scaled), and the head keeps the one whose error reaches the layer output least
   (``E‖(v − v̂) W_oᵀ‖²``, W_o the head's block of the attention output projection).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from .. import __version__
from ..errors import EsmTurboError
from ..fasta import Record, records_hash
from ..quant.allocation import ChannelTables, channel_tables, grid_tables, widest_bits
from ..quant.codec import KVCodec, VectorQuantizer, check_lut_kind
from ..quant.fit import FitOptions, fit_quantizer
from ..quant.tables import pad_levels
from ..quant.histogram import HistogramAccumulator
from ..quant.predict import PredictorFit, Unstored, ValuePredictor, group_size, rotary_angles
from ..quant.rotations import AffineStats, CovarianceAccumulator, build_rotations, identity_reflectors
from .alphabet import encode
from .attention import RunContext
from .checkpoint import Calibration, CalibrationConfig, quantizer_seed
from .engine import TurboEsm
from .layer_widths import layer_sensitivity, narrow_least_sensitive, narrower, sensitivity_sample
from .loading import model_fingerprint

log = logging.getLogger(__name__)


def token_batches(records: list[Record], batch_tokens: int, max_tokens: int | None = None) -> list[list[Record]]:
    """Length-sorted batches of at most ``batch_tokens`` padded tokens (deterministic order)."""
    ordered = sorted(records, key=lambda r: (len(r.sequence), r.id))
    batches: list[list[Record]] = []
    cur: list[Record] = []
    seen = 0
    for rec in ordered:
        n = len(rec.sequence) + 2
        if max_tokens is not None and seen + n > max_tokens and (batches or cur):
            break
        if cur and (len(cur) + 1) * n > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(rec)
        seen += n
    if cur:
        batches.append(cur)
    return batches


def _run(engine: TurboEsm, batches: list[list[Record]], recorder, desc: str, progress: bool,
         values=None) -> int:
    """Prefill ``batches`` once, ``recorder(layer, q, k, v, valid)`` called in every layer (q, k, v [B, H, S, d]
    post-RoPE, valid [B, S]); ``values(layer, k, v)``, if given, replaces v first (the residuals a value predictor
    leaves). Returns the real tokens seen."""
    if values is not None:
        plain = recorder

        def recorder(layer, q, k, v, valid):
            return plain(layer, q, k, values(layer, k, v).to(v.dtype), valid)
    tokens_seen = 0
    for batch in tqdm(batches, desc=desc, disable=not progress, unit="batch"):
        tokens, mask = encode([r.sequence for r in batch], [r.id for r in batch])
        tokens, mask = tokens.to(engine.device), mask.to(engine.device)
        with engine.context(RunContext(mode="prefill", recorder=recorder, valid=mask.bool())), torch.no_grad():
            engine.base(input_ids=tokens, attention_mask=mask)
        tokens_seen += int(mask.sum())
    return tokens_seen


def _valid_values(y: torch.Tensor, valid: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """y [B, H, S, d], valid [B, S] → values of real tokens per LUT group: [H·d, N] (``per_channel``,
    channel-minor) or [H, N·d]."""
    if per_channel:
        return y.permute(1, 3, 0, 2)[:, :, valid].reshape(y.shape[1] * y.shape[3], -1)
    return y.permute(1, 0, 2, 3)[:, valid].reshape(y.shape[1], -1)


def attention_received(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, H, S] float32: for each key/value token t, Σ over valid queries s of p[s, t], the layer's attention
    probabilities (q [B, H, S, d] scaled, k [B, H, S, d], valid [B, S] bool; padded tokens get 0). Every query's
    row sums to 1, so over a sequence's tokens the mean is 1. A key's quantization error moves the output
    through p[s, t]·(score error) and a value's through p[s, t]·δv: a token nobody attends to barely matters.
    One head at a time: [B, S, S] scores at most."""
    keys = valid[:, None, :]
    queries = valid[:, :, None].float()
    out = []
    for h in range(q.shape[1]):
        scores = q[:, h].float() @ k[:, h].float().transpose(-1, -2)
        p = torch.softmax(scores.masked_fill(~keys, float("-inf")), dim=-1) * queries
        out.append(p.sum(-2))
    return torch.stack(out, 1)


def _token_weights(w: torch.Tensor, valid: torch.Tensor, dim: int, per_channel: bool) -> torch.Tensor:
    """Per-token weights w [B, H, S] laid out as ``_valid_values`` lays out the values of [B, H, S, dim]."""
    rows = w.permute(1, 0, 2)[:, valid]  # [H, N]
    return rows.repeat_interleave(dim, dim=0) if per_channel else rows.repeat_interleave(dim, dim=1)


def _histogram(second_moments: torch.Tensor, config: CalibrationConfig, device: torch.device) -> HistogramAccumulator:
    """Histograms over ±10 rms of each LUT group: a head (its largest channel rms) or a channel; accumulated on
    the model's device."""
    rms = second_moments.sqrt()  # [H, d]
    if config.lut != "head":
        return HistogramAccumulator(10 * rms.reshape(-1), config.channel_bins, device)
    return HistogramAccumulator(10 * rms.amax(-1), config.bins, device)


def combine_heads(candidates: tuple[VectorQuantizer, ...], choice: torch.Tensor) -> VectorQuantizer:
    """One quantizer whose head h has the tables of ``candidates[choice[h]]`` (same bits and residual)."""
    first = candidates[0]
    levels = max(q.centroids.shape[-1] for q in candidates)
    out = VectorQuantizer(first.heads, first.dim, first.bits, first.residual, first.normalize, first.qjl_seed,
                          max_bits=levels.bit_length() - 1)
    out = out.to(first.rot.device)
    if len({q.grid for q in candidates}) != 1:
        raise ValueError("cannot combine grid and LUT quantizers in one")
    out.grid = first.grid
    eye = identity_reflectors(1, first.dim)[0]
    stored, order = [], []
    for h, c in enumerate(choice.tolist()):
        q = candidates[c]
        for name in ("rot", "offset", "scale", "widths"):
            getattr(out, name)[h] = getattr(q, name)[h]
        for name in ("centroids", "eps"):  # a narrower table repeats its last level
            getattr(out, name)[h] = pad_levels(getattr(q, name)[h:h + 1], q.widths[h:h + 1], levels)[0]
        stored.append(q.rot_stored[h] if q.rot_stored is not None else eye)
        order.append(q.rot_order[h] if q.rot_order is not None else torch.arange(first.dim))
    out.rot_stored = torch.stack(stored)  # fp16 reflectors: identity heads rebuild exactly
    out.rot_order = torch.stack(order) if any(q.rot_order is not None for q in candidates) else None
    return out


def _pick_heads(candidates: tuple[torch.Tensor, ...], choice: torch.Tensor) -> torch.Tensor:
    """[H, ...] rows: head h from ``candidates[choice[h]]``."""
    return torch.stack([candidates[c][h] for h, c in enumerate(choice.tolist())])


def combine_affine(candidates: tuple[AffineStats, ...], choice: torch.Tensor) -> AffineStats:
    """One per-head transform whose head h is ``candidates[choice[h]]``'s (stored reflectors kept; an unfitted
    head's are the identity's)."""
    heads, dim = candidates[0].rot.shape[:2]
    stored = tuple(a.stored if a.stored is not None else identity_reflectors(heads, dim) for a in candidates)
    return AffineStats(*(_pick_heads(tuple(getattr(a, name) for a in candidates), choice)
                         for name in ("rot", "offset", "scale")), _pick_heads(stored, choice))


def _pick_table_heads(candidates: tuple[ChannelTables, ...], choice: torch.Tensor, dim: int) -> ChannelTables:
    """Channel tables (rows h·d … h·d + d − 1 per head) whose head h is ``candidates[choice[h]]``'s."""
    parts = [candidates[c].rows(h * dim, (h + 1) * dim) for h, c in enumerate(choice.tolist())]
    return ChannelTables([torch.cat([p.luts[b] for p in parts]) for b in range(len(parts[0].luts))],
                         [torch.cat([p.eps[b] for p in parts]) if parts[0].eps[b] is not None else None
                          for b in range(len(parts[0].eps))], torch.cat([p.mse for p in parts]), candidates[0].grid)


def _tables_by_layer(hists: list[HistogramAccumulator], bits: int, config: CalibrationConfig, kind: str,
                     max_groups: int = 1 << 16) -> list[ChannelTables | None]:
    """With bit allocation or grids, each layer's :class:`ChannelTables`, fitted for as many layers at once as
    ``max_groups`` channels allow (on a GPU the Lloyd iterations cost launches, not arithmetic); else Nones."""
    grid = config.lut == "grid"
    if not (config.bit_allocation or grid):
        return [None] * len(hists)
    top = widest_bits(bits, config.channel_cap(kind)) if config.bit_allocation else bits
    sign_mode = config.sign_mode if config.residual == "sign" else None
    per_layer = hists[0].count.shape[0]
    step = max(1, max_groups // per_layer)
    out: list[ChannelTables | None] = []
    for first in range(0, len(hists), step):
        points = [h.padded() for h in hists[first:first + step]]
        values, weights = torch.cat([p[0] for p in points]), torch.cat([p[1] for p in points])
        fitted = (grid_tables(values, weights, top, sign_mode is not None, span=config.grid_span) if grid
                  else channel_tables(values, weights, top, sign_mode))
        out += [fitted.rows(i * per_layer, (i + 1) * per_layer) for i in range(len(points))]
    return out


def channel_importance(affine: AffineStats, reach: CovarianceAccumulator | torch.Tensor) -> torch.Tensor:
    """How much an error in each affine channel reaches the output, [H, d]: ``scale_c² · (Π M Πᵀ)_cc`` with M
    the queries' second moments E[q qᵀ] (keys: the score error) or a head's output Gram matrix W_oᵀW_o
    (values), each [H, d, d]."""
    m = reach if isinstance(reach, torch.Tensor) else reach.moments(centered=False)
    rot = affine.rot.double().to(m.device)
    diag = torch.einsum("hij,hjk,hik->hi", rot, m.double(), rot)
    return (diag * affine.scale.double().to(m.device) ** 2).float()


def _output_weights(engine: TurboEsm, layer: int) -> torch.Tensor:
    """[H, d, d] Gram matrices W_hᵀ W_h of each head's block of the attention output projection."""
    w = engine.submodule(layer, engine.family.o).weight.detach().float()  # [D, H·d]
    blocks = w.reshape(w.shape[0], engine.heads, engine.head_dim).permute(1, 0, 2)  # [H, D, d]
    return blocks.transpose(1, 2) @ blocks


def _choose_value_codecs(engine: TurboEsm, batches, plain: list[VectorQuantizer], rotated: list[VectorQuantizer],
                         progress: bool, values=None) -> list[torch.Tensor]:
    """Per layer, per head: 1 where the rotated codec's value error reaches the output less."""
    grams = [_output_weights(engine, li) for li in range(engine.num_layers)]
    err = torch.zeros(engine.num_layers, 2, engine.heads, dtype=torch.float64)

    def record(layer, query, k, v, valid):
        for i, q in enumerate((plain[layer], rotated[layer])):
            e = (v.float() - q.decode(q.encode(v))) * valid[:, None, :, None]  # [B, H, S, d]
            err[layer, i] += torch.einsum("bhsd,hde,bhse->h", e, grams[layer], e).double().cpu()

    _run(engine, batches, record, "calibrate: value rotation choice", progress, values)
    return [(e[1] < e[0]).long() for e in err]


@torch.no_grad()
def calibrate(model, records: list[Record], config: CalibrationConfig = CalibrationConfig(),
              progress: bool = True, model_name: str = "") -> Calibration:
    """Fit per-layer TurboESM codecs for ``model`` (EsmForMaskedLM) on ``records`` (``config`` resolved first:
    :meth:`CalibrationConfig.resolved`; the checkpoint holds the resolved recipe)."""
    if not records:
        raise ValueError("calibration needs at least one sequence")
    asked = config
    try:
        config = config.resolved()
        if config.narrow_layers:
            narrower(asked).resolved()
    except ValueError as err:
        raise EsmTurboError(str(err)) from None
    if config.key_rotation == "auto" or (config.value_rotation == "auto" and config.shared_lut):
        raise EsmTurboError("rotation 'auto' is for values only, and needs separate K and V LUTs "
                            "(shared_lut with value_rotation 'identity' or 'svd-scaled')")
    if config.value_rotation == "svd-query":
        raise EsmTurboError("rotation 'svd-query' is for keys (it weighs their error by the queries that read them)")
    check_lut_kind(config.lut)
    if not 0.0 <= config.attention_weight <= 1.0:
        raise EsmTurboError(f"attention_weight {config.attention_weight} is not in [0, 1]")
    if config.bit_allocation and (config.lut == "head" or config.shared_lut):
        raise EsmTurboError("bit allocation gives each channel its own LUT width: it needs lut='channel' (or "
                            "'grid') and separate K and V LUTs (or pass bit_allocation=False / --no-bit-allocation)")
    if config.lut == "grid" and (config.shared_lut or config.residual == "qjl"):
        raise EsmTurboError("lut='grid' fits each channel's own uniform levels: it needs separate K and V tables "
                            "and a sign residual or none (not qjl)")
    engine = TurboEsm(model)
    layers, heads, dim = engine.num_layers, engine.heads, engine.head_dim
    if config.narrow_layers >= layers:
        raise EsmTurboError(f"narrow_layers {config.narrow_layers}: give fewer than the model's {layers} layers")
    if config.value_index_bits == 0 and (config.slots or config.narrow_layers):
        raise EsmTurboError("values not stored (value_index_bits 0) leave no value codes for slots or narrowed "
                            "layers to adjust: give slots 0 and narrow_layers 0, or value_index_bits ≥ 1")
    try:
        group = group_size(config.predict_group, heads, dim)
    except ValueError as e:
        raise EsmTurboError(str(e)) from None
    if group is not None and not config.predict_values:
        raise EsmTurboError(f"predict_group {config.predict_group}: grouping the heads of a value predictor needs "
                            "predict_values")
    if config.predict_values:
        if config.shared_lut:
            raise EsmTurboError("predict_values fits the values' tables on what the keys do not predict: it needs "
                                "separate K and V LUTs (not shared_lut)")
        check_rotary(engine)
    batches = token_batches(records, config.batch_tokens, config.max_tokens)
    used = [r for b in batches for r in b]
    start = time.perf_counter()
    if config.predict_values:  # keys first; the values' tables are then fitted on what the keys do not predict
        # the keys' codecs alone (no value tables fitted: their values are :class:`Unstored` placeholders)
        coded, _, n_tokens = _fit_codecs(engine, batches, replace(config, predict_values=False), progress,
                                         keys_only=True)
        keys = [c.key for c in coded]
        predictors = fit_value_predictors(engine, batches, coded, progress, group)
        explained = [p.explained for p in predictors]
        log.info("values' variance the decoded keys predict, per layer: %s", ", ".join(f"{e:.4f}" for e in explained))
        if config.value_index_bits == 0 and min(explained) < UNSTORED_MIN_EXPLAINED:
            warnings.warn(f"values not stored (value_index_bits 0) but the keys predict as little as "
                          f"{min(explained):.4f} of a layer's values' variance (layer {explained.index(min(explained))}"
                          f"): code the residual instead (value_index_bits ≥ 1)", stacklevel=2)
        if config.value_index_bits == 0:  # nothing stored of the values: the prediction is the value
            codecs = [config.codec(k, Unstored(heads, dim), p) for k, p in zip(keys, predictors)]
            choice = None
        else:
            def residual(layer, k, v):
                return v.float() - predictors[layer](coded[layer].coded_keys(k))

            fitted, choice, n_tokens = _fit_codecs(engine, batches, config, progress, residual)
            codecs = [config.codec(k, c.value, p) for k, c, p in zip(keys, fitted, predictors)]
    else:
        codecs, choice, n_tokens = _fit_codecs(engine, batches, config, progress)
    elapsed = time.perf_counter() - start
    log.info("calibrated %d layers × %d heads on %d tokens in %.1f s", layers, heads, n_tokens, elapsed)
    meta = dict(layers=layers, heads=heads, head_dim=dim, model_fingerprint=model_fingerprint(model),
                model_name=str(model_name), calibration_set_sha256=records_hash(used),
                calibration_sequences=len(used), calibration_tokens=n_tokens, esm_turbo_version=__version__)
    if config.predict_values:
        meta["value_prediction_explained"] = [round(e, 6) for e in explained]
    if choice is not None:  # per layer, per head: 0 = values unrotated, 1 = svd-scaled
        meta["value_rotation_choice"] = [c.tolist() for c in choice]
    cal = Calibration(codecs, replace(config), meta)
    cal.seconds = elapsed
    if config.narrow_layers:
        narrow = calibrate(model, records, narrower(asked), progress, model_name)
        sensitivity = layer_sensitivity(model, cal, narrow, sensitivity_sample(used, config.seed), progress)
        cal = narrow_least_sensitive(cal, narrow, sensitivity, config.narrow_layers)
        log.info("narrowed layers %s (mean decode cos lost one bit narrower: %s)", cal.meta["narrowed_layers"],
                 ", ".join(f"{s:.4f}" for s in sensitivity))
    return cal


#: below this share of a layer's values' variance predicted by its decoded keys, values not stored are warned of (in
#: ESM-2 the values are an affine map of the keys; what misses is the keys' coding error: the trained testbeds' layers
#: predict 0.976–1.000 from keys of 3 + sign bits, 0.986–1.000 from 4 + sign, and decode at a mean cos ≥ 0.995)
UNSTORED_MIN_EXPLAINED = 0.95


def check_rotary(engine: TurboEsm) -> None:
    """Refuse a value predictor for a model whose rotary embedding is not the one it un-rotates
    (:func:`~esm_turbo.quant.predict.rotary_angles` of the module's ``inv_freq``)."""
    inv_freq = getattr(engine.rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.numel() != engine.head_dim // 2:
        raise EsmTurboError("predict_values: the model's rotary embedding has no inv_freq of head_dim/2 frequencies")
    positions = torch.arange(64, device=engine.device)[None]
    probe = torch.zeros(1, 64, engine.heads * engine.head_dim, device=engine.device)
    cos, sin = engine.rotary(probe, positions)
    want_cos, want_sin = rotary_angles(positions, inv_freq)
    if not (torch.allclose(cos.float(), want_cos, atol=1e-3) and torch.allclose(sin.float(), want_sin, atol=1e-3)):
        raise EsmTurboError("predict_values: the model's rotary embedding is not the standard one (frequencies "
                            "repeated over the two halves, unscaled) that the value predictor un-rotates")


def fit_value_predictors(engine: TurboEsm, batches, coded: list[KVCodec], progress: bool,
                         group: int | None = None) -> list[ValuePredictor]:
    """Per layer, the least-squares :class:`~esm_turbo.quant.predict.ValuePredictor` of the values from every head's
    keys (``group``: from the keys of the head's group of ``group`` consecutive heads alone) as ``coded[layer]``
    decodes them, before the rotary embedding."""
    fits = [PredictorFit(engine.heads, engine.head_dim, engine.rotary.inv_freq, engine.device)
            for _ in range(engine.num_layers)]

    def record(layer, q, k, v, valid):
        fits[layer].add(coded[layer].coded_keys(k), v, valid)

    _run(engine, batches, record, "calibrate: value predictors", progress)
    return [f.solve(group=group).to(engine.device) for f in fits]


def _fit_codecs(engine: TurboEsm, batches, config: CalibrationConfig, progress: bool, values=None,
                keys_only: bool = False) -> tuple[list[KVCodec], list[torch.Tensor] | None, int]:
    """The passes of :func:`calibrate` (its ``config`` resolved): (a codec a layer, the per-head value rotation
    choice or None, tokens seen); ``values`` as :func:`_run`'s; ``keys_only``: the keys' tables alone, the values
    :class:`Unstored` (what a value predictor is fitted on)."""
    layers, heads, dim = engine.num_layers, engine.heads, engine.head_dim

    def run(recorder, desc):
        return _run(engine, batches, recorder, desc, progress, values)

    need_queries = config.bit_allocation or config.key_rotation == "svd-query"
    cov = {kind: [CovarianceAccumulator(heads, dim) for _ in range(layers)]
           for kind in ("q" if need_queries else "") + ("k" if keys_only else "kv")}

    def record_cov(layer, q, k, v, valid):
        for kind, x in zip("qkv", (q, k, v)):
            if kind in cov:
                cov[kind][layer].add(x, valid)

    n_tokens = run(record_cov, "calibrate: rotations")

    # candidate transforms per tensor kind: "k", "v", and for an automatic V choice a second one "v*"
    rotation = {"k": config.key_rotation} if keys_only else {"k": config.key_rotation, "v": config.value_rotation}
    if config.value_rotation == "auto" and not keys_only:
        rotation.update(v="identity", **{"v*": "svd-scaled"})
    source = {"k": "k", "v": "v", "v*": "v"}
    affine: dict[str, list[AffineStats]] = {
        kind: build_rotations(rot, heads, dim, [quantizer_seed(config, li, source[kind]) for li in range(layers)],
                              cov[source[kind]], cov.get("q"), engine.device) for kind, rot in rotation.items()}
    hist = {kind: [_histogram(affine[kind][li].second_moments(cov[source[kind]][li]), config, engine.device)
                   for li in range(layers)] for kind in rotation}

    mix = config.attention_weight
    per_channel = config.lut != "head"

    def record_hist(layer, q, k, v, valid):
        weights = None
        if mix > 0:  # tokens weighed by the attention they receive (CalibrationConfig.attention_weight)
            received = attention_received(q, k, valid)
            weights = _token_weights((1 - mix) + mix * received, valid, dim, per_channel)
        for kind in rotation:
            x = k if source[kind] == "k" else v
            hist[kind][layer].add(_valid_values(affine[kind][layer].forward(x), valid, per_channel), weights)

    run(record_hist, "calibrate: LUTs")

    bits = {"k": config.key_index_bits, "v": config.value_index_bits}
    tables = {kind: _tables_by_layer(hist[kind], bits[source[kind]], config, source[kind]) for kind in rotation}
    quantizers: dict[str, list[VectorQuantizer]] = {kind: [] for kind in rotation}
    importances: dict[str, list[torch.Tensor | None]] = {kind: [] for kind in rotation}
    for li in range(layers):
        points = {kind: hist[kind][li].padded() for kind in rotation}
        shared = None
        if config.shared_lut:  # ablation: one LUT per group fitted on K and V together
            shared = tuple(torch.cat(pair, 1) for pair in zip(points["k"], points["v"]))
        for kind in rotation:
            importance = None
            if config.bit_allocation:
                reach = cov["q"][li] if source[kind] == "k" else _output_weights(engine, li)
                importance = channel_importance(affine[kind][li], reach)
            importances[kind].append(importance)
            fit = FitOptions(bits[source[kind]], config.residual, config.sign_mode,
                             quantizer_seed(config, li, source[kind]), config.channel_cap(source[kind]),
                             config.shared_widths)
            quantizers[kind].append(fit_quantizer(affine[kind][li], points[kind], fit, shared, importance,
                                                  tables[kind][li]).to(engine.device))

    choice = None
    if "v*" in rotation:
        choice = _choose_value_codecs(engine, batches, quantizers["v"], quantizers["v*"], progress, values)
        if config.bit_allocation and config.shared_widths:  # one allocation over the heads as chosen
            quantizers["v"] = [fit_quantizer(
                combine_affine((affine["v"][li], affine["v*"][li]), c), hist["v"][li].padded(),
                FitOptions(config.value_index_bits, config.residual, config.sign_mode, quantizer_seed(config, li, "v"),
                           shared_widths=True),
                importance=_pick_heads((importances["v"][li], importances["v*"][li]), c),
                tables=_pick_table_heads((tables["v"][li], tables["v*"][li]), c, dim)).to(engine.device)
                for li, c in enumerate(choice)]
        else:
            quantizers["v"] = [combine_heads((a, b), c) for a, b, c in zip(quantizers["v"], quantizers["v*"], choice)]
    if keys_only:
        return [config.codec(k, Unstored(heads, dim)) for k in quantizers["k"]], None, n_tokens
    return [config.codec(k, v) for k, v in zip(quantizers["k"], quantizers["v"])], choice, n_tokens
