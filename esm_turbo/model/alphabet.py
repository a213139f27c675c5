"""Tokenisation with fair-esm's ESM-2 alphabet (the same ids as the Hugging Face ESM-2 vocabulary)."""

from __future__ import annotations

import functools
import re

import numpy as np
import torch

from ..errors import EsmTurboError

#: residue letters ESM-2 has tokens for (20 standard + X B U Z O)
RESIDUES = frozenset("LAGVSERTIDPKQNFYMHWCXBUZO")
#: alignment gaps, which ESM-2's alphabet also has tokens for (aligned FASTA embeds as given, or with the
#: gaps stripped: ``strip_gaps``)
GAPS = frozenset("-.")
SEQUENCE_CHARS = RESIDUES | GAPS
#: any character that is not an ESM-2 residue or gap (upper case)
NOT_A_TOKEN = re.compile(f"[^{re.escape(''.join(sorted(SEQUENCE_CHARS)))}]")


#: ESM-2's vocabulary in id order: fair-esm's ``Alphabet.from_architecture("ESM-1b")``, which every ESM-2 size and the
#: Hugging Face checkpoints share (tests/test_fast_esm.py ties the two)
ESM2_TOKENS = ("<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q",
               "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O", ".", "-", "<null_1>", "<mask>")
_TOKEN = re.compile(r"<[^<>\s]*>|\S")


class Alphabet:
    """ESM-2's token ids, as fair-esm's alphabet names them (``padding_idx``, ``get_idx``, ``encode`` …), without
    importing fair-esm (and torch hub) to get them."""

    def __init__(self, tokens: tuple[str, ...] = ESM2_TOKENS):
        self.all_toks = list(tokens)
        self.tok_to_idx = {t: i for i, t in enumerate(tokens)}
        self.unk_idx = self.tok_to_idx["<unk>"]
        self.padding_idx, self.cls_idx = self.tok_to_idx["<pad>"], self.tok_to_idx["<cls>"]
        self.eos_idx, self.mask_idx = self.tok_to_idx["<eos>"], self.tok_to_idx["<mask>"]

    def __len__(self) -> int:
        return len(self.all_toks)

    def get_idx(self, tok: str) -> int:
        """The id of ``tok``; ``<unk>``'s for anything else."""
        return self.tok_to_idx.get(tok, self.unk_idx)

    def get_tok(self, idx: int) -> str:
        return self.all_toks[idx]

    def tokenize(self, text: str) -> list[str]:
        """Special tokens (``<mask>``) whole, everything else a character at a time; whitespace dropped."""
        return _TOKEN.findall(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (a KeyError names a token ESM-2 does not have, as fair-esm's does)."""
        return [self.tok_to_idx[tok] for tok in self.tokenize(text)]


@functools.lru_cache(maxsize=1)
def alphabet() -> Alphabet:
    """ESM-2's alphabet (shared by all sizes)."""
    return Alphabet()


def check_sequence(seq: str, name: str = "sequence", max_residues: int | None = None) -> str:
    """Upper-case ``seq`` and check it; errors name the record and the 1-based position."""
    s = seq.strip().upper()
    if not s:
        raise EsmTurboError(f"{name}: empty sequence")
    bad = NOT_A_TOKEN.search(s)
    if bad:
        raise EsmTurboError(f"{name}: position {bad.start() + 1}: character {bad.group()!r} is not an ESM-2 residue "
                            f"or gap")
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


def strip_gaps(seq: str) -> str:
    """``seq`` without alignment gaps ('-' and '.')."""
    return seq.replace("-", "").replace(".", "")


@functools.lru_cache(maxsize=1)
def _byte_table() -> np.ndarray:
    """[256] int64: token id of each ASCII byte that is an ESM-2 residue or gap, -1 elsewhere."""
    alpha = alphabet()
    table = np.full(256, -1, dtype=np.int64)
    for ch in SEQUENCE_CHARS:
        table[ord(ch)] = alpha.get_idx(ch)
    return table


def packed_residue_mask(cu: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """[N] bool over a packed token stream with sequence starts ``cu`` [S + 1]: the residues (not ``<cls>`` /
    ``<eos>``) of the sequences ``rows`` (default all)."""
    mask = np.ones(int(cu[-1]), dtype=bool)
    mask[cu[:-1]] = False
    mask[cu[1:] - 1] = False
    if rows is not None:
        keep = np.zeros(len(cu) - 1, dtype=bool)
        keep[rows] = True
        mask &= np.repeat(keep, np.diff(cu))
    return mask


def encode_packed(sequences: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checked, upper-case sequences → one token stream ``<cls> residues <eos>`` after another:
    (token ids [N] int64, position in its sequence [N] int64, sequence starts [S + 1] int64)."""
    alpha = alphabet()
    lengths = np.fromiter((len(s) + 2 for s in sequences), dtype=np.int64, count=len(sequences))
    cu = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    ids = np.empty(int(cu[-1]), dtype=np.int64)
    ids[packed_residue_mask(cu)] = _byte_table()[np.frombuffer("".join(sequences).encode("latin-1"), dtype=np.uint8)]
    ids[cu[:-1]], ids[cu[1:] - 1] = alpha.cls_idx, alpha.eos_idx
    if (ids < 0).any():
        raise EsmTurboError("encode_packed: a sequence holds a character that is not an ESM-2 residue or gap "
                            "(check it with check_sequence first)")
    positions = np.arange(len(ids)) - np.repeat(cu[:-1], lengths)
    return ids, positions, cu


def residue_ids() -> torch.Tensor:
    """Token ids of the 20 standard amino acids (for sampling in design loops)."""
    alpha = alphabet()
    return torch.tensor([alpha.get_idx(c) for c in "ACDEFGHIKLMNPQRSTVWY"])


def decode_ids(ids: list[int]) -> str:
    alpha = alphabet()
    return "".join(alpha.get_tok(int(i)) for i in ids)
