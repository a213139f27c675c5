"""Embedding outputs, written atomically so a killed run leaves only whole files, and saying what made them.

* ``pt``: one ``<id>.pt`` per record with fair-esm's keys (``label``, ``representations``, ``mean_representations``,
  ``bos_representations``, ``contacts``) plus ``logits`` when asked; ``manifest.json`` says what the folder was made
  with (model, dtype, layers, includes) and lists every record's file.
* ``h5``: one HDF5 file of columns (:mod:`esm_turbo.embed.h5`). Each batch goes to its own part file under
  ``<out>.parts/``, written atomically; rank 0 folds the parts into ``<out>`` (temp file + rename) as they land when
  a follower process is started (:meth:`H5Writer.start_merging`), else at the end. Resume reads the ids already in
  the parts and the output; several ranks write their own parts and rank 0 merges.

Writers take :class:`~esm_turbo.embed.chunk.Chunk` s (``write_chunk``) or lists of fair-esm dicts (``write``).

A file name cannot hold '/', so ids are stored with '/' as '%2F' (and '%' as '%25'). An id whose name would pass
200 bytes (file systems allow 255) is stored as its first characters, '~' and 16 hex digits of its sha256; the
``.pt`` file's ``label`` and the manifest keep the whole id.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import EsmTurboError
from ..io import atomic_write, atomic_write_bytes, atomic_write_text, remove_stale_temporaries, remove_temporaries
from .chunk import Chunk, chunk_of_items

FORMATS = ("pt", "h5")
MAX_NAME_BYTES = 200
MANIFEST = "manifest.json"
#: what must match between an output and a run that adds to it (``--resume``)
MATCHED = ("model_fingerprint", "dtype", "repr_layers", "include", "truncation_seq_length", "long_policy",
           "window_overlap", "fp8_keep", "gelu")


def safe_name(rid: str) -> str:
    """The file name (without ``.pt``) of a record id."""
    name = rid.replace("%", "%25").replace("/", "%2F")
    if len(name.encode()) <= MAX_NAME_BYTES:
        return name
    digest = hashlib.sha256(rid.encode()).hexdigest()[:16]
    head = name.encode()[: MAX_NAME_BYTES - 17].decode(errors="ignore")
    return f"{head}~{digest}"


class PtWriter:
    """One ``.pt`` file per record in ``out_dir``."""

    def __init__(self, out_dir: str | Path, rank: int = 0, world: int = 1, meta: dict | None = None):
        self.out = Path(out_dir)
        if self.out.exists() and not self.out.is_dir():
            raise FileExistsError(f"{self.out}: exists and is not a directory (--format pt writes a folder)")
        self.rank, self.world, self.meta = rank, world, meta
        self.written: list[str] = []

    def path_of(self, rid: str) -> Path:
        return self.out / f"{safe_name(rid)}.pt"

    def has_records(self) -> bool:
        return self.out.is_dir() and (any(self.out.glob("*.pt")) or (self.out / MANIFEST).is_file())

    def stored_meta(self) -> dict | None:
        manifest = self.out / MANIFEST
        if not manifest.is_file():
            return None
        try:
            return json.loads(manifest.read_text()).get("meta")
        except (OSError, ValueError, AttributeError) as err:
            raise EsmTurboError(f"{manifest}: unreadable ({type(err).__name__}); move it away to resume") from None

    def written_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` already have their file (resume)."""
        if not self.out.is_dir():
            return set()
        names = {p.name[:-3] for p in self.out.glob("*.pt")}
        return {rid for rid in ids if safe_name(rid) in names}

    def clear(self) -> None:
        """Remove what an earlier run wrote here (``--overwrite``): its ``.pt`` files and manifests."""
        if not self.out.is_dir():
            return
        for p in [*self.out.glob("*.pt"), *self.out.glob("manifest*.json")]:
            p.unlink()
        remove_temporaries(self.out)

    def start(self) -> None:
        """Before the first record (rank 0, before any rank writes): a killed run's temporaries removed, and the
        manifest says what the folder holds (a killed run's folder says it too)."""
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        remove_temporaries(self.out)
        if self.meta is not None:
            manifest = self.out / MANIFEST
            files = json.loads(manifest.read_text()).get("files", {}) if manifest.is_file() else {}
            atomic_write_text(manifest, json.dumps({"meta": self.meta, "files": files}, indent=1))

    def write_chunk(self, chunk: Chunk) -> None:
        import io

        import torch
        self.out.mkdir(parents=True, exist_ok=True)
        for item in chunk.items():
            buf = io.BytesIO()
            torch.save(item, buf)
            atomic_write_bytes(self.path_of(item["label"]), buf.getbuffer())
            self.written.append(item["label"])

    def write(self, items: list[dict]) -> None:
        if items:
            self.write_chunk(chunk_of_items(items))

    def finalize(self, written: list[str] | None = None) -> Path:
        """This rank's list of what it wrote (``written``: every writer process's, else this object's)."""
        written = self.written if written is None else written
        atomic_write_text(self.out / f"manifest.rank{self.rank}.json",
                          json.dumps({"rank": self.rank, "world": self.world, "written": written}, indent=1))
        return self.out

    def merge(self) -> Path:
        """Rank 0, once every rank has finished: fold the ranks' lists into ``manifest.json``, which then lists
        every record in the folder (from this run and earlier ones)."""
        manifest = self.out / MANIFEST
        old = json.loads(manifest.read_text()) if manifest.is_file() else {}
        files = dict(old.get("files", {}))
        for part in sorted(self.out.glob("manifest.rank*.json")):
            files.update({rid: self.path_of(rid).name for rid in json.loads(part.read_text())["written"]})
            part.unlink()
        atomic_write_text(manifest, json.dumps({"meta": self.meta or old.get("meta"), "files": files}, indent=1))
        return self.out


class H5Writer:
    """Chunks → part files (atomic); ``merge`` folds them into one HDF5 file."""

    def __init__(self, out_file: str | Path, rank: int = 0, world: int = 1, meta: dict | None = None):
        self.out = Path(out_file)
        self.parts = self.out.with_name(self.out.name + ".parts")
        self.rank, self.world, self.meta = rank, world, meta
        self.written: list[str] = []
        self._n = 0

    def has_records(self) -> bool:
        return self.out.exists() or any(self.parts.glob("*.h5"))

    def stored_meta(self) -> dict | None:
        from .h5 import _h5py, read_meta
        for path in [self.out, *sorted(self.parts.glob("*.h5"))]:
            if path.is_file():
                try:
                    with _h5py().File(path, "r") as fh:
                        return read_meta(fh)
                except (OSError, ValueError) as err:
                    raise EsmTurboError(f"{path}: not a readable HDF5 file ({type(err).__name__}); move it away "
                                        f"to resume") from None
        return None

    def written_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` are already in the output or its parts (resume)."""
        from .h5 import read_ids
        found: set[str] = set()
        for path in [*self.parts.glob("*.h5"), self.out]:
            if path.is_file():
                found.update(read_ids(path))
        return found & set(ids)

    def clear(self) -> None:
        """Remove what an earlier run wrote (``--overwrite``): the output and its parts."""
        if self.parts.is_dir():
            shutil.rmtree(self.parts)
        self.out.unlink(missing_ok=True)

    def start(self, clean: bool = True) -> None:
        """Before the first part: the parts folder made, a killed run's temporaries of this rank removed (``clean``),
        part numbers continued after the ones there."""
        if clean:
            self.parts.mkdir(parents=True, exist_ok=True)
            remove_temporaries(self.parts, f".rank{self.rank}-")
            if self.rank == 0:
                remove_stale_temporaries(self.out)
        taken = [int(p.stem.split("-")[1]) for p in self.parts.glob(f"rank{self.rank}-*.h5")]
        self._n = max(taken, default=-1) + 1

    def write_chunk(self, chunk: Chunk) -> None:
        from .h5 import write_part
        if not chunk.ids:
            return
        name = f"rank{self.rank}-{self._n:06d}.h5"
        self._n += 1
        atomic_write(self.parts / name, lambda tmp: write_part(tmp, chunk, self.meta or {}))
        self.written.extend(chunk.ids)

    def write(self, items: list[dict]) -> None:
        if items:
            self.write_chunk(chunk_of_items(items))

    def finalize(self, written: list[str] | None = None) -> Path:
        return self.out

    def start_merging(self) -> None:
        """Fold parts into ``out`` while the run goes on (rank 0): a follower process copies each part as it
        lands, so only the last few are left when every rank is done. :meth:`merge` waits for it."""
        self.parts.mkdir(parents=True, exist_ok=True)
        self._follower = subprocess.Popen([sys.executable, "-m", "esm_turbo.embed.h5merge", str(self.out),
                                           json.dumps(self.meta)], stdin=subprocess.PIPE)

    def merge(self) -> Path:
        """Fold the existing output (if any) and every part into ``out`` (atomically), then drop the parts.
        Call it once every rank has finished writing; with a follower started, this tells it so and waits."""
        follower = getattr(self, "_follower", None)
        if follower is None:
            follow_parts(self.out, done=lambda: True, meta=self.meta)
            return self.out
        follower.stdin.close()
        if follower.wait():
            raise EsmTurboError(f"{self.out}: merging the parts failed (exit {follower.returncode}); they are kept "
                                f"in {self.parts}, and --resume folds them in")
        return self.out


def follow_parts(out: str | Path, done: Callable[[], bool], poll: float = 0.05, meta: dict | None = None) -> Path:
    """Copy ``out`` (if it exists) and then each part file under ``<out>.parts/`` into a new ``out``, written
    atomically, until ``done()`` is true and no part is left unread; then drop the parts. Parts appear whole
    (each is renamed into place), so one listed is complete."""
    from .h5 import ColumnWriter, _h5py
    out = Path(out)
    parts = out.with_name(out.name + ".parts")
    h5py = _h5py()
    read: set[str] = set()

    def dump(tmp: str) -> None:
        # a chunk cache that holds every column's open chunk (a mean chunk of a 1280-wide model is 1.3 MB, over
        # HDF5's default 1 MB, which would read and rewrite it whole on every append)
        with h5py.File(tmp, "w", libver="latest", rdcc_nbytes=256 << 20, rdcc_nslots=10007) as dst:
            columns = ColumnWriter(dst, meta)
            if out.is_file():
                columns.append_file(out)
            while True:
                finished = done()  # asked before listing: a part written before the answer is listed below
                for part in sorted(parts.glob("*.h5")):
                    if part.name not in read:
                        columns.append_file(part)
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


def make_writer(fmt: str, out: str | Path, rank: int = 0, world: int = 1, meta: dict | None = None):
    if fmt == "pt":
        return PtWriter(out, rank, world, meta)
    if fmt == "h5":
        return H5Writer(out, rank, world, meta)
    raise ValueError(f"unknown output format {fmt!r}: choose one of {FORMATS}")


def check_output(writer, meta: dict, resume: bool, overwrite: bool) -> None:
    """Before any work: an output that holds records is added to only with ``--resume`` and only when it was made
    the same way (``meta``'s fields in :data:`MATCHED`, the model's fingerprint once known), or replaced with
    ``--overwrite``. One-line errors name the output and the field."""
    if not writer.has_records() or overwrite:
        return
    if not resume:
        raise EsmTurboError(f"{writer.out}: already holds embeddings; pass --resume to add the missing records or "
                            f"--overwrite to replace it")
    stored = writer.stored_meta()
    if stored is None:
        return  # an output of an earlier version says nothing to check against
    for key in MATCHED:
        if key in meta and key in stored and _norm(stored[key]) != _norm(meta[key]):
            what = "another model" if key == "model_fingerprint" else f"{key} {stored[key]}"
            asked = "" if key == "model_fingerprint" else f", this run asks for {meta[key]}"
            raise EsmTurboError(f"--resume: {writer.out} was made with {what}{asked}; write to a new output or pass "
                                f"--overwrite to replace it")


def _norm(value):
    return sorted(value) if isinstance(value, list) else value


__all__ = ["FORMATS", "H5Writer", "MATCHED", "PtWriter", "check_output", "follow_parts", "make_writer",
           "safe_name"]
