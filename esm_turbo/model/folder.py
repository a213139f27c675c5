"""ESM-2 and ESM C weights read straight from a transformers folder (``config.json`` + ``model.safetensors``), without
transformers: what :class:`~esm_turbo.embed.fast_esm.FastEsm` needs to embed, put on the device in the dtype it runs
in, and checked on the way (every tensor present, of the shape the config gives, finite; nothing unknown).

Importing transformers and building ``EsmForMaskedLM`` costs seconds at every start; this path costs the read. Names
are taken in every spelling a transformers checkpoint uses: with or without the masked-LM wrapper's prefix (``esm.``,
``esmc.``), and LayerNorm parameters as ``weight``/``bias`` or ``gamma``/``beta``. Each family's names come from
:mod:`esm_turbo.model.family`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .family import ESM2, ESMC, FAMILIES, Family, family_of

#: buffers some checkpoints carry that the model recomputes
IGNORED_BUFFERS = ("position_ids", "inv_freq")


@dataclass(frozen=True)
class ModelShape:
    """What FastEsm reads of a model's config (the attribute names of transformers' ``EsmConfig``), for either
    family (:mod:`esm_turbo.model.family`)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int = 33
    layer_norm_eps: float = 1e-5
    token_dropout: bool = True
    mask_token_id: int = 32
    pad_token_id: int = 1
    family: str = "esm2"
    rope_theta: float = 10000.0
    #: the dtype the checkpoint was saved in (transformers builds the model in it, rotary buffers included)
    stored_dtype: str = "float32"

    def arch(self) -> dict:
        """The fields that say what the model computes (for fingerprints)."""
        return arch_of(self)


#: the :class:`ModelShape` fields that say what a model computes (not how its file stores it); ESM-2's
#: fingerprints keep the fields they always had
ARCH_FIELDS = tuple(f.name for f in fields(ModelShape) if f.name not in ("stored_dtype", "family", "rope_theta"))


def arch_of(config) -> dict:
    """:data:`ARCH_FIELDS` of any config (a :class:`ModelShape`, transformers' ``EsmConfig`` or ``EsmcConfig``),
    plus the family and rotary base where they are not ESM-2's."""
    shape = shape_of(config)
    arch = {name: getattr(shape, name) for name in ARCH_FIELDS}
    if shape.family != ESM2.name:
        arch.update(family=shape.family, rope_theta=shape.rope_theta)
    return arch


def shape_of(config) -> ModelShape:
    """A :class:`ModelShape` of transformers' config (or the shape itself)."""
    if isinstance(config, ModelShape):
        return config
    family = family_of(config)
    common = dict(hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
                  num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size,
                  vocab_size=config.vocab_size, mask_token_id=config.mask_token_id, pad_token_id=config.pad_token_id)
    if family is ESMC:
        rope = getattr(config, "rope_parameters", None) or {}
        return ModelShape(**common, layer_norm_eps=1e-5, token_dropout=False, family=ESMC.name,
                          rope_theta=float(rope.get("rope_theta", 10000.0)))
    return ModelShape(**common, layer_norm_eps=config.layer_norm_eps, token_dropout=bool(config.token_dropout))


def _esm2_shape(cfg: dict, path: Path) -> ModelShape:
    if cfg.get("position_embedding_type") != "rotary" or cfg.get("emb_layer_norm_before") or cfg.get(
            "is_folding_model"):
        raise ModelLoadError(f"{path}: only ESM-2 (rotary position embeddings, no embedding LayerNorm) is supported")
    # transformers' EsmConfig defaults, for configs written with only what differs from them
    return ModelShape(hidden_size=int(cfg.get("hidden_size", 768)),
                      num_hidden_layers=int(cfg.get("num_hidden_layers", 12)),
                      num_attention_heads=int(cfg.get("num_attention_heads", 12)),
                      intermediate_size=int(cfg.get("intermediate_size", 3072)),
                      vocab_size=int(cfg["vocab_size"]), layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                      token_dropout=bool(cfg.get("token_dropout", False)),
                      mask_token_id=int(cfg["mask_token_id"]), pad_token_id=int(cfg["pad_token_id"]),
                      stored_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))


def _esmc_shape(cfg: dict, path: Path) -> ModelShape:
    # transformers' EsmcConfig defaults (ESMC-6B's shape) for fields a config leaves out
    hidden, heads = int(cfg.get("hidden_size", 2560)), int(cfg.get("num_attention_heads", 40))
    for field, ok in (("attention_bias", not cfg.get("attention_bias")), ("mlp_bias", not cfg.get("mlp_bias")),
                      ("hidden_act", cfg.get("hidden_act", "silu") == "silu"),
                      ("num_key_value_heads", cfg.get("num_key_value_heads") in (None, heads)),
                      ("head_dim", cfg.get("head_dim") in (None, hidden // max(heads, 1))),
                      ("rope_parameters", (cfg.get("rope_parameters") or {}).get("rope_type", "default") == "default")):
        if not ok:
            raise ModelLoadError(f"{path}: {field} {cfg.get(field)!r} is not what ESM C computes")
    rope = cfg.get("rope_parameters") or {}
    return ModelShape(hidden_size=hidden, num_hidden_layers=int(cfg.get("num_hidden_layers", 80)),
                      num_attention_heads=heads, intermediate_size=int(cfg.get("intermediate_size", 6912)),
                      vocab_size=int(cfg.get("vocab_size", 64)), layer_norm_eps=1e-5, token_dropout=False,
                      mask_token_id=int(cfg.get("mask_token_id") or 32), pad_token_id=int(cfg.get("pad_token_id") or 1),
                      family=ESMC.name, rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                      stored_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))


def read_config(folder: str | Path) -> ModelShape:
    """``folder/config.json`` as a :class:`ModelShape` (ESM-2 or ESM C); errors name the file and the field."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot read the model config ({type(err).__name__}: {err})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") not in ("esm", "esmc"):
        kind = cfg.get("model_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise ModelLoadError(f"{path}: model_type {kind!r} is neither ESM-2 ('esm') nor ESM C ('esmc')")
    try:
        shape = (_esmc_shape if cfg["model_type"] == "esmc" else _esm2_shape)(cfg, path)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ModelLoadError(f"{path}: field {err} is missing or not a number") from None
    if min(shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads, shape.intermediate_size) < 1 or \
            shape.hidden_size % shape.num_attention_heads or (shape.hidden_size // shape.num_attention_heads) % 2:
        raise ModelLoadError(f"{path}: hidden_size {shape.hidden_size} does not split into "
                             f"{shape.num_attention_heads} heads of an even width")
    return shape


def canonical_name(name: str) -> str:
    """A checkpoint's tensor name in the base model's spelling (``EsmModel``, ``EsmcModel``): no masked-LM prefix,
    LayerNorms as weight/bias."""
    for family in FAMILIES.values():
        if name.startswith(family.prefix + "."):
            name = name[len(family.prefix) + 1:]
            break
    if name.endswith(".gamma"):
        name = name[:-6] + ".weight"
    elif name.endswith(".beta"):
        name = name[:-5] + ".bias"
    return name


def expected_shapes(shape: ModelShape) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(tensors every checkpoint of the family holds, tensors it may hold: the LM head, ESM-2's contact head),
    name → shape."""
    family: Family = FAMILIES[shape.family]
    d, f, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    need: dict[str, tuple[int, ...]] = {family.embeddings + ".weight": (v, d), family.final_norm + ".weight": (d,)}
    if family.final_norm_bias:
        need[family.final_norm + ".bias"] = (d,)
    for i in range(shape.num_hidden_layers):
        p = family.layer_prefix(i)
        linears = [(family.q, d, d), (family.k, d, d), (family.v, d, d), (family.o, d, d),
                   *((name, f, d) for name in family.ffn_in), (family.ffn_out, d, f)]
        for name, out, inp in linears:
            need[p + name + ".weight"] = (out, inp)
            if family.linear_bias:
                need[p + name + ".bias"] = (out,)
        for norm in (family.attn_norm, family.ffn_norm):
            need[p + norm + ".weight"], need[p + norm + ".bias"] = (d,), (d,)
        for norm in (family.q_norm, family.k_norm):
            if norm is not None:
                need[p + norm + ".weight"] = (d,)
    optional = {"lm_head.dense.weight": (d, d), "lm_head.dense.bias": (d,), "lm_head.layer_norm.weight": (d,),
                "lm_head.layer_norm.bias": (d,), "lm_head.decoder.weight": (v, d)}
    if family is ESMC:
        optional["lm_head.decoder.bias"] = (v,)
    else:
        heads = 2 * shape.num_hidden_layers * shape.num_attention_heads
        optional.update({"lm_head.bias": (v,), "contact_head.regression.weight": (1, heads // 2),
                         "contact_head.regression.bias": (1,)})
    return need, optional


def safetensors_files(folder: str | Path) -> list[Path] | None:
    """The folder's safetensors shards (one file, or those its index names); None when it has none."""
    folder = Path(folder)
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{index}: cannot read the shard index ({type(err).__name__}: {err})") from None
        return [folder / n for n in names]
    return None


def direct_folder(model: str | Path) -> Path | None:
    """The local folder :func:`load_tensors` can read for ``--model`` (a ``save_pretrained`` folder with
    safetensors, or a hub id already in the local Hugging Face cache); None when only transformers can load it
    (fair-esm ``.pt``, ``pytorch_model.bin``, quantized folders, hub ids not downloaded yet)."""
    path = Path(str(model)).expanduser()
    if not path.is_dir():
        if path.exists() or str(model).count("/") != 1:
            return None
        try:
            from huggingface_hub import try_to_load_from_cache
            found = try_to_load_from_cache(str(model), "config.json")
        except Exception:  # noqa: BLE001 - no cache, bad id: the transformers path reports it
            return None
        if not isinstance(found, str):
            return None
        path = Path(found).parent
    if not (path / "config.json").is_file() or (path / "weight_quant.json").is_file():
        return None
    return path if safetensors_files(path) else None


def load_tensors(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float16,
                 heads: bool = False) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """(the config, every tensor under its :func:`canonical_name`, on ``device`` in ``dtype``). The LM and
    contact heads are read only when ``heads`` is set. Errors name the file and the tensor: a missing or unknown
    tensor, a shape the config does not give, a value that is not finite."""
    from safetensors import SafetensorError, safe_open
    folder = Path(folder)
    shape = read_config(folder)
    need, optional = expected_shapes(shape)
    files = safetensors_files(folder)
    if not files:
        raise ModelLoadError(f"{folder}: no model.safetensors")
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device=str(device)) as fh:
                for raw in fh.keys():
                    name = canonical_name(raw)
                    if name.rsplit(".", 1)[-1] in IGNORED_BUFFERS:
                        continue
                    if name not in need and name not in optional:
                        label = FAMILIES[shape.family].label
                        raise ModelLoadError(f"{file}: unexpected tensor {raw!r} (not part of {label} with "
                                             f"{shape.num_hidden_layers} layers; is this an {label} checkpoint?)")
                    if name in out:
                        raise ModelLoadError(f"{file}: tensor {raw!r} is stored twice")
                    if name in optional and not heads:
                        continue
                    t = fh.get_tensor(raw)
                    want = need.get(name, optional.get(name))
                    if tuple(t.shape) != want:
                        raise ModelLoadError(f"{file}: tensor {raw!r} has shape {list(t.shape)}, the config "
                                             f"({folder / 'config.json'}) gives {list(want)}")
                    out[name] = t.to(dtype)
        except (OSError, SafetensorError) as err:
            raise ModelLoadError(f"{file}: cannot read ({type(err).__name__}: {str(err)[:200]})") from None
    missing = [n for n in need if n not in out]
    if missing:
        raise ModelLoadError(f"{folder}: tensor {missing[0]!r} is missing"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    check_finite(out.items(), str(folder))
    return shape, out


def check_finite(named: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """A one-line error naming the first tensor holding NaN or ±inf (one device sync for all of them)."""
    named = [(n, t) for n, t in named if t.is_floating_point()]
    if not named:
        return
    flags = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu()
    bad = [n for (n, _), ok in zip(named, flags.tolist()) if not ok]
    if bad:
        raise ModelLoadError(f"{where}: tensor {bad[0]!r} holds NaN or infinite values"
                             + (f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""))


def weights_fingerprint(arch: dict, named: Iterable[tuple[str, torch.Tensor]],
                        samples_per_tensor: int = 65_536) -> str:
    """sha256 of an architecture and its weights: names, shapes and up to 65,536 evenly spaced values of each
    tensor (as float32), in name order. Fast for 15B; any change a model file would show changes it."""
    h = hashlib.sha256(json.dumps(arch, sort_keys=True).encode())
    named = sorted(named, key=lambda x: x[0])
    samples = []
    for _, t in named:
        flat = t.detach().reshape(-1)
        samples.append(flat[:: max(1, flat.numel() // samples_per_tensor)].float())
    by_device: dict = {}  # one copy to the host per device, not one per tensor
    for i, s in enumerate(samples):
        by_device.setdefault(s.device, []).append(i)
    host: list = [None] * len(samples)
    for idx in by_device.values():
        flat = torch.cat([samples[i] for i in idx]).cpu().numpy()
        offset = 0
        for i in idx:
            host[i] = flat[offset: offset + samples[i].numel()]
            offset += samples[i].numel()
    for (name, t), values in zip(named, host):
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(values.tobytes())
    return h.hexdigest()

__all__ = ["ModelShape", "arch_of", "canonical_name", "check_finite", "direct_folder", "expected_shapes",
           "load_tensors", "read_config", "safetensors_files", "shape_of", "weights_fingerprint"]
