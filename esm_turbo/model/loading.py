"""Load ESM-2 or ESM C from a hub id, a local ``save_pretrained`` directory or a weight file of the original packages
(a fair-esm ``.pt`` checkpoint, the ESM C package's ``.pth``).

Weight files are converted once, at the edge, into transformers' ``EsmForMaskedLM`` / ``EsmcForMaskedLM`` layout, so
the rest of the package never branches on checkpoint format.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
from pathlib import Path

import torch
from transformers import EsmConfig, EsmForMaskedLM

from ..errors import ModelLoadError
from .family import ESM2, Family, family_of, hf_masked_lm_class
from .folder import IGNORED_BUFFERS, arch_of, weights_fingerprint
from .sizes import esm2_config, resolve_model_id

log = logging.getLogger(__name__)

_FAIR_PREFIX = re.compile(r"^(encoder\.sentence_encoder\.|encoder\.)")
_LAYER_MAP = {
    "self_attn.q_proj": "attention.self.query",
    "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value",
    "self_attn.out_proj": "attention.output.dense",
    "self_attn_layer_norm": "attention.LayerNorm",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
    "final_layer_norm": "LayerNorm",
}
_TOP_MAP = {
    "embed_tokens.weight": "esm.embeddings.word_embeddings.weight",
    "emb_layer_norm_after.weight": "esm.encoder.emb_layer_norm_after.weight",
    "emb_layer_norm_after.bias": "esm.encoder.emb_layer_norm_after.bias",
    "contact_head.regression.weight": "esm.contact_head.regression.weight",
    "contact_head.regression.bias": "esm.contact_head.regression.bias",
    "lm_head.dense.weight": "lm_head.dense.weight",
    "lm_head.dense.bias": "lm_head.dense.bias",
    "lm_head.layer_norm.weight": "lm_head.layer_norm.weight",
    "lm_head.layer_norm.bias": "lm_head.layer_norm.bias",
    "lm_head.weight": "lm_head.decoder.weight",
    "lm_head.bias": "lm_head.bias",
}


def _cfg_get(cfg, name: str):
    return cfg[name] if isinstance(cfg, dict) else getattr(cfg, name)


def convert_fair_esm(model_data: dict) -> tuple[EsmConfig, dict[str, torch.Tensor]]:
    """fair-esm ESM-2 checkpoint dict (``{"model": state, "cfg": {"model": args}}``) →
    (EsmConfig, state dict for ``EsmForMaskedLM``)."""
    try:
        cfg = model_data["cfg"]["model"]
        state = model_data["model"]
        layers = int(_cfg_get(cfg, "encoder_layers"))
        hidden = int(_cfg_get(cfg, "encoder_embed_dim"))
        heads = int(_cfg_get(cfg, "encoder_attention_heads"))
        token_dropout = bool(_cfg_get(cfg, "token_dropout"))
    except (KeyError, AttributeError, TypeError) as err:
        raise ModelLoadError(f"neither a fair-esm ESM-2 checkpoint (missing {err}) nor the ESM C package's "
                             f"weights") from None
    config = esm2_config(layers=layers, hidden=hidden, heads=heads, token_dropout=token_dropout)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        name = _FAIR_PREFIX.sub("", name)
        if name in _TOP_MAP:
            out[_TOP_MAP[name]] = tensor
            continue
        m = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias|inv_freq)$", name)
        if m is None:
            raise ModelLoadError(f"fair-esm checkpoint: unexpected parameter {name!r}")
        i, module, kind = m.groups()
        if module == "self_attn.rot_emb":
            continue  # recomputed by transformers from the config
        if module not in _LAYER_MAP:
            raise ModelLoadError(f"fair-esm checkpoint: unexpected parameter {name!r}")
        out[f"esm.encoder.layer.{i}.{_LAYER_MAP[module]}.{kind}"] = tensor
    return config, out


def load_weight_file(path: str | Path):
    """Load a weight file: a fair-esm ``.pt`` ESM-2 checkpoint or the original ESM C package's ``.pth`` state dict
    (:mod:`esm_turbo.model.esmc_original`), read with ``weights_only`` (argparse.Namespace allowed), converted into
    transformers' ``EsmForMaskedLM`` / ``EsmcForMaskedLM``."""
    from .esmc_original import convert_esmc_original, is_esmc_original
    path = Path(path)
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - surface any unpickling failure with the path
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            raise ModelLoadError(f"{path}: cannot read as a fair-esm checkpoint ({type(err).__name__}: "
                                 f"{first})") from None
    if is_esmc_original(data):
        config, state = convert_esmc_original(data, str(path))
        model = hf_masked_lm_class(family_of(config))(config)
    else:
        config, state = convert_fair_esm(data)
        model = EsmForMaskedLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "contact_head" not in k and "position_ids" not in k
               and "inv_freq" not in k]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: converted checkpoint does not fit {family_of(config).label} "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.tie_weights()
    return model


#: names a transformers ESM-2 checkpoint may lack without loss: buffers recomputed from the config, and the contact
#: head, which only contact maps read
_MAY_LACK = (*IGNORED_BUFFERS, "contact_head.")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' own report of a load and its loading bar (printed before our one-line error) silenced while
    loading, unless esm_turbo's own logging is verbose."""
    from transformers.utils import logging as hf_logging
    if logging.getLogger("esm_turbo").isEnabledFor(logging.INFO):
        yield
        return
    level, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


def _from_pretrained(source, where: str, dtype: torch.dtype, family: Family | None = None, **kwargs):
    """transformers' ``from_pretrained`` of the family's masked-LM class (``AutoModelForMaskedLM`` when the family is
    not known yet, a hub id), refusing in one line naming the tensor a checkpoint missing a weight, holding one the
    model does not have, or one of another shape than the config gives (transformers would fill them with random
    values and go on)."""
    if family is None:
        from transformers import AutoModelForMaskedLM as cls
    else:
        cls = hf_masked_lm_class(family)
    with _quiet_transformers():
        net, info = cls.from_pretrained(source, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True,
                                        **kwargs)
    family = family_of(net.config)
    missing = [k for k in info.get("missing_keys", []) if not any(m in k for m in _MAY_LACK)]
    if missing:
        raise ModelLoadError(f"{where}: tensor {missing[0]!r} is missing" +
                             (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = [k for k in info.get("unexpected_keys", []) if not any(m in k for m in _MAY_LACK)]
    if unexpected:
        raise ModelLoadError(f"{where}: unexpected tensor {unexpected[0]!r} (not part of this {family.label}; is it "
                             f"an {family.label} checkpoint, and its config.json the one it was saved with?)")
    for name, got, want in info.get("mismatched_keys", []):
        raise ModelLoadError(f"{where}: tensor {name!r} has shape {list(got)}, the config gives {list(want)}")
    return net


def _hub_unreachable(timeout: float = 1.0) -> str | None:
    """Why the Hugging Face hub cannot be reached from here (no route to its host within ``timeout``), or None.
    Behind a proxy the answer is left to the download itself."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    import socket
    from urllib.parse import urlparse
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as err:
        return f"{host} is unreachable ({type(err).__name__})"
    return None


def load_esm(model: str | Path, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu"):
    """Load ESM-2 (``EsmForMaskedLM``) or ESM C (``EsmcForMaskedLM``) for masked-LM inference in eval mode, checked:
    every weight present, of the shape its config gives, finite.

    ``model``: a size name (``8M`` … ``15B``, ``ESMC-300M`` …), a hub id (``facebook/esm2_t33_650M_UR50D``,
    ``biohub/ESMC-300M``), a local directory written by ``save_pretrained`` or by ``esm-turbo quantize-weights``, or
    a weight file (:func:`load_weight_file`: fair-esm ``.pt``, the ESM C package's ``.pth``).
    A transformers checkpoint is read straight into ``dtype`` (no float32 copy of a 16-bit model).
    """
    from ..weights.model import is_quantized_dir, load_quantized
    from .folder import check_finite
    path = Path(str(model)).expanduser()
    if path.is_file():
        net = load_weight_file(path)
    elif is_quantized_dir(path):  # esm-turbo quantize-weights
        net = load_quantized(path)
    elif path.is_dir():
        family = None
        if (path / "config.json").is_file():
            from .folder import read_config
            family = family_of(read_config(path))  # an ESM-2 or ESM C config, or a one-line error naming the field
        try:
            net = _from_pretrained(path, str(path), dtype, family)
        except ModelLoadError:
            raise
        except Exception as err:  # noqa: BLE001
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise ModelLoadError(f"{path}: not a transformers ESM-2 or ESM C directory ({first})") from None
    else:
        hub_id = resolve_model_id(str(model))
        try:
            net = _from_pretrained(hub_id, hub_id, dtype, local_files_only=True)
        except ModelLoadError:
            raise
        except Exception:  # noqa: BLE001 - not in the local HF cache: try the hub unless offline or unreachable
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
            try:
                if offline:
                    raise OSError("HF_HUB_OFFLINE is set")
                unreachable = _hub_unreachable()
                if unreachable:
                    raise OSError(unreachable)
                net = _from_pretrained(hub_id, hub_id, dtype)
            except ModelLoadError:
                raise
            except Exception as err:  # noqa: BLE001
                raise ModelLoadError(
                    f"cannot load {model!r} from the Hugging Face hub ({type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}). Without internet, pass "
                    f"a local path instead: a directory written by save_pretrained (e.g. --model "
                    f"/models/esm2_t33_650M_UR50D) or a fair-esm .pt file (e.g. --model "
                    f"~/.cache/torch/hub/checkpoints/esm2_t33_650M_UR50D.pt)."
                ) from None
    family = family_of(net.config)  # ESM-2 or ESM C, or a one-line error
    if family is ESM2 and getattr(net.config, "position_embedding_type", "") != "rotary":
        raise ModelLoadError(f"{model}: only ESM-2 (rotary position embeddings) is supported")
    net = net.to(device=device, dtype=dtype).eval()
    check_finite(net.state_dict().items(), str(model))
    return net


def model_fingerprint(model, samples_per_tensor: int = 65_536) -> str:
    """sha256 of the architecture and the weights (shapes + up to 65 536 evenly spaced values of
    every tensor), so a calibration made for one model is recognised on another. Fast for 15B."""
    cfg = model.config
    if family_of(cfg) is ESM2:  # the fields ESM-2 calibrations were always fingerprinted with
        arch = {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "intermediate_size", "vocab_size", "token_dropout")}
    else:
        arch = arch_of(cfg)
    return weights_fingerprint(arch, model.state_dict().items(), samples_per_tensor)
