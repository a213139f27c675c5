"""``esm-turbo bench embed --corpus FASTA``: what a user meets, end to end.

Each row is a whole process on the corpus, timed from its start to its exit with the output closed:

* ``ours h5`` / ``ours pt``: ``esm-turbo embed --include mean`` into one HDF5 file / fair-esm ``.pt`` files, on a
  random-weight model folder of the shape (speed does not depend on the weights), in fp16. *Cold*: torch's compile
  caches empty (a new machine); *warm*: the second run.
* ``user compiled`` / ``user eager``: a careful user's script (:mod:`esm_turbo.bench.baselines.user_embed`):
  length-sorted batches, the tokenizer in DataLoader workers, ``EsmModel`` with SDPA, ``torch.compile(dynamic=True)``
  or not, means kept on the GPU and written with h5py.

Beside them, measured in the same run: the engine alone on the same records (``Embedder.run`` into a writer that
drops what reaches the host; one untimed pass, then one timed), the start-up floor (a process that imports torch and
makes the CUDA context, best of two), the floor of writing the ``.pt`` files (the same files written by the same
number of processes, nothing else running) and the GEMM ceiling (the model's matrix products alone, cuBLAS fp16).
The end-to-end floor of a run is the start-up floor plus the engine's time on the corpus.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..fasta import read_fasta
from .benchmark import _progress, gemm_ceiling, random_masked_lm

USER_SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "baselines" / "user_embed.py"
_LOOP = re.compile(r"(\d+) tokens in ([\d.]+) s \((\d+) tokens/s\)")
_PHASE = re.compile(r"(start-up|first batch|waiting on writes|final merge) ([\d.]+) s")


def model_folder(size: str, out: Path, device: torch.device) -> Path:
    """A random-weight ESM-2 of ``size`` saved as a hub folder would be: fp16 safetensors, config, tokenizer."""
    from transformers import EsmTokenizer

    from ..model.alphabet import ESM2_TOKENS
    net = random_masked_lm(size, device, torch.float16 if device.type == "cuda" else torch.float32)
    net.save_pretrained(out)
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(ESM2_TOKENS) + "\n")
    EsmTokenizer(str(vocab)).save_pretrained(out)
    del net
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


#: the end-to-end rows, in the order they run (the warm rows reuse the compile caches their cold row filled)
RUNS = ("ours h5 (cold)", "ours h5 (warm)", "ours pt (warm)", "user compiled (cold)", "user compiled (warm)",
        "user eager")


def _timed_process(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])}…: exit {proc.returncode}: {proc.stderr[-1500:]}")
    return seconds, proc.stderr + proc.stdout


def _caches(root: Path, name: str) -> dict:
    """Compile caches of their own (a new machine when empty, a second run when kept)."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / name / "inductor"), "TRITON_CACHE_DIR": str(root / name / "triton")}


def pt_floor(ids: list[str], dim: int, layers: list[int], workers: int, out: Path) -> float:
    """Seconds to write one fair-esm ``.pt`` per id (a mean of ``dim`` per layer) with ``workers`` processes of
    esm_turbo's own writer, and nothing else running: the least ``--format pt`` can take on this machine."""
    from .pool import _CTX, _bare_main
    shares = [ids[i::workers] for i in range(workers)]
    with _bare_main():
        pool = _CTX.Pool(workers)
    with pool:
        pool.map(_ready, range(4 * workers), chunksize=1)  # the workers up and imported before the clock starts
        t0 = time.perf_counter()
        pool.starmap(_write_share, [(share, dim, layers, str(out)) for share in shares])
        return time.perf_counter() - t0


def _ready(_) -> None:
    from . import writers  # noqa: F401
    time.sleep(0.05)


def _write_share(ids: list[str], dim: int, layers: list[int], out: str) -> None:
    from .chunk import Chunk
    from .writers import PtWriter
    writer = PtWriter(out)
    rng = np.random.default_rng(0)
    for i in range(0, len(ids), 256):
        part = ids[i: i + 256]
        writer.write_chunk(Chunk(part, np.zeros(len(part), np.int64),
                                 mean={layer: rng.standard_normal((len(part), dim), np.float32) for layer in layers}))


def startup_floor(device: torch.device) -> float:
    """Seconds for a process that imports torch and makes the CUDA context (on CPU: imports torch), best of two:
    what any PyTorch command pays before its first batch on this machine."""
    code = "import torch; torch.empty(1, device='cuda')" if device.type == "cuda" else "import torch"
    return min(_timed_process([sys.executable, "-c", code], dict(os.environ))[0] for _ in range(2))


def engine_alone(folder: Path, records, device: torch.device, budget: int) -> float:
    """Tokens/s of ``Embedder.run`` on ``records`` in this process (fp16, mean; nothing written): one untimed pass,
    then one timed (every shape already met)."""
    from ..schema import DTYPES
    from .benchmark import _NullWriter, _timed
    from .extract import EmbedConfig, Embedder
    from .fast_esm import FastEsm
    dtype = "fp16" if device.type == "cuda" else "fp32"
    fast = FastEsm.from_pretrained(folder, dtype=DTYPES[dtype], device=device, lm_head=False)
    embedder = Embedder(fast, EmbedConfig(include=["mean"], toks_per_batch=budget, dtype=dtype), device)
    tokens = sum(len(r.sequence) + 2 for r in records)
    seconds = _timed(lambda: embedder.run(records, _NullWriter(), progress=False), device, repeats=1)
    return tokens / seconds


def bench_end_to_end(corpus: str, size: str, device: torch.device, workdir: str | None = None,
                     budget: int = 16384, runs: tuple[str, ...] | None = None) -> dict:
    """Every row of the module docstring on ``corpus`` with a ``size``-shaped model (fp32 without CUDA: a smoke run
    of the same steps, no speed claim). ``runs``: only these rows of :data:`RUNS`."""
    from ..bench.timing import device_name  # the bench package: seconds of imports the embed command never needs
    records, _ = read_fasta(corpus)
    tokens = sum(len(r.sequence) + 2 for r in records)
    root = Path(tempfile.mkdtemp(prefix="esm_turbo_e2e_", dir=workdir))
    folder = model_folder(size, root / "model", device)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = sys.executable
    dtype = "fp16" if device.type == "cuda" else "fp32"
    ours = [py, "-m", "esm_turbo.cli", "embed", "--model", str(folder), corpus, "--include", "mean", "--dtype", dtype,
            "--toks-per-batch", str(budget), "--quiet"]
    user = [py, str(USER_SCRIPT), str(folder), corpus, str(root / "user.h5"), "--toks-per-batch", str(budget)]
    plan = [("ours h5 (cold)", "ours", ours + ["--format", "h5", "-o", str(root / "o.h5")], "h5"),
            ("ours h5 (warm)", "ours", ours + ["--format", "h5", "-o", str(root / "o.h5")], "h5"),
            ("ours pt (warm)", "ours", ours + ["--format", "pt", "-o", str(root / "pt")], "pt"),
            ("user compiled (cold)", "user", user + ["--compile"], None),
            ("user compiled (warm)", "user", user + ["--compile"], None),
            ("user eager", "user", user, None)]
    plan = [step for step in plan if runs is None or step[0] in runs]
    rows: dict = dict(size=size, corpus=corpus, records=len(records), tokens=tokens, toks_per_batch=budget,
                      dtype=dtype, device=device_name(device),
                      runs={})
    for name, who, cmd, fmt in plan:
        _progress(f"end to end: {name}")
        for stale in (root / "o.h5", root / "user.h5"):
            stale.unlink(missing_ok=True)
        if fmt == "pt" and (root / "pt").exists():
            shutil.rmtree(root / "pt")
        seconds, log = _timed_process(cmd, dict(env, **_caches(root, who)))
        run = dict(seconds=seconds, tokens_per_s=tokens / seconds)
        loop = _LOOP.search(log)
        if loop:
            run.update(loop_s=float(loop.group(2)), loop_tokens_per_s=float(loop.group(3)))
            run.update({k.replace(" ", "_").replace("-", "") + "_s": float(v) for k, v in _PHASE.findall(log)})
            steady = max(0.0, run["loop_s"] - run.get("first_batch_s", 0.0) - run.get("waiting_on_writes_s", 0.0))
            run["outside_loop_s"] = seconds - steady  # start-up, first batch, waits on writes, merge, exit
        rows["runs"][name] = run
    _progress("end to end: the start-up floor, the engine alone, the .pt floor, the GEMM ceiling")
    rows["startup_floor_s"] = startup_floor(device)
    rows["engine_tokens_per_s"] = engine_alone(folder, records, device, budget)
    from .command import default_writers
    workers = default_writers("pt", 1)
    shutil.rmtree(root / "pt", ignore_errors=True)
    from ..model.folder import read_config
    cfg = read_config(folder)
    rows["pt_floor"] = dict(workers=workers, seconds=pt_floor([r.id for r in records], cfg.hidden_size,
                                                              [cfg.num_hidden_layers], workers, root / "pt"))
    rows["gemm_ceiling_tokens_per_s"] = gemm_ceiling(cfg, budget, device, torch.float16)  # None off CUDA
    shutil.rmtree(root, ignore_errors=True)
    return rows


def format_end_to_end(e: dict) -> list[str]:
    """The end-to-end table: each run's wall time and tokens/s, the loop's share, ratios to the baselines."""
    lines = [f"\nend to end on {e['corpus']}: {e['records']} records, {e['tokens']} tokens, {e['size']}-shaped "
             f"{e['dtype']}, "
             f"{e['toks_per_batch']}-token batches, {e['device']} (process start to exit, output closed)"]
    runs = e["runs"]
    user = runs.get("user compiled (warm)", {}).get("seconds")
    engine = e.get("engine_tokens_per_s")
    for name, r in runs.items():
        extra = ""
        if "loop_s" in r:
            extra = (f"  loop {r['loop_tokens_per_s'] / 1e3:.0f}K/s ({100 * r['loop_tokens_per_s'] / engine:.0f}% of "
                     f"the engine), outside the loop {r['outside_loop_s']:.1f} s (start-up "
                     f"{r.get('startup_s', 0):.1f}, first batch {r.get('first_batch_s', 0):.1f}, write waits "
                     f"{r.get('waiting_on_writes_s', 0):.1f}, merge {r.get('final_merge_s', 0):.1f})")
        ratio = f"  {user / r['seconds']:.2f}× user compiled (warm)" if user and name.startswith("ours") else ""
        lines.append(f"  {name:22} {r['seconds']:7.1f} s {r['tokens_per_s'] / 1e3:7.0f}K tokens/s{ratio}{extra}")
    if engine:
        lines.append(f"  {'engine alone':22} {e['tokens'] / engine:7.1f} s {engine / 1e3:7.0f}K tokens/s "
                     f"(Embedder.run in one process, nothing written)")
    if engine and e.get("startup_floor_s") is not None:
        floor_s = e["startup_floor_s"] + e["tokens"] / engine
        lines.append(f"  {'end-to-end floor':22} {floor_s:7.1f} s {e['tokens'] / floor_s / 1e3:7.0f}K tokens/s "
                     f"(a process that imports torch and starts the device: {e['startup_floor_s']:.1f} s; then the "
                     f"engine alone)")
    floor = e.get("pt_floor")
    if floor:
        lines.append(f"  {'.pt floor':22} {floor['seconds']:7.1f} s  writing the {e['records']} files alone with "
                     f"{floor['workers']} processes")
    if e.get("gemm_ceiling_tokens_per_s"):
        g = e["gemm_ceiling_tokens_per_s"]
        lines.append(f"  {'GEMM ceiling':22} {e['tokens'] / g:7.1f} s {g / 1e3:7.0f}K tokens/s (matrix products alone)")
    return lines


__all__ = ["RUNS", "bench_end_to_end", "engine_alone", "format_end_to_end", "model_folder", "pt_floor", "startup_floor"]
