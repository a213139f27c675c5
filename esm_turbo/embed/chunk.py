"""A chunk of finished records: what the embedding loop hands its writers, once per batch.

The loop copies a batch's outputs to the host in one go; a :class:`Chunk` is a view of them by kind, for the batch's
first ``len(ids)`` rows (records embedded whole; windows of longer records are stitched by the loop and arrive as
chunks of their own). Writers turn it into files: fair-esm's one ``.pt`` per record, or columns of an HDF5 file.

Arrays (float32, on the host):

* ``mean[layer]``, ``bos[layer]``: [R, D];
* ``tokens[layer]``: [M, D], the residues of the R records one after another (``residues`` [R] says how many each);
* ``logits``: [M, V], laid out as ``tokens``;
* ``contacts``: [R, W, W] with record r's map in ``[:n_r, :n_r]`` (W ≥ every n_r).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

#: the fair-esm key of each per-layer kind
LAYER_KEYS = {"tokens": "representations", "mean": "mean_representations", "bos": "bos_representations"}


@dataclass
class Chunk:
    ids: list[str]
    residues: np.ndarray  # [R] int64
    mean: dict[int, np.ndarray] = field(default_factory=dict)
    bos: dict[int, np.ndarray] = field(default_factory=dict)
    tokens: dict[int, np.ndarray] = field(default_factory=dict)
    logits: np.ndarray | None = None
    contacts: np.ndarray | None = None

    def offsets(self) -> np.ndarray:
        """[R + 1]: where each record's residues start in ``tokens`` and ``logits``."""
        out = np.zeros(len(self.ids) + 1, dtype=np.int64)
        np.cumsum(self.residues, out=out[1:])
        return out

    def items(self) -> Iterator[dict]:
        """Each record as fair-esm's dict (``label``, ``representations``, ``mean_representations``, …), its tensors
        copies that own their memory (a saved view would carry the whole batch)."""
        offsets = self.offsets()
        for r, rid in enumerate(self.ids):
            lo, hi = offsets[r], offsets[r + 1]
            item: dict = {"label": rid}
            if self.tokens:
                item["representations"] = {k: _own(v[lo:hi]) for k, v in self.tokens.items()}
            if self.mean:
                item["mean_representations"] = {k: _own(v[r]) for k, v in self.mean.items()}
            if self.bos:
                item["bos_representations"] = {k: _own(v[r]) for k, v in self.bos.items()}
            if self.contacts is not None:
                n = int(self.residues[r])
                item["contacts"] = _own(self.contacts[r, :n, :n])
            if self.logits is not None:
                item["logits"] = _own(self.logits[lo:hi])
            yield item


def _own(a: np.ndarray):
    import torch
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True))


def chunk_of_items(items: list[dict]) -> Chunk:
    """The chunk holding these fair-esm dicts (all with the same keys; inverse of :meth:`Chunk.items`)."""
    first = items[0]
    if "representations" in first:
        residues = [len(next(iter(i["representations"].values()))) for i in items]
    elif "logits" in first:
        residues = [len(i["logits"]) for i in items]
    elif "contacts" in first:
        residues = [len(i["contacts"]) for i in items]
    else:
        residues = [0] * len(items)
    chunk = Chunk([i["label"] for i in items], np.asarray(residues, dtype=np.int64))
    for kind, key in LAYER_KEYS.items():
        if key in first:
            cat = np.concatenate if kind == "tokens" else np.stack
            getattr(chunk, kind).update({layer: cat([np.asarray(i[key][layer], np.float32) for i in items])
                                         for layer in first[key]})
    if "logits" in first:
        chunk.logits = np.concatenate([np.asarray(i["logits"], np.float32) for i in items])
    if "contacts" in first:
        w = max(residues)
        chunk.contacts = np.zeros((len(items), w, w), np.float32)
        for r, i in enumerate(items):
            chunk.contacts[r, : residues[r], : residues[r]] = np.asarray(i["contacts"], np.float32)
    return chunk


__all__ = ["Chunk", "LAYER_KEYS", "chunk_of_items"]
