"""The paged cache: the same contents as the contiguous cache under any sequence of writes, peeks, commits,
rollbacks and forks (copy-on-write never shows a row another's tokens), shared prefixes counted once, and a decode
session that gives the contiguous session's outputs."""

import copy
import random

import pytest
import torch

from esm_turbo import ops
from esm_turbo.cache import KVCache
from esm_turbo.model.engine import TurboEsm
from esm_turbo.paged import PagedKVCache
from esm_turbo.testing import random_turbo_codec

HEADS, DIM, LAYERS = 2, 16, 2


def codecs():
    return [random_turbo_codec(HEADS, DIM, 3, 3, "sign", seed=i) for i in range(LAYERS)]


def assert_same(paged: PagedKVCache, flat: KVCache, peeked: bool = False) -> None:
    assert torch.equal(paged.lengths, flat.lengths)
    for layer in range(LAYERS):
        kp, vp, valid = paged.dequantize(layer)
        kf, vf, valid_f = flat.dequantize(layer)
        assert torch.equal(valid, valid_f)
        mask = valid[:, None, :, None]
        assert torch.equal(torch.where(mask, kp, 0), torch.where(mask, kf, 0)), layer
        assert torch.equal(torch.where(mask, vp, 0), torch.where(mask, vf, 0)), layer
    # the bookkeeping: every block's count is the number of tables holding it, free blocks are unreferenced
    refs = paged.pool.refs
    held = [0] * len(refs)
    for table in paged.tables:
        for block in table:
            held[block] += 1
    assert held == refs
    assert sorted(paged.pool.free_ids) == [i for i, r in enumerate(refs) if r == 0]
    for table, length in zip(paged.tables, paged.lengths.tolist()):  # a peek's blocks stay until a commit
        assert len(table) >= -(-length // paged.block_size) if peeked else len(table) == -(-length // paged.block_size)


@pytest.mark.parametrize("seed,fused", [(0, False), (1, False), (2, True), (3, True)])
def test_random_operations_match_the_contiguous_cache(seed, fused):
    """``fused``: both caches take the fused ops' path (on the CPU their reference bodies: the quantize kernel's
    encode into a step buffer, decode attention reading the pool through :meth:`PagedKVCache.pages`), and every
    operation is followed by a decode attention step on both."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cs = codecs()
    paged, flat = PagedKVCache(cs, 3, capacity=4, block_size=4), KVCache(cs, 3, capacity=4)
    paged.fused = flat.fused = [fused] * LAYERS
    for _ in range(40):
        op = rng.choice(["append", "append", "peek", "truncate", "select"])
        b = paged.batch_size
        if op in ("append", "peek"):
            s = rng.randint(1, 5)
            for layer in range(LAYERS):
                k, v = torch.randn(2, b, HEADS, s, DIM, generator=gen)
                paged.write(layer, k, v)
                flat.write(layer, k, v)
            if op == "append":
                counts = torch.tensor([rng.randint(0, s) for _ in range(b)])
                paged.commit(counts)
                flat.commit(counts)
        elif op == "truncate":
            n = torch.tensor([rng.randint(0, 4) for _ in range(b)])
            paged.truncate(n)
            flat.truncate(n)
        else:
            rows = [rng.randrange(b) for _ in range(rng.randint(1, 6))]
            paged.select(rows)
            flat.select(rows)
        assert_same(paged, flat, peeked=op in ("peek", "select"))  # select keeps a peek's blocks
        if fused:
            q, k, v = torch.randn(3, paged.batch_size, HEADS, 2, DIM, generator=gen)
            valid = torch.ones(paged.batch_size, 2, dtype=torch.bool)
            for layer in range(LAYERS):
                out_p = ops.decode_attention(q, paged, layer, k, v, valid)
                out_f = ops.decode_attention(q, flat, layer, k, v, valid)
                assert torch.allclose(out_p, out_f, atol=1e-5, rtol=1e-5), (out_p - out_f).abs().max()


def test_forks_share_their_prefix():
    """32 candidates forked from one 64-token prefix, each extended by 16 tokens: one prefix plus the tails held."""
    cs, block = codecs(), 16
    cache = PagedKVCache(cs, 1, capacity=64, block_size=block)
    gen = torch.Generator().manual_seed(0)
    cache.append(*[list(t) for t in torch.randn(2, LAYERS, 1, HEADS, 64, DIM, generator=gen)])
    cache.select([0] * 32)
    cache.append(*[list(t) for t in torch.randn(2, LAYERS, 32, HEADS, block, DIM, generator=gen)])
    report = cache.memory_report()
    block_bytes = report.bytes_per_token_per_layer * LAYERS * block
    assert report.tokens == 32 * (64 + block)
    assert report.used_bytes == (64 // block + 32) * block_bytes + 4 * 32 * (64 // block + 1)
    assert report.used_bytes <= 1.3 * (64 + 32 * block) * report.bytes_per_token_per_layer * LAYERS
    assert report.shared_saved_bytes == 31 * (64 // block) * block_bytes
    # rolling every candidate back to the prefix frees the tails; keeping one row frees the other tables
    cache.truncate(block)
    cache.select([5])
    assert cache.memory_report().used_bytes == (64 // block) * block_bytes + 4 * (64 // block)


def test_forks_report_the_prefix_they_share():
    """``shared_prefix``: the tokens every row holds in the same blocks as its lead (what decode attention may read
    once for a lead's rows), as forks write apart, roll back and are selected; each row's lead where forks of several
    scaffolds step together; nothing for one row, too few rows a lead, or a contiguous cache."""
    cs, block = codecs(), 16
    cache = PagedKVCache(cs, 1, capacity=80, block_size=block)
    gen = torch.Generator().manual_seed(0)
    cache.append(*[list(t) for t in torch.randn(2, LAYERS, 1, HEADS, 70, DIM, generator=gen)])
    assert cache.shared_prefix() == (0, None)  # one row
    cache.select([0] * 8)
    assert cache.shared_prefix() == (70, None)  # every block shared, the last one partly filled; row 0 leads
    cache.append(*[list(t) for t in torch.randn(2, LAYERS, 8, HEADS, 1, DIM, generator=gen)])
    assert cache.shared_prefix() == (64, None)  # each row wrote into its own copy of the partly filled block
    cache.truncate(10)
    assert cache.shared_prefix() == (61, None)  # no row reaches past 61 now
    cache.select([3, 3, 3, 3])
    assert cache.shared_prefix() == (61, None)
    cache.select([0, 1])
    assert cache.shared_prefix() == (0, None)  # two rows a lead: too few to pay
    assert KVCache(cs, 4, capacity=8).shared_prefix() == (0, None)

    two = PagedKVCache(cs, 2, capacity=80, block_size=block)  # two scaffolds, forked and interleaved
    two.append(*[list(t) for t in torch.randn(2, LAYERS, 2, HEADS, 40, DIM, generator=gen)])
    two.select([0, 1, 0, 0, 1, 1, 0, 1, 1, 0])
    span, leads = two.shared_prefix()
    assert span == 40 and leads.tolist() == [0, 1, 0, 0, 1, 1, 0, 1, 1, 0]
    assert leads.dtype == torch.int32 and leads.device == two.device


def _paged_and_contiguous_outputs(engine, factory, block_size):
    outputs = []
    for paged in (False, True):
        session = engine.session(factory, capacity=8, paged=paged, block_size=block_size)
        first = session.start(["MKTAYIAKQR", "GSHMLE"])
        session.fork(3)
        steps = [first.logits[:, :6]]
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            tokens = torch.randint(4, 24, (session.cache.batch_size, 2), generator=gen)
            steps.append(session.step(tokens).logits)
        session.rollback(3)
        session.select([5, 0, 0, 2])
        steps.append(session.step(torch.full((4, 1), 32)).logits)  # <mask> after the rollback
        steps.append(session.step(torch.full((4, 1), 5), commit=False).logits)
        outputs.append((steps, session.sequences()))
        if paged and block_size == 4:
            assert session.cache.memory_report().shared_saved_bytes > 0  # rows 1 and 2 share their blocks
            if session.cache.device.type != "cuda":  # on CUDA a paged step captures (test_paged_capture.py)
                with pytest.raises(RuntimeError, match="CUDA device"):
                    session.capture_step(torch.zeros(4, 1, dtype=torch.long))
    return outputs


def test_a_paged_session_decodes_as_the_contiguous_one(stress_model):
    (flat, seqs_flat), (paged, seqs_paged) = _paged_and_contiguous_outputs(TurboEsm(stress_model), "turboquant-3", 4)
    assert seqs_flat == seqs_paged
    for a, b in zip(flat, paged):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("block_size", [4, 64])
def test_a_paged_session_runs_the_kernels_as_the_contiguous_one(stress_model, block_size):
    """On CUDA both caches write with the quantize kernel and read with the decode kernel (the paged one through its
    block tables)."""
    from esm_turbo.bench.synthetic import layer_codec
    engine = TurboEsm(copy.deepcopy(stress_model).cuda())  # the fixture stays on the CPU
    (flat, seqs_flat), (paged, seqs_paged) = _paged_and_contiguous_outputs(engine, layer_codec, block_size)
    assert seqs_flat == seqs_paged
    for a, b in zip(flat, paged):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_forks_of_one_scaffold_step_with_the_shared_walk_as_without(stress_model, monkeypatch):
    """16 forks of one 300-residue scaffold on CUDA: with the shared walk on (the scaffold's blocks read once for the
    forks, ``kernels/decode/shared.py``) a step's logits are the per-row walks' within fp32 rounding, eager and
    captured."""
    from esm_turbo.bench.synthetic import layer_codec
    from esm_turbo.kernels.decode import launch, plan
    engine = TurboEsm(copy.deepcopy(stress_model).cuda())
    scaffold = "".join("ACDEFGHIKLMNPQRSTVWY"[i * 7 % 20] for i in range(300))
    launches, kernel = [], launch._shared_kernel

    class Spy:  # counts the shared walk's launches
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]
    monkeypatch.setattr(launch, "_shared_kernel", Spy())
    out = []
    for on in (False, True):
        monkeypatch.setattr(plan, "SHARED_WALK", on)
        session = engine.session(layer_codec, capacity=320, paged=True, block_size=64)
        session.start([scaffold])
        session.fork(16)
        held = session.cache.host_lengths[0]
        assert session.cache.shared_prefix() == (held, None)
        tokens = torch.randint(4, 24, (16, 1), generator=torch.Generator().manual_seed(0)).cuda()
        steps = [session.step(tokens).logits]
        assert session.cache.shared_prefix() == (held // 64 * 64, None)
        steps.append(session.step(tokens, commit=False).logits)
        steps.append(session.capture_step(tokens, commit=False).replay().logits)
        out.append(steps)
        assert bool(launches) == on
    for a, b in zip(*out):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


def test_paged_cache_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(codecs(), 1, block_size=0)
    windowed = codecs()[0]
    windowed.window = 4  # as a KIVI codec carries
    with pytest.raises(ValueError, match="recent-token windows"):
        PagedKVCache([windowed], 1)


def per_row(cache: PagedKVCache, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's decoded keys and values, read through a one-row view (only its blocks on the device)."""
    out = []
    for r in range(cache.batch_size):
        k, v, valid = cache.view([r]).dequantize(layer)
        n = int(valid.sum())
        out.append((k[0, :, :n], v[0, :, :n]))
    return out


CUDA_LINKS = [pytest.param("cuda", streams, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="needs CUDA (run on the GPU machine)"),
                            id=f"cuda-streams-{streams}") for streams in (True, False)]


@pytest.mark.parametrize("device,streams", [("cpu", False), *CUDA_LINKS])
@pytest.mark.parametrize("slots", [0, 1])
def test_host_tier_round_trips_exactly(slots, device, streams, monkeypatch):
    """Under a device budget of a few blocks, rows stepped one or two at a time push the others' blocks to host
    memory and fetch them back: every row reads what an unbudgeted cache holds, bit for bit (codecs with slots too:
    their per-token parts ride in the same block rows). On CUDA with the link's copies on streams of their own and
    without, staging two blocks at a time, so that a move takes several fills through the two buffers in turn."""
    from esm_turbo import host_link
    from esm_turbo.quant.codec import KVCodec
    cs, block = [KVCodec(c.key, c.value, slots=slots).to(device) for c in codecs()], 4
    block_bytes = sum(c.token_bytes(HEADS) for c in cs) * block
    small = PagedKVCache(cs, 1, capacity=4, block_size=block, device_budget_bytes=12 * block_bytes, device=device)
    free = PagedKVCache(cs, 1, capacity=4, block_size=block, device=device)
    monkeypatch.setattr(host_link, "COPY_STREAMS", streams)
    monkeypatch.setattr(host_link, "STAGE_BYTES", 2 * small.pool.layout.row_bytes * (2 if streams else 1))
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    kv = torch.randn(2, LAYERS, 1, HEADS, 6, DIM, generator=gen).to(device)
    for cache in (small, free):
        cache.append(list(kv[0]), list(kv[1]))
        cache.select([0, 0, 0, 0, 0])
    moved = 0
    for _ in range(20):
        rows = rng.sample(range(5), rng.choice([1, 1, 2]))
        s = rng.randint(1, 2)
        kv = torch.randn(2, LAYERS, len(rows), HEADS, s, DIM, generator=gen).to(device)
        for cache in (small, free):
            view = cache.view(rows)
            view.append(list(kv[0]), list(kv[1]))
            view.give_back()
        moved = max(moved, small.memory_report().host_bytes)
        assert small.pool.slots <= 12
    assert moved > 0  # the budget did push blocks out
    assert torch.equal(small.lengths, free.lengths)
    for layer in range(LAYERS):
        for (ks, vs), (kf, vf) in zip(per_row(small, layer), per_row(free, layer)):
            assert torch.equal(ks, kf) and torch.equal(vs, vf)
    report = small.memory_report()
    assert report.used_bytes == free.memory_report().used_bytes  # the same blocks, wherever they are
    with pytest.raises(Exception, match="budget"):  # every row at once needs more blocks than the device holds
        small.dequantize(0)


def test_clean_blocks_leave_the_device_without_a_copy():
    """A block brought back from the host and only read keeps its host copy: sent out again, it gives up its device
    slot and nothing is copied; a block written since is copied."""
    cs, block = codecs(), 4
    block_bytes = sum(c.bytes_per_token() for c in cs) * HEADS * block
    cache = PagedKVCache(cs, 2, capacity=8, block_size=block, device_budget_bytes=3 * block_bytes)
    gen = torch.Generator().manual_seed(0)
    for row in (0, 1):  # each row: one full block, then one token of a second
        view = cache.view([row])
        view.append(*[list(t) for t in torch.randn(2, LAYERS, 1, HEADS, block + 1, DIM, generator=gen)])
        view.give_back()
    moved = cache.pool.moved
    full0 = cache.tables[0][0]
    cache.view([0]).dequantize(0)  # row 0 back on the device (its blocks read, not written)
    assert cache.pool.slot[full0] >= 0 and cache.pool.host_slot[full0] >= 0
    before = dict(moved)
    cache.view([1]).dequantize(0)  # row 1 back: row 0's blocks leave again, clean: no device-to-host copy
    assert cache.pool.slot[full0] < 0
    assert moved["out"] == before["out"] and moved["in"] > before["in"]  # only the way back in
    view = cache.view([0])
    view.append(*[list(t) for t in torch.randn(2, LAYERS, 1, HEADS, 1, DIM, generator=gen)])  # writes its 2nd block
    view.give_back()
    assert cache.pool.host_slot[cache.tables[0][1]] < 0  # written: its host copy let go


def test_a_view_shares_its_rows_blocks_and_gives_back_their_lengths():
    """PagedRows: the rows' block-table lists are the parent's own (a block a step takes shows there), the lengths
    are copies until give_back."""
    from esm_turbo.paged import PagedRows
    cache = PagedKVCache(codecs(), 3, capacity=8, block_size=4)
    view = cache.view([2, 0])
    assert isinstance(view, PagedRows) and view.batch_size == 2 and view.pool is cache.pool
    assert view.tables[0] is cache.tables[2] and view.tables[1] is cache.tables[0]
    gen = torch.Generator().manual_seed(0)
    view.append(*[list(t) for t in torch.randn(2, LAYERS, 2, HEADS, 5, DIM, generator=gen)])
    assert len(cache.tables[2]) == 2 and cache.tables[1] == []  # blocks taken through the view, row 1 untouched
    assert cache.lengths.tolist() == [0, 0, 0]
    view.give_back()
    assert cache.lengths.tolist() == [5, 0, 5] and cache.host_lengths == [5, 0, 5]


def test_a_budgeted_session_steps_some_rows(stress_model):
    """Stepping a subset of rows under a tiny device budget gives what the same steps give with no budget, and a
    contiguous session refuses a subset step."""
    engine = TurboEsm(stress_model)
    results, budget = [], None
    for _ in range(2):
        session = engine.session("turboquant-3", paged=True, block_size=4, gpu_budget_gib=budget)
        session.start(["MKTAYIAKQRQISFVK"])  # 17 tokens: 4 full blocks and one more, shared by the forks
        session.fork(4)
        gen = torch.Generator().manual_seed(1)
        outs, host = [], 0
        for step in range(6):  # two rows a step: the 4 shared blocks and the two rows' own tail blocks
            rows = [step % 4, (step + 2) % 4]
            outs.append(session.step(torch.randint(4, 24, (2, 1), generator=gen), rows=rows).logits)
            host = max(host, session.memory_report().host_bytes)
        outs.append(session.step(torch.full((1, 1), 32), rows=[3], commit=False).logits)
        results.append((outs, session.sequences(), host))
        rep = session.memory_report()
        budget = 7 * rep.bytes_per_token_per_layer * rep.layers * 4 / 2**30  # 7 blocks; the rows hold 8
    (plain, seqs, _), (budgeted, seqs_b, host) = results
    assert seqs == seqs_b and host > 0
    for a, b in zip(plain, budgeted):
        assert torch.equal(a, b)
    flat = engine.session("turboquant-3")
    flat.start(["MKTAYIAK"])
    with pytest.raises(ValueError, match="paged session"):
        flat.step(torch.zeros(1, 1, dtype=torch.long), rows=[0])
    with pytest.raises(ValueError, match="paged=True"):
        engine.session("turboquant-3", gpu_budget_gib=1)


class _Event:
    def __init__(self, name: str):
        self.name, self.done = name, False

    def query(self) -> bool:
        return self.done


class _Stream:
    """Records what a HostLink asks of a stream: the events it waits for, and each event it records (named in turn)."""

    def __init__(self, name: str):
        self.name, self.waited, self.recorded = name, [], []

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event.name)

    def record_event(self) -> _Event:
        self.recorded.append(_Event(f"{self.name}{len(self.recorded)}"))
        return self.recorded[-1]


def test_host_link_orders_what_its_two_streams_share():
    """The host link's bookkeeping (on CUDA its copies run on a stream each way): a copy back waits for the latest copy
    out that wrote any of its host rows and is still in flight, and for none where its rows were written by copies
    seen done; a copy out waits for the last copy back (it may write rows that copy read before they were freed)."""
    from esm_turbo.host_link import HostLink
    link, out, back = HostLink(torch.device("cpu")), _Stream("out"), _Stream("in")
    link._order(out, [0, 1], to_device=False)
    assert out.waited == []  # nothing came back yet
    link._finished(out, [0, 1], to_device=False)  # batch 1 wrote rows 0, 1
    link._finished(out, [2], to_device=False)  # batch 2 wrote row 2
    link._order(back, [1, 7], to_device=True)
    assert back.waited == ["out0"]  # row 1's copy out
    link._order(back, [0, 2], to_device=True)
    assert back.waited == ["out0", "out1"]  # the later of the two batches: one stream's events complete in order
    link._order(back, [7], to_device=True)
    assert back.waited == ["out0", "out1"]  # no copy out wrote row 7
    link._finished(back, [0, 2], to_device=True)
    out.recorded[0].done = True
    link._finished(out, [5], to_device=False)  # batch 3; batch 1 is seen done and forgotten
    assert sorted(link.out_events) == [2, 3]
    link._order(back, [0, 1], to_device=True)
    assert back.waited == ["out0", "out1"]  # rows 0 and 1 were written by a copy seen done: nothing to wait for
    link._order(out, [9], to_device=False)
    assert out.waited == ["in0"]  # a copy out after the last copy back
