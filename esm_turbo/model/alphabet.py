"""Tokenisation with fair-esm's ESM-2 alphabet (the same ids as the Hugging Face ESM-2 vocabulary)."""

from __future__ import annotations

import functools

import torch

from ..errors import EsmTurboError

#: residue letters ESM-2 has tokens for (20 standard + X B U Z O)
RESIDUES = frozenset("LAGVSERTIDPKQNFYMHWCXBUZO")


@functools.lru_cache(maxsize=1)
def alphabet():
    """fair-esm's ``Alphabet.from_architecture("ESM-1b")`` (shared by all ESM-2 sizes)."""
    import esm
    return esm.data.Alphabet.from_architecture("ESM-1b")


def check_sequence(seq: str, name: str = "sequence", max_residues: int | None = None) -> str:
    """Upper-case ``seq`` and check it; errors name the record and the 1-based position."""
    s = seq.strip().upper()
    if not s:
        raise EsmTurboError(f"{name}: empty sequence")
    for i, ch in enumerate(s):
        if ch not in RESIDUES:
            raise EsmTurboError(f"{name}: position {i + 1}: character {ch!r} is not an ESM-2 residue")
    if max_residues is not None and len(s) > max_residues:
        raise EsmTurboError(f"{name}: {len(s)} residues exceeds the limit of {max_residues}")
    return s


def encode(sequences: list[str], names: list[str] | None = None, add_eos: bool = True,
           max_residues: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences → (token ids [B, T] long, right-padded; attention mask [B, T] long).

    Each row is ``<cls> residues [<eos>]``; padding uses the alphabet's padding index.
    """
    alpha = alphabet()
    names = names or [f"sequence {i + 1}" for i in range(len(sequences))]
    rows = []
    for seq, name in zip(sequences, names):
        s = check_sequence(seq, name, max_residues)
        ids = [alpha.cls_idx] + [alpha.get_idx(c) for c in s] + ([alpha.eos_idx] if add_eos else [])
        rows.append(ids)
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), alpha.padding_idx, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return tokens, (tokens != alpha.padding_idx).long()


def residue_ids() -> torch.Tensor:
    """Token ids of the 20 standard amino acids (for sampling in design loops)."""
    alpha = alphabet()
    return torch.tensor([alpha.get_idx(c) for c in "ACDEFGHIKLMNPQRSTVWY"])


def decode_ids(ids: list[int]) -> str:
    alpha = alphabet()
    return "".join(alpha.get_tok(int(i)) for i in ids)
