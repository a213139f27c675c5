"""``esm-turbo bench embed``: embedding extraction against what a careful user writes, in one run.

For each ESM-2 shape, and ESM C's on request (``--sizes ESMC-600M``; random weights: speed does not depend on them)
and the same real sequences
(calibration_data, repeated under new ids), mean of the last layer, fp16 on CUDA:

* ``ours``: :class:`~esm_turbo.embed.extract.Embedder` (what ``esm-turbo embed`` runs) into a writer that
  discards what reached the host;
* ``ours_fp8`` / ``ours_fp8_keep0`` (GPUs with FP8): the same with every block's products in FP8 e4m3 / with the first
  block's in bf16 (``--fp8-keep 0``);
* ``ours_gelu_tanh`` (ESM-2, CUDA): ``ours`` with GELU's tanh approximation (``--gelu tanh``);
* ``hf_sorted`` (the baseline of every claim): transformers' ``EsmModel`` (``EsmcModel``) with SDPA, length-sorted
  batches under the same token budget (rows × longest), masked mean on the GPU;
* ``hf_compiled``: the same loop with the stock model under ``torch.compile`` (a user's one-line
  alternative; compiled in the warm-up pass, which is not timed);
* ``hf_unsorted``: the same model over the file order in batches of 16;
* ``fair_esm``: fair-esm's ``ESM2`` with its own length-batched loader (``get_batch_indices``; ESM-2 only).

Every method runs one untimed pass over the whole set (every batch shape it meets compiled and cached), then the
methods pass in turn, each at least twice and on a GPU for at least three seconds, and the best pass is kept. Tokens/s
count ``<cls>``/``<eos>``; FLOPs per token are 2 × the linear layers' weights; "% peak" is against the
GPU's dense fp16 tensor rate, and "GEMM ceiling" is the tokens/s of the model's four matrix products
alone (cuBLAS, fp16, the same token count per batch), measured here. Also: one L=200 sequence end to
end (latency), and the peak GPU memory per token budget.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from ..fasta import Record, read_fastas
from ..model.alphabet import encode

#: dense fp16/bf16 tensor-core peak (no sparsity), by GPU name
DENSE_FP16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
METHODS = ("ours", "ours_gelu_tanh", "ours_fp8", "ours_fp8_keep0", "hf_sorted", "hf_compiled", "hf_unsorted",
           "fair_esm")
#: timed passes per method (the best is kept), after one warm-up pass over the whole set: at least REPEATS, and on a
#: GPU as many more as fill MIN_TIMED_S of each method's passes, up to MAX_REPEATS (the best of two passes of a fraction
#: of a second drifted by a fifth between processes with the card's clocks)
REPEATS = 2
MIN_TIMED_S = 3.0
MAX_REPEATS = 20
#: shapes of the GPU suite and how many copies of the sequence set each embeds
EMBED_BENCH_SIZES = {"8M": 8, "35M": 8, "150M": 8, "650M": 8, "3B": 2}
#: shapes run only when ``--sizes`` names them
EMBED_BENCH_EXTRA = {"ESMC-300M": 8, "ESMC-600M": 8, "ESMC-6B": 1}


class _NullWriter:
    """Discards outputs (after they reached the host): the benchmark times extraction, not disk."""

    written: list = []

    def written_ids(self, ids) -> set:
        return set()

    def write_chunk(self, chunk) -> None:
        pass


def dense_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DENSE_FP16_PEAK.items() if k in name), None)


def _linear_shapes(cfg) -> tuple[tuple[int, int], ...]:
    """(out, in) of a block's matrix products as FastEsm runs them: QKV, O, the feed-forward's in (ESM C's gate and
    up stacked), its out."""
    from ..model.family import family_of
    d, f = cfg.hidden_size, cfg.intermediate_size
    return (3 * d, d), (d, d), (family_of(cfg).ffn_in_width(f), d), (d, f)


def flops_per_token(cfg) -> float:
    """2 × the weights of the linear layers (Q, K, V, O and the feed-forward's) per token."""
    return 2.0 * cfg.num_hidden_layers * sum(o * i for o, i in _linear_shapes(cfg))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_masked_lm(size: str, device: torch.device, dtype: torch.dtype):
    """A released ESM-2 or ESM C shape (``650M``, ``ESMC-600M``) with random weights, built on the device (speed does
    not depend on weights)."""
    from ..model.family import ESM2, ESMC, hf_masked_lm_class
    from ..model.sizes import ESMC_SIZES, esm2_config, esmc_config
    family = ESMC if size in ESMC_SIZES else ESM2
    cfg = esmc_config(size) if family is ESMC else esm2_config(size)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return hf_masked_lm_class(family)(cfg).to(dtype).eval()


def _base(net):
    """transformers' base model of a masked-LM net (``EsmModel``, ``EsmcModel``)."""
    from ..model.family import family_of_net
    return family_of_net(net).base(net)


def hf_loop(esm, seqs: list[str], batches: list[list[int]], device: torch.device) -> None:
    """transformers' forward over the given batches, masked mean of the last layer copied to the host."""
    with torch.inference_mode():
        for idx in batches:
            tokens, mask = encode([seqs[i] for i in idx])
            tokens, mask = tokens.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            h = esm(input_ids=tokens, attention_mask=mask).last_hidden_state
            m = mask[..., None].to(h.dtype)
            ((h * m).sum(1) / m.sum(1)).float().cpu()


def fair_esm_runner(net, seqs: list[str], device: torch.device, budget: int) -> Callable[[list[str]], None] | None:
    """fair-esm's ESM2 (same shape, fp16) over its own batches; None when fair-esm is not installed."""
    try:
        import esm as fair
    except ImportError:
        return None
    cfg = net.config
    alpha = fair.data.Alphabet.from_architecture("ESM-1b")
    with torch.device(device):
        model = fair.model.esm2.ESM2(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, alpha,
                                     token_dropout=True).to(net.dtype).eval()
    converter = alpha.get_batch_converter()
    last = cfg.num_hidden_layers

    def run(subset: list[str]) -> None:
        data = fair.data.FastaBatchedDataset([str(i) for i in range(len(subset))], subset)
        loader = torch.utils.data.DataLoader(data, collate_fn=converter,
                                             batch_sampler=data.get_batch_indices(budget, extra_toks_per_seq=1))
        with torch.inference_mode():
            for _, strs, toks in loader:
                toks = toks.to(device, non_blocking=True)
                rep = model(toks, repr_layers=[last])["representations"][last]
                [rep[i, 1: len(s) + 1].mean(0).float().cpu() for i, s in enumerate(strs)]
    return run


def fp8_bound(ours: float, gemm: float, fp8_gemm: float) -> float:
    """The most FP8 products can speed up our forward (× its time), from three rates of one run (tokens/s): ``ours``
    (the fp16 forward), ``gemm`` (its four products alone in fp16) and ``fp8_gemm`` (the same in FP8): the products at
    the FP8 ceiling and everything else as the fp16 forward spends it (1/ours − 1/gemm a token; FP8's work around its
    products is no cheaper in bf16), with nothing added for quantizing the activations."""
    rest = max(0.0, 1 / ours - 1 / gemm)
    return (1 / ours) / (1 / fp8_gemm + rest)


def gemm_ceiling(cfg, tokens: int, device: torch.device, dtype: torch.dtype) -> float | None:
    """Tokens/s of the model's matrix products alone at ``tokens`` rows (cuBLAS), measured here."""
    if device.type != "cuda":
        return None
    import triton.testing
    d, f = cfg.hidden_size, cfg.intermediate_size
    x, y = torch.randn(tokens, d, device=device, dtype=dtype), torch.randn(tokens, f, device=device, dtype=dtype)
    ws = [torch.randn(o, i, device=device, dtype=dtype) for o, i in _linear_shapes(cfg)]

    def layer():
        torch.nn.functional.linear(x, ws[0])
        torch.nn.functional.linear(x, ws[1])
        torch.nn.functional.linear(x, ws[2])
        torch.nn.functional.linear(y, ws[3])
    seconds = triton.testing.do_bench(layer, warmup=50, rep=300, return_mode="median") / 1e3
    return tokens / (seconds * cfg.num_hidden_layers)


def fp8_gemm_ceiling(cfg, tokens: int, device: torch.device) -> float | None:
    """Tokens/s of the same matrix products in FP8 e4m3 (``torch._scaled_mm``, row-wise scales, bf16 out) at
    ``tokens`` rows, measured here; None without FP8 tensor cores."""
    from .fp8 import fp8_supported
    if not fp8_supported(device):
        return None
    import triton.testing
    d, f = cfg.hidden_size, cfg.intermediate_size
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(tokens, d, device=device).to(e4m3)
    y = torch.randn(tokens, f, device=device).to(e4m3)
    sx = torch.ones(tokens, 1, device=device)
    shapes = _linear_shapes(cfg)
    ws = [(torch.randn(o, i, device=device).to(e4m3), torch.ones(1, o, device=device)) for o, i in shapes]

    def layer():
        for (w, sw), a in zip(ws, (x, x, x, y)):
            torch._scaled_mm(a, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
    seconds = triton.testing.do_bench(layer, warmup=50, rep=300, return_mode="median") / 1e3
    return tokens / (seconds * cfg.num_hidden_layers)


def _timed(fn: Callable[[], None], device: torch.device, repeats: int = REPEATS) -> float:
    """Best of ``repeats`` timed passes of ``fn`` after one untimed pass over the same work."""
    got = _timed_all({"fn": fn}, device, repeats, min_seconds=0.0)["fn"]
    if isinstance(got, Exception):
        raise got
    return got


def _timed_all(runs: dict[str, Callable[[], None]], device: torch.device, repeats: int = REPEATS,
               min_seconds: float | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Best seconds of a pass of each of ``runs``, or the exception it raised: one untimed pass each (every batch
    shape it meets compiled, autotuned and cached before timing), then rounds in which each method passes once in
    turn (a drift of the card's clocks falls on all alike) until each has ``repeats`` passes and ``min_seconds`` of
    them (default :data:`MIN_TIMED_S` on CUDA, none elsewhere), at most :data:`MAX_REPEATS`."""
    if min_seconds is None:
        min_seconds = MIN_TIMED_S if device.type == "cuda" else 0.0
    best: dict = {}
    spent: dict[str, float] = {}
    passes: dict[str, int] = {}
    for name, fn in runs.items():
        if progress is not None:
            progress(name)
        try:
            fn()
            _sync(device)
        except Exception as err:  # noqa: BLE001 - a method that fails is reported, the others timed
            best[name] = err
            continue
        best[name], spent[name], passes[name] = float("inf"), 0.0, 0

    def wanted(name: str) -> bool:
        return passes[name] < MAX_REPEATS and (passes[name] < repeats or spent[name] < min_seconds)

    while any(wanted(n) for n in passes):
        for name in [n for n in passes if wanted(n)]:
            t0 = time.perf_counter()
            runs[name]()
            _sync(device)
            seconds = time.perf_counter() - t0
            best[name] = min(best[name], seconds)
            spent[name] += seconds
            passes[name] += 1
    return best


def bench_size(size: str, records: list[Record], device: torch.device, budget: int,
               methods: tuple[str, ...] = METHODS, dtype: torch.dtype | None = None) -> dict:
    """Tokens/s of each method over ``records``: one untimed pass over all of them, then the best of the timed passes
    :func:`_timed_all` takes, the methods in turn."""
    from .extract import DTYPES, EmbedConfig, Embedder
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    net = random_masked_lm(size, device, dtype)
    seqs = [r.sequence for r in records]
    tokens = sum(len(s) + 2 for s in seqs)
    fpt = flops_per_token(net.config)
    row: dict = dict(size=size, sequences=len(seqs), tokens=tokens, toks_per_batch=budget, flops_per_token=fpt)
    runs: dict[str, Callable[[], None]] = {}
    from ..model.family import family_of_net
    name = next(k for k, v in DTYPES.items() if v == dtype)
    for method, gelu in (("ours", None), ("ours_gelu_tanh", "tanh")):  # the tanh form: ESM-2 on CUDA
        if method in methods and (gelu is None or device.type == "cuda" and family_of_net(net).activation == "gelu"):
            embedder = Embedder(net, EmbedConfig(include=["mean"], toks_per_batch=budget, dtype=name, gelu=gelu),
                                device)
            runs[method] = lambda embedder=embedder: embedder.run(records, _NullWriter(), progress=False)
    from .fp8 import fp8_supported
    for method, keep in (("ours_fp8", ()), ("ours_fp8_keep0", (0,))):
        if method in methods and fp8_supported(device):
            from .fast_esm import FastEsm
            fp8 = Embedder(FastEsm.from_hf(net).to_fp8(keep), EmbedConfig(include=["mean"], toks_per_batch=budget,
                                                                          dtype="fp8", fp8_keep=list(keep)), device)
            runs[method] = lambda fp8=fp8: fp8.run(records, _NullWriter(), progress=False)
    from ..bench.baselines.user_embed import batches as sorted_batches  # importing esm_turbo.bench is heavy
    sorted_all = sorted_batches(seqs, budget)
    if "hf_sorted" in methods:
        runs["hf_sorted"] = lambda: hf_loop(_base(net), seqs, sorted_all, device)
    if "hf_compiled" in methods:
        compiled = torch.compile(_base(net), dynamic=True)
        runs["hf_compiled"] = lambda: hf_loop(compiled, seqs, sorted_all, device)
    if "hf_unsorted" in methods:
        chunks = [list(range(i, min(i + 16, len(seqs)))) for i in range(0, len(seqs), 16)]
        runs["hf_unsorted"] = lambda: hf_loop(_base(net), seqs, chunks, device)
    fair = fair_esm_runner(net, seqs, device, budget) if "fair_esm" in methods and hasattr(net, "esm") else None
    if fair is not None:
        runs["fair_esm"] = lambda: fair(seqs)
    peak = dense_peak(device)
    timed = _timed_all(runs, device, progress=lambda method: _progress(f"{size}-shaped: {method}"))
    for method, seconds in timed.items():
        if isinstance(seconds, Exception):  # a baseline that fails is reported, the others kept
            row[method] = dict(error=f"{type(seconds).__name__}: {str(seconds)[:300]}")
            continue
        row[method] = dict(seconds=seconds, tokens_per_s=tokens / seconds,
                           pct_peak=100 * tokens / seconds * fpt / peak if peak else None)
    base = row.get("hf_sorted", {}).get("tokens_per_s")
    for method in runs:
        if "tokens_per_s" in row[method]:
            row[method]["x_sorted"] = row[method]["tokens_per_s"] / base if base else None
    row["gemm_ceiling_tokens_per_s"] = gemm_ceiling(net.config, budget, device, dtype)
    row["fp8_gemm_ceiling_tokens_per_s"] = fp8_gemm_ceiling(net.config, budget, device)
    for method, ceiling in (("ours", "gemm_ceiling_tokens_per_s"), ("ours_gelu_tanh", "gemm_ceiling_tokens_per_s"),
                            ("ours_fp8", "fp8_gemm_ceiling_tokens_per_s"),
                            ("ours_fp8_keep0", "fp8_gemm_ceiling_tokens_per_s")):
        if row[ceiling] and "tokens_per_s" in row.get(method, {}):
            row[method]["pct_gemm_ceiling"] = 100 * row[method]["tokens_per_s"] / row[ceiling]
    ours = row.get("ours", {}).get("tokens_per_s")
    if ours and row["gemm_ceiling_tokens_per_s"] and row["fp8_gemm_ceiling_tokens_per_s"]:
        row["fp8_bound_x_ours"] = fp8_bound(ours, row["gemm_ceiling_tokens_per_s"],
                                            row["fp8_gemm_ceiling_tokens_per_s"])
    return row


def _release(device: torch.device) -> None:
    """Free what a size left behind (compiled graphs hold their modules) before the next is measured."""
    import gc
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_latency(size: str, device: torch.device, length: int = 200, reps: int = 20) -> dict:
    """One sequence of ``length`` residues end to end (tokens in, mean embedding on the host), median ms."""
    from ..bench.synthetic import random_protein as _random_protein
    from .fast_esm import FastEsm
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    net = random_masked_lm(size, device, dtype)
    fast = FastEsm.from_hf(net)
    seq = _random_protein(length, 0)
    out = {}
    for name, fn in (("ours", lambda: fast.embed([seq])),
                     ("hf", lambda: hf_loop(_base(net), [seq], [[0]], device))):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1e3 * sorted(times)[reps // 2]
    return dict(size=size, length=length, **out)


def bench_memory(size: str, records: list[Record], device: torch.device, budgets: tuple[int, ...]) -> list[dict]:
    """Peak GPU memory of ``esm-turbo embed`` (mean) per token budget, weights included."""
    from .extract import EmbedConfig, Embedder
    if device.type != "cuda":
        return []
    net = random_masked_lm(size, device, torch.float16)
    rows = []
    for budget in budgets:
        embedder = Embedder(net, EmbedConfig(include=["mean"], toks_per_batch=budget, dtype="fp16"), device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        embedder.run(records, _NullWriter(), progress=False)
        rows.append(dict(size=size, toks_per_batch=budget,
                         peak_gib=torch.cuda.max_memory_allocated(device) / 2 ** 30))
        del embedder
        torch.cuda.empty_cache()
    return rows


def _progress(message: str) -> None:
    print(f"[bench embed {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bench_embed(device: torch.device, fasta: list[str], quick: bool = False,
                sizes: list[str] | None = None, corpus: str | None = None) -> dict:
    """The whole embed suite (CPU: the 8M shape, fp32, a smoke run; no speed claim). ``sizes``: a subset of
    8M, 150M, 650M, 3B (the latency row runs with 650M, the memory rows with 3B). ``corpus``: instead of the suite,
    the end-to-end rows (:mod:`esm_turbo.embed.bench_e2e`) on that FASTA, for each size asked (default 650M)."""
    if corpus is not None:
        from .bench_e2e import bench_end_to_end
        return dict(end_to_end=[bench_end_to_end(corpus, size, device) for size in (sizes or ["650M"])])
    return _bench_suite(device, fasta, quick, sizes)


def _bench_suite(device: torch.device, fasta: list[str], quick: bool, sizes: list[str] | None) -> dict:
    base = read_fastas(fasta)
    from .extract import TOKS_PER_BATCH

    def copies_of(n: int) -> list[Record]:
        return [Record(f"{r.id}#{k}", r.sequence, r.source) for k in range(n) for r in base]
    if device.type != "cuda":
        return dict(rows=[bench_size("8M", copies_of(1), device, TOKS_PER_BATCH,
                                     methods=("ours", "hf_sorted", "hf_unsorted"))],
                    latency=[bench_latency("8M", device, reps=5)], memory=[])
    plan = tuple(EMBED_BENCH_SIZES.items()) if not quick else (("8M", 2), ("650M", 2))
    plan = tuple((s, n) for s, n in plan if sizes is None or s in sizes)
    plan += tuple((s, n) for s, n in EMBED_BENCH_EXTRA.items() if sizes is not None and s in sizes)
    rows = []
    for size, n in plan:
        _progress(f"{size}-shaped: {len(METHODS)} methods")
        rows.append(bench_size(size, copies_of(n), device, TOKS_PER_BATCH))
        _progress("\n".join(format_embed(dict(rows=rows[-1:]))[1:]))
        _release(device)
    latency = [bench_latency("650M", device)] if sizes is None or "650M" in sizes else []
    _release(device)
    memory = (bench_memory("3B", copies_of(1), device, (4096, 8192, 16384, 32768))
              if not quick and (sizes is None or "3B" in sizes) else [])
    return dict(rows=rows, latency=latency, memory=memory)


def format_embed(e: dict) -> list[str]:
    lines = ["\nembedding extraction (mean of the last layer; tokens/s, % of dense fp16 peak, × the sorted "
             "transformers loop)"] if e.get("rows") else []
    for r in e.get("rows", []):
        lines.append(f"  {r['size']}-shaped: {r['sequences']} sequences, {r['tokens']} tokens, "
                     f"{r['toks_per_batch']}-token batches, {r['flops_per_token'] / 1e9:.2f} GFLOP/token")
        for m in METHODS:
            if m not in r:
                continue
            x = r[m]
            if "error" in x:
                lines.append(f"    {m:14} failed: {x['error']}")
                continue
            pct = f"{x['pct_peak']:5.1f}%" if x.get("pct_peak") is not None else "   n/a"
            ratio = f"{x['x_sorted']:.2f}×" if x.get("x_sorted") else "n/a"
            which = "FP8" if "fp8" in m else "GEMM"
            extra = f"   {x['pct_gemm_ceiling']:.0f}% of the {which} ceiling" if "pct_gemm_ceiling" in x else ""
            lines.append(f"    {m:14} {x['tokens_per_s']:>10.0f} tokens/s  {pct}  {ratio:>6}{extra}")
        if r.get("gemm_ceiling_tokens_per_s"):
            lines.append(f"    {'GEMM ceiling':14} {r['gemm_ceiling_tokens_per_s']:>10.0f} tokens/s (matrix products "
                         f"alone, {r['toks_per_batch']} rows)")
        if r.get("fp8_gemm_ceiling_tokens_per_s"):
            lines.append(f"    {'FP8 ceiling':14} {r['fp8_gemm_ceiling_tokens_per_s']:>10.0f} tokens/s (the same "
                         f"products in FP8 e4m3, row-wise scales)")
        if r.get("fp8_bound_x_ours"):
            got = r.get("ours_fp8", {}).get("tokens_per_s")
            now = f"; ours_fp8 {got / r['ours']['tokens_per_s']:.2f}×" if got else ""
            lines.append(f"    {'FP8 bound':14} {r['fp8_bound_x_ours']:>9.2f}× ours (its products at the FP8 ceiling, "
                         f"the rest of ours as it runs{now})")
    for r in e.get("latency", []):
        lines.append(f"  one {r['length']}-residue sequence through the {r['size']}-shaped model, end to end: "
                     f"ours {r['ours_ms']:.2f} ms, transformers {r['hf_ms']:.2f} ms")
    for r in e.get("memory", []):
        lines.append(f"  peak GPU memory, {r['size']}-shaped fp16, {r['toks_per_batch']}-token batches: "
                     f"{r['peak_gib']:.2f} GiB")
    if e.get("end_to_end"):
        from .bench_e2e import format_end_to_end
        for row in e["end_to_end"]:
            lines += format_end_to_end(row)
    lines += [f"  note: {n}" for n in e.get("notes", [])]
    return lines


__all__ = ["bench_embed", "bench_latency", "bench_memory", "bench_size", "flops_per_token", "format_embed",
           "fp8_gemm_ceiling", "gemm_ceiling", "hf_loop",
           "random_masked_lm"]
