"""Atomic file writes: write to a temporary file in the target's folder, then rename over it, so a
killed job leaves either the old file or the new one, never half of one. And queued host-to-device copies."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


def _read_umask() -> int:
    """The process's umask (os.umask can only be read by setting it: done once, at import, not while a writer
    thread might be creating files)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, str]]:
    """(open descriptor, name) of a new temporary file beside ``path``, moved onto ``path`` when the block ends well
    and removed when it does not. The block closes the descriptor and sets the permissions."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        yield fd, tmp
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` and move the result to ``path`` (parents created), with the permissions a plain
    ``open(path, "w")`` would give (``mkstemp`` makes its file private)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _replacing(path) as (fd, tmp):
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
    return path


def remove_stale_temporaries(path: str | Path) -> None:
    """The temporaries a killed :func:`atomic_write` (or a folder written whole the same way) into ``path`` left
    beside it: ``.<name>.<random>.tmp`` files and folders."""
    path = Path(path)
    remove_temporaries(path.parent, f".{path.name}.")


def remove_temporaries(folder: str | Path, prefix: str = ".") -> None:
    """Every temporary of :func:`atomic_write` in ``folder`` whose name starts with ``prefix`` (``.`` for all)."""
    import shutil
    for stale in Path(folder).glob(f"{prefix}*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes | memoryview) -> Path:
    """``data`` to ``path`` atomically in one write to one open file (what :func:`atomic_write` does through a
    path, with fewer system calls: many small files are bound by them). The folder must exist."""
    path = Path(path)
    with _replacing(path) as (fd, _):
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, 0o666 & ~_UMASK)
        finally:
            os.close(fd)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def seconds_since_start() -> float | None:
    """Wall-clock seconds since this process started (Linux's /proc; None where that is missing)."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(stat[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def to_device_queued(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on ``device``; on CUDA through pinned memory, queued on the current
    stream, so the host does not wait for the device's queued work (a plain copy from pageable memory does)."""
    import torch
    t = torch.as_tensor(values, dtype=dtype or torch.long)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
