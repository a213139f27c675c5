"""Checks the CLI runs on its arguments before any model is loaded or FASTA read: devices that exist,
output places that can be written and are of the expected kind, model paths that exist, numbers in
range. Each failure raises :class:`~esm_turbo.errors.EsmTurboError` naming the flag and the value; the
CLI turns it into one line and exit code 2."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from .errors import EsmTurboError


def int_in(lo: int, hi: int | None = None):
    """An argparse ``type``: an integer in [lo, hi] (hi None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"{value} is out of range (a whole number {bound})")
        return value
    return parse


def float_in(lo: float, hi: float):
    """An argparse ``type``: a number in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range ({lo} to {hi})")
        return value
    return parse


def device(value: str, flag: str = "--device") -> str:
    """A device torch can use here: cpu, cuda / cuda:N (with CUDA present), mps (where available)."""
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise EsmTurboError(f"{flag} {value!r}: not a device (use cpu, cuda, cuda:N or mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EsmTurboError(f"{flag} {value!r}: this machine has no CUDA GPU (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise EsmTurboError(f"{flag} {value!r}: there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise EsmTurboError(f"{flag} {value!r}: MPS is not available on this machine")
    elif dev.type != "cpu":
        raise EsmTurboError(f"{flag} {value!r}: not a device (use cpu, cuda, cuda:N or mps)")
    return value


def _writable_ancestor(path: Path, flag: str) -> None:
    """The nearest existing ancestor of ``path`` is a folder we can create things in."""
    parent = path.parent
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise EsmTurboError(f"{flag} {str(path)!r}: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise EsmTurboError(f"{flag} {str(path)!r}: cannot write in {str(parent)!r} (permission denied)")


#: file systems that hold the kernel's and devices' entries, not files (/dev/shm is ordinary memory)
_SPECIAL = (Path("/proc"), Path("/sys"), Path("/dev"))


def _ordinary_place(path: Path, flag: str) -> None:
    """Not under /proc, /sys or /dev (but /dev/shm), and, if it exists, a regular file or a folder: writing a device
    node, a pipe or a socket would replace it (an atomic write renames a new file over it)."""
    resolved = path.expanduser().resolve()
    shm = Path("/dev/shm")
    special = [p for p in _SPECIAL if p == resolved or p in resolved.parents]
    if special and not (resolved == shm or shm in resolved.parents):
        raise EsmTurboError(f"{flag} {str(path)!r}: lies under {special[0]}, which holds no ordinary files; name a "
                            f"place on a disk")
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise EsmTurboError(f"{flag} {str(path)!r}: exists and is not a regular file (a device, a pipe or a socket)")


def output_file(path: str | Path, flag: str, hdf5: bool = False) -> Path:
    """A file the command will write: not a folder; its folder writable (or creatable); an existing
    file is writable, and with ``hdf5`` an HDF5 file (it is appended to, as ``--resume`` does)."""
    path = Path(path)
    _ordinary_place(path, flag)
    if path.is_dir():
        raise EsmTurboError(f"{flag} {str(path)!r}: is a folder; name a file")
    _writable_ancestor(path, flag)
    if path.exists():
        if not os.access(path, os.W_OK):
            raise EsmTurboError(f"{flag} {str(path)!r}: exists and is not writable")
        if hdf5:
            import h5py
            if not h5py.is_hdf5(path):
                raise EsmTurboError(f"{flag} {str(path)!r}: exists and is not an HDF5 file (name a new file)")
    return path


def output_dir(path: str | Path, flag: str) -> Path:
    """A folder the command will write into: not a file; writable or creatable."""
    path = Path(path)
    _ordinary_place(path, flag)
    if path.exists() and not path.is_dir():
        raise EsmTurboError(f"{flag} {str(path)!r}: is a file; name a folder")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise EsmTurboError(f"{flag} {str(path)!r}: cannot write in this folder (permission denied)")
    else:
        _writable_ancestor(path, flag)
    return path


def input_file(path: str | Path, flag: str, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise EsmTurboError(f"{flag} {str(path)!r}: no such {what}")
    if path.is_dir():
        raise EsmTurboError(f"{flag} {str(path)!r}: is a folder, not a {what}")
    return path


def model_source(value: str, flag: str = "--model") -> str:
    """A size name or hub id passes; something written as a local path must exist."""
    from .model.sizes import ESM2_SIZES
    if value in ESM2_SIZES or Path(value).expanduser().exists():
        return value
    looks_local = (value.startswith(("/", ".", "~")) or value.endswith((".pt", ".pth", ".safetensors"))
                   or value.count("/") != 1 or os.sep != "/" and os.sep in value)
    if looks_local:
        raise EsmTurboError(f"{flag} {value!r}: no such local path (a Hugging Face hub id is written "
                            f"'organisation/name', e.g. facebook/esm2_t33_650M_UR50D, and needs a network)")
    return value


def known_layer_count(model: str) -> int | None:
    """The layer count of a size name or a ``save_pretrained`` folder, read without loading weights (None
    for anything else, which is checked once loaded)."""
    import json

    from .model.sizes import ESM2_SIZES
    if model in ESM2_SIZES:
        return ESM2_SIZES[model][0]
    config = Path(model).expanduser() / "config.json"
    try:
        return int(json.loads(config.read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def not_an_input(path: str | Path, inputs: list[str | Path], flag: str) -> None:
    """An output that is one of the command's inputs (a FASTA, the model's file or folder) would overwrite it."""
    out = Path(path).expanduser().resolve()
    for given in inputs:
        if Path(given).expanduser().resolve() == out:
            raise EsmTurboError(f"{flag} {str(path)!r}: is the input {str(given)!r}; name another output")


__all__ = ["device", "float_in", "input_file", "int_in", "known_layer_count", "model_source", "not_an_input",
           "output_dir", "output_file"]
