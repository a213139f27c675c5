"""What a decode step must cost and where its time goes.

The floor of a step is one read of the bytes it must read: the cache's codes (or fp16 keys and values) of every row it
steps and the codecs' tables, the model's weights, and each layer's hidden states (read once a layer), at the rate a
pure-read kernel reaches in the same run (:func:`read_rate_gbs`). The breakdown splits one step's GPU time by kernel
kind (:data:`KINDS`), the gaps between its kernels, and, for a step run eagerly, the host's share.
"""

from __future__ import annotations

import torch

from ..cache import MemoryReport
from .timing import Product

#: kernel kinds of a step, each named by substrings of its kernels' names (the first kind that matches takes it):
#: attention before linears, as memory-efficient attention's kernels are named after cutlass
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("_prefix_kernel", "_stream_kernel", "_prep_kernel", "_merge_kernel", "_small_kernel",
                   "_blocks_kernel", "flash", "fmha", "attention", "sdpa")),
    ("cache write", ("_quantize_pack_kernel",)),
    ("linears", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "splitk", "_dequant_matmul_kernel", "_mma_kernel",
                 "_rotate_kernel")),
)
#: what no kind names: norms, rotary, residual adds, activations, embedding look-ups, copies
OTHER = "other"
#: kernels (by name) a breakdown lists, the longest in all first
TOP = 10


def kernel_kind(name: str) -> str:
    """The kind (:data:`KINDS`, else :data:`OTHER`) of a GPU kernel named ``name``."""
    low = name.lower()
    for kind, marks in KINDS:
        if any(m.lower() in low for m in marks):
            return kind
    return OTHER


def kv_bytes_held(report: MemoryReport, paged: bool) -> int:
    """Bytes of keys and values a cache holds for its rows' tokens: a paged cache's blocks (a block shared by forks
    once), a contiguous cache's every row (copies of a shared prefix each)."""
    return report.used_bytes if paged else report.tokens * report.bytes_per_token


def weight_bytes(model: torch.nn.Module, rows: int) -> int:
    """Bytes of ``model``'s parameters and buffers (each tensor once) that a step over ``rows`` rows reads: all but
    the word-embedding table, of which only the rows' own tokens."""
    embeddings = model.get_input_embeddings().weight
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = (t.data_ptr(), t.numel())
        if key in seen or t.data_ptr() == embeddings.data_ptr():
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total + rows * embeddings.shape[1] * embeddings.element_size()


def step_bytes(session, rows: int | None = None) -> dict[str, int]:
    """What one decode step of ``session`` (every row, or ``rows`` of them, one token each) must read once: ``kv``
    (held keys and values plus the codecs' tables), ``weights`` (:func:`weight_bytes`) and ``activations`` (each
    layer's input hidden state, [rows, hidden] in the model's dtype)."""
    engine = session.engine
    rep = session.memory_report()
    rows = session.cache.batch_size if rows is None else rows
    kv = kv_bytes_held(rep, session.paged) + rep.constant_bytes
    if rows != session.cache.batch_size:
        kv = kv * rows // session.cache.batch_size
    param = next(engine.model.parameters())
    hidden = engine.model.get_input_embeddings().weight.shape[1]
    acts = rows * hidden * param.element_size() * len(engine.layers)
    return dict(kv=kv, weights=weight_bytes(engine.model, rows), activations=acts)


def launch_bytes(session, rows: int | None = None, commit: bool = False,
                 products: str | None = None) -> list[int | Product]:
    """Bytes each launch of a fused decode step of ``session`` (FastEsm's blocks, ``model.fused_step``) must read,
    one entry a launch, layer by layer: the attention (the layer's share of :func:`step_bytes`' ``kv``), with a
    compressed cache the merge of its partials (one float32 a row's output channel) or with an uncompressed one the
    step's write (the new keys and values), the four products (each weight and bias), the rotary embedding (q and k),
    GELU (FFN-up's output) and two residual adds with their LayerNorm (two hidden states each): ten a layer; a
    compressed cache's committing step (``commit``) also writes its new keys and values: eleven. Timed as pure reads
    (:func:`~.timing.launch_floors_us`), they are the least a step of this many launches takes. ``products``
    ("fp16" or "fp8"): the four products as :class:`~.timing.Product` launches of the step's shapes instead, so the
    same timing gives the least such a step takes with its products as cuBLAS runs them."""
    cfg = session.engine.model.config
    rows = session.cache.batch_size if rows is None else rows
    d, f, layers = cfg.hidden_size, cfg.intermediate_size, len(session.engine.layers)
    e = next(session.engine.model.parameters()).element_size()
    kv = step_bytes(session, rows)["kv"] // layers
    from ..quant.codec import DenseQuantizer
    dense = isinstance(session.cache.codecs[0].key, DenseQuantizer)
    attend_side = rows * 2 * d * e if dense else rows * d * 4
    shapes = [(3 * d, d), (d, d), (f, d), (d, f)]
    if products is None:
        linears = [(n * k + n) * e for n, k in shapes]
    else:
        linears = [Product(rows, n, k, fp8=products == "fp8") for n, k in shapes]
    layer = [kv, attend_side, *linears, rows * 2 * d * e, rows * f * e, 2 * rows * d * e, 2 * rows * d * e]
    if commit and not dense:
        layer.append(rows * 2 * d * e)  # quantize-and-pack reads the new keys and values
    return layer * layers


def read_rate_gbs(device: torch.device, nbytes: int = 2**30) -> float:
    """GB/s of a kernel that only reads ``nbytes`` (:func:`~esm_turbo.bench.timing.read_floor_us`): the rate a step's
    floor is taken at (CUDA)."""
    from .timing import read_floor_us
    return nbytes / read_floor_us(nbytes, device) / 1e3


def floor_ms(nbytes: int, rate_gbs: float) -> float:
    """Milliseconds to read ``nbytes`` once at ``rate_gbs``."""
    return nbytes / rate_gbs / 1e6


def kernel_times(events) -> list[tuple[str, float, float]]:
    """``(name, start µs, end µs)`` of the GPU kernels, copies and fills among a profiler's ``events``, by start."""
    from torch.autograd import DeviceType
    out = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    return sorted(out, key=lambda k: k[1])


def breakdown(kernels: list[tuple[str, float, float]]) -> dict:
    """Milliseconds of one step's kernels (``kernel_times``) by kind, how many there were, the time at least one ran
    (``busy_ms``), their span from the first start to the last end, and the gaps in it (span less busy)."""
    kinds = {kind: 0.0 for kind, _ in KINDS} | {OTHER: 0.0}
    names: dict[str, list] = {}
    busy, last_end = 0.0, None
    for name, start, end in kernels:
        kinds[kernel_kind(name)] += (end - start) / 1e3
        entry = names.setdefault(name, [0.0, 0])
        entry[0] += (end - start) / 1e3
        entry[1] += 1
        lo = start if last_end is None else max(start, last_end)
        busy += max(0.0, end - lo)
        last_end = end if last_end is None else max(last_end, end)
    span = (kernels[-1][2] - kernels[0][1]) / 1e3 if kernels else 0.0
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:TOP]
    return dict(kinds_ms=kinds, launches=len(kernels), busy_ms=busy / 1e3, span_ms=span, gaps_ms=span - busy / 1e3,
                top=[dict(name=n[:120], kind=kernel_kind(n), ms=ms, calls=c) for n, (ms, c) in top])


def profile_step(fn, device: torch.device) -> dict:
    """:func:`breakdown` of one call of ``fn`` (run once before, untimed) under torch.profiler (CUDA)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return breakdown(kernel_times(prof.events()))


def step_report(session, step_ms: float, rate_gbs: float, rows: int | None = None) -> dict:
    """The floor of a step of ``session`` that took ``step_ms``: its bytes (:func:`step_bytes`), their one-read time
    at ``rate_gbs`` and the fraction of it the step reached."""
    nbytes = step_bytes(session, rows)
    floor = floor_ms(sum(nbytes.values()), rate_gbs)
    return dict(bytes=nbytes, floor_ms=floor, of_floor=floor / step_ms)


def format_breakdown(b: dict, step_ms: float) -> str:
    """One line: the kernels' ms by kind, and the rest of a ``step_ms`` step (the GPU idle: launch gaps, and eagerly
    the host's work)."""
    parts = [f"{kind} {ms:.2f}" for kind, ms in b["kinds_ms"].items()]
    how = "an eager step's" if b.get("eager") else "the step's"
    return (f"{how} {b['launches']} kernels: " + ", ".join(parts) +
            f" ms; GPU idle {max(0.0, step_ms - b['busy_ms']):.2f} ms")
