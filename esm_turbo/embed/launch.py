"""``esm-turbo embed --gpus N``: the command as N rank processes on this host, one GPU each, started without
torchrun.

The launching process imports neither torch nor the rest of the package (torchrun's launcher imports torch before
it starts any rank, seconds that every multi-GPU run waits through): it finds a free port, starts
``python -m esm_turbo.cli embed …`` once per rank with the environment torchrun would give (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), and waits. When a rank
fails, the others are stopped and the launcher exits with that rank's code; Ctrl-C stops them all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def gpus_asked(argv: list[str]) -> str | None:
    """The value of ``--gpus`` in an ``embed`` command line (``--gpus N`` or ``--gpus=N``), else None."""
    if not argv or argv[0] != "embed":
        return None
    for i, arg in enumerate(argv):
        if arg == "--gpus" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--gpus="):
            return arg.split("=", 1)[1]
    return None


def visible_gpus() -> int:
    """GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else those ``nvidia-smi -L`` lists (0 when it
    cannot be run)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def rank_count(value: str) -> int:
    """``--gpus``' value as a process count: a whole number ≥ 1, or ``all`` (every visible GPU). One line names a
    bad value or a count above the GPUs there are."""
    from ..errors import EsmTurboError
    have = visible_gpus()
    if value == "all":
        if have == 0:
            raise EsmTurboError("--gpus all: no GPU is visible here (CUDA_VISIBLE_DEVICES, nvidia-smi -L)")
        return have
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise EsmTurboError(f"--gpus {value!r}: give a whole number of GPUs (1 or more) or 'all'")
    if count > 1 and count > have:
        raise EsmTurboError(f"--gpus {count}: only {have} GPU(s) are visible here")
    return count


def launch_if_asked(argv: list[str], value: str | None = None) -> int | None:
    """The exit code of ``argv``'s ranks when it is an ``embed`` command line asking for more than one GPU
    (``value``: its ``--gpus``, when already parsed) and this process is not itself a rank; None when the command
    runs here. A bad ``--gpus`` raises its one-line error."""
    value = gpus_asked(argv) if value is None else value
    if value is None or "WORLD_SIZE" in os.environ:
        return None
    ranks = rank_count(value)
    return launch_ranks(argv, ranks) if ranks > 1 else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(argv: list[str], ranks: int) -> int:
    """Run ``esm-turbo`` with ``argv`` (an ``embed`` command line; its ``--gpus`` dropped) as ``ranks`` processes;
    returns the exit code (0 when every rank succeeded, else the first failure's)."""
    argv = _without_gpus(argv)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks),
               LOCAL_WORLD_SIZE=str(ranks))
    procs = [subprocess.Popen([sys.executable, "-m", "esm_turbo.cli", *argv],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(ranks)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                _stop(procs)
                return failed
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _without_gpus(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--gpus":
            skip = True
        elif not arg.startswith("--gpus="):
            out.append(arg)
    return out


__all__ = ["gpus_asked", "launch_if_asked", "launch_ranks", "rank_count", "visible_gpus"]
