"""The original ESM C package's weight files (``esmc_300m_2024_12_v0.pth`` and the like: a state dict of
``esm.models.esmc.ESMC``) converted once, at the edge, into transformers' ``EsmcForMaskedLM`` layout.

That package keeps each block's LayerNorm and fused projection together (``attn.layernorm_qkv.0`` and ``.1``, q, k and
v stacked), the query/key LayerNorms as ``attn.q_ln``/``attn.k_ln``, the feed-forward as one sequence (``ffn.0``
LayerNorm, ``ffn.1`` gate and up stacked, ``ffn.3`` down), the final LayerNorm as ``transformer.norm`` and the
masked-LM head as ``sequence_head`` (``.0`` dense, ``.2`` LayerNorm, ``.3`` decoder). The file holds no config: the
shapes give the width, the depth and the feed-forward width, and the heads are 64 wide, as at every released size
(300M: 15 heads of 960, 600M: 18 of 1,152, 6B: 40 of 2,560).
"""

from __future__ import annotations

import re

import torch

from ..errors import ModelLoadError

HEAD_WIDTH = 64
_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.(.+)$")
#: block tensor in the original file → its name in EsmcModel's layer (None: split, see ``_SPLIT``)
_BLOCK_MAP = {"attn.layernorm_qkv.0.weight": "input_layernorm.weight",
              "attn.layernorm_qkv.0.bias": "input_layernorm.bias",
              "attn.out_proj.weight": "self_attn.o_proj.weight", "attn.q_ln.weight": "self_attn.q_norm.weight",
              "attn.k_ln.weight": "self_attn.k_norm.weight", "ffn.0.weight": "post_attention_layernorm.weight",
              "ffn.0.bias": "post_attention_layernorm.bias", "ffn.3.weight": "mlp.down_proj.weight"}
#: stacked block tensors → the names of their equal parts, in order
_SPLIT = {"attn.layernorm_qkv.1.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"),
          "ffn.1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
_TOP_MAP = {"embed.weight": "esmc.embed_tokens.weight", "transformer.norm.weight": "esmc.norm.weight",
            "sequence_head.0.weight": "lm_head.dense.weight", "sequence_head.0.bias": "lm_head.dense.bias",
            "sequence_head.2.weight": "lm_head.layer_norm.weight", "sequence_head.2.bias": "lm_head.layer_norm.bias",
            "sequence_head.3.weight": "lm_head.decoder.weight", "sequence_head.3.bias": "lm_head.decoder.bias"}


def is_esmc_original(data) -> bool:
    """Whether a loaded file looks like the ESM C package's state dict."""
    return isinstance(data, dict) and "embed.weight" in data and any(
        isinstance(k, str) and k.startswith("transformer.blocks.") for k in data)


def convert_esmc_original(state: dict[str, torch.Tensor], where: str = "ESM C weights"):
    """The ESM C package's state dict → (``EsmcConfig``, state dict for ``EsmcForMaskedLM``); errors name the
    tensor."""
    from .sizes import esmc_config
    out: dict[str, torch.Tensor] = {}
    layers = set()
    for name, tensor in state.items():
        if name in _TOP_MAP:
            out[_TOP_MAP[name]] = tensor
            continue
        m = _BLOCK.match(name)
        if m is None or (m.group(2) not in _BLOCK_MAP and m.group(2) not in _SPLIT):
            raise ModelLoadError(f"{where}: unexpected tensor {name!r} (not part of ESM C)")
        i, rest = m.groups()
        layers.add(int(i))
        prefix = f"esmc.layers.{i}."
        if rest in _SPLIT:
            parts = _SPLIT[rest]
            if tensor.shape[0] % len(parts):
                raise ModelLoadError(f"{where}: tensor {name!r} of shape {list(tensor.shape)} does not split into "
                                     f"{len(parts)}")
            for part, piece in zip(parts, tensor.chunk(len(parts))):
                out[prefix + part] = piece.contiguous()
        else:
            out[prefix + _BLOCK_MAP[rest]] = tensor
    if "embed.weight" not in state or not layers or layers != set(range(len(layers))):
        raise ModelLoadError(f"{where}: not the ESM C package's weights (no embeddings, or blocks missing)")
    hidden = state["embed.weight"].shape[1]
    gate_up = state.get("transformer.blocks.0.ffn.1.weight")
    if hidden % HEAD_WIDTH or gate_up is None:
        raise ModelLoadError(f"{where}: width {hidden} is not a whole number of {HEAD_WIDTH}-wide heads")
    config = esmc_config(layers=len(layers), hidden=hidden, heads=hidden // HEAD_WIDTH,
                         intermediate=gate_up.shape[0] // 2, vocab_size=state["embed.weight"].shape[0])
    return config, out


__all__ = ["HEAD_WIDTH", "convert_esmc_original", "is_esmc_original"]
