"""ESM-2 weights read straight from a transformers folder (``config.json`` + ``model.safetensors``), without
transformers: what :class:`~esm_turbo.embed.fast_esm.FastEsm` needs to embed, put on the device in the dtype it runs
in, and checked on the way (every tensor present, of the shape the config gives, finite; nothing unknown).

Importing transformers and building ``EsmForMaskedLM`` costs seconds at every start; this path costs the read. Names
are taken in every spelling a transformers ESM-2 checkpoint uses: with or without the ``esm.`` prefix (``EsmModel``
vs ``EsmForMaskedLM``), and LayerNorm parameters as ``weight``/``bias`` or ``gamma``/``beta``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..errors import ModelLoadError

#: buffers some checkpoints carry that the model recomputes
IGNORED_BUFFERS = ("position_ids", "inv_freq")


@dataclass(frozen=True)
class Esm2Shape:
    """What FastEsm reads of an ESM-2 config (the attribute names of transformers' ``EsmConfig``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int = 33
    layer_norm_eps: float = 1e-5
    token_dropout: bool = True
    mask_token_id: int = 32
    pad_token_id: int = 1
    #: the dtype the checkpoint was saved in (transformers builds the model in it, rotary buffers included)
    stored_dtype: str = "float32"

    def arch(self) -> dict:
        """The fields that say what the model computes (for fingerprints)."""
        return arch_of(self)


#: the :class:`Esm2Shape` fields that say what a model computes (not how its file stores it)
ARCH_FIELDS = tuple(f.name for f in fields(Esm2Shape) if f.name != "stored_dtype")


def arch_of(config) -> dict:
    """:data:`ARCH_FIELDS` of any ESM-2 config (an :class:`Esm2Shape` or transformers' ``EsmConfig``)."""
    return {name: getattr(config, name) for name in ARCH_FIELDS}


def read_config(folder: str | Path) -> Esm2Shape:
    """``folder/config.json`` as an :class:`Esm2Shape`; errors name the file and the field."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot read the model config ({type(err).__name__}: {err})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "esm":
        kind = cfg.get("model_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise ModelLoadError(f"{path}: model_type {kind!r} is not ESM-2 ('esm')")
    if cfg.get("position_embedding_type") != "rotary" or cfg.get("emb_layer_norm_before") or cfg.get(
            "is_folding_model"):
        raise ModelLoadError(f"{path}: only ESM-2 (rotary position embeddings, no embedding LayerNorm) is supported")
    try:
        # transformers' EsmConfig defaults, for configs written with only what differs from them
        shape = Esm2Shape(hidden_size=int(cfg.get("hidden_size", 768)),
                          num_hidden_layers=int(cfg.get("num_hidden_layers", 12)),
                          num_attention_heads=int(cfg.get("num_attention_heads", 12)),
                          intermediate_size=int(cfg.get("intermediate_size", 3072)),
                          vocab_size=int(cfg["vocab_size"]), layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                          token_dropout=bool(cfg.get("token_dropout", False)),
                          mask_token_id=int(cfg["mask_token_id"]), pad_token_id=int(cfg["pad_token_id"]),
                          stored_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{path}: field {err} is missing or not a number") from None
    if min(shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads, shape.intermediate_size) < 1 or \
            shape.hidden_size % shape.num_attention_heads or (shape.hidden_size // shape.num_attention_heads) % 2:
        raise ModelLoadError(f"{path}: hidden_size {shape.hidden_size} does not split into "
                             f"{shape.num_attention_heads} heads of an even width")
    return shape


def canonical_name(name: str) -> str:
    """A checkpoint's tensor name in ``EsmModel``'s spelling: no ``esm.`` prefix, LayerNorms as weight/bias."""
    if name.startswith("esm."):
        name = name[4:]
    if name.endswith(".gamma"):
        name = name[:-6] + ".weight"
    elif name.endswith(".beta"):
        name = name[:-5] + ".bias"
    return name


def expected_shapes(shape: Esm2Shape) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(tensors every ESM-2 checkpoint holds, tensors it may hold: the LM and contact heads), name → shape."""
    d, f, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    need: dict[str, tuple[int, ...]] = {"embeddings.word_embeddings.weight": (v, d),
                                        "encoder.emb_layer_norm_after.weight": (d,),
                                        "encoder.emb_layer_norm_after.bias": (d,)}
    for i in range(shape.num_hidden_layers):
        p = f"encoder.layer.{i}."
        for name, out, inp in (("attention.self.query", d, d), ("attention.self.key", d, d),
                               ("attention.self.value", d, d), ("attention.output.dense", d, d),
                               ("intermediate.dense", f, d), ("output.dense", d, f)):
            need[p + name + ".weight"], need[p + name + ".bias"] = (out, inp), (out,)
        for norm in ("attention.LayerNorm", "LayerNorm"):
            need[p + norm + ".weight"], need[p + norm + ".bias"] = (d,), (d,)
    heads = 2 * shape.num_hidden_layers * shape.num_attention_heads
    optional = {"lm_head.dense.weight": (d, d), "lm_head.dense.bias": (d,), "lm_head.layer_norm.weight": (d,),
                "lm_head.layer_norm.bias": (d,), "lm_head.bias": (v,), "lm_head.decoder.weight": (v, d),
                "contact_head.regression.weight": (1, heads // 2), "contact_head.regression.bias": (1,)}
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
                 heads: bool = False) -> tuple[Esm2Shape, dict[str, torch.Tensor]]:
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
                        raise ModelLoadError(f"{file}: unexpected tensor {raw!r} (not part of ESM-2 with "
                                             f"{shape.num_hidden_layers} layers; is this an ESM-2 checkpoint?)")
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

__all__ = ["Esm2Shape", "canonical_name", "check_finite", "direct_folder", "expected_shapes", "load_tensors",
           "read_config", "safetensors_files", "weights_fingerprint"]
