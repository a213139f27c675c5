"""Fused ops vs their references.

* The affine-domain attention reference (``compressed_attention_reference``) must equal the two-step
  path (dequantize, rotate back, attend) — this checks the maths of the rotated-domain query.
* The Triton kernels must match the references, with the flash-attention tolerance rule of STYLE.md:
  ``max|out − ref64| ≤ 2 · max|out_pt − ref64|`` (plus float32 eps), where ref64 is the reference in
  float64 and out_pt the same reference in float32. Without CUDA they run under Triton's interpreter
  (``TRITON_INTERPRET=1``, set in conftest) at small sizes; on a GPU at the full grid of sizes.
"""

import os

import pytest
import torch

from esm_turbo.cache import KVCache
from esm_turbo.kernels import triton_supported
from esm_turbo.ops import attend_compressed, decode_attention_reference, fused_supported, gather_blocks
from esm_turbo.ops.compressed import (cached_codes, compressed_attention_reference, fused_tables,
                                      quantize_pack_reference, split_rotation)
from esm_turbo.quant.codec import KVCodec
from esm_turbo.quant.layout import decode_grid
from esm_turbo.quant.fit import oblivious_codec
from esm_turbo.testing import random_turbo_codec

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (run on the GPU machine)")
needs_triton = pytest.mark.skipif(not triton_supported(),
                                  reason="triton >= 3.5 is not installed (pip install -e '.[test]' on Linux x86-64)")


def filled_cache(codec, batch, lengths, device, seed=0):
    """A one-layer cache holding ragged random post-RoPE K/V (written by the reference encoder)."""
    gen = torch.Generator().manual_seed(seed)
    h, d = codec.key.heads, codec.key.dim
    t = max(lengths)
    cache = KVCache([codec.to(device)], batch, capacity=t + 8, device=device)
    k = (torch.randn(batch, h, t, d, generator=gen) * 2).to(device)
    v = torch.randn(batch, h, t, d, generator=gen).to(device)
    encoded = codec.encode(k, v)
    for name, val in encoded.items():
        cache.parts[0][name][:, :, :t] = val
    cache.lengths = torch.tensor(lengths, device=device)
    cache.rewind_bound(t)
    return cache


def step_inputs(batch, heads, s, d, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, heads, s, d, generator=gen) * d**-0.5 * 3).to(device)
    k = torch.randn(batch, heads, s, d, generator=gen).to(device)
    v = torch.randn(batch, heads, s, d, generator=gen).to(device)
    valid = torch.ones(batch, s, dtype=torch.bool, device=device)
    valid[-1, s - 1] = s == 1  # a padded new token in the last row (when S > 1)
    return q, k, v, valid


@pytest.mark.parametrize("bits,residual", [(2, "sign"), (3, "sign"), (4, "none"), (3, "none")])
def test_affine_domain_attention_equals_two_step(bits, residual):
    codec = random_turbo_codec(3, 16, bits, bits, residual, seed=bits)
    cache = filled_cache(codec, 3, [5, 40, 0], "cpu")
    q, k, v, valid = step_inputs(3, 3, 2, 16, "cpu")
    ref = decode_attention_reference(q, cache, 0, k, v, valid)
    out = attend_compressed(codec, cache.parts[0], cache.lengths, q, k, v, valid)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()


def test_fused_support_rules():
    assert fused_supported(random_turbo_codec(2, 64))
    assert not fused_supported(random_turbo_codec(2, 64, residual="qjl"))
    assert not fused_supported(oblivious_codec(2, 64, 3))  # TurboQuant stores per-vector norms
    assert fused_supported(random_turbo_codec(2, 24)) and not fused_supported(random_turbo_codec(2, 24), True)


def _reference_args(codec, cache, q, k, v, valid, dtype, per_head=False):
    """Arguments of the decode attention reference and kernel (``per_head``: field shifts read from each head's
    layout row instead of compiled in)."""
    cast = (lambda t: t.to(dtype)) if dtype != torch.float32 else (lambda t: t)

    def codes(kind):
        c = cached_codes(codec, cache.parts[0], kind)
        return c._replace(table=cast(c.table), rot=cast(c.rot), offset=cast(c.offset), scale=cast(c.scale),
                          code=c.code.per_head() if per_head else c.code)
    return cast(q), cast(k), cast(v), valid.to(torch.uint8), cache.lengths, codes("k"), codes("v")


def strided(t):
    """The same values as a [B, H, S, d] view of a [B, S, H, d] tensor, as post-RoPE q/k/v arrive."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def paged_args(args, block_size, seed=0):
    """The same cache as ``_reference_args`` gives, laid out as a paged cache does: each kind's parts as a pool
    [slots, H, block_size, ·] whose blocks sit at shuffled slots (spare slots full of junk), and the block table.
    Returns (args with pooled parts, pages [B, blocks] int32)."""
    from esm_turbo.bench.synthetic import as_blocks, shuffled_pages
    keys = args[5]
    batch, _, t_cap = keys.main.shape[:3]
    pages = shuffled_pages(batch, -(-t_cap // block_size), spare=3, seed=seed, device=keys.main.device)
    slots = pages.numel() + 3

    def pooled(part):
        return as_blocks(part, pages, block_size, slots, fill=255) if part.numel() else part
    kinds = [c._replace(main=pooled(c.main), sign=pooled(c.sign), slots=pooled(c.slots) if c.has_slots() else None)
             for c in args[5:7]]
    return (*args[:5], *kinds), pages


def check_kernel_matches(bits, residual, d, batch, lengths, s, heads=2, seed=0, dtype=torch.float32, path="auto",
                         allocate=True, shared=False, grid=False, config=None, block_size=0, max_bits=None,
                         slots=False, permuted_keys=False):
    """Inputs arrive as strided views in ``dtype`` (the output too); the references compute in float32 /
    float64 from the same values. ``allocate``: channels of allocated widths, each head its own (the kernels
    read a field layout per head) or, ``shared``, the same for every head (compiled-in shifts, as for equal
    widths); ``grid``: a grid codec, whose values the kernels compute from the codes. ``block_size`` > 0: the
    kernel reads the cache laid out in blocks of that many tokens through a block table (:func:`paged_args`).
    ``max_bits``: the widest channel of an allocation (default bits + 1). ``slots``: the codec keeps one slot a token
    and kind (``esm_turbo.quant.slots``), which the kernel must read: the reference without them is far off.
    ``permuted_keys``: the keys' rotation permutes each head's channels (the default recipe's)."""
    from esm_turbo.kernels.decode import compressed_attention_triton
    key_bits, value_bits = bits if isinstance(bits, tuple) else (bits, bits)  # (keys, values): the default's split
    codec = random_turbo_codec(heads, d, key_bits, value_bits, residual, seed=seed, allocate=allocate,
                               shared=shared, grid=grid, max_bits=max_bits, permuted_keys=permuted_keys).to(DEVICE)
    if slots:
        codec = KVCodec(codec.key, codec.value, slots=1)
    if max_bits is not None:  # the allocation did use widths beyond bits + 1
        assert max(int(q.widths.max()) for q in (codec.key, codec.value)) > max(key_bits, value_bits) + 1
    tables = fused_tables(codec)
    assert (decode_grid(tables.k_code, tables.v_code) > 0) == grid
    if not allocate or shared:
        assert tables.k_code.fields >= 0 and tables.v_code.fields >= 0
    # heads of a random allocation may happen to agree: the per-head layout path is what is tested without sharing
    per_head = allocate and not shared
    cache = filled_cache(codec, batch, lengths, DEVICE, seed)
    q, k, v, valid = (strided(t.to(dtype)) if t.is_floating_point() else t
                      for t in step_inputs(batch, heads, s, d, DEVICE, seed + 1))
    ref64 = compressed_attention_reference(*_reference_args(codec, cache, q, k, v, valid, torch.float64, per_head))
    ref32 = compressed_attention_reference(*_reference_args(codec, cache, q, k, v, valid, torch.float32, per_head))
    args = _reference_args(codec, cache, q, k, v, valid, torch.float32, per_head)
    pages = {}
    if block_size:
        args, table = paged_args(args, block_size, seed)
        pages = dict(pages=table, block_size=block_size)
        paged_ref = compressed_attention_reference(*args, **pages)  # reads the pool through the table
        assert (paged_ref.double() - ref64).abs().max().item() <= 2 * (ref32.double() - ref64).abs().max().item() + 1e-6
    out = compressed_attention_triton(*args, config=dict(path=path) | (config or {}), **pages)
    assert torch.isfinite(out).all() and out.dtype == dtype
    err = (out.double() - ref64).abs().max().item()
    err_pt = (ref32.double() - ref64).abs().max().item()
    assert err <= 2 * err_pt + 1e-5, (err, err_pt)
    if slots:  # the slots move the output far beyond the tolerance: the kernel read them
        unslotted = [c._replace(slots=None) for c in args[5:7]]
        bare = compressed_attention_reference(*args[:5], *unslotted, **pages).double()
        assert (bare - ref64).abs().max().item() > 20 * (err + 1e-6)
    return out


@needs_triton
@pytest.mark.parametrize("bits,residual,d,path", [(3, "sign", 16, "one"), (3, "sign", 64, "split"),
                                                  (4, "sign", 32, "split"), (2, "none", 16, "one")])
def test_decode_kernel_equal_widths(bits, residual, d, path):
    """Equal widths (``--no-bit-allocation``): the kernels shift by constants instead of reading a field layout."""
    check_kernel_matches(bits, residual, d, batch=3, lengths=[1, 70, 0], s=1, path=path, allocate=False)


@needs_triton
@pytest.mark.parametrize("bits,residual,d,path", [(3, "sign", 16, "one"), (3, "sign", 64, "split"),
                                                  (4, "sign", 32, "one"), (2, "none", 16, "split")])
def test_decode_kernel_shared_widths(bits, residual, d, path):
    """Allocated widths shared by every head: the kernels compile the field shifts in."""
    check_kernel_matches(bits, residual, d, batch=3, lengths=[1, 70, 0], s=1, path=path, shared=True)


@needs_triton
@pytest.mark.parametrize("bits,residual,d", [(3, "sign", 16), (2, "sign", 32), (4, "none", 16), (3, "none", 64),
                                             (4, "sign", 32), (1, "sign", 16), ((4, 2), "sign", 64),
                                             ((3, 1), "sign", 16)])
def test_decode_kernel_small(bits, residual, d):
    check_kernel_matches(bits, residual, d, batch=3, lengths=[1, 70, 0], s=1)


@needs_triton
@pytest.mark.parametrize("path", ["one", "split"])
@pytest.mark.parametrize("bits,residual,d,dtype", [(3, "sign", 16, torch.float32), (2, "none", 32, torch.float16),
                                                   (4, "sign", 64, torch.float32)])
def test_decode_kernel_both_paths(bits, residual, d, dtype, path):
    """The one-launch path (the last split merges) and the three-launch split-K path against the
    reference: an empty row, a one-token row, rows across several tiles and splits."""
    check_kernel_matches(bits, residual, d, batch=4, lengths=[0, 1, 300, 129], s=1, dtype=dtype, path=path)


@needs_triton
@pytest.mark.parametrize("path", ["one", "split"])
@pytest.mark.parametrize("bits,residual,d,allocate,shared", [(3, "sign", 16, True, True), (3, "sign", 64, True, False),
                                                             ((4, 2), "none", 32, True, True),
                                                             (4, "sign", 16, True, True), (2, "sign", 32, False, False)])
def test_decode_kernel_grid_codec(bits, residual, d, allocate, shared, path):
    """A grid codec's cache: the kernels compute values from the codes (``GRID``) instead of looking them up, in
    both launch paths, fused and separate sign bits, compiled-in and per-head field layouts."""
    check_kernel_matches(bits, residual, d, batch=3, lengths=[1, 70, 0], s=1 if path == "one" else 2, path=path,
                         allocate=allocate, shared=shared, grid=True)


@needs_triton
@pytest.mark.parametrize("bits,residual,d,shared,path,extra", [
    (3, "sign", 64, True, "split", {}), ((4, 2), "none", 64, True, "split", {}), (3, "sign", 16, False, "one", {}),
    (2, "sign", 32, False, "split", dict(stream=0)), (3, "sign", 32, True, "split", dict(block_size=64)),
    ((4, 2), "sign", 64, True, "split", dict(slots=True)), (3, "none", 16, False, "one", dict(slots=True))])
def test_decode_kernel_subnormal_codes(bits, residual, d, shared, path, extra):
    """Grid codes decoded as float32 subnormals (``launch_config``'s ``subnormal``: no exponent OR-ed in, no 1
    subtracted; scores kept at 2^−96 and softmax weights at 2^96): within the tolerance rule, and bit for bit the
    output of the codes decoded through 1.0's exponent (every scale a power of two, every product normal) — with
    fields compiled in or read per head, a sign plane, stream-K and split-K, paged, with slots."""
    extra = dict(extra)
    stream = {"stream": extra.pop("stream")} if "stream" in extra else {}
    outs = [check_kernel_matches(bits, residual, d, batch=3, lengths=[1, 70, 0], s=1, path=path, shared=shared,
                                 grid=True, config=dict(subnormal=sub, **stream), **extra) for sub in (True, False)]
    assert torch.equal(outs[0], outs[1])


@needs_triton
@pytest.mark.parametrize("bits,residual,d,grid,s,extra", [
    (3, "sign", 64, True, 1, {}), ((4, 2), "none", 32, True, 2, dict(stream=0)), (3, "sign", 16, False, 1, {}),
    (3, "sign", 32, True, 1, dict(block_size=64)), ((4, 2), "sign", 64, True, 1, dict(slots=True))])
def test_decode_kernel_gathered_query(bits, residual, d, grid, s, extra):
    """Keys whose rotation permutes each head's channels (the default recipe's): with ``gather_query`` the walk
    gathers and scales each query itself and the merge makes c0 from q, with no prep launch — within the tolerance
    rule (and close to the prep's output: Π·q on tensor cores is q gathered to within fp32's rounding); stream-K and
    split-K, several queries a row, grid and LUT codes, paged, with slots. Without a permutation it is not taken."""
    extra = dict(extra)
    stream = {"stream": extra.pop("stream")} if "stream" in extra else {}
    outs = [check_kernel_matches(bits, residual, d, batch=3, lengths=[1, 70, 0], s=s, path="split", shared=True,
                                 grid=grid, permuted_keys=True, config=dict(gather_query=g, **stream), **extra)
            for g in (True, False)]
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5 * (1 + outs[1].abs().max().item())


@needs_triton
def test_gathered_query_needs_a_permutation(monkeypatch):
    """``gather_query`` is taken only where the keys carry a permutation (``CachedCodes.perm``): a dense rotation still
    runs the prep kernel (checked by the launches made) and matches the reference."""
    import esm_turbo.kernels.decode.launch as launch
    launched = []
    real = launch._prep_kernel
    monkeypatch.setattr(launch, "_prep_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})())
    check_kernel_matches(3, "sign", 32, batch=2, lengths=[5, 40], s=1, path="split", shared=True, grid=True,
                         config=dict(gather_query=True))
    assert launched, "a dense rotation must run the prep kernel"
    launched.clear()
    check_kernel_matches(3, "sign", 32, batch=2, lengths=[5, 40], s=1, path="split", shared=True, grid=True,
                         permuted_keys=True, config=dict(gather_query=True))
    assert not launched, "a permutation needs no prep launch"


@needs_triton
@pytest.mark.parametrize("bits,residual,shared,grid,max_bits", [
    (2, "sign", True, True, 6), (2, "sign", False, True, 6), ((4, 2), "none", True, True, 7),
    (2, "sign", True, False, 6), (3, "sign", True, True, 7)])
def test_decode_kernel_wide_widths(bits, residual, shared, grid, max_bits):
    """Allocations whose widest channels take far more than the mean (``max_channel_bits``, preset ``wide``): the
    field layouts and the grid's widest code reach 7 and 8 bits."""
    check_kernel_matches(bits, residual, 64, batch=3, lengths=[1, 70, 0], s=1, path="split", shared=shared,
                         grid=grid, max_bits=max_bits)


@needs_triton
@pytest.mark.parametrize("stream,grid", [(1, True), (3, False), (0, True)])
def test_decode_kernel_stream_k(stream, grid):
    """Stream-K prefix programs (``stream`` per SM: equal runs of tiles that cross rows, so a row's partials come from
    several programs; 0: (query, split) programs), with the prep and merge rotations in column chunks, against the
    reference."""
    check_kernel_matches(3, "sign", 32, batch=4, lengths=[0, 1, 300, 129], s=2, path="split", grid=grid,
                         config=dict(stream=stream, prep_cols=8, merge_cols=16))


@needs_triton
@pytest.mark.parametrize("block_size,path,stream,grid", [(64, "split", 1, True), (16, "split", 3, False),
                                                         (64, "one", 0, False), (128, "split", 0, True),
                                                         (16, "one", 0, True)])
def test_decode_kernel_paged(block_size, path, stream, grid):
    """A paged cache read through its block table (blocks holding whole tiles: one table entry a tile; smaller
    blocks: one a token), every launch path, against the reference over the same rows stored contiguously."""
    check_kernel_matches(3, "sign", 32, batch=4, lengths=[0, 1, 300, 129], s=1, path=path, grid=grid,
                         shared=grid, config=dict(stream=stream), block_size=block_size)


def check_shared_prefix(d, grid, batch, lengths, s, span, block_size, stream=None, permuted_keys=False, heads=2,
                        seed=0, leads=None):
    """A paged step whose rows hold their first ``span`` tokens in row 0's blocks (forks of one scaffold): the shared
    walk reads them once (``kernels/decode/shared.py``), the rows' own walks the rest. The other rows' table entries
    for the shared blocks point at junk, so only a kernel that reads the shared prefix through row 0's table alone
    matches the reference (which reads row 0's blocks for every row). ``stream``: the walks' launch (None: the
    default's); ``leads``: each row's lead (forks of several scaffolds; None: row 0 leads every row)."""
    from esm_turbo.kernels.decode import compressed_attention_triton
    codec = random_turbo_codec(heads, d, 3, 3, "sign", seed=seed, grid=grid, permuted_keys=permuted_keys).to(DEVICE)
    cache = filled_cache(codec, batch, lengths, DEVICE, seed)
    lead = leads or [0] * batch
    for part in cache.parts[0].values():  # every row's first span tokens: its lead's
        part[:, :, :span] = part[lead, :, :span]
    q, k, v, valid = (strided(t) if t.is_floating_point() else t for t in step_inputs(batch, heads, s, d, DEVICE, 7))
    ref64 = compressed_attention_reference(*_reference_args(codec, cache, q, k, v, valid, torch.float64))
    ref32 = compressed_attention_reference(*_reference_args(codec, cache, q, k, v, valid, torch.float32))
    args, table = paged_args(_reference_args(codec, cache, q, k, v, valid, torch.float32), block_size, seed)
    blocks = span // block_size
    junk = table.clone()
    for b, first in enumerate(lead):
        junk[b, :blocks] = table[first, :blocks] if first == b else table.numel()  # a spare slot, full of junk
    call = dict(pages=junk, block_size=block_size, shared=span,
                leads=None if leads is None else torch.tensor(leads, dtype=torch.int32, device=DEVICE))
    launch = dict(path="split") | ({} if stream is None else dict(stream=stream))
    out = compressed_attention_triton(*args, config=dict(launch, shared=True), **call)
    err, err_pt = ((t.double() - ref64).abs().max().item() for t in (out, ref32))
    assert err <= 2 * err_pt + 1e-5, (err, err_pt)
    unshared = compressed_attention_triton(*args, config=launch, **call)  # the walks read the junk
    assert (unshared.double() - ref64).abs().max().item() > 100 * (err + 1e-6)


@needs_triton
@pytest.mark.parametrize("d,grid,s,block_size,stream,permuted,leads", [
    (16, True, 1, 16, 2, False, None), (64, True, 1, 64, 0, True, None), (32, False, 2, 32, 0, False, None),
    (16, True, 1, 32, 2, True, [0, 0, 2, 2, 0, 5, 5, 5, 2]), (32, False, 2, 64, 0, False, [0, 1, 2, 0, 1, 2, 0, 1, 2])])
def test_decode_kernel_shared_prefix(d, grid, s, block_size, stream, permuted, leads):
    """The shared walk over forks of one scaffold (or of several, ``leads``, in runs or interleaved: a pass a lead):
    grid and looked-up codes, one and two queries a row, the rows' own walks stream-K and split, the query gathered
    (keys' channels permuted) or prepared; a row whose length is the shared prefix exactly walks nothing of its own."""
    from esm_turbo.kernels.decode.shared import MIN_SHARED
    span = MIN_SHARED
    lengths = [span + 37, span, span + 1, span + 64, span + 100, span + 3, span + 9, span + 70, span + 15]
    check_shared_prefix(d, grid, len(lengths), lengths, s, span, block_size, stream, permuted, leads=leads)


@needs_triton
def test_shared_span_rule():
    """Where the shared walk takes a prefix: whole tiles of both walks, paged, no slots, enough tokens and queries."""
    from esm_turbo.kernels.decode.shared import BLOCK_T, MIN_QUERIES, MIN_SHARED, shared_span
    assert shared_span(MIN_SHARED + 5, 64, 16, True, False) == MIN_SHARED
    assert shared_span(1000, 64, 64, True, False) == 1000 // 64 * 64 and BLOCK_T <= 64
    assert shared_span(MIN_SHARED - 1, 64, 16, True, False) == 0
    assert shared_span(4096, MIN_QUERIES - 1, 16, True, False) == 0
    assert shared_span(4096, 64, 16, False, False) == 0 and shared_span(4096, 64, 16, True, True) == 0


@needs_triton
def test_walk_asks_tiles_ahead_below_eight_code_bits():
    """The default cache's walk asks tiles ahead into L2 (``prefetch`` = ``plan.L2_AHEAD``) at the 3.0-bit default's
    4 + 2 code bits a channel, not at the 4.0-bit default's 4 + 4, nor for a LUT codec's cache."""
    from esm_turbo.bench.synthetic import default_codec
    from esm_turbo.kernels.decode import launch_config, plan
    from esm_turbo.model.recipe import recipe
    prefetch = {}
    for bits in (3, 2):
        tables = fused_tables(default_codec(20, 64, recipe=recipe("default", bits).resolved()))
        prefetch[bits] = launch_config(64, tables.k_code, tables.v_code, 64, 20, 1, 16384)["prefetch"]
    assert plan.L2_AHEAD > 1 and prefetch == {3: 1, 2: plan.L2_AHEAD}
    tables = fused_tables(random_turbo_codec(4, 64, 3, 1, "sign", seed=0))
    assert decode_grid(tables.k_code, tables.v_code) == 0
    assert launch_config(64, tables.k_code, tables.v_code, 64, 4, 1, 16384)["prefetch"] == 1


@needs_triton
def test_walk_tiles_hold_lean_tile_channel_tokens():
    """The default cache's one-warp tiles hold ``plan.LEAN_TILE`` channels × tokens at heads of 16, 32 and 64 (128,
    64 and 32 tokens), and ask tiles ahead into L2 at every width under heads of 64."""
    from esm_turbo.bench.synthetic import default_codec
    from esm_turbo.kernels.decode import launch_config, plan
    for d in (16, 32, 64):
        tables = fused_tables(default_codec(20, d))
        cfg = launch_config(d, tables.k_code, tables.v_code, 64, 20, 1, 4096)
        assert not cfg["small"] and cfg["stream"] and cfg["num_warps"] == 1
        assert cfg["block_t"] == plan.LEAN_TILE // d
        assert cfg["prefetch"] == (plan.L2_AHEAD if d < 64 else 1)


@needs_triton
def test_stream_plan_covers_every_tile_once():
    """The runs of a stream-K cut tile every row's capacity once, and no row meets more runs than its partial slots."""
    from esm_turbo.kernels.decode import stream_plan
    for rows, capacity, block_t, programs in ((1280, 1024, 32, 1584), (160, 16384, 32, 1584), (2560, 1024, 16, 1584),
                                              (3, 71, 32, 48), (8, 4096, 32, 5), (1, 1, 32, 1584)):
        nt, run, slots, launched = stream_plan(rows, capacity, block_t, programs)
        assert nt * block_t >= capacity and launched <= max(programs, 1)
        assert (launched - 1) * run < rows * nt <= launched * run
        for r in range(rows):
            assert ((r + 1) * nt - 1) // run - (r * nt) // run + 1 <= slots


@needs_triton
def test_one_launch_counts_stay_zero():
    """The one-launch path's arrival counts are kept between launches (no memset): each launch leaves them zero,
    so the next one merges as the first did."""
    from esm_turbo.kernels.decode import compressed_attention_triton, split_counters
    codec = random_turbo_codec(2, 16, 3, 3, "sign", seed=0).to(DEVICE)
    cache = filled_cache(codec, 3, [1, 70, 0], DEVICE, 0)
    args = _reference_args(codec, cache, *step_inputs(3, 2, 1, 16, DEVICE, 1), torch.float32)
    first = compressed_attention_triton(*args, config=dict(path="one"))
    counts = split_counters(6, torch.device(DEVICE))
    assert not counts.any()
    second = compressed_attention_triton(*args, config=dict(path="one"))
    assert split_counters(6, torch.device(DEVICE)).data_ptr() == counts.data_ptr() and not counts.any()
    assert torch.equal(first, second)


@needs_triton
def test_one_launch_rule():
    from esm_turbo.kernels.decode.plan import GRID_MAX_ROWS, GRID_MAX_SLOTS, SMALL_MAX_SLOTS, one_launch
    assert one_launch(1, 20, 1, 64, 1024)
    assert not one_launch(1, 20, 2, 64, 1024)  # several queries per row: the three-launch path
    assert not one_launch(1, 20, 1, 128, 1024)
    assert not one_launch(1, 1, 1, 64, SMALL_MAX_SLOTS + 1)
    # a grid codec's cache (the default) takes one launch further: up to a slot and a (row, head) bound
    assert one_launch(16, 20, 1, 64, 4096, grid=True) and not one_launch(16, 20, 1, 64, 4096)
    assert not one_launch(1, 1, 1, 64, GRID_MAX_SLOTS + 1, grid=True)
    assert not one_launch(GRID_MAX_ROWS + 1, 1, 1, 64, 1, grid=True)
    assert not one_launch(1, 20, 1, 128, 1024, grid=True) and not one_launch(1, 20, 2, 64, 1024, grid=True)


@needs_triton
@pytest.mark.parametrize("chunks,programs,warps", [(7, 3, 1), (2, 5, 1), (6, 2, 2)])
def test_read_kernel_matches_reference(chunks, programs, warps):
    """The bench's read-only floor reads every word once: uneven runs, programs left without a chunk (their rows
    zero) and two-warp chunks XOR to what the reference gets."""
    from esm_turbo.bench.read import WORDS_PER_WARP, read_words, read_words_reference
    gen = torch.Generator().manual_seed(chunks)
    words = torch.randint(-2**31, 2**31 - 1, (chunks * WORDS_PER_WARP * warps,), generator=gen,
                          dtype=torch.int32).to(DEVICE)
    got = read_words(words, programs, warps)
    assert torch.equal(got, read_words_reference(words, programs, warps))
    assert got.shape == (programs, WORDS_PER_WARP * warps) and got.any()
    with pytest.raises(ValueError, match="multiple of 512"):
        read_words(words[1:], programs)


def test_split_rotation_keeps_fp32_accuracy():
    """Π's fp16 halves (what the quantize kernel reads for fp16 inputs): Π_hi + Π_lo/2048 is Π to ~2^-22
    relative, so fp16 x times the two halves matches x Πᵀ as an fp32 product would."""
    rot = random_turbo_codec(3, 64).key.rot
    halves = split_rotation(rot)
    assert halves.shape == (3, 2, 64, 64) and halves.dtype == torch.float16
    back = halves[:, 0].double() + halves[:, 1].double() / 2048
    assert (back - rot.double()).abs().max() < 2 ** -22
    assert (halves[:, 0].double() - rot.double()).abs().max() > 2 ** -16  # one half alone is fp16-coarse
    x = torch.randn(3, 10, 64).half().double()
    exact = x @ rot.double().transpose(1, 2)
    two = x @ halves[:, 0].double().transpose(1, 2) + (x @ halves[:, 1].double().transpose(1, 2)) / 2048
    assert (two - exact).abs().max() < 1e-5 * exact.abs().max()


@needs_triton
@pytest.mark.parametrize("widths", [[4] * 8, [5, 5, 4, 4, 4, 4, 3, 3], [1, 2, 3, 4, 5, 6, 7, 0]])
def test_field_readers_invert_packed_shifts(widths):
    """The kernels' compile-time readers of a packed layout give back the widths it was packed from and their
    running sums as shifts (field 8: the word's width)."""
    from esm_turbo.kernels.common import field_shift, field_width
    from esm_turbo.quant.packing import packed_shifts
    fields = packed_shifts(widths)
    assert [field_width(fields, j) for j in range(8)] == widths
    assert [field_shift(fields, j) for j in range(9)] == [sum(widths[:j]) for j in range(9)]


@needs_triton
def test_old_triton_takes_the_reference_path(monkeypatch):
    """A Triton older than the kernels need (no ``triton.constexpr_function``) is reported and the PyTorch path
    taken, even with CUDA present; a new enough one (nightly suffixes included) runs the kernels."""
    import triton
    from esm_turbo import kernels
    assert kernels.triton_version_ok("3.5.0") and kernels.triton_version_ok("3.6.0+git1a2b3c")
    assert not kernels.triton_version_ok("3.4.0") and not kernels.triton_version_ok("2.3.1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def fresh():
        kernels.triton_supported.cache_clear()
        kernels.triton_available.cache_clear()

    monkeypatch.setattr(triton, "__version__", "3.4.0")
    fresh()
    try:
        with pytest.warns(RuntimeWarning, match="older than 3.5"):
            assert not kernels.triton_available()
        assert not kernels.triton_supported()
        fresh()
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        assert kernels.triton_available() and kernels.triton_supported()
    finally:
        fresh()


@needs_triton
def test_aligned_table_starts_every_row_on_its_size():
    """The look-ups OR a code's offset into its row's address: a table that does not start on a row (a view
    12 bytes in) is copied to one that does, values unchanged; codes not a power of two are padded; an aligned
    table is passed through as is."""
    from esm_turbo.kernels.decode.codes import aligned_table
    tab = torch.randn(2, 16, 16)
    view = torch.empty(tab.numel() + 3)[3:].view(2, 16, 16)
    view.copy_(tab)
    moved = aligned_table(view)
    assert moved.data_ptr() % (16 * 4) == 0 and torch.equal(moved, tab)
    assert aligned_table(moved) is moved
    odd = torch.randn(2, 16, 12)
    padded = aligned_table(odd)
    assert padded.shape == (2, 16, 16) and padded.data_ptr() % (16 * 4) == 0
    assert torch.equal(padded[..., :12], odd) and not padded[..., 12:].any()


@needs_triton
def test_split_plan_bounds_each_walk():
    from esm_turbo.kernels.decode.plan import MAX_CHUNK, plan_splits
    for programs, capacity, block_t in ((1280, 16384, 64), (160, 16384, 64), (1280, 1024, 64), (20, 1024, 32),
                                        (2560, 16384, 32), (4, 5, 32)):
        splits, chunk = plan_splits(programs, capacity, block_t, 132)
        assert chunk % block_t == 0 and chunk <= max(MAX_CHUNK, block_t)
        assert (splits - 1) * chunk < capacity <= splits * chunk  # every split has rows, together all of them
    assert plan_splits(1280, 16384, 64, 132) == (8, 2048)  # B=64 (650M): 1.6 waves of 16K walks → 8 splits
    assert plan_splits(1280, 1024, 64, 132) == (1, 1024)
    assert plan_splits(1280, 16384, 64, 132, splits=3) == (3, 5504)


@needs_triton
@pytest.mark.parametrize("rows,cols,s,dtype", [(1, 16, 1, torch.float16), (2, 32, 3, torch.float32),
                                               (4, 16, 2, torch.float16), (16, 32, 1, torch.float32)])
def test_decode_merge_blocks(rows, cols, s, dtype):
    """The merge kernel's blocks: ``rows`` sequences of one head per program (five sequences: the last block
    partly empty), the back-rotation ``cols`` output channels per dot, one or several queries per sequence, and
    the prep kernel's rotations in ``cols``-channel dots too."""
    check_kernel_matches(3, "sign", 32, batch=5, lengths=[40, 3, 0, 77, 12], s=s, heads=3, dtype=dtype,
                         path="split", config=dict(merge_rows=rows, merge_cols=cols, prep_cols=cols))


@needs_triton
def test_decode_kernel_several_queries():
    check_kernel_matches(3, "sign", 16, batch=2, lengths=[33, 9], s=3)


@needs_triton
def test_decode_merge_ignores_unwritten_partials(monkeypatch):
    """Three queries take partial slots for four (a power of two): the fourth is never written, and its lanes
    must not be read as data. Scratch buffers poisoned with NaN — what an uninitialised one may hold — change
    nothing and raise no floating-point warning."""
    import warnings
    from esm_turbo.kernels.decode import compressed_attention_triton
    codec = random_turbo_codec(2, 16, 3, 3, "sign", seed=0).to(DEVICE)
    cache = filled_cache(codec, 2, [33, 9], DEVICE, 0)
    args = _reference_args(codec, cache, *step_inputs(2, 2, 3, 16, DEVICE, 1), torch.float32)
    clean = compressed_attention_triton(*args, config=dict(path="split"))
    empty = torch.empty

    def poisoned(*shape, **kw):
        out = empty(*shape, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    monkeypatch.setattr(torch, "empty", poisoned)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        dirty = compressed_attention_triton(*args, config=dict(path="split"))
    assert torch.equal(clean, dirty)


@needs_triton
def test_decode_kernel_fp16_inputs():
    check_kernel_matches(3, "sign", 32, batch=2, lengths=[40, 3], s=2, dtype=torch.float16)


@needs_triton
@pytest.mark.parametrize("bits,residual,d,dtype,shared", [(3, "sign", 16, torch.float32, False),
                                                          (2, "none", 32, torch.float16, True),
                                                          (4, "sign", 64, torch.float16, False),
                                                          (2, "sign", 32, torch.float32, True),
                                                          (3, "sign", 64, torch.float16, True),
                                                          ((4, 2), "sign", 64, torch.float16, True),
                                                          ((3, 1), "none", 16, torch.float32, False)])
@pytest.mark.parametrize("s", [7, 1])
def test_quantize_pack_kernel(bits, residual, d, dtype, shared, s):
    check_quantize_matches(bits, residual, d, dtype, shared, s, block_n=16)


@needs_triton
@pytest.mark.parametrize("bits,residual,d,dtype", [(3, "sign", 64, torch.float16), ((4, 2), "sign", 64, torch.float16),
                                                   (2, "sign", 32, torch.float32), (3, "none", 16, torch.float16)])
@pytest.mark.parametrize("s", [7, 100])
def test_quantize_pack_kernel_wide_blocks(bits, residual, d, dtype, s):
    """64-token blocks of a prefill split by position: Π's rows place-major, the compares channel-major."""
    check_quantize_matches(bits, residual, d, dtype, True, s, block_n=64)


@needs_triton
@pytest.mark.parametrize("bits,residual,d,shared,s,block_n", [
    (3, "sign", 64, True, 100, 64), (3, "sign", 16, False, 7, 16), ((4, 2), "sign", 32, True, 7, 16),
    (2, "none", 32, True, 1, 16), (4, "sign", 16, True, 1, 16), (3, "none", 16, False, 7, 16)])
def test_quantize_pack_kernel_grid_codec(bits, residual, d, shared, s, block_n):
    """A grid codec's codes are rounded to, not searched for (``_grid_code``): in every branch (split by position,
    per-head layout rows, a decode step), fused and separate sign bits, and without a sign residual."""
    check_quantize_matches(bits, residual, d, torch.float16, shared, s, block_n=block_n, grid=True)


@needs_triton
@pytest.mark.parametrize("bits,residual,shared,grid,max_bits", [
    (2, "sign", True, True, 6), (2, "sign", False, True, 6), ((4, 2), "none", True, True, 7),
    (2, "sign", True, False, 6)])
def test_quantize_pack_kernel_wide_widths(bits, residual, shared, grid, max_bits):
    """The quantize kernel on allocations with channels far wider than the mean (preset ``wide``)."""
    check_quantize_matches(bits, residual, 64, torch.float16, shared, 7, block_n=16, grid=grid, max_bits=max_bits)


@needs_triton
@pytest.mark.parametrize("bits,residual,d,dtype,shared,grid,s,block_n,rank", [
    (3, "sign", 16, torch.float32, True, False, 7, 16, "absolute"), (2, "none", 32, torch.float32, False, False, 1, 16,
                                                                      "relative"),
    (3, "sign", 64, torch.float16, True, True, 100, 64, "absolute"), ((4, 2), "sign", 32, torch.float16, True, True, 1,
                                                                      16, "absolute"),
    (4, "sign", 16, torch.float32, False, False, 7, 16, "relative")])
def test_quantize_pack_kernel_picks_slots(bits, residual, d, dtype, shared, grid, s, block_n, rank):
    """One slot a token and kind picked in the kernel (each head offers its worst value, the last to arrive keeps the
    largest) as the reference picks it: prefills and decode steps, LUT and grid codes, both rankings."""
    check_quantize_matches(bits, residual, d, dtype, shared, s, block_n=block_n, grid=grid, slots=rank)


@needs_triton
@pytest.mark.parametrize("case", [
    dict(bits=3, residual="sign", d=16, lengths=[1, 70, 0], s=1, path="one"),
    dict(bits=3, residual="sign", d=32, lengths=[0, 1, 300, 129], s=2, path="split", grid=True),
    dict(bits=3, residual="sign", d=32, lengths=[0, 1, 300, 129], s=1, path="split", grid=True, shared=True,
         config=dict(stream=1), block_size=64),
    dict(bits=(4, 2), residual="none", d=32, lengths=[1, 70, 0], s=1, path="one", grid=True, shared=True),
    dict(bits=2, residual="sign", d=16, lengths=[1, 70, 0], s=1, path="one", block_size=16)])
def test_decode_kernel_reads_slots(case):
    """A cache whose codec keeps one slot a token and kind: every launch path (one launch, split-K, stream-K), LUT
    and grid codes (a grid's fields scaled per place: the corrections scaled alike), contiguous and paged, match the
    reference that applies the slots, and differ from the one that does not."""
    check_kernel_matches(batch=len(case["lengths"]), slots=True, **case)


def check_quantize_matches(bits, residual, d, dtype, shared, s, block_n, grid=False, max_bits=None, slots=None):
    """One launch encodes keys and values (different tables, strided inputs) into their parts, as the
    reference does: a prefill of S tokens per sequence (programs per sequence) or a decode step of one
    token per sequence (programs across sequences), blocks of ``block_n`` partly masked. Allocated widths, read from each
    head's layout row or (``shared``: every head has the same widths) compiled in as field shifts (a prefill then
    splits the channels by their place in a group of 8). ``slots`` ("absolute" or "relative"): the codec keeps one
    slot a token and kind, which both pick as they rank."""
    from esm_turbo.kernels.quantize import quantize_pack_triton
    heads, batch = 2, 3
    key_bits, value_bits = bits if isinstance(bits, tuple) else (bits, bits)
    codec = random_turbo_codec(heads, d, key_bits, value_bits, residual, seed=key_bits, shared=shared,
                               grid=grid, max_bits=max_bits).to(DEVICE)
    if slots:
        codec = KVCodec(codec.key, codec.value, slots=1, relative_slots=slots == "relative")
    tables = fused_tables(codec)
    # shared: the kernel compiles the field shifts in; else it reads each head's layout row
    layouts = {"k": tables.k_code, "v": tables.v_code}
    if shared:
        assert min(c.fields for c in layouts.values()) >= 0
    else:
        layouts = {kind: c.per_head() for kind, c in layouts.items()}
    gen = torch.Generator().manual_seed(key_bits)
    x = {kind: strided((torch.randn(batch, heads, s, d, generator=gen) * 2).to(DEVICE, dtype)) for kind in "kv"}
    pos = torch.tensor([0, 7, 3], device=DEVICE)
    quantizer = {"k": codec.key, "v": codec.value}
    bounds = {"k": tables.k_bounds, "v": tables.v_bounds}

    def args(kind):
        q = quantizer[kind]
        return (q.rot, q.offset, q.scale, bounds[kind], q.centroids, q.layout())

    outs = []
    for use_kernel in (False, True):
        cache = KVCache([codec], batch, capacity=s + 9, device=DEVICE)
        parts = {kind: tables.packed(cache.parts[0], kind) for kind in "kv"}
        slot_parts = {kind: cache.parts[0].get(f"{kind}.slots") for kind in "kv"}
        tabs, relative = {"k": tables.k_tab, "v": tables.v_tab}, slots == "relative"
        if use_kernel:
            # Π's fp16 halves as the op passes them (read for fp16 inputs on CUDA)
            halves = (split_rotation(codec.key.rot), split_rotation(codec.value.rot))
            quantize_pack_triton(x["k"], x["v"], args("k"), args("v"), parts["k"], parts["v"], pos, layouts["k"],
                                 layouts["v"], halves, config=dict(block_n=block_n),
                                 slots=(slot_parts["k"], slot_parts["v"], tabs["k"], tabs["v"], relative)
                                 if slots else None)
        else:
            for kind in "kv":
                quantize_pack_reference(x[kind], *args(kind), *parts[kind], pos, layouts[kind], None, slot_parts[kind],
                                        tabs[kind], relative)
        outs.append((parts, slot_parts))
    if slots:
        enc = codec.encode(x["k"], x["v"])
        for kind in "kv":
            ref, ker = outs[0][1][kind], outs[1][1][kind]
            # the same value picked (but where rounding of x Πᵀ flips a near tie) and the same correction to fp16's
            same = (ref >> 16) == (ker >> 16)
            assert same.float().mean() > 0.97 and ker[1, 0, 7:7 + s].any() and not ker[1, 0, :7].any()
            delta = lambda w: (w & 0xFFFF).to(torch.int16).view(torch.float16).float()  # noqa: E731
            assert ((delta(ref) - delta(ker)).abs() <= 2e-3 * delta(ref).abs() + 1e-3)[same].all()
            assert torch.equal(ref[0, :, :s], enc[f"{kind}.slots"][0])  # the reference picks as the codec does
    outs = [o[0] for o in outs]
    for kind in "kv":
        ref, ker = outs[0][kind], outs[1][kind]
        # identical bytes, except where float rounding of x Πᵀ flips a value sitting on a boundary
        assert (ref[0] != ker[0]).float().mean() < 2e-3
        if ref[1].numel():
            assert (ref[1] != ker[1]).float().mean() < 2e-3
        assert ker[0][1, :, 7:7 + s].any() and not ker[0][1, :, :7].any() and not ker[0][1, :, 7 + s:].any()
        # and the reference writes what the codec's own encoder makes
        enc = quantizer[kind].encode(x[kind])
        assert torch.equal(ref[0][0, :, :s], enc[layouts[kind].part][0])


def _identity_affine(codec):
    """Identity rotations and affine maps on both quantizers, so the kernels' y is x exactly (with fp32 dots)."""
    for q in (codec.key, codec.value):
        q.rot.copy_(torch.eye(q.rot.shape[-1]))
        q.offset.zero_()
        q.scale.fill_(1.0)


def _keys_encoded_both_ways(codec, x, per_head=True):
    """The key parts x [1, 1, T, d] is encoded into by the reference and by the kernel (keys and values both get
    the key tables; fp32 dots, so x Iᵀ is exact on CUDA too; ``per_head``: field shifts read from each head's
    layout row): (reference parts, kernel parts)."""
    from esm_turbo.kernels.quantize import quantize_pack_triton
    tables = fused_tables(codec)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    tabs = (codec.key.rot, codec.key.offset, codec.key.scale, tables.k_bounds, codec.key.centroids, tables.k_layout)
    code = tables.k_code.per_head() if per_head else tables.k_code
    outs = []
    for use_kernel in (False, True):
        cache = KVCache([codec], 1, capacity=x.shape[2], device=DEVICE)
        parts = tables.packed(cache.parts[0], "k")
        if use_kernel:
            quantize_pack_triton(x, x, tabs, tabs, parts, tables.packed(cache.parts[0], "v"), pos, code, code,
                                 config=dict(block_n=16, precision="ieee"))
        else:
            quantize_pack_reference(x, *tabs, *parts, pos, code)
        outs.append([p.clone() for p in parts])
    return outs


@needs_triton
@pytest.mark.parametrize("bits", [2, 3])
def test_quantize_kernel_on_boundaries(bits):
    """Kernel and reference codes agree byte for byte where ties decide: y exactly on a centroid (the
    sign's y ≥ c[idx]) or a bound (idx counts bounds < y), and two tied centroids (a Lloyd-Max fit on
    concentrated data can leave them). Identity rotation and fp32 dots, so y = x exactly."""
    d = 16
    codec = random_turbo_codec(1, d, bits, bits, "sign", seed=0, allocate=False).to(DEVICE)
    cent = torch.linspace(-2.0, 2.0, 1 << bits)
    cent[1] = cent[2]  # a tie
    _identity_affine(codec)
    for q in (codec.key, codec.value):
        q.centroids.copy_(cent)
    tables = fused_tables(codec)
    on_grid = torch.cat([cent, tables.k_bounds[0, 0].cpu(), torch.tensor([-9.0, 9.0])])
    x = torch.cat([on_grid, torch.randn(40 * d - on_grid.numel(), generator=torch.Generator().manual_seed(0))])
    ref, ker = _keys_encoded_both_ways(codec, x.reshape(1, 1, 40, d).to(DEVICE))
    assert torch.equal(ref[0], ker[0])


@needs_triton
@pytest.mark.parametrize("residual", ["sign", "none"])
def test_quantize_grid_kernel_on_boundaries(residual):
    """Rounded grid codes are the LUT search's, byte for byte, where ties decide: y on every bound and centroid of
    a grid codec (the halves and integers from −3 to 33: every width's levels and beyond) and one float step either
    side. Identity rotation and fp32 dots, so y = x exactly."""
    d = 16
    codec = random_turbo_codec(1, d, 3, 3, residual, seed=0, grid=True).to(DEVICE)
    assert codec.key.grid and int(codec.key.widths.max()) > int(codec.key.widths.min())
    _identity_affine(codec)
    ties = torch.arange(-6, 67, dtype=torch.float32) / 2
    y = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    x = y[:, None].expand(-1, d).reshape(1, 1, -1, d).contiguous().to(DEVICE)
    ref, ker = _keys_encoded_both_ways(codec, x, per_head=False)
    for a, b in zip(ref, ker):
        assert torch.equal(a, b)


def _has_nvidia_backend() -> bool:
    if not triton_supported():
        return False
    import triton.backends
    return "nvidia" in triton.backends.backends


def _compiling(script: str) -> str:
    """The stdout of ``script`` (relative to tests/) run in a process without TRITON_INTERPRET, so that it compiles
    the kernels; the test fails with its stderr if it fails."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), script)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton without its NVIDIA backend (ptxas)")
def test_kernels_compile_for_sm90():
    """Every Triton kernel compiles for sm_90 (tests/compile_sm90.py, in a process without
    TRITON_INTERPRET): the CPU interpreter runs the kernels' Python but never compiles them, so without
    this a compile error would surface only on a GPU. No programmatic dependent launch reads through the read-only
    path after its wait (ptxas may move such a read ahead of it: a race the interpreter cannot show)."""
    out = _compiling("compile_sm90.py")
    compiled = [line for line in out.splitlines() if line.startswith("compiled ")]
    # decode prefix, one-launch and stream-K kernels in 2 layouts × (LUT, grid through 1.0's exponent and as
    # subnormals, grid gathering its queries, grid paged, LUT and grid reading slots), the 3.0-bit default's stream-K
    # walk asking tiles ahead into L2, the heads-of-16 default cache's stream-K walk at its launch twice (contiguous,
    # paged with slots; no spills), the shared walk over a paged step's shared prefix in 2 layouts × (grid, LUT),
    # prep, merge three times (many
    # sequences per program, several queries, c0 from gathered queries); quantize-and-pack eight times: prefills in
    # blocks of 32 and 64, a decode step (also into a paged pool), the last two also with grid codes, two picking
    # slots; the 4-bit weights' tensor-core matmul three times (groups
    # of 32 and 128, split and merged in-kernel, codes a tile ahead), the register-fed one six times (two with a
    # stage left out, as tools/weights_stages.py times it; two with every step's codes before the walk, one of them
    # a programmatic dependent launch), CUDA-core matmul, input rotation (also after a layer norm, letting the
    # product after it start at once) and dequantization; a paged pool's block moves both ways; a decode step's rotary
    # embedding and an uncompressed cache's write; FastEsm's residual add and LayerNorm five times (with and without the
    # add, one row and four a program, a scaled branch into e4m3, in place without a bias) and its activation kernel
    # six times (GELU, SwiGLU, none; into e4m3 or not; GELU's row maxima from the rows' bounds and from GELU over the
    # row; with the rows' maxima known) and once holding a row in registers; products with their epilogue in warps of
    # their own eight times (Gluon: fp16 GELU with a bias in epilogue partitions of 2 + 1 and 1 + 1, in GELU's tanh
    # form and in its exp2poly form, bf16 without,
    # e4m3 GELU with the rows' maxima, fp16 and e4m3 QKV with the rotary embedding; no spills); its products with folded
    # epilogues (fp16 GELU through descriptors, in GELU's tanh and exp2poly forms, warp-specialized, fp16 residual
    # through pointers, e4m3 bias, residual and GELU with row maxima, 150M's two programs a multiprocessor under a
    # register cap) and split along K at a step's rows five times (bias, GELU, scaled residual, the rotary
    # embedding; one run), a block's feed-forward half in one persistent launch twice (rows in tiles of 64 and 16, a
    # barrier sleeping between looks),
    # its attention three times (key tiles of 64 and 32 at heads of 64, of 32 at heads of 32) and twice with each
    # tile's scores under the previous tile's softmax (Gluon, heads of 32 and 64), its rotary over (token, head)
    # pairs and its mean pooling; the scores and pooling walks over predicted values and the one-pass walk at 20
    # heads of 16, 32 and 64 and 40 of 64 (a coded residual, the keys alone) within a Hopper program's shared memory,
    # their merge and the write's read-back of a token's keys twice (grid, LUT); the bench's read-only kernel
    assert len(compiled) == 151, out


@pytest.fixture(scope="module")
def walk_listing() -> str:
    """tools/sass_mix.py's output, compiled once for the tests that read it."""
    return _compiling(os.path.join(os.pardir, "tools", "sass_mix.py"))


@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton without its NVIDIA backend (ptxas, nvdisasm)")
def test_default_walk_loads_its_codes_128_bits_at_a_time(walk_listing):
    """tools/sass_mix.py compiles the stream-K walk as a launch on the default cache compiles it: each thread's share
    of a tile's key and value words (64 bytes) arrives in four 128-bit loads at both head_dims. Pointer arithmetic
    that loses the alignment Triton infers would split them into 32-bit or byte loads (and more instructions)."""
    import re
    out = walk_listing
    loads = re.findall(r"^d=(\d+) .*?(\d+) loads \((\d+) of them 128-bit\)", out, re.M)
    assert sorted(int(d) for d, _, _ in loads) == [64, 128], out
    assert all(n == wide == "4" for _, n, wide in loads), out


@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton without its NVIDIA backend (ptxas, nvdisasm)")
def test_the_three_bit_walk_keeps_the_four_bit_tiles_layout(walk_listing):
    """The 3.0-bit default's walk (4-bit key words, 2-bit value words) issues about the 4.0-bit walk's instructions a
    tile: its value words load 8 bytes a thread (two 64-bit loads beside the keys' two 128-bit ones), so a token's
    groups lie in two threads as in the 4-bit tile. Loaded a token a thread, the walk was 1.24x slower on an H200."""
    import re
    out = walk_listing
    tiles = dict(re.findall(r"^(d=64|3.0 bits d=64) .*?: (\d+) instructions a tile", out, re.M))
    assert int(tiles["3.0 bits d=64"]) <= 1.05 * int(tiles["d=64"]), out
    assert re.search(r"^3.0 bits d=64 .*?4 loads \(2 of them 128-bit\)", out, re.M), out


@pytest.mark.parametrize("slots", [0, 1])
def test_custom_ops_compile_without_graph_breaks(slots):
    """Both ops traced whole by torch.compile (a slot a token and kind among their arguments too): the same output and
    the same cache bytes as eager."""
    from esm_turbo.ops.compressed import write_compressed
    codec = random_turbo_codec(2, 16, 3, 3, "sign")
    codec = KVCodec(codec.key, codec.value, slots=slots)
    cache = filled_cache(codec, 2, [6, 11], "cpu")
    q, k, v, valid = step_inputs(2, 2, 1, 16, "cpu")

    def step(q, k, v, valid, lengths):
        return attend_compressed(codec, cache.parts[0], lengths, q, k, v, valid)

    eager = step(q, k, v, valid, cache.lengths)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, valid, cache.lengths)
    assert torch.allclose(eager, compiled, atol=1e-5)
    written = []
    for fn in (write_compressed, torch.compile(write_compressed, fullgraph=True, backend="aot_eager")):
        parts = {n: t.clone() for n, t in cache.parts[0].items()}
        fn(codec, parts, k, v, cache.lengths)
        written.append(parts)
    assert all(torch.equal(written[0][n], written[1][n]) for n in written[0])
    assert not slots or not torch.equal(written[0]["k.slots"], cache.parts[0]["k.slots"])


# ---- GPU only: the full grid, dispatch and CUDA-graph capture -------------------------------------------

@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_decode_kernel_grid_gpu(bits, d):
    for residual in ("sign", "none"):
        for batch, t in ((1, 1), (4, 1000), (64, 300), (2, 16384)):
            lengths = torch.randint(max(t // 2, 1), t + 1, (batch,)).tolist()
            lengths[0] = t
            check_kernel_matches(bits, residual, d, batch, lengths, s=1, heads=4, seed=bits + d)
            check_kernel_matches(bits, residual, d, batch, lengths, s=1, heads=4, seed=bits + d, shared=True)
    check_kernel_matches(bits, "sign", d, 8, [500] * 8, s=4, heads=4)
    check_kernel_matches(bits, "sign", d, 16, [1000] * 16, s=1, heads=4, dtype=torch.float16)
    for path in ("one", "split"):  # both paths whatever the dispatch rule picks for these shapes
        check_kernel_matches(bits, "sign", d, 3, [2000, 1, 0], s=1, heads=4, path=path)
        check_kernel_matches(bits, "none", d, 2, [16384, 700], s=1, heads=4, dtype=torch.float16, path=path)


@gpu
@pytest.mark.parametrize("bits", [3, (4, 2), 4])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_decode_kernel_grid_codec_gpu(bits, d):
    """Grid codecs (values computed from the codes) over batch, context and launch paths."""
    for residual in ("sign", "none"):
        for batch, t in ((1, 1), (4, 1000), (64, 300), (2, 16384)):
            lengths = torch.randint(max(t // 2, 1), t + 1, (batch,)).tolist()
            lengths[0] = t
            check_kernel_matches(bits, residual, d, batch, lengths, s=1, heads=4, seed=d, shared=True, grid=True)
    check_kernel_matches(bits, "sign", d, 8, [500] * 8, s=4, heads=4, dtype=torch.float16, shared=True, grid=True)
    for path in ("one", "split"):
        check_kernel_matches(bits, "sign", d, 3, [2000, 1, 0], s=1, heads=4, path=path, grid=True)
        check_kernel_matches(bits, "none", d, 2, [16384, 700], s=1, heads=4, dtype=torch.float16, path=path,
                             shared=True, grid=True)


@gpu
@pytest.mark.parametrize("bits", [(4, 2), (3, 1)])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_decode_kernel_split_widths_gpu(bits, d):
    """Keys wider than values (preset keys-first: 4 + sign and 2 + sign bits; the default at 3 bits all-in: 4 and
    2), both launch paths."""
    for shared in (False, True):
        check_kernel_matches(bits, "sign", d, 64, [300] * 63 + [1], s=1, heads=4, seed=d, shared=shared)
        check_kernel_matches(bits, "none", d, 2, [16384, 700], s=1, heads=4, dtype=torch.float16, shared=shared)
    for path in ("one", "split"):  # grid codecs of such widths take the default cache's one-warp and stream-K walks
        check_kernel_matches(bits, "sign", d, 3, [2000, 1, 0], s=1, heads=4, path=path, shared=True, grid=True)
    check_kernel_matches(bits, "sign", d, 8, [500] * 8, s=4, heads=4, dtype=torch.float16, shared=True)
    for path in ("one", "split"):
        check_kernel_matches(bits, "sign", d, 3, [2000, 1, 0], s=1, heads=4, path=path, shared=True)


@gpu
@pytest.mark.parametrize("ahead", [2, 3])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_decode_kernel_l2_ahead_gpu(ahead, d):
    """Walks that ask the codes of a tile ``ahead`` tiles on into L2 (``launch_config``'s ``prefetch`` > 1;
    ``plan.L2_AHEAD``) match the reference: stream-K and split-K walks, contiguous and paged, rows shorter than the
    look-ahead among them."""
    cfg = dict(prefetch=ahead)
    for block_size in (0, 16, 64):
        check_kernel_matches((3, 1), "sign", d, 64, [300] * 62 + [1, 40], s=1, heads=4, seed=d, shared=True,
                             grid=True, block_size=block_size, config=cfg)
        check_kernel_matches((4, 2), "none", d, 2, [16384, 700], s=1, heads=4, dtype=torch.float16, shared=True,
                             grid=True, block_size=block_size, config=dict(cfg, path="split"))
        check_kernel_matches(3, "sign", d, 8, [2000] * 8, s=1, heads=4, grid=False, block_size=block_size, config=cfg)


@gpu
@pytest.mark.parametrize("d", [16, 64, 128])
def test_decode_kernel_shared_prefix_gpu(d):
    """The shared walk over forks of one scaffold at the launch's own choices (stream-K or split-K walks, the
    default's gathered queries): 8 to 300 forks of 256- to 2,048-token scaffolds (the 300 of six scaffolds), grid and
    looked-up codes."""
    gen = torch.Generator().manual_seed(d)
    for grid in (True, False):
        for batch, span, tail, block in ((8, 256, 64, 64), (64, 1024, 64, 64), (300, 2048, 200, 128)):
            lengths = (span + torch.randint(0, tail + 1, (batch,), generator=gen)).tolist()
            leads = [b // 50 * 50 for b in range(batch)] if batch == 300 else None  # six scaffolds of 50 forks
            check_shared_prefix(d, grid, batch, lengths, 1, span, block, permuted_keys=grid, heads=4, seed=batch,
                                leads=leads)


@gpu
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("block_size,slots", [(16, False), (64, False), (256, False), (0, True), (64, True)])
def test_decode_kernel_paged_gpu(d, block_size, slots):
    """The paged layout (``block_size`` > 0) and a slot a token and kind (``slots``, contiguous and paged) over batch,
    context, codecs and launch paths."""
    for grid in (False, True):
        for batch, t in ((1, 1), (64, 300), (2, 16384)):
            lengths = torch.randint(max(t // 2, 1), t + 1, (batch,)).tolist()
            lengths[0] = t
            check_kernel_matches(3, "sign", d, batch, lengths, s=1, heads=4, seed=d, shared=grid, grid=grid,
                                 block_size=block_size, slots=slots)
        check_kernel_matches(3, "sign", d, 8, [500] * 8, s=4, heads=4, dtype=torch.float16, shared=grid, grid=grid,
                             block_size=block_size, slots=slots)
        for path in ("one", "split"):
            check_kernel_matches((4, 2), "sign", d, 3, [2000, 1, 0], s=1, heads=4, path=path, shared=True, grid=grid,
                                 block_size=block_size, slots=slots)


@gpu
def test_model_decode_step_replays_as_cuda_graph():
    from esm_turbo.testing import stress_esm2
    from esm_turbo.model.engine import TurboEsm
    from esm_turbo.model.calibrate import calibrate
    from esm_turbo.model.checkpoint import CalibrationConfig
    from esm_turbo.fasta import Record
    model = stress_esm2(layers=2, hidden=128, heads=4, seed=0).cuda()
    recs = [Record(f"s{i}", "MKTAYIAKQRQISFVKSHFSRQ" * 3, "x", "") for i in range(4)]
    cal = calibrate(model, recs, CalibrationConfig(), progress=False)
    engine = TurboEsm(model, cal)
    session = engine.session("turbo", capacity=128)
    session.start(["MKTAYIAKQRQISFVKSHFSRQ", "MKVLAAGIVGL"])
    tokens = torch.full((2, 1), engine_mask_id(), device="cuda")
    eager = session.step(tokens, commit=False).logits
    captured = session.capture_step(tokens)  # a peek step: replays leave the cache as it is
    out = captured.replay()
    assert torch.allclose(out.logits, eager, atol=1e-4)
    before = session.lengths.clone()
    committed = session.capture_step(tokens, commit=True, reserve=4)
    for _ in range(3):
        committed.replay()
    assert torch.equal(session.lengths, before + 3)
    with pytest.raises(RuntimeError, match="reserved"):  # the graph holds the buffers: no growth
        for _ in range(session.cache.capacity):
            committed.replay()


@gpu
def test_two_step_decode_captures_as_cuda_graph():
    """The PyTorch path's decode (unpack, code-table look-up, inverse rotation) reads nothing on the host, so
    a CUDA graph captures it (the two-step baseline of ``esm-turbo bench``)."""
    codec = random_turbo_codec(4, 64, 3, 3, "sign", seed=0, allocate=True).to(DEVICE)
    cache = filled_cache(codec, 2, [100, 50], DEVICE, 0)
    eager = codec.decode(cache.layer_parts(0, upto=100))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        codec.decode(cache.layer_parts(0, upto=100))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = codec.decode(cache.layer_parts(0, upto=100))
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out, eager))


def engine_mask_id():
    from esm_turbo.model.alphabet import alphabet
    return alphabet().mask_idx


def test_dense_cache_sdpa_path_matches_reference():
    """The fp16/fp32-cache baseline (the new tokens written after each prefix, SDPA over the buffer in place)."""
    from esm_turbo.ops import attend_dense
    from esm_turbo.quant.codec import dense_codec
    codec = dense_codec(3, 16)
    cache = filled_cache(codec, 3, [5, 40, 0], "cpu")
    q, k, v, valid = step_inputs(3, 3, 2, 16, "cpu")
    valid[0, 1] = False  # a padded new token in the first row
    ref = decode_attention_reference(q, cache, 0, k, v, valid)
    cache.write(0, k, v, valid)  # the engine's part: written, not committed
    out = attend_dense(q, cache, 0, valid)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert torch.equal(cache.lengths, torch.tensor([5, 40, 0]))  # nothing committed by a peek
    memo = {}  # a step's layers share the mask of what each row sees: made by the first, the same outputs
    assert torch.equal(attend_dense(q, cache, 0, valid, memo), out) and len(memo) == 1
    assert torch.equal(attend_dense(q, cache, 0, valid, memo), out) and len(memo) == 1
    (mask,) = memo.values()  # additive, as SDPA would turn a boolean mask into on every call: the same output
    seen = mask == 0
    assert mask.dtype == cache.parts[0]["k.x"].dtype and bool(torch.isneginf(mask[~seen]).all())
    keys, values = cache.parts[0]["k.x"], cache.parts[0]["v.x"]
    boolean = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=seen, scale=1.0)
    assert torch.equal(boolean, out)


def test_eager_calls_skip_the_op_dispatch(monkeypatch):
    """Eagerly, the write and the decode attention run the ops' bodies directly (the same outputs); with
    ``DIRECT_IN_EAGER`` off they go through the registered ``torch.library`` ops."""
    import esm_turbo.ops.compressed as compressed
    codec = random_turbo_codec(2, 16, 3, 3, "sign", seed=0)
    cache = filled_cache(codec, 2, [9, 20], "cpu")
    q, k, v, valid = step_inputs(2, 2, 1, 16, "cpu")
    outs = []
    for direct in (True, False):
        monkeypatch.setattr(compressed, "DIRECT_IN_EAGER", direct)
        calls = []
        for name in ("quantize_pack", "compressed_attention"):
            op = getattr(compressed, name)
            monkeypatch.setattr(compressed, name, lambda *a, _op=op, _name=name: calls.append(_name) or _op(*a))
        out = attend_compressed(codec, cache.parts[0], cache.lengths, q, k, v, valid)
        parts = KVCache([codec], 2, capacity=8, device="cpu").parts[0]
        compressed.write_compressed(codec, parts, k, v, torch.tensor([0, 3]))
        assert calls == ([] if direct else ["compressed_attention", "quantize_pack"])
        outs.append((out, parts))
        monkeypatch.undo()
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(outs[0][1][name], outs[1][1][name]) for name in outs[0][1])


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the kernels need Triton's interpreter, on "
                    "only without CUDA; on a GPU the ops' CUDA bodies run in the GPU tests")
@pytest.mark.parametrize("slots", [0, 1])
def test_the_ops_cuda_bodies_run_the_kernels(slots):
    """The custom ops' CUDA implementations are their bodies with the kernel switched on: run here on CPU tensors
    under Triton's interpreter, they agree with the default (reference) bodies, on a contiguous and a paged cache,
    with and without a slot a token and kind."""
    from esm_turbo.ops.compressed import _compressed_attention_with, _quantize_pack_with
    codec = random_turbo_codec(2, 16, 3, 3, "sign", seed=0)
    codec = KVCodec(codec.key, codec.value, slots=slots)
    cache = filled_cache(codec, 2, [9, 20], "cpu")
    q, k, v, valid = step_inputs(2, 2, 1, 16, "cpu")
    keys, values = (cached_codes(codec, cache.parts[0], kind) for kind in "kv")
    args = (q, k, v, valid.to(torch.uint8), cache.lengths, keys, values)
    (*head, pk, pv), pages = paged_args(args, 8)
    for (*lead, kk, vv), table, block in ((args, torch.empty(0, dtype=torch.int32), 0), ((*head, pk, pv), pages, 8)):
        flat = (*lead, *kk[:7], kk.code.to_op(), *vv[:7], vv.code.to_op(), table, block, kk.slots, vv.slots)
        want = _compressed_attention_with(lambda: False)(*flat)
        assert torch.allclose(_compressed_attention_with(lambda: True)(*flat), want, atol=1e-4, rtol=1e-3)
    tables = fused_tables(codec)
    x = {kind: torch.randn(2, 2, 5, 16, generator=torch.Generator().manual_seed(i)) * 2 for i, kind in enumerate("kv")}
    pos = torch.tensor([0, 3])
    # a paged write: pools of 8 slots of 4-token blocks, row 0's positions 0..4 in slots 5, 2, row 1's 3..7 in 0, 7
    table = torch.tensor([[5, 2], [0, 7]], dtype=torch.int32)
    written = {}
    for kernel in (False, True):
        for paged in (False, True):
            parts = (KVCache([codec], 8, capacity=4, device="cpu") if paged else
                     KVCache([codec], 2, capacity=8, device="cpu")).parts[0]
            _quantize_pack_with(lambda: kernel)(
                x["k"], x["v"], codec.key.rot, codec.key.offset, codec.key.scale, tables.k_bounds, codec.key.centroids,
                tables.k_layout, *tables.packed(parts, "k"), codec.value.rot, codec.value.offset, codec.value.scale,
                tables.v_bounds, codec.value.centroids, tables.v_layout, *tables.packed(parts, "v"),
                pos, tables.k_code.to_op(), tables.v_code.to_op(), pages=table if paged else None,
                k_slots=parts.get("k.slots"), v_slots=parts.get("v.slots"), k_tab=tables.k_tab, v_tab=tables.v_tab)
            written[kernel, paged] = parts
    for name, ref in written[False, False].items():
        for paged in (False, True):  # the same bytes but where rounding flips a value on a boundary
            got = written[True, paged][name]
            want = written[False, paged][name]
            assert (want != got).float().mean() < 2e-3 and got.any(), name
        # the paged reference puts each token where the contiguous one does, read back through the table
        rows = gather_blocks(written[False, True][name], table)
        for b, start in enumerate(pos.tolist()):
            assert torch.equal(rows[b, :, start:start + 5], ref[b, :, start:start + 5]), name
        untouched = torch.ones(8, dtype=torch.bool)
        untouched[table.flatten().long()] = False
        assert not written[True, True][name][untouched].any(), name


@needs_triton
@pytest.mark.parametrize("shapes,heads,word", [
    ({"k.main": ((24,), torch.uint8), "k.norm": ((4,), torch.float16)}, 2, 8),
    ({"k.main": ((3,), torch.uint8), "v.scale": ((), torch.float32)}, 2, 2),
    ({"k.main": ((3,), torch.uint8), "v.scale": ((), torch.float16)}, 1, 1)])
def test_block_moves_match_the_reference(shapes, heads, word):
    """A paged pool's blocks to staging rows and back (kernels/blocks.py against ops/blocks.py's reference): the
    same bytes in the same places, other slots untouched."""
    from esm_turbo.ops.blocks import BlockLayout, move_blocks_reference
    from esm_turbo.kernels.blocks import move_blocks_triton
    specs, block = [shapes, shapes, shapes], 3
    layout = BlockLayout(specs, heads, block)
    assert layout.word == word
    gen = torch.Generator().manual_seed(0)

    def pools():
        return [{n: torch.randint(0, 256, (7, heads, block, *shape), generator=gen).to(dtype).to(DEVICE)
                 for n, (shape, dtype) in spec.items()} for spec in specs]

    src, slots = pools(), torch.tensor([5, 0, 3, 6], device=DEVICE)
    ref = torch.zeros(4, layout.row_bytes, dtype=torch.uint8, device=DEVICE)
    out = torch.full_like(ref, 7)
    move_blocks_reference(layout, src, ref, slots, to_pool=False)
    words = layout._word_dtype()
    move_blocks_triton(out.view(words), *layout._segments(src, out.device), slots, to_pool=False)
    assert torch.equal(out, ref)
    assert torch.equal(ref[1, :layout.sizes[0]], src[0]["k.main"][0].reshape(-1).view(torch.uint8)[:layout.sizes[0]])
    into_ref = pools()
    into = [{n: b.clone() for n, b in layer.items()} for layer in into_ref]
    move_blocks_reference(layout, into_ref, ref, slots, to_pool=True)
    move_blocks_triton(ref.view(words), *layout._segments(into, ref.device), slots, to_pool=True)
    for a, b, s in zip(into, into_ref, src):
        for name in a:
            assert torch.equal(a[name], b[name])
            assert torch.equal(a[name][slots], s[name][slots])


@needs_triton
@pytest.mark.parametrize("heads,d,s", [(20, 64, 1), (3, 24, 2)])
def test_dense_write_kernel_equals_scatter_rows(heads, d, s):
    """An uncompressed cache's write of a step's keys and values in one launch (kernels/write.py) against
    ``ops.scatter_rows`` per buffer: the same buffers, from strided [B, S, H, d] views cast to the cache's dtype, rows
    at their own positions, nothing else touched."""
    from esm_turbo.kernels.write import write_rows_triton
    from esm_turbo.ops import scatter_rows
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    b, cap = 3, 16
    k, v = (torch.randn(b, s, heads, d, generator=gen).to(dev).transpose(1, 2) for _ in range(2))
    pos = torch.tensor([0, 5, cap - s], device=dev)
    want = [torch.randn(b, heads, cap, d, generator=gen).to(dev, torch.float16) for _ in range(2)]
    got = [t.clone() for t in want]
    for buf, val in zip(want, (k, v)):
        scatter_rows(buf, val.to(buf.dtype), pos)
    write_rows_triton(got[0], got[1], k, v, pos)
    assert all(torch.equal(a, g) for a, g in zip(want, got))
    with pytest.raises(ValueError, match="do not fit the buffers"):
        write_rows_triton(got[0], got[1], k[:, :1], v, pos)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, pytest.param(torch.bfloat16, marks=gpu)])
@pytest.mark.parametrize("heads,d,s", [(5, 64, 1), (3, 24, 2), (2, 128, 3)])
def test_rope_kernel_equals_transformers_bit_for_bit(dtype, heads, d, s):
    """A decode step's query scaling and rotary embedding in one launch (kernels/rope.py) against transformers'
    ``apply_rotary_pos_emb`` (ops.reference.rope_reference): the same bits, from column slices of one q/k/v output
    as a shared launch gives them, at head widths that are and are not powers of two. (bf16 on the GPU only: Triton's
    interpreter truncates float32 to bf16 where the GPU rounds.)"""
    from esm_turbo.kernels.rope import rope_triton
    from esm_turbo.ops.reference import rope_reference
    gen = torch.Generator().manual_seed(d)
    b, width = 3, heads * d
    qkv = (torch.randn(b, s, 3 * width, generator=gen) * 3).to(DEVICE, dtype)
    q, k = qkv[..., :width], qkv[..., width:2 * width]
    freqs = torch.randint(0, 1000, (b, s, 1), generator=gen).float() / 10000 ** (torch.arange(0, d, 2) / d)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    want, got = rope_reference(q, k, cos, sin, d), rope_triton(q, k, cos, sin, d)
    for w, g in zip(want, got):
        assert g.shape == w.shape == (b, heads, s, d) and g.dtype == dtype
        assert torch.equal(g, w)


@needs_triton
@torch.no_grad()
def test_decode_session_with_the_rope_kernel_gives_the_same_step(monkeypatch):
    """A decode session whose attention layers take the RoPE kernel (as on CUDA) gives the same logits, bit for
    bit, as one taking transformers' path."""
    from esm_turbo.testing import stress_esm2
    from esm_turbo.model.engine import TurboEsm
    import esm_turbo.kernels.rope as rope
    from esm_turbo import ops
    model = stress_esm2(layers=2, hidden=64, heads=4, seed=0).to(DEVICE)
    tokens = torch.full((2, 1), engine_mask_id(), device=DEVICE)
    steps, calls, kernel = [], [], rope.rope_triton
    monkeypatch.setattr(rope, "rope_triton", lambda *a: calls.append(1) or kernel(*a))
    for fused in (False, True):
        monkeypatch.setattr(ops, "use_kernels", lambda _, f=fused: f)
        session = TurboEsm(model).session("fp32", capacity=64)
        session.start(["MKTAYIAKQRQISFVKSHFSRQ", "MKVLAAGIVGL"])
        calls.clear()
        steps.append(session.step(tokens, commit=False).logits)
        assert len(calls) == (2 if fused else 0)  # one launch a layer
    assert torch.equal(steps[0], steps[1])
