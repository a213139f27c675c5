"""The Triton attention of 64-token tiles over a packed batch (esm_turbo.kernels.varlen_attention) against the
per-sequence reference: under Triton's interpreter on CPU, and in fp16/bf16 on the GPU under the flash-attention
rule."""

import pytest
import torch

from esm_turbo.embed.varlen import varlen_attention_reference
from esm_turbo.kernels import triton_supported

pytestmark = pytest.mark.skipif(not triton_supported(), reason="needs Triton (its interpreter on CPU)")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def test_query_blocks_cut_each_sequence_into_tiles_of_its_own():
    from esm_turbo.kernels.varlen_attention import query_blocks
    table = query_blocks([1, 70, 3, 130], "cpu").tolist()
    assert table[0] == [0, 1, 65, 71, 74, 138, 202]       # block starts
    assert table[1] == [0, 1, 1, 71, 74, 74, 74]          # their sequence's start
    assert table[2] == [1, 71, 71, 74, 204, 204, 204]     # and end


def test_attention_plan_puts_each_sequence_in_the_first_class_it_fits():
    from esm_turbo.kernels.varlen_attention import AttentionTile, attention_plan
    short, long = AttentionTile(64, 64), AttentionTile(128, 64, 8)
    plan = attention_plan([1, 70, 3, 130], "cpu", ((64, short), (100, long)))
    assert [t for _, t in plan.launches] == [short, long]
    assert plan.launches[0][0].tolist() == [[0, 71], [0, 71], [1, 74]]           # the 1- and 3-token sequences
    assert plan.launches[1][0].tolist() == [[1, 74, 202], [1, 74, 74], [71, 204, 204]]  # 70 and 130 in 128-blocks
    assert len(attention_plan([5, 6], "cpu", ((64, short), (100, long))).launches) == 1


TILES = [(64, 64, 4, None), (128, 64, 8, 3), (64, 32, 4, 2), (128, 128, 8, 2)]


@pytest.mark.parametrize("dtype", [torch.float32] if not CUDA else [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
@pytest.mark.parametrize("tile", TILES if CUDA else TILES[:2], ids=lambda t: "x".join(map(str, t[:2])))
def test_triton_varlen_attention_matches_the_reference(dtype, head_dim, tile):
    """Sequences of 1, 63, 64, 65 and 200 tokens (full key tiles, a partial last one, a sequence shorter than one
    tile); v a column view of a wider projection output (the layout FastEsm hands it); the output no further from
    float64 than twice the reference in the same dtype, for every tile shape."""
    from esm_turbo.kernels.varlen_attention import AttentionTile, query_blocks, varlen_attention_triton
    tile = AttentionTile(*tile)
    lengths = [1, 63, 64, 65, 200] if CUDA else [1, 63, 65, 7, 130]
    n, heads = sum(lengths), 3
    gen = torch.Generator().manual_seed(head_dim)
    q, k = (torch.randn(n, heads, head_dim, generator=gen).to(DEV, dtype) for _ in range(2))
    wide = torch.randn(n, 3 * heads * head_dim, generator=gen).to(DEV, dtype)
    v = wide[:, 2 * heads * head_dim:].view(n, heads, head_dim)
    out = varlen_attention_triton(q, k, v, query_blocks(lengths, DEV, tile.bm), tile=tile)
    ref = varlen_attention_reference(q.double(), k.double(), v.double(), lengths)
    err = (out.double() - ref).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-5
    else:
        own = (varlen_attention_reference(q, k, v, lengths).double() - ref).abs().max().item()
        assert torch.isfinite(out).all() and err <= 2 * own + torch.finfo(dtype).eps, (err, own)


def test_fast_esm_takes_the_triton_attention_when_asked():
    from esm_turbo.embed.fast_esm import FastEsm, PackedBatch
    from esm_turbo.testing import stress_esm2
    net = stress_esm2(layers=2, hidden=64, heads=4, seed=5).to(DEV)
    if CUDA:
        net = net.half()
    fast = FastEsm.from_hf(net, fused=True)
    batch = PackedBatch.from_sequences(["MKTAYIAKQRQISFVKSHFSRQ", "W" * 70, "GSHM"], DEV)
    flash = fast(batch, [2])[2].float()
    fast.attention_kernel = "triton"
    tiles = fast(batch, [2])[2].float()
    assert (tiles - flash).abs().max() <= (4e-3 if CUDA else 1e-5) * max(1.0, flash.abs().max().item())


@pytest.mark.skipif(not CUDA, reason="needs a compute-capability 9.0 GPU (Gluon)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("bn,stages", [(64, 3), (64, 4), (32, 4), (64, 5)])
def test_gluon_varlen_attention_matches_the_reference(dtype, head_dim, bn, stages):
    """The Gluon kernel (each key tile's scores under the previous tile's softmax): sequences of 1, 63, 64, 65, 200
    and 130 tokens (one tile and less, several full tiles, a partial last one: keys past a sequence's end are the next
    one's, or past the batch TMA's zeros), q, k and v column views of one projection output as FastEsm hands them;
    no further from float64 than twice the reference in the same dtype."""
    from esm_turbo.kernels.gemm_ws import available
    from esm_turbo.kernels.varlen_attention import query_blocks
    from esm_turbo.kernels.varlen_attention_gluon import varlen_attention_gluon
    if not available():
        pytest.skip("needs a compute-capability 9.0 GPU with Triton's Gluon")
    lengths = [1, 63, 64, 65, 200, 130]
    n, heads = sum(lengths), 3
    gen = torch.Generator().manual_seed(head_dim + bn)
    qkv = torch.randn(n, 3 * heads * head_dim, generator=gen).to(DEV, dtype)
    q, k, v = (qkv[:, i * heads * head_dim: (i + 1) * heads * head_dim].view(n, heads, head_dim) for i in range(3))
    out = varlen_attention_gluon(q, k, v, query_blocks(lengths, DEV, 64), bn=bn, stages=stages)
    ref = varlen_attention_reference(q.double(), k.double(), v.double(), lengths)
    own = (varlen_attention_reference(q, k, v, lengths).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= 2 * own + torch.finfo(dtype).eps, (err, own)


@pytest.mark.parametrize("heads", [4, 2])
def test_fast_esm_takes_the_gluon_attention_where_it_runs_and_the_triton_one_elsewhere(heads):
    """FastEsm.attention_kernel = "gluon": on a compute-capability 9.0 GPU (heads of 32 and 64 here) the plan runs in
    the Gluon kernel, within fp16's rounding of the Triton kernel's output; elsewhere (CPU, the interpreter) the same
    plan runs in the Triton kernel, bit for bit. The default is the Triton kernel; a name it does not know is refused
    (not run as flash)."""
    from esm_turbo.embed.fast_esm import FastEsm, PackedBatch
    from esm_turbo.kernels.varlen_attention_gluon import usable
    from esm_turbo.testing import stress_esm2
    net = stress_esm2(layers=2, hidden=128, heads=heads, seed=5).to(DEV)
    if CUDA:
        net = net.half()
    fast = FastEsm.from_hf(net, fused=True)
    batch = PackedBatch.from_sequences(["MKTAYIAKQRQISFVKSHFSRQ" * 4, "W" * 70, "GSHM"], DEV)
    assert fast.attention_kernel == "triton"
    with pytest.raises(ValueError, match="attention_kernel 'Gluon': one of"):
        fast.attention_kernel = "Gluon"
    triton_out = fast(batch, [2])[2].float()
    fast.attention_kernel = "gluon"
    gluon_out = fast(batch, [2])[2].float()
    dtype, d = next(net.parameters()).dtype, 128 // heads
    if usable(torch.device(DEV), dtype, d):
        assert (gluon_out - triton_out).abs().max() <= 4e-3 * max(1.0, triton_out.abs().max().item())
    else:
        assert torch.equal(gluon_out, triton_out)
