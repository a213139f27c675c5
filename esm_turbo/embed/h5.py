"""The HDF5 output of ``esm-turbo embed``: records as rows of a few columns, and reading it back.

Layout (``esm_turbo_layout`` = 2 at the root, beside ``meta``: the JSON of what the file was made with)::

    ids                            [N] str        record ids, in the order of the rows below
    residues                       [N] int64      residues per record
    mean_representations/<layer>   [N, D] float32
    bos_representations/<layer>    [N, D] float32
    representations/<layer>        [M, D] float32 every record's residues one after another (M = sum of residues)
    logits                         [M, V] float32 laid out as representations
    contacts                       [sum n²] float32 each record's [n, n] map, flattened, one after another

A few objects per batch instead of several per record, so writing costs what the bytes cost. Files of the earlier
layout (a group per record, ``/<id>/mean_representations/<layer>``) are read by the same :func:`open_embeddings`, and
``--resume`` folds them in.

    with open_embeddings("emb.h5") as emb:
        emb.mean(33)            # [N, 1280] numpy, rows in emb.ids order
        emb["sp|P69905|HBA"]    # fair-esm's dict for one record
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .chunk import LAYER_KEYS, Chunk

LAYOUT = 2
#: rows per HDF5 chunk of the growing columns
_ROWS_PER_CHUNK = 256


def _h5py():
    try:
        import h5py
    except ImportError as err:  # pragma: no cover - h5py is a dependency
        raise RuntimeError("--format h5 needs h5py (pip install h5py)") from err
    return h5py


def _strings(values) -> list[str]:
    """An ``ids`` column as str (h5py reads variable-length strings back as bytes)."""
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def columns_of(chunk: Chunk) -> dict[str, np.ndarray]:
    """The chunk as the file's columns (name → array), ``ids`` included."""
    cols: dict[str, np.ndarray] = {"ids": np.asarray(chunk.ids, dtype=object), "residues": chunk.residues}
    for kind, key in LAYER_KEYS.items():
        for layer, arr in getattr(chunk, kind).items():
            cols[f"{key}/{layer}"] = arr
    if chunk.logits is not None:
        cols["logits"] = chunk.logits
    if chunk.contacts is not None:
        n = chunk.residues
        cols["contacts"] = (np.concatenate([chunk.contacts[r, : n[r], : n[r]].ravel() for r in range(len(n))])
                            if len(n) else np.zeros(0, np.float32))
    return cols


def is_columnar(fh) -> bool:
    return int(fh.attrs.get("esm_turbo_layout", 0)) >= LAYOUT


def read_meta(fh) -> dict | None:
    """What the file says it was made with, or None (files of the earlier layout say nothing)."""
    text = fh.attrs.get("meta")
    return json.loads(text) if text else None


def write_part(path: str | Path, chunk: Chunk, meta: dict) -> None:
    """One file holding ``chunk`` (fixed-size columns)."""
    h5py = _h5py()
    with h5py.File(path, "w") as fh:
        fh.attrs["esm_turbo_layout"] = LAYOUT
        fh.attrs["meta"] = json.dumps(meta)
        for name, arr in columns_of(chunk).items():
            if name == "ids":
                fh.create_dataset(name, data=arr, dtype=h5py.string_dtype())
            else:
                fh.create_dataset(name, data=arr)


def read_ids(path: str | Path) -> list[str]:
    """The record ids a file holds (either layout)."""
    with _h5py().File(path, "r") as fh:
        if is_columnar(fh):
            return _strings(fh["ids"][()])
        return [fh[k].attrs["label"] for k in fh.keys()]


class ColumnWriter:
    """Appends chunks' columns to an open HDF5 file, each column growing as rows arrive; ids already there are
    skipped (a record is stored once)."""

    def __init__(self, fh, meta: dict | None):
        self.fh = fh
        fh.attrs["esm_turbo_layout"] = LAYOUT
        if meta is not None:
            fh.attrs["meta"] = json.dumps(meta)
        self.seen: set[str] = set()

    def append(self, cols: dict[str, np.ndarray]) -> int:
        """Append one part's columns (:func:`columns_of`); returns the rows added."""
        ids = _strings(cols["ids"])
        keep = np.fromiter((i not in self.seen for i in ids), dtype=bool, count=len(ids))
        if not keep.any():
            return 0
        if not keep.all():
            cols = _select(cols, keep)
            ids = [i for i, k in zip(ids, keep) if k]
        self.seen.update(ids)
        h5py = _h5py()
        for name, arr in cols.items():
            arr = np.asarray(ids, dtype=object) if name == "ids" else arr
            if name not in self.fh:
                kw = dict(dtype=h5py.string_dtype()) if name == "ids" else dict(dtype=arr.dtype)
                width = arr.shape[1:]
                rows = _ROWS_PER_CHUNK if name in ("ids", "residues") or name.startswith(("mean", "bos")) else 4096
                self.fh.create_dataset(name, shape=(0, *width), maxshape=(None, *width),
                                       chunks=(rows, *width) if width else (rows * 16,), **kw)
            dset = self.fh[name]
            start = dset.shape[0]
            dset.resize(start + len(arr), axis=0)
            dset[start:] = arr
        return len(ids)

    def append_file(self, path: str | Path) -> int:
        """Append every record of a file (either layout)."""
        with _h5py().File(path, "r") as src:
            if is_columnar(src):
                return self.append({name: src[name][()] for name in _dataset_names(src)})
            added, items = 0, []
            for key in src.keys():
                items.append(read_h5_item(src[key]))
                if len(items) == 1024:
                    added += self._append_items(items)
                    items = []
            return added + (self._append_items(items) if items else 0)

    def _append_items(self, items: list[dict]) -> int:
        from .chunk import chunk_of_items
        return self.append(columns_of(chunk_of_items(items)))


def _dataset_names(fh) -> list[str]:
    names: list[str] = []
    fh.visititems(lambda name, obj: names.append(name) if hasattr(obj, "shape") else None)
    return names


def _select(cols: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``keep`` of a part's columns (per-residue and contact columns follow their records)."""
    residues = cols["residues"]
    tok = np.repeat(keep, residues)
    con = np.repeat(keep, residues ** 2)
    out = {}
    for name, arr in cols.items():
        if name.startswith("representations/") or name == "logits":
            out[name] = arr[tok]
        elif name == "contacts":
            out[name] = arr[con]
        else:
            out[name] = arr[keep]
    return out


def read_h5_item(group) -> dict:
    """One record's group of the earlier layout as a fair-esm-style dict (layers as ints)."""
    import torch
    item = {"label": group.attrs["label"]}
    for key, val in group.items():
        if hasattr(val, "keys"):
            item[key] = {int(k): torch.from_numpy(v[()]) for k, v in val.items()}
        else:
            item[key] = torch.from_numpy(val[()])
    return item


class Embeddings:
    """Read access to an ``esm-turbo embed`` HDF5 file of either layout (use :func:`open_embeddings`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fh = _h5py().File(self.path, "r")
        self.columnar = is_columnar(self.fh)
        self.meta = read_meta(self.fh)
        if self.columnar:
            self.ids = _strings(self.fh["ids"][()])
            residues = self.fh["residues"][()]
            self._offsets = np.concatenate([[0], np.cumsum(residues)])
            self._contact_offsets = np.concatenate([[0], np.cumsum(residues.astype(np.int64) ** 2)])
            self._residues = residues
        else:
            self._keys = {self.fh[k].attrs["label"]: k for k in self.fh.keys()}
            self.ids = list(self._keys)
        self._row = {rid: r for r, rid in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, rid: str) -> bool:
        return rid in self._row

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids)

    def layers(self, kind: str = "mean_representations") -> list[int]:
        """The layers stored for ``kind`` (``mean_representations``, ``bos_representations``, ``representations``)."""
        if self.columnar:
            return sorted(int(k) for k in self.fh[kind].keys()) if kind in self.fh else []
        first = self.fh[self._keys[self.ids[0]]] if self.ids else {}
        return sorted(int(k) for k in first[kind].keys()) if kind in first else []

    def mean(self, layer: int) -> np.ndarray:
        """[N, D] mean representations of ``layer``, rows in ``ids`` order."""
        return self._column("mean_representations", layer)

    def bos(self, layer: int) -> np.ndarray:
        """[N, D] ``<cls>`` representations of ``layer``, rows in ``ids`` order."""
        return self._column("bos_representations", layer)

    def _column(self, key: str, layer: int) -> np.ndarray:
        if self.columnar:
            return self.fh[f"{key}/{layer}"][()]
        return np.stack([self.fh[self._keys[i]][key][str(layer)][()] for i in self.ids])

    def __getitem__(self, rid: str) -> dict:
        """fair-esm's dict for one record (torch tensors; layers as ints)."""
        import torch
        if rid not in self._row:
            raise KeyError(f"{self.path}: no record {rid!r}")
        if not self.columnar:
            return read_h5_item(self.fh[self._keys[rid]])
        r = self._row[rid]
        lo, hi = int(self._offsets[r]), int(self._offsets[r + 1])
        item: dict = {"label": rid}
        for key, sl in (("representations", slice(lo, hi)), ("mean_representations", r),
                        ("bos_representations", r)):
            if key in self.fh:
                item[key] = {int(k): torch.from_numpy(np.asarray(v[sl])) for k, v in self.fh[key].items()}
        if "contacts" in self.fh:
            n = int(self._residues[r])
            flat = self.fh["contacts"][int(self._contact_offsets[r]): int(self._contact_offsets[r + 1])]
            item["contacts"] = torch.from_numpy(flat.reshape(n, n))
        if "logits" in self.fh:
            item["logits"] = torch.from_numpy(self.fh["logits"][lo:hi])
        return item

    def close(self) -> None:
        self.fh.close()

    def __enter__(self) -> "Embeddings":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_embeddings(path: str | Path) -> Embeddings:
    """Open an ``esm-turbo embed --format h5`` file (either layout) for reading."""
    return Embeddings(path)


__all__ = ["ColumnWriter", "Embeddings", "LAYOUT", "columns_of", "open_embeddings", "read_h5_item", "read_ids",
           "read_meta", "write_part"]
