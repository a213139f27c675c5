"""A whole ESM-2 with quantized linear layers: quantize it, save it, load it, account for its bytes.

The checkpoint is a folder, self-contained (no fp16 copy of the model is needed to load it, so a model that does not
fit a GPU in fp16 can be loaded onto it):

* ``config.json``: the transformers ``EsmConfig``;
* ``weights.safetensors``: every tensor of the model, the quantized linears as their codes, scales and codebooks,
  the rest (embeddings, LayerNorms, the LM head) in fp16; metadata ``esm_turbo_weights`` (JSON): format version,
  bits, group, passes, seed, which linears are quantized, the source model's name and fingerprint; and
  ``esm_turbo_content_sha256``, the hash of every tensor's bytes.

The folder is written whole under a temporary name and renamed; loading checks the content hash (bytes changed on
disk are refused), the metadata, the tensors' shapes against ``config.json``, completeness and the format version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import CheckpointError
from .codec import WeightQuantConfig
from .fusion import fuse_blocks
from .linear import QuantizedLinear

FORMAT_VERSION = 1
META_KEY = "esm_turbo_weights"
#: the safetensors metadata key of the tensors' sha256 (:func:`content_hash`)
CONTENT_KEY = "esm_turbo_content_sha256"
WEIGHTS_FILE = "weights.safetensors"


def block_linears(model) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, parent module, attribute) of every block linear of an ``EsmForMaskedLM`` or
    ``EsmcForMaskedLM`` (:meth:`~esm_turbo.model.family.Family.linear_roles`: q, k, v, o, the feed-forward's)."""
    from ..model.family import family_of_net
    family = family_of_net(model)
    out = []
    for i, layer in enumerate(family.layers(model)):
        for path in family.linear_roles():
            parent_path, _, attr = path.rpartition(".")
            out.append((f"{family.prefix}.{family.layer_prefix(i)}{path}", layer.get_submodule(parent_path), attr))
    return out


def quantize_model(model, config: WeightQuantConfig, source: str = "", progress: bool = False):
    """Replace every block linear of ``model`` (in place) by a :class:`QuantizedLinear` and round the other
    parameters to fp16 values (as the checkpoint stores them); returns the model with its quantization recorded in
    ``model.weight_quant`` (a dict, the checkpoint's metadata)."""
    from tqdm.auto import tqdm

    from ..model.loading import model_fingerprint
    fingerprint = model_fingerprint(model)
    names = []
    for k, (name, parent, attr) in enumerate(tqdm(block_linears(model), desc="quantize weights", disable=not progress)):
        linear = getattr(parent, attr)
        setattr(parent, attr, QuantizedLinear.from_linear(linear, config, config.seed + k))
        names.append(name)
    with torch.no_grad():  # the rest is stored in fp16: round it here too, so the model is what its checkpoint holds
        for p in model.parameters():
            p.copy_(p.half().to(p.dtype))
    model.weight_quant = dict(format_version=FORMAT_VERSION, config=asdict(config), quantized=names,
                              source_model=str(source), source_fingerprint=fingerprint)
    fuse_blocks(model)
    return model


def is_quantized_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / WEIGHTS_FILE).is_file()


def content_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and the sha256 of its bytes, in name order: what a quantized
    folder's metadata records at save and its loading checks, so bytes changed on disk are refused, not embedded
    with. The tensors are hashed on several threads (hashlib releases the interpreter lock)."""
    from concurrent.futures import ThreadPoolExecutor

    def digest(t: torch.Tensor) -> bytes:
        return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).digest()
    names = sorted(tensors)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(digest, (tensors[n] for n in names)))
    h = hashlib.sha256()
    for name, d in zip(names, digests):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode() + d)
    return h.hexdigest()


def save_quantized(model, out: str | Path) -> Path:
    """Write ``model`` (quantized by :func:`quantize_model`) to the folder ``out``: into a temporary folder beside it,
    renamed to ``out`` once whole (a killed save leaves no half folder; ``out`` must not exist or be empty)."""
    out = Path(out)
    meta = getattr(model, "weight_quant", None)
    if getattr(model, "residual_offload", None) is not None:
        raise ValueError("the model's residual pass is offloaded (its device copies are per-layer slots): save the "
                         "model before offload_residual")
    if meta is None:
        raise ValueError("the model has no quantized weights: run quantize_model first")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        keep = "inv_freq" in name or not t.is_floating_point()  # rotary frequencies stay exact
        t = (t if keep else t.to(torch.float16)).contiguous()
        part = t.untyped_storage().nbytes() != t.numel() * t.element_size()  # a view into a stack (SharedInput)
        tensors[name] = t.clone() if part else t
    if model.config.tie_word_embeddings:  # one copy of the tied LM decoder
        tensors.pop("lm_head.decoder.weight", None)
    header = {META_KEY: json.dumps(meta, sort_keys=True), CONTENT_KEY: content_hash(tensors)}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        (tmp / "config.json").write_text(model.config.to_json_string())
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=header)
        os.chmod(tmp, 0o777 & ~_umask())
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _quantized_shell(config, quant: WeightQuantConfig, shape_of: Callable[[str, int], tuple[int, int]]):
    """An ``EsmForMaskedLM`` (``EsmcForMaskedLM``) of ``config`` on the meta device whose block linears are
    :class:`QuantizedLinear` (no memory is allocated); ``shape_of(name, in_features)`` gives each one's (group,
    passes)."""
    from ..model.family import family_of, hf_masked_lm_class
    with torch.device("meta"):
        model = hf_masked_lm_class(family_of(config))(config)
        for k, (name, parent, attr) in enumerate(block_linears(model)):
            linear = getattr(parent, attr)
            group, passes = shape_of(name, linear.in_features)
            setattr(parent, attr, QuantizedLinear(linear.in_features, linear.out_features, quant.bits, group, passes,
                                                  quant.seed + k, linear.bias is not None))
    fuse_blocks(model)
    return model


def random_model(config, device: torch.device | str, quant: WeightQuantConfig | None = WeightQuantConfig(),
                 dtype: torch.dtype = torch.float16, seed: int = 0):
    """An ``EsmForMaskedLM`` (``EsmcForMaskedLM``) of ``config``'s shape built straight on ``device`` with random
    weights (speed and memory do not depend on the values): with ``quant``, :class:`QuantizedLinear` block linears
    holding random codes and no fp16 copy of the model at any point (a stand-in for a quantized model too large to
    quantize here); None: plain linears. LayerNorms are the identity, the rotary frequencies the default ones."""
    from ..model.family import family_of, hf_masked_lm_class

    from .codec import group_size
    if quant is None:
        with torch.device("meta"):
            model = hf_masked_lm_class(family_of(config))(config)
    else:
        model = _quantized_shell(config, quant, lambda name, n: (group_size(n, quant.group), 1 + quant.residual))
    model.to_empty(device=device)
    model.tie_weights()  # the LM head's decoder is the embedding matrix again (to_empty gave each its own)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if t.dtype == torch.uint8:  # codes
                t.copy_(torch.randint(0, 256, t.shape, device=device, dtype=torch.uint8, generator=gen))
            elif leaf.startswith("codebook"):
                t.copy_(torch.linspace(-2.5, 2.5, t.numel()))
            elif leaf.startswith("scales"):
                t.fill_(0.02)
            elif leaf in ("inv_freq", "original_inv_freq"):
                dim = 2 * t.numel()
                t.copy_(1.0 / 10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
            elif leaf == "position_ids":
                t.copy_(torch.arange(t.numel(), device=device).view(t.shape))
            elif t.is_floating_point():
                if t.dim() > 1:
                    t.normal_(0.0, 0.02, generator=gen)
                else:  # LayerNorm weights 1, biases 0
                    t.fill_(1.0 if leaf == "weight" else 0.0)
    return model.to(dtype).eval()


def load_quantized(path: str | Path):
    """An ``EsmForMaskedLM`` (``EsmcForMaskedLM``) with :class:`QuantizedLinear` block linears from a folder of
    :func:`save_quantized`."""
    from ..model.family import family_of, hf_masked_lm_class
    path = Path(path)
    try:
        config_class = hf_masked_lm_class(family_of(json.loads((path / "config.json").read_text()))).config_class
        config = config_class.from_json_file(str(path / "config.json"))
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as fh:
            header = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as err:  # noqa: BLE001 - truncated, missing or not safetensors
        raise CheckpointError(f"{path}: not a readable quantized-weights checkpoint ({type(err).__name__}: "
                              f"{str(err)[:200]})") from None
    if META_KEY not in header:
        raise CheckpointError(f"{path / WEIGHTS_FILE}: safetensors file without {META_KEY} metadata")
    try:
        meta = json.loads(header[META_KEY])
        version = meta.get("format_version")
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{path / WEIGHTS_FILE}: its {META_KEY} metadata is not a JSON object "
                              f"({type(err).__name__}); quantize again with `esm-turbo quantize-weights`") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: quantized-weights format {version}, this esm_turbo reads "
                              f"format {FORMAT_VERSION}: quantize again with `esm-turbo quantize-weights`")
    expected = header.get(CONTENT_KEY)
    if expected is not None and content_hash(tensors) != expected:
        raise CheckpointError(f"{path / WEIGHTS_FILE}: its tensors are not the ones saved (content hash differs): "
                              f"the file was changed or damaged; quantize again")
    try:
        cfg = WeightQuantConfig(**meta["config"])
        for key in ("quantized", "source_model", "source_fingerprint"):
            meta[key]  # noqa: B018 - every field a saved folder has
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / WEIGHTS_FILE}: its {META_KEY} metadata has a missing or unknown field "
                              f"({type(err).__name__}: {str(err)[:120]}); quantize again") from None

    def stored(name: str, in_features: int) -> tuple[int, int]:
        if f"{name}.scales0" not in tensors:
            raise CheckpointError(f"{path}: incomplete checkpoint (no codes for {name})")
        return in_features // tensors[f"{name}.scales0"].shape[1], 2 if f"{name}.codes1" in tensors else 1

    model = _quantized_shell(config, cfg, stored)
    model = model.to_empty(device="cpu")
    if config.tie_word_embeddings and "esm.embeddings.word_embeddings.weight" in tensors:
        tensors["lm_head.decoder.weight"] = tensors["esm.embeddings.word_embeddings.weight"]
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, t in tensors.items():
        if name in shapes and tuple(t.shape) != shapes[name]:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(t.shape)}, its config.json gives "
                                  f"{list(shapes[name])}")
    missing, unexpected = model.load_state_dict({k: v.float() if v.dtype == torch.float16 and "scales" not in k
                                                 and "codebook" not in k else v for k, v in tensors.items()},
                                                strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: incomplete checkpoint (missing {missing[:4]}, unexpected {unexpected[:4]})")
    _restore_buffers(model)
    model.tie_weights()
    model.weight_quant = meta
    return model.eval()


def _restore_buffers(model) -> None:
    """Buffers no checkpoint stores (non-persistent: position ids, rotary frequencies), left uninitialised by
    ``to_empty``: rebuilt as the model's constructor builds them."""
    for module in model.modules():
        for name in list(getattr(module, "_non_persistent_buffers_set", ())):
            buf = getattr(module, name)
            if name == "position_ids":
                setattr(module, name, torch.arange(buf.shape[-1]).expand(buf.shape).clone())
            elif name in ("inv_freq", "original_inv_freq") and hasattr(module, "compute_default_rope_parameters"):
                setattr(module, name, module.compute_default_rope_parameters(model.config)[0])
            else:
                raise CheckpointError(f"cannot rebuild the buffer {name!r} of {type(module).__name__}")


def weight_memory(model) -> dict:
    """Bytes of the model's weights as held: quantized linears (codes, scales, codebooks), everything else, and the
    same model's fp16 and fp32 bytes (every parameter at 2 and 4 bytes). With the residual pass offloaded
    (``weights.offload``), the quantized bytes count its device slots, and ``host_bytes`` its pinned host copy."""
    quantized = other = 0
    params = 0
    offload = getattr(model, "residual_offload", None)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            if offload is None:
                quantized += module.nbytes()
            else:  # the first pass and every codebook stay on the device
                quantized += module._pass(0).nbytes() + sum(getattr(module, f"codebook{p}").nbytes
                                                             for p in range(1, module.passes))
            params += module.in_features * module.out_features
    if offload is not None:
        quantized += offload.device_bytes
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        other += p.numel() * 2  # held in fp16
        params += p.numel()
    return dict(quantized_linear_bytes=quantized, other_bytes_fp16=other, total_bytes=quantized + other,
                fp16_bytes=2 * params, fp32_bytes=4 * params, ratio_vs_fp16=(quantized + other) / (2 * params),
                host_bytes=offload.host_bytes if offload is not None else 0)


def estimate_bytes(config, quant: WeightQuantConfig) -> dict:
    """:func:`weight_memory` of an ESM-2 of ``config`` (an ``EsmConfig``) quantized by ``quant``, counted on a shell of
    the model on the meta device: for sizes that do not fit here (15B)."""
    from .codec import group_size
    passes = 2 if quant.residual else 1
    return weight_memory(_quantized_shell(config, quant, lambda name, n: (group_size(n, quant.group), passes)))
