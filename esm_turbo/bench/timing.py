"""How the bench times GPU work: CUDA-graph replays with a cold L2 (a call alone, or among a decode step's layer
calls), and the hardware floors each timing is compared with (a device copy, an empty graph, a pure read)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

def device_name(device: torch.device | str) -> str:
    """The GPU's name ("NVIDIA H100 80GB HBM3"), or "cpu": what results name the machine by."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def time_eager(fn, device: torch.device, reps: int = 5) -> float:
    """Median wall-clock seconds of ``fn`` over ``reps`` calls after one warm-up, each call synchronised on CUDA:
    for work a CUDA graph cannot hold."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def time_graph(fn, device: torch.device, reps: int = 20) -> float:
    """Median seconds of ``fn`` (CUDA: replayed as a CUDA graph, timed with events; CPU: wall clock)."""
    if device.type != "cuda":
        return time_eager(fn, device, max(3, reps // 5))
    import triton.testing
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / 1e3


#: layer calls captured in one CUDA graph for the "in a step" timings: a decode step of the 650M model replays its
#: 33 layers' calls as one graph, so the graph's launch is paid once per step, not once per call
STEP_CALLS = 33


def time_in_step(fn, device: torch.device, calls: int = STEP_CALLS) -> float:
    """Median seconds per call of ``fn`` among ``calls`` calls captured in one CUDA graph (CPU: :func:`time_graph`)."""
    if device.type != "cuda":
        return time_graph(fn, device)

    def step():
        for _ in range(calls):
            fn()
    return time_graph(step, device, reps=10) / calls


def peak_copy_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth (bytes read + written) over a 2 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    sec = time_graph(lambda: dst.copy_(src), device)
    return 2 * src.numel() / sec / 1e9


def link_h2d_gbs(device: torch.device, nbytes: int = 256 * 2**20) -> float:
    """GB/s of one host-to-device copy of ``nbytes`` from pinned memory, the fastest of five (what bounds a paged
    cache's host tier); 0 off CUDA."""
    if device.type != "cuda":
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host)
    times = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def graph_floor_us(device: torch.device) -> float:
    """µs of a graph holding one one-element add, timed as every call here is (:func:`time_graph`): what each
    timing includes besides its kernels."""
    one = torch.zeros(1, device=device)
    return time_graph(lambda: one.add_(1), device) * 1e6


#: programs per SM of the read-only floor: one-warp programs; on an H100 12 and 16 per SM read a large buffer fastest,
#: 4 and 8 a launch of a few MB (11 MB in a graph of such launches: 6.5 µs at 8 against 6.7 at 12 and 7.1 at 16;
#: ``tools/read_floor_programs.py``)
READ_PROGRAMS_PER_SM = (4, 8, 12, 16)


def read_floor_us(nbytes: int, device: torch.device) -> float:
    """µs (as :func:`time_graph`) of a kernel that only reads ``nbytes`` (rounded up to whole 2 KB chunks), the
    fastest of :data:`READ_PROGRAMS_PER_SM`: the least any kernel reading those bytes takes (CUDA)."""
    return launch_floors_us([nbytes], device)


@dataclass(frozen=True)
class Product:
    """A launch that multiplies [rows, in_features] by a weight [out_features, in_features] of its own and adds a
    bias, as a step's linear does: ``F.linear`` in fp16 (cuBLAS), or with ``fp8`` one row-scaled e4m3 product
    (:func:`esm_turbo.embed.fp8.fp8_linear`, bf16 rows: its rows' quantize launch included)."""
    rows: int
    out_features: int
    in_features: int
    fp8: bool = False

    def launch(self, device: torch.device):
        """A call that runs this product once on fresh random operands (built now, on ``device``)."""
        dtype = torch.bfloat16 if self.fp8 else torch.float16
        x = torch.randn(self.rows, self.in_features, device=device, dtype=dtype)
        w = torch.randn(self.out_features, self.in_features, device=device, dtype=dtype) * 0.02
        b = torch.randn(self.out_features, device=device, dtype=dtype)
        if self.fp8:
            from ..embed.fp8 import Fp8Weight, fp8_linear
            q = Fp8Weight.quantize(w)
            return lambda: fp8_linear(x, q, b)
        return lambda: torch.nn.functional.linear(x, w, b)


def step_launches(sizes: list[int | Product], device: torch.device) -> list:
    """One launch of :func:`launch_floors_us` an entry of ``sizes``, built on ``device``: a :class:`Product`'s call,
    or for a byte count a random int32 buffer of its own, rounded up to whole 2 KB chunks (read by ``read_words``)."""
    from .read import WORDS_PER_WARP
    return [n.launch(device) if isinstance(n, Product) else
            torch.empty(-(-n // (4 * WORDS_PER_WARP)) * WORDS_PER_WARP, dtype=torch.int32, device=device).random_()
            for n in sizes]


def launches_us(launches: list, programs: int, device: torch.device) -> float:
    """µs (as :func:`time_graph`) of one graph running each of ``launches`` (:func:`step_launches`) once: a product's
    call as it is, a buffer read by ``read_words`` in ``programs`` one-warp programs."""
    from .read import read_words
    return time_graph(lambda: [b() if callable(b) else read_words(b, programs) for b in launches], device) * 1e6


def launch_floors_us(sizes: list[int | Product], device: torch.device) -> float:
    """µs (as :func:`time_graph`) of one graph of pure reads, one launch a byte count of ``sizes`` (each rounded up to
    whole 2 KB chunks) over its own buffer (so none is in L2 when it is read, as a step's launches over every layer's
    own weights), the fastest of :data:`READ_PROGRAMS_PER_SM`: the least a step reading those bytes in those launches
    takes (CUDA). A :class:`Product` entry runs that product instead, over its own weight: the least such a step
    takes with its products as the library runs them alone."""
    from ..kernels.common import num_sms
    launches = step_launches(sizes, device)
    sms = num_sms(device)
    return min(launches_us(launches, sms * p, device) for p in READ_PROGRAMS_PER_SM)
