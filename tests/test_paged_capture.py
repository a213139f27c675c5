"""A paged decode step captured as a CUDA graph: blocks reserved ahead keep the block tables still for every step
within their reach (what a graph's replays need), the host's lengths follow the replays, and a replay refuses once
the cache has changed under it. The bookkeeping is tested on CPU, the graph itself on CUDA."""

from types import SimpleNamespace

import pytest
import torch

from esm_turbo.model.engine import CapturedStep, TurboEsm

SEQS = ["MKTAYIAKQRQISFVKSH", "GSHMLEDPV"]


def _session(engine, paged=True, capacity=8, **kw):
    session = engine.session("turboquant-3", capacity=capacity, paged=paged, block_size=4, **kw)
    session.start(SEQS)
    session.fork(3)  # rows share their scaffold's blocks, the last one partly filled
    return session


def _tokens(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 24, (batch, 1), generator=torch.Generator().manual_seed(seed))


def test_reserved_blocks_keep_the_tables_still_and_the_outputs_the_same(stress_model):
    engine = TurboEsm(stress_model)
    reserved, plain = _session(engine), _session(engine)
    cache = reserved.cache
    shared_before = cache.memory_report().shared_saved_bytes
    cache.reserve(6)  # every row's blocks for 6 more tokens, its shared last block copied now
    version = cache.storage_version
    assert cache.memory_report().shared_saved_bytes < shared_before
    for i in range(6):
        tokens = _tokens(6, i)
        a, b = reserved.step(tokens).logits, plain.step(tokens).logits
        assert torch.equal(a, b), i
        assert cache.storage_version == version, f"step {i} changed the tables within the reach"
    assert reserved.sequences() == plain.sequences()
    reserved.step(_tokens(6, 99))  # past the reach: blocks are taken again
    assert cache.storage_version != version


def test_claim_and_rewind_follow_the_replays_on_the_host(stress_model):
    cache = _session(TurboEsm(stress_model)).cache
    start = list(cache.host_lengths)
    cache.reserve(3)
    bound = cache.length_bound
    cache.claim(2)
    assert cache.host_lengths == [n + 2 for n in start] and cache.length_bound == bound + 2
    with pytest.raises(RuntimeError, match="reserved cache room"):
        cache.claim(2)  # 4 more would pass the reach of 3
    cache.rewind_bound(bound)
    assert cache.host_lengths == start and cache.length_bound == bound


def test_a_select_lets_the_reserved_blocks_go(stress_model):
    engine = TurboEsm(stress_model)
    reserved, plain = _session(engine), _session(engine)
    reserved.cache.reserve(6)
    version = reserved.cache.storage_version
    for session in (reserved, plain):
        session.select([0, 0, 3])
    assert reserved.cache.storage_version != version
    assert reserved.cache.memory_report().used_bytes == plain.cache.memory_report().used_bytes
    tokens = _tokens(3, 5)
    assert torch.equal(reserved.step(tokens).logits, plain.step(tokens).logits)


def test_under_a_device_budget_a_paged_step_is_not_captured(stress_model):
    session = _session(TurboEsm(stress_model), gpu_budget_gib=1.0)
    with pytest.raises(RuntimeError, match="device budget"):
        session.cache.reserve(4)


def test_the_contiguous_cache_versions_its_buffers(stress_model):
    session = _session(TurboEsm(stress_model), paged=False, capacity=32)
    cache = session.cache
    version = cache.storage_version
    cache.reserve(2)  # within the capacity: nothing replaced
    assert cache.storage_version == version
    cache.reserve(4 * cache.capacity)
    assert cache.storage_version != version
    version = cache.storage_version
    session.select([1, 2])
    assert cache.storage_version != version


@pytest.mark.parametrize("paged", [False, True])
def test_a_replay_refuses_a_changed_cache(stress_model, paged):
    """A captured step holds its cache's buffers and tables: after a select (or a new start) it refuses in one
    line instead of writing where the rows no longer are."""
    session = _session(TurboEsm(stress_model), paged=paged)
    replays = []
    graph = SimpleNamespace(replay=lambda: replays.append(1))
    step = CapturedStep(session, graph, torch.zeros(6, 1, dtype=torch.long), torch.ones(6, dtype=torch.long), None,
                        False, 1, session.cache, session.cache.storage_version)
    step.replay()
    assert replays == [1]
    session.select([0, 1])
    with pytest.raises(RuntimeError, match="capture the step again"):
        step.replay()
    session.start(SEQS)
    with pytest.raises(RuntimeError, match="capture the step again"):
        step.replay()
    assert replays == [1]


@pytest.mark.parametrize("paged", [False, True])
def test_a_rollback_keeps_what_a_captured_step_reads_in_place(stress_model, paged):
    """A captured step holds the addresses of the session's token record, mask counts and cache lengths: a rollback
    changes them in place (a new tensor would leave a replay reading freed memory)."""
    session = TurboEsm(stress_model).session("turboquant-3", capacity=32, paged=paged, block_size=4)
    session.start(["MKTAYIAKQR", "GSHMLE"])
    session.step(torch.full((2, 2), 32))  # two <mask> tokens a row
    held = [t.data_ptr() for t in (session.tokens, session.mask_counts, session.cache.lengths)]
    counts = session.mask_counts.clone()
    session.rollback(1)
    assert [t.data_ptr() for t in (session.tokens, session.mask_counts, session.cache.lengths)] == held
    assert torch.equal(session.mask_counts, counts - 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_a_paged_step_replays_as_a_cuda_graph():
    """Forks of a scaffold on the paged cache, stepped by replays of one captured committing step, give the eager
    contiguous session's logits; a rollback replays on; a fork makes it refuse."""
    from esm_turbo.testing import stress_esm2
    model = stress_esm2(layers=2, hidden=128, heads=4, seed=0).cuda().half()
    engine = TurboEsm(model)
    paged = engine.session("turboquant-3", capacity=64, paged=True, block_size=16)
    flat = engine.session("turboquant-3", capacity=64)
    for s in (paged, flat):
        s.start(SEQS)
        s.fork(3)
    tokens = torch.full((6, 1), 5, device="cuda")
    captured = paged.capture_step(tokens, commit=True, reserve=24)
    for i in range(20):
        step = torch.randint(4, 24, (6, 1), generator=torch.Generator().manual_seed(i)).cuda()
        got = captured.replay(step).logits
        want = flat.step(step).logits
        assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (i, (got - want).abs().max())
    assert torch.equal(paged.lengths, flat.lengths)
    assert paged.sequences() == flat.sequences()
    paged.rollback(2)
    flat.rollback(2)
    step = torch.full((6, 1), 7, device="cuda")
    assert torch.allclose(captured.replay(step).logits, flat.step(step).logits, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="reserved cache room"):
        for _ in range(8):
            captured.replay(step)
    paged.fork(2)
    with pytest.raises(RuntimeError, match="capture the step again"):
        captured.replay(step)
