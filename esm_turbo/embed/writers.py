"""Embedding outputs, written atomically so a killed run leaves only whole files.

* ``pt``: one ``<id>.pt`` per sequence with fair-esm's keys (``label``, ``representations``,
  ``mean_representations``, ``bos_representations``, ``contacts``) plus ``logits`` when asked.
* ``h5``: one HDF5 file keyed by sequence id (``/<id>/representations/<layer>``, …; the id is also the
  group's ``label`` attribute). Each batch goes to its own part file under ``<out>.parts/``, written
  atomically; rank 0 folds the parts into ``<out>`` (temp file + rename), as they land when a follower
  process is started (:meth:`H5Writer.start_merging`), else at the end. Resume reads the ids already in the
  parts; several ranks write their own parts and rank 0 merges.

A file name or HDF5 key cannot hold '/', so ids are stored with '/' as '%2F' (and '%' as '%25'). An id
whose name would pass 200 bytes (file systems allow 255) is stored as its first characters, '~' and 16 hex
digits of its sha256; the ``.pt`` file's ``label`` and the manifest keep the whole id.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..io import atomic_write, atomic_write_text

FORMATS = ("pt", "h5")


MAX_NAME_BYTES = 200


def safe_name(rid: str) -> str:
    """The file name (without ``.pt``) or HDF5 key of a record id."""
    name = rid.replace("%", "%25").replace("/", "%2F")
    if len(name.encode()) <= MAX_NAME_BYTES:
        return name
    digest = hashlib.sha256(rid.encode()).hexdigest()[:16]
    head = name.encode()[: MAX_NAME_BYTES - 17].decode(errors="ignore")
    return f"{head}~{digest}"


class PtWriter:
    """One ``.pt`` file per sequence in ``out_dir``."""

    def __init__(self, out_dir: str | Path, rank: int = 0, world: int = 1):
        self.out = Path(out_dir)
        if self.out.exists() and not self.out.is_dir():
            raise FileExistsError(f"{self.out}: exists and is not a directory (--format pt writes a folder)")
        self.out.mkdir(parents=True, exist_ok=True)
        self.rank, self.world = rank, world
        self.written: list[str] = []

    def path_of(self, rid: str) -> Path:
        return self.out / f"{safe_name(rid)}.pt"

    def written_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` already have their file (resume)."""
        names = {p.name[:-3] for p in self.out.glob("*.pt")}
        return {rid for rid in ids if safe_name(rid) in names}

    def write(self, items: list[dict]) -> None:
        for item in items:
            atomic_write(self.path_of(item["label"]), lambda tmp, item=item: torch.save(item, tmp))
            self.written.append(item["label"])

    def finalize(self) -> Path:
        atomic_write_text(self.out / f"manifest.rank{self.rank}.json",
                          json.dumps({"rank": self.rank, "world": self.world, "written": self.written,
                                      "files": {rid: self.path_of(rid).name for rid in self.written}}, indent=1))
        return self.out


def _h5():
    try:
        import h5py
    except ImportError as err:  # pragma: no cover - h5py is a dependency
        raise RuntimeError("--format h5 needs h5py (pip install h5py)") from err
    return h5py


def _write_item(group, item: dict) -> None:
    group.attrs["label"] = item["label"]
    for key, val in item.items():
        if key == "label":
            continue
        if isinstance(val, dict):
            sub = group.create_group(key)
            for layer, t in val.items():
                sub.create_dataset(str(layer), data=t.numpy())
        else:
            group.create_dataset(key, data=val.numpy())


def read_h5_item(group) -> dict:
    """One sequence's group back as a fair-esm-style dict (layers as ints)."""
    item = {"label": group.attrs["label"]}
    for key, val in group.items():
        if hasattr(val, "keys"):
            item[key] = {int(k): torch.from_numpy(v[()]) for k, v in val.items()}
        else:
            item[key] = torch.from_numpy(val[()])
    return item


class H5Writer:
    """Batches → part files (atomic); ``finalize`` merges them into one HDF5 file."""

    def __init__(self, out_file: str | Path, rank: int = 0, world: int = 1):
        self.out = Path(out_file)
        self.parts = self.out.with_name(self.out.name + ".parts")
        self.parts.mkdir(parents=True, exist_ok=True)
        self.rank, self.world = rank, world
        self.written: list[str] = []
        self._n = len(list(self.parts.glob(f"rank{rank}-*.h5")))

    def written_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` are already in the output or its parts (resume)."""
        return self._labels() & set(ids)

    def _labels(self) -> set[str]:
        h5py = _h5()
        ids: set[str] = set()
        for part in self.parts.glob("*.h5"):
            with h5py.File(part, "r") as fh:
                ids.update(fh[k].attrs["label"] for k in fh.keys())
        if self.out.is_file():
            with h5py.File(self.out, "r") as fh:
                ids.update(fh[k].attrs["label"] for k in fh.keys())
        return ids

    def write(self, items: list[dict]) -> None:
        h5py = _h5()

        def dump(tmp: str) -> None:
            with h5py.File(tmp, "w") as fh:
                for item in items:
                    _write_item(fh.create_group(safe_name(item["label"])), item)
        atomic_write(self.parts / f"rank{self.rank}-{self._n:06d}.h5", dump)
        self._n += 1
        self.written.extend(item["label"] for item in items)

    def finalize(self) -> Path:
        atomic_write_text(self.parts / f"manifest.rank{self.rank}.json",
                          json.dumps({"rank": self.rank, "world": self.world, "written": self.written}, indent=1))
        return self.out

    def start_merging(self) -> None:
        """Fold parts into ``out`` while the run goes on (rank 0): a follower process copies each part as it
        lands, so only the last few are left when every rank is done. :meth:`merge` waits for it."""
        self._follower = subprocess.Popen([sys.executable, "-m", "esm_turbo.embed.h5merge", str(self.out)],
                                          stdin=subprocess.PIPE)

    def merge(self) -> Path:
        """Fold the existing output (if any) and every part into ``out`` (atomically), then drop the parts.
        Call it once every rank has finished writing; with a follower started, this tells it so and waits."""
        follower = getattr(self, "_follower", None)
        if follower is None:
            follow_parts(self.out, done=lambda: True)
            return self.out
        follower.stdin.close()
        if follower.wait():
            raise RuntimeError(f"{self.out}: merging the parts failed (exit {follower.returncode}); they are kept "
                               f"in {self.parts}, and --resume folds them in")
        return self.out


def _fold(dst, src_path: Path) -> None:
    h5py = _h5()
    with h5py.File(src_path, "r") as src:
        for key in src.keys():
            if key not in dst:
                h5py.h5o.copy(src.id, key.encode(), dst.id, key.encode())


def follow_parts(out: str | Path, done: Callable[[], bool], poll: float = 0.25) -> Path:
    """Copy ``out`` (if it exists) and then each part file under ``<out>.parts/`` into a new ``out``, written
    atomically, until ``done()`` is true and no part is left unread; then drop the parts. Parts appear whole
    (each is renamed into place), so one listed is complete."""
    out = Path(out)
    parts = out.with_name(out.name + ".parts")
    h5py = _h5()

    read: set[str] = set()

    def dump(tmp: str) -> None:
        with h5py.File(tmp, "w", libver="latest") as dst:
            if out.is_file():
                _fold(dst, out)
            while True:
                finished = done()  # asked before listing: a part written before the answer is listed below
                for part in sorted(parts.glob("*.h5")):
                    if part.name not in read:
                        _fold(dst, part)
                        read.add(part.name)
                if finished:
                    return
                time.sleep(poll)
    atomic_write(out, dump)
    for name in read:  # only what was folded in: a rank still writing (a killed run) keeps its new parts
        (parts / name).unlink()
    for manifest in parts.glob("manifest.rank*.json"):
        manifest.unlink()
    try:
        parts.rmdir()
    except OSError:
        pass  # not empty: parts written after the last listing wait for the next merge (--resume)
    return out


def make_writer(fmt: str, out: str | Path, rank: int = 0, world: int = 1):
    if fmt == "pt":
        return PtWriter(out, rank, world)
    if fmt == "h5":
        return H5Writer(out, rank, world)
    raise ValueError(f"unknown output format {fmt!r}: choose one of {FORMATS}")
