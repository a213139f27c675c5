"""The released sizes of ESM-2 and ESM C as data (one row each), and transformers configs built from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import EsmConfig

#: name → (layers, hidden size, attention heads, Hugging Face hub id)
ESM2_SIZES: dict[str, tuple[int, int, int, str]] = {
    "8M": (6, 320, 20, "facebook/esm2_t6_8M_UR50D"),
    "35M": (12, 480, 20, "facebook/esm2_t12_35M_UR50D"),
    "150M": (30, 640, 20, "facebook/esm2_t30_150M_UR50D"),
    "650M": (33, 1280, 20, "facebook/esm2_t33_650M_UR50D"),
    "3B": (36, 2560, 40, "facebook/esm2_t36_3B_UR50D"),
    "15B": (48, 5120, 40, "facebook/esm2_t48_15B_UR50D"),
}

#: name → (layers, hidden size, attention heads, feed-forward width, Hugging Face hub id). Heads of 64 throughout.
ESMC_SIZES: dict[str, tuple[int, int, int, int, str]] = {
    "ESMC-300M": (30, 960, 15, 2560, "biohub/ESMC-300M"),
    "ESMC-600M": (36, 1152, 18, 3072, "biohub/ESMC-600M"),
    "ESMC-6B": (80, 2560, 40, 6912, "biohub/ESMC-6B"),
}


def resolve_model_id(model: str) -> str:
    """Short size names (``650M``, ``ESMC-300M``) → hub ids; anything else is returned as given."""
    if model in ESM2_SIZES:
        return ESM2_SIZES[model][3]
    return ESMC_SIZES[model][4] if model in ESMC_SIZES else model


#: the trained context of ESM-2: 1024 positions = 1022 residues + <cls> + <eos>
MAX_RESIDUES = 1022


def esm2_config(size: str | None = None, *, layers: int | None = None, hidden: int | None = None,
                heads: int | None = None, **overrides) -> EsmConfig:
    """An EsmConfig shaped like a released ESM-2 size (or custom dims), as the hub configs set it."""
    from transformers import EsmConfig
    if size is not None:
        if size not in ESM2_SIZES:
            raise ValueError(f"unknown ESM-2 size {size!r}: choose one of {list(ESM2_SIZES)}")
        dl, dh, dn, _ = ESM2_SIZES[size]
        layers, hidden, heads = layers or dl, hidden or dh, heads or dn
    if None in (layers, hidden, heads):
        raise ValueError("give a size name or all of layers, hidden and heads")
    kwargs = dict(vocab_size=33, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=4 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  max_position_embeddings=1026, position_embedding_type="rotary", emb_layer_norm_before=False,
                  token_dropout=True, mask_token_id=32, pad_token_id=1, layer_norm_eps=1e-5)
    kwargs.update(overrides)
    return EsmConfig(**kwargs)


def esmc_config(size: str | None = None, *, layers: int | None = None, hidden: int | None = None,
                heads: int | None = None, intermediate: int | None = None, **overrides):
    """An ``EsmcConfig`` shaped like a released ESM C size (or custom dims; the feed-forward width defaults to
    8/3 of the hidden size rounded up to 256, as ESM C's are), as the hub configs set it."""
    from .family import ESMC, hf_masked_lm_class
    hf_masked_lm_class(ESMC)  # a one-line error when this transformers has no ESM C
    from transformers import EsmcConfig
    if size is not None:
        if size not in ESMC_SIZES:
            raise ValueError(f"unknown ESM C size {size!r}: choose one of {list(ESMC_SIZES)}")
        dl, dh, dn, df, _ = ESMC_SIZES[size]
        layers, hidden, heads, intermediate = layers or dl, hidden or dh, heads or dn, intermediate or df
    if None in (layers, hidden, heads):
        raise ValueError("give a size name or all of layers, hidden and heads")
    if intermediate is None:
        intermediate = -(-hidden * 8 // 3 // 256) * 256
    kwargs = dict(vocab_size=64, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=intermediate, mask_token_id=32, pad_token_id=1)
    kwargs.update(overrides)
    return EsmcConfig(**kwargs)
