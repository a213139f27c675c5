"""Stress models: small ESM-2 checkpoints whose attention is not flattering to a quantizer.

Random weights give near-uniform attention and isotropic K/V. A stress model plants, with more of
each in later layers:

* function-preserving key outliers: one RoPE channel pair (i, i + d/2) of W_k (and its bias) × s and
  the same pair of W_q × 1/s — scores are unchanged, keys get channels s× the rest;
* function-preserving value outliers: a V channel × s and the matching column of W_o × 1/s;
* outliers the query does use (sink-like): a key pair × s with no compensation in W_q, so the
  attention sharpens along that channel;
* per-head sharpness: W_q of each head scaled by a factor from broad (0.5) to peaked (16).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import EsmForMaskedLM

from .model.loading import _LAYER_MAP, _TOP_MAP
from .model.sizes import esm2_config


def _seeded(make_config, model_class, size, layers, hidden, heads, seed: int, init_std: float | None):
    """(a model of a size name or of the given dims, built after seeding torch, eval; a generator seeded the same;
    the weights' std, 0.64/√hidden unless given)."""
    cfg = make_config(size, layers=layers if size is None else None, hidden=hidden if size is None else None,
                      heads=heads if size is None else None)
    torch.manual_seed(seed)
    std = init_std if init_std is not None else 0.64 / cfg.hidden_size**0.5
    return model_class(cfg).eval(), torch.Generator().manual_seed(seed), std


@torch.no_grad()
def stress_esm2(layers: int = 4, hidden: int = 64, heads: int = 4, seed: int = 0,
                outlier_scale: float = 30.0, size: str | None = None,
                init_std: float | None = None) -> EsmForMaskedLM:
    """A small ESM-2 (EsmForMaskedLM, fp32, eval) with planted outliers and varied sharpness.
    Weights are N(0, init_std²) with init_std = 0.64/√hidden by default (same activation scale at any width)."""
    model, gen, init_std = _seeded(esm2_config, EsmForMaskedLM, size, layers, hidden, heads, seed, init_std)
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    n_heads, n_layers = cfg.num_attention_heads, cfg.num_hidden_layers
    for name, p in model.named_parameters():  # larger-than-default weights: non-trivial attention
        if name.endswith("weight") and p.dim() == 2:
            p.normal_(0.0, init_std, generator=gen)
        elif name.endswith("bias"):
            p.normal_(0.0, init_std / 4, generator=gen)
    for li, layer in enumerate(model.esm.encoder.layer):
        attn = layer.attention.self
        wq, bq = attn.query.weight, attn.query.bias
        wk, bk = attn.key.weight, attn.key.bias
        wv, bv = attn.value.weight, attn.value.bias
        wo = layer.attention.output.dense.weight
        depth = (li + 1) / n_layers
        for h in range(n_heads):
            rows = slice(h * d, (h + 1) * d)
            sharp = float(torch.logspace(-0.3, 1.2, n_heads)[h])  # 0.5 … 16, broad to peaked
            wq[rows] *= sharp
            bq[rows] *= sharp
        n_planted = max(1, round(depth * n_heads * 0.75))
        for j in range(n_planted):
            h = (li + j) % n_heads
            s = outlier_scale * (0.5 + depth) * (1 + j % 3) / 2
            i = int(torch.randint(0, d // 2, (1,), generator=gen))
            pair = [h * d + i, h * d + i + d // 2]
            if j % 3 == 2:  # used by the query: sharpen along this pair
                wk[pair] *= s / 4
                bk[pair] *= s / 4
            else:  # function-preserving: K × s, Q × 1/s
                wk[pair] *= s
                bk[pair] *= s
                wq[pair] /= s
                bq[pair] /= s
            c = h * d + int(torch.randint(0, d, (1,), generator=gen))
            wv[c] *= s
            bv[c] *= s
            wo[:, c] /= s
    return model


@torch.no_grad()
def plant_outliers(model: EsmForMaskedLM, max_scale: float = 200.0, seed: int = 0,
                   min_scale: float | None = None) -> EsmForMaskedLM:
    """Plant function-preserving K/V outliers into ``model`` in place (and return it): the logits do not change.

    In each layer, a share of the heads growing from a quarter (first layer) to all (last) gets

    * a key outlier: one RoPE channel pair (i, i + d/2) of W_k and its bias × s, the same pair of W_q and its
      bias × 1/s (RoPE turns a pair by one angle, so every score q·k is unchanged);
    * a value outlier: a channel c of W_v and its bias × s, column c of W_o × 1/s (the attention output's
      channel c is s× larger and W_o takes it back).

    s is log-uniform in [``min_scale``, ``max_scale``] (``min_scale`` default ``max_scale``/4) times 0.5 … 1 from
    the first layer to the last: real ESM-2 650M has K/V channels 50–200× the median channel's RMS, more in
    later layers. A trained model keeps its attention patterns; only the coordinates a quantizer sees change."""
    gen = torch.Generator().manual_seed(seed)
    lo = math.log(min_scale if min_scale is not None else max_scale / 4)
    hi = math.log(max_scale)
    heads = model.config.num_attention_heads
    d = model.config.hidden_size // heads
    layers = model.esm.encoder.layer
    for li, layer in enumerate(layers):
        attn = getattr(layer.attention.self, "inner", layer.attention.self)  # under TurboEsm too
        wo = layer.attention.output.dense.weight
        depth = li / max(1, len(layers) - 1)
        picked = torch.randperm(heads, generator=gen)[: max(1, round(heads * (0.25 + 0.75 * depth)))]
        for h in picked.tolist():
            scales = torch.exp(lo + (hi - lo) * torch.rand(2, generator=gen, dtype=torch.float64)) * (0.5 + depth / 2)
            s_k, s_v = (float(x) for x in scales)
            i = int(torch.randint(0, d // 2, (1,), generator=gen))
            pair = [h * d + i, h * d + i + d // 2]
            for lin, factor in ((attn.key, s_k), (attn.query, 1 / s_k)):
                lin.weight[pair] *= factor
                if lin.bias is not None:
                    lin.bias[pair] *= factor
            c = h * d + int(torch.randint(0, d, (1,), generator=gen))
            attn.value.weight[c] *= s_v
            if attn.value.bias is not None:
                attn.value.bias[c] *= s_v
            wo[:, c] /= s_v
    return model


@torch.no_grad()
def plant_product_outliers(model, channels: int = 4, low: float = 20.0, high: float = 100.0, seed: int = 0):
    """Plant function-preserving outlier channels into the inputs of a FastEsm's matrix products, in place (and
    return it): in every block, ``channels`` channels of each LayerNorm's output (its γ and β × s, the matching input
    columns of the next product ÷ s) and of the attention output (V's output channels and biases × s, W_o's input
    columns ÷ s), s growing from ``low`` in the first block to ``high`` in the last. Pre-LN ESM-2 feeds its residual
    stream to a product only through a LayerNorm, so this is where a residual stream's outlier channels meet an
    FP8 (or int8) product; the model computes what it did before, up to rounding (ESM C too: its bias-free
    LayerNorms and products, and its query and key LayerNorms, which see the product's unchanged output). Needs dense
    fp32/bf16/fp16 weights (before :meth:`~esm_turbo.embed.fast_esm.FastEsm.to_fp8`)."""
    gen = torch.Generator().manual_seed(seed)
    dim = model.config.hidden_size
    for i, b in enumerate(model.blocks):
        s = low + (high - low) * i / max(1, len(model.blocks) - 1)
        for norm, lin in ((b.attn_norm, b.qkv), (b.ffn_norm, b.fc1)):
            picked = torch.randperm(dim, generator=gen)[:channels]
            norm.weight[picked] *= s
            if norm.bias is not None:
                norm.bias[picked] *= s
            lin.weight[:, picked] /= s
        picked = torch.randperm(dim, generator=gen)[:channels]
        b.qkv.weight[2 * dim + picked] *= s
        if b.qkv.bias is not None:
            b.qkv.bias[2 * dim + picked] *= s
        b.out.weight[:, picked] /= s
    return model


@torch.no_grad()
def stress_esmc(layers: int = 4, hidden: int = 128, heads: int = 2, seed: int = 0, size: str | None = None,
                init_std: float | None = None):
    """A small ESM C (``EsmcForMaskedLM``, fp32, eval) with weights N(0, init_std²) (0.64/√hidden by default) and
    LayerNorm gains and biases spread around 1 and 0 (transformers initialises them to exactly 1 and 0, which would
    hide a norm read from the wrong tensor); its heads sharpen from broad to peaked, as :func:`stress_esm2`'s do."""
    from transformers import EsmcForMaskedLM

    from .model.sizes import esmc_config
    model, gen, init_std = _seeded(esmc_config, EsmcForMaskedLM, size, layers, hidden, heads, seed, init_std)
    cfg = model.config
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("weight") and p.dim() == 2:
            p.normal_(0.0, init_std, generator=gen)
        elif name.endswith("bias"):
            p.normal_(0.0, init_std / 4, generator=gen)
    d = cfg.hidden_size // cfg.num_attention_heads
    sharp = torch.logspace(-0.3, 0.3, cfg.num_attention_heads).repeat_interleave(d)  # the q norm sets the scale
    for layer in model.esmc.layers:
        layer.self_attn.q_norm.weight.mul_(sharp)
    return model


def save_stress_esmc(out_dir: str | Path, **kwargs) -> Path:
    """Write a :func:`stress_esmc` model with ``save_pretrained``."""
    out = Path(out_dir)
    stress_esmc(**kwargs).save_pretrained(out)
    return out


def to_esmc_original(model) -> dict[str, torch.Tensor]:
    """The inverse of the ESM C package converter (:mod:`esm_turbo.model.esmc_original`): an ``EsmcForMaskedLM``'s
    weights as that package's state dict (what its ``.pth`` files hold)."""
    from .model.esmc_original import _BLOCK_MAP, _SPLIT, _TOP_MAP
    state = model.state_dict()
    out = {orig: state[ours].clone() for orig, ours in _TOP_MAP.items() if ours in state}
    for i in range(model.config.num_hidden_layers):
        prefix = f"esmc.layers.{i}."
        for orig, ours in _BLOCK_MAP.items():
            out[f"transformer.blocks.{i}.{orig}"] = state[prefix + ours].clone()
        for orig, parts in _SPLIT.items():
            out[f"transformer.blocks.{i}.{orig}"] = torch.cat([state[prefix + p] for p in parts])
    return out


def to_fair_esm(model: EsmForMaskedLM) -> dict:
    """The inverse of the fair-esm converter: a checkpoint dict as fair-esm's hub ``.pt`` files hold."""
    inv_top = {v: k for k, v in _TOP_MAP.items()}
    inv_layer = {v: k for k, v in _LAYER_MAP.items()}
    state = {}
    for name, t in model.state_dict().items():
        if name in inv_top:
            key = inv_top[name]
        elif name.startswith("esm.encoder.layer."):
            rest = name[len("esm.encoder.layer."):]
            idx, tail = rest.split(".", 1)
            module, kind = tail.rsplit(".", 1)
            if module not in inv_layer:
                continue
            key = f"layers.{idx}.{inv_layer[module]}.{kind}"
        else:
            continue
        prefix = "encoder." if key.startswith("lm_head") else "encoder.sentence_encoder."
        state[prefix + key] = t.clone()
    cfg = model.config
    args = argparse.Namespace(encoder_layers=cfg.num_hidden_layers, encoder_embed_dim=cfg.hidden_size,
                              encoder_attention_heads=cfg.num_attention_heads, token_dropout=cfg.token_dropout)
    return {"model": state, "cfg": {"model": args}}


def save_stress_model(out_dir: str | Path, fair_esm_pt: bool = True, **kwargs) -> Path:
    """Write a stress model with ``save_pretrained`` (and ``model.pt`` in fair-esm format)."""
    out = Path(out_dir)
    model = stress_esm2(**kwargs)
    model.save_pretrained(out)
    if fair_esm_pt:
        torch.save(to_fair_esm(model), out / "model.pt")
    return out


def random_turbo_codec(heads: int, dim: int, key_bits: int = 3, value_bits: int = 3, residual: str = "sign",
                       seed: int = 0, allocate: bool = True, max_bits: int | None = None, shared: bool = True,
                       grid: bool = False, value_max_bits: int | None = None, importance_spread: float = 1.5,
                       permuted_keys: bool = False):
    """A calibrated-style :class:`~esm_turbo.quant.codec.KVCodec` without a model: Haar rotations,
    random per-channel centring and scaling, per-channel LUTs and ε fitted on Gaussian samples of
    per-channel spread (every channel's table differs) and, with ``allocate``, channel widths allocated by a
    random importance (log-normal, σ = ``importance_spread`` in its log: widths from 0 to ``max_bits``, default
    bits + 1, the values' to ``value_max_bits``, default ``max_bits``; ``shared``: the same widths for every head, as
    calibration does by default; ``grid``: uniform levels, ``lut="grid"``; ``permuted_keys``: the keys' rotation a
    random permutation of each head's channels, as the default recipe's "identity" rotation is). For kernel tests and
    speed benchmarks (values are what a calibration produces)."""
    from .quant.codec import KVCodec, VectorQuantizer
    from .quant.fit import FitOptions, fit_quantizer
    from .quant.rotations import AffineStats, haar_orthogonal

    gen = torch.Generator().manual_seed(seed)

    def one(bits: int, salt: int, max_bits: int | None, permuted: bool = False) -> VectorQuantizer:
        rot = (torch.eye(dim)[torch.stack([torch.randperm(dim, generator=gen) for _ in range(heads)])] if permuted
               else haar_orthogonal(dim, seed + salt, heads))
        affine = AffineStats(rot=rot,
                             offset=torch.randn(heads, dim, generator=gen),
                             scale=torch.exp(0.5 * torch.randn(heads, dim, generator=gen)))
        spread = 0.6 + 0.8 * torch.rand(heads * dim, 1, generator=gen, dtype=torch.float64)
        values = torch.randn(heads * dim, 512, generator=gen, dtype=torch.float64) * spread
        importance = torch.exp(importance_spread * torch.randn(heads, dim, generator=gen)) if allocate else None
        fit = FitOptions(bits, residual, "bin", seed + salt, max_bits, shared, grid)
        return fit_quantizer(affine, (values, torch.ones_like(values)), fit, importance=importance)

    value_max_bits = max_bits if value_max_bits is None else value_max_bits
    return KVCodec(one(key_bits, 1, max_bits, permuted_keys), one(value_bits, 2, value_max_bits))


def fused_and_reference_steps(engine, paged: bool = False, capture: bool = True, steps: int = 3,
                               atol: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """A CUDA session of ``engine`` (two rows prefilled, then ``steps`` masked tokens) run on the fused ops and again
    with the PyTorch reference forced: (fused, reference) log-softmaxed logits [steps, B, 1, vocab]. Every layer is
    checked to take the path asked for; with ``capture`` (contiguous sessions), a captured step must replay the eager
    one within ``atol``."""
    from . import ops
    from .model.alphabet import alphabet
    mask = alphabet().mask_idx
    out = []
    for forced in (False, True):
        ops.force_reference(forced)
        try:
            session = engine.session("turbo", capacity=128, paged=paged)
            session.start(["MKTAYIAKQRQISFVKSHFSRQ" * 2, "MKVLAAGIVGL"])
            if all(session.cache.fused) == forced:
                raise AssertionError(f"layers took {'the fused ops' if forced else 'the reference'}: "
                                     f"{session.cache.fused}")
            tokens = torch.full((2, 1), mask, device="cuda")
            out.append(torch.stack([session.step(tokens).logits.float() for _ in range(steps)]))
            if capture and not forced and not paged:
                eager = session.step(tokens, commit=False).logits
                replayed = session.capture_step(tokens).replay().logits
                if not torch.allclose(replayed, eager, atol=atol):
                    raise AssertionError(f"a captured step differs from the eager one by "
                                         f"{(replayed - eager).abs().max():.2e}")
        finally:
            ops.force_reference(False)
    fused, reference = (torch.log_softmax(t, -1) for t in out)
    return fused, reference


def flash_rule(out: torch.Tensor, ref: torch.Tensor, same_dtype: torch.Tensor, eps: float | None = None,
               times: float = 2.0) -> tuple[float, float, float]:
    """The flash-attention rule for a kernel's output ``out``: its largest error against ``ref`` (fp64 or fp32) may
    be at most ``times`` (2) that of ``same_dtype`` (the PyTorch path computed in ``out``'s dtype) plus ``eps``
    (default: the larger of one unit in the last place of ``out``'s dtype and 1e-5, times ``ref``'s largest
    magnitude). A whole block or model chains several kernels, each rounding where the PyTorch path rounds elsewhere;
    its tests pass a larger ``times`` and say so. Returns (out's error, the PyTorch path's error, the bound)."""
    ref = ref.detach().double().cpu()
    err = (out.detach().double().cpu() - ref).abs().max().item()
    err_pt = (same_dtype.detach().double().cpu() - ref).abs().max().item()
    if eps is None:
        eps = max(torch.finfo(out.dtype).eps, 1e-5) * ref.abs().max().item()
    return err, err_pt, times * err_pt + eps
