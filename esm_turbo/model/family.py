"""Model families, said once each: where a family keeps its layers, projections and norms, what its blocks compute
differently, and how its config reads.

Two families: ESM-2 (transformers' ``EsmForMaskedLM``, ``model_type`` ``"esm"``) and ESM C (``EsmcForMaskedLM``,
``"esmc"``). Both tokenise residues alike (``<cls>`` 0, ``<pad>`` 1, ``<eos>`` 2, residues 4–30, ``<mask>`` 32; ESM C's
vocabulary runs to 64 with unused slots), run pre-LayerNorm blocks with rotary attention and number hidden states the
same way (0 the embeddings, ``i`` block ``i``'s output, the last after the final LayerNorm). Where they differ:

==========================  ==========================  ======================================================
                            ESM-2                       ESM C
==========================  ==========================  ======================================================
projections                 q, k, v, o with biases      q, k, v, o without
query / key                 scaled, rotary              LayerNorm over the whole width (no bias), then rotary
feed-forward                fc1, erf GELU, fc2          SwiGLU: silu(gate) · up, then down; no biases
residual branches           added                       divided by sqrt(layers / 36), then added
final LayerNorm             with bias                   without
embeddings                  token-dropout rescaling     none
==========================  ==========================  ======================================================

Names below are a checkpoint's tensor names without the masked-LM wrapper's prefix (``esm.``, ``esmc.``), which are
also the modules' attribute paths in transformers' base model: one table serves loading from files and reading a
built model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    """One model family's layout. Block roles (relative to :meth:`layer_prefix`): ``attn_norm``, ``q``, ``k``,
    ``v``, ``o``, ``ffn_norm``, ``ffn_in`` (one linear, or gate and up stacked in that order), ``ffn_out``, and for
    ESM C ``q_norm``, ``k_norm``."""

    name: str  # "esm2", "esmc"
    label: str  # "ESM-2", "ESM C"
    model_type: str  # config.json's model_type
    prefix: str  # the masked-LM wrapper's attribute holding the base model
    hf_class: str  # transformers' masked-LM class
    layers_path: str  # the base model's list of blocks
    embeddings: str
    final_norm: str
    attn_norm: str
    q: str
    k: str
    v: str
    o: str
    ffn_norm: str
    ffn_in: tuple[str, ...]
    ffn_out: str
    attention: str  # the block's self-attention module (what the KV cache's attention hook replaces)
    rotary: str  # the base model's rotary module: (hidden, positions) → (cos, sin)
    q_norm: str | None = None
    k_norm: str | None = None
    linear_bias: bool = True
    final_norm_bias: bool = True
    activation: str = "gelu"  # "gelu" (erf) or "swiglu"
    residual_scaled: bool = False  # branches divided by sqrt(layers / 36)
    contacts: bool = True  # a contact head over the attention maps
    max_residues: int = 1022  # the trained context, <cls> and <eos> left out

    def layer_prefix(self, i: int) -> str:
        return f"{self.layers_path}.{i}."

    def linear_roles(self) -> tuple[str, ...]:
        """Every linear of a block, by name, in the order q, k, v, o, the feed-forward's in, its out."""
        return (self.q, self.k, self.v, self.o, *self.ffn_in, self.ffn_out)

    def residual_scale(self, layers: int) -> float:
        """What each residual branch is divided by."""
        return math.sqrt(layers / 36) if self.residual_scaled else 1.0

    def base(self, net):
        """transformers' base model (``EsmModel``, ``EsmcModel``) inside a masked-LM net, or the net itself."""
        return getattr(net, self.prefix, net)

    def layers(self, net) -> list:
        return list(self.base(net).get_submodule(self.layers_path))

    def attention_module(self, layer):
        return layer.get_submodule(self.attention)

    def set_attention_module(self, layer, module) -> None:
        parent, _, name = self.attention.rpartition(".")
        setattr(layer.get_submodule(parent), name, module)

    def ffn_in_width(self, intermediate: int) -> int:
        """Rows of the stacked feed-forward input matrix."""
        return intermediate * len(self.ffn_in)


ESM2 = Family(name="esm2", label="ESM-2", model_type="esm", prefix="esm", hf_class="EsmForMaskedLM",
              layers_path="encoder.layer", embeddings="embeddings.word_embeddings",
              final_norm="encoder.emb_layer_norm_after", attn_norm="attention.LayerNorm",
              q="attention.self.query", k="attention.self.key", v="attention.self.value", o="attention.output.dense",
              ffn_norm="LayerNorm", ffn_in=("intermediate.dense",), ffn_out="output.dense", attention="attention.self",
              rotary="rotary_embeddings")

ESMC = Family(name="esmc", label="ESM C", model_type="esmc", prefix="esmc", hf_class="EsmcForMaskedLM",
              layers_path="layers", embeddings="embed_tokens", final_norm="norm", attn_norm="input_layernorm",
              q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
              ffn_norm="post_attention_layernorm", ffn_in=("mlp.gate_proj", "mlp.up_proj"), ffn_out="mlp.down_proj",
              attention="self_attn", rotary="rotary_emb",
              q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", linear_bias=False, final_norm_bias=False,
              activation="swiglu", residual_scaled=True, contacts=False, max_residues=2046)

FAMILIES: dict[str, Family] = {f.name: f for f in (ESM2, ESMC)}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}
#: the longest trained context of any family (residues a pass)
MAX_CONTEXT = max(f.max_residues for f in FAMILIES.values())


def family_of(config) -> Family:
    """The family of a config: transformers' (``EsmConfig``, ``EsmcConfig``), a :class:`~esm_turbo.model.folder.
    ModelShape` or a config.json dict."""
    family = getattr(config, "family", None)
    if isinstance(family, str) and family in FAMILIES:
        return FAMILIES[family]
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if model_type not in _BY_MODEL_TYPE:
        raise ModelLoadError(f"model_type {model_type!r} is neither ESM-2 ('esm') nor ESM C ('esmc')")
    return _BY_MODEL_TYPE[model_type]


def family_of_net(net) -> Family:
    """The family of a transformers model (masked-LM or base)."""
    return family_of(net.config)


def hf_masked_lm_class(family: Family):
    """transformers' masked-LM class of a family, or a one-line error when this transformers lacks it."""
    import transformers
    cls = getattr(transformers, family.hf_class, None)
    if cls is None:
        raise ModelLoadError(f"{family.label} needs transformers with {family.hf_class} (5.x or newer); this one is "
                             f"{transformers.__version__}")
    return cls


__all__ = ["ESM2", "ESMC", "FAMILIES", "MAX_CONTEXT", "Family", "family_of", "family_of_net", "hf_masked_lm_class"]
