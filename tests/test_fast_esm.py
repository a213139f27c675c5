"""FastEsm (packed batches, variable-length attention) returns what transformers' EsmModel returns."""

import pytest
import torch

from esm_turbo import FastEsm
from esm_turbo.cli import main
from esm_turbo.embed.fast_esm import PackedBatch
from esm_turbo.embed.varlen import varlen_attention, varlen_attention_reference
from esm_turbo.fasta import read_fasta, write_fasta
from esm_turbo.model.alphabet import alphabet, encode
from esm_turbo.model.loading import load_esm
from esm_turbo.testing import stress_esm2

# mixed lengths in one batch: a padding or boundary bug shows on the short rows
SEQS = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "MKV", "GSHMLEDPVDAFQ" * 5, "A", "ACDEFGHIKLMNPQRSTVWYX-B.U"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def padded_reference(net, seqs, dtype=torch.float32, device="cpu"):
    """transformers' hidden states for the sequences in one padded batch: list over layers of [B, T, D]."""
    tokens, mask = encode(seqs)
    with torch.inference_mode():
        out = net.esm(input_ids=tokens.to(device), attention_mask=mask.to(device), output_hidden_states=True)
    return [h.float().cpu() for h in out.hidden_states]


def unpad(packed: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    return list(packed.float().cpu().split(batch.lengths))


@pytest.fixture(scope="module")
def net():
    model = stress_esm2(layers=3, hidden=64, heads=4, seed=3).eval()
    model.config._attn_implementation = "sdpa"
    return model


def test_hidden_states_match_transformers_on_mixed_lengths(net):
    fast = FastEsm.from_hf(net)
    batch = PackedBatch.from_sequences(SEQS)
    hidden = fast(batch, [0, 1, 2, 3])
    ref = padded_reference(net, SEQS)
    for layer in range(4):
        for row, got in enumerate(unpad(hidden[layer], batch)):
            want = ref[layer][row, : len(got)]
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (layer, row, (got - want).abs().max())


def test_only_layers_asked_for_are_returned(net):
    fast = FastEsm.from_hf(net)
    batch = PackedBatch.from_sequences(SEQS[:2])
    assert set(fast(batch, [1])) == {1}
    assert set(fast(batch)) == {3}  # default: the last layer


def test_token_dropout_rescaling_follows_masks_per_sequence(net):
    """Rows with <mask> tokens get ESM-2's per-sequence rescaling, the others not."""
    alpha = alphabet()
    fast = FastEsm.from_hf(net)
    tokens, mask = encode(SEQS[:3])
    tokens[0, 3] = tokens[0, 7] = alpha.mask_idx  # two masks in the first row only
    rows = [t[m.bool()].tolist() for t, m in zip(tokens, mask)]
    lengths = [len(r) for r in rows]
    cu = torch.tensor([0] + lengths).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lengths])
    batch = PackedBatch.from_arrays(torch.tensor([t for r in rows for t in r]), positions, cu)
    got = unpad(fast(batch, [0, 3])[3], batch)
    with torch.inference_mode():
        ref = net.esm(input_ids=tokens, attention_mask=mask, output_hidden_states=True).hidden_states[3]
    for row, g in enumerate(got):
        assert torch.allclose(g, ref[row, : len(g)], atol=2e-5, rtol=1e-5), row


def test_pooling_means_residues_and_takes_cls(net):
    fast = FastEsm.from_hf(net)
    out = fast.embed(SEQS, layers=[-1, 0], per_token=True)
    ref = padded_reference(net, SEQS)
    for row, seq in enumerate(SEQS):
        n = len(seq)
        for layer in (0, 3):
            res = ref[layer][row, 1: n + 1]
            assert torch.allclose(out["per_token"][layer][row], res, atol=2e-5)
            assert torch.allclose(out["mean"][layer][row], res.mean(0), atol=2e-5)
            assert torch.allclose(out["bos"][layer][row], ref[layer][row, 0], atol=2e-5)


def test_loads_hf_directories_and_fair_esm_files_alike(stress_dir):
    a = FastEsm.from_pretrained(stress_dir, dtype=torch.float32, device="cpu")
    b = FastEsm.from_pretrained(stress_dir / "model.pt", dtype=torch.float32, device="cpu")
    batch = PackedBatch.from_sequences(SEQS)
    ha, hb = a(batch, [3])[3], b(batch, [3])[3]
    assert torch.allclose(ha, hb, atol=1e-6)
    ref = padded_reference(load_esm(stress_dir), SEQS)[3]
    assert torch.allclose(unpad(ha, batch)[0], ref[0, : len(SEQS[0]) + 2], atol=2e-5)


def test_reference_attention_matches_padded_sdpa():
    lengths = [5, 1, 17, 9]
    q, k, v = (torch.randn(sum(lengths), 3, 16, dtype=torch.float64) for _ in range(3))
    got = varlen_attention_reference(q, k, v, lengths)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        s = torch.einsum("qhd,khd->hqk", q[sl], k[sl]) / 4.0
        want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[sl])
        assert torch.allclose(got[sl], want, atol=1e-12)
        start += n


def test_gaps_are_tokens_unless_stripped(tmp_path, stress_dir):
    path = tmp_path / "aln.fasta"
    write_fasta(path, [("aligned", "MK-TA.YI")])
    assert read_fasta(path)[0][0].sequence == "MK-TA.YI"
    assert read_fasta(path, strip_gaps=True)[0][0].sequence == "MKTAYI"
    for extra, layer_len in (([], 8), (["--strip-gaps"], 6)):
        out = tmp_path / f"o{len(extra)}"
        assert main(["embed", "--model", str(stress_dir), str(path), "-o", str(out), "--include", "per_tok",
                     "--nogpu", "--quiet", *extra]) == 0
        assert torch.load(out / "aligned.pt")["representations"][3].shape[0] == layer_len


def test_empty_fasta_is_called_empty(tmp_path, stress_dir, capsys):
    path = tmp_path / "empty.fasta"
    path.write_text("")
    assert main(["embed", "--model", str(stress_dir), str(path), "-o", str(tmp_path / "o"), "--nogpu"]) == 2
    err = capsys.readouterr().err
    assert "empty file" in err and str(path) in err and "Traceback" not in err


# ---- on the GPU: the flash-attention rule -------------------------------------------------------------
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_kernel_within_twice_the_reference_error(dtype):
    lengths = [1, 200, 3, 77, 513, 64, 1026]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lengths), 20, 64, device="cuda") for _ in range(3))
    ref = varlen_attention_reference(q.double(), k.double(), v.double(), lengths)
    low = [t.to(dtype) for t in (q, k, v)]
    out = torch.full_like(low[0], float("nan"))
    out.copy_(varlen_attention(*low, cu, max(lengths)))
    pt = varlen_attention_reference(*low, lengths)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= 2 * (pt.double() - ref).abs().max()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_forward_within_twice_transformers_low_precision_error(dtype):
    """Per-token and mean embeddings against an fp32 reference: our error ≤ 2× that of transformers'
    own forward in the same dtype, over mixed lengths in one batch (the fused path, as embed runs it)."""
    from esm_turbo.model.sizes import esm2_config
    from transformers import EsmForMaskedLM
    torch.manual_seed(0)
    cfg = esm2_config(layers=6, hidden=320, heads=20)
    cfg._attn_implementation = "sdpa"
    net32 = EsmForMaskedLM(cfg).cuda().eval()
    seqs = SEQS[:4] + ["MADEEKLPPGWEKRMSRSSGRVYYFNHITNASQWERPSG" * 12]
    ref = padded_reference(net32, seqs, device="cuda")
    low = EsmForMaskedLM(cfg).cuda().eval()
    low.load_state_dict(net32.state_dict())
    low = low.to(dtype)
    theirs = padded_reference(low, seqs, device="cuda")
    fast = FastEsm.from_hf(low)
    batch = PackedBatch.from_sequences(seqs, "cuda")
    ours = fast(batch, [6])[6]
    mean_ours, _ = fast.pool(ours, batch)
    err_tok = err_tok_pt = err_mean = err_mean_pt = 0.0
    for row, got in enumerate(unpad(ours, batch)):
        n = len(got)
        want = ref[6][row, :n]
        err_tok = max(err_tok, (got - want).abs().max().item())
        err_tok_pt = max(err_tok_pt, (theirs[6][row, :n] - want).abs().max().item())
        err_mean = max(err_mean, (mean_ours[row].cpu() - want[1:-1].mean(0)).abs().max().item())
        err_mean_pt = max(err_mean_pt, (theirs[6][row, 1: n - 1].mean(0) - want[1:-1].mean(0)).abs().max().item())
    assert err_tok <= 2 * err_tok_pt, (err_tok, err_tok_pt)
    assert err_mean <= 2 * err_mean_pt, (err_mean, err_mean_pt)


def test_embed_without_contacts_takes_the_packed_path_and_matches(stress_dir, tmp_path):
    from esm_turbo.embed.extract import EmbedConfig, Embedder
    from esm_turbo.embed.writers import safe_name
    path = tmp_path / "in.fasta"
    write_fasta(path, [(f"s{i}", s) for i, s in enumerate(SEQS)])
    net = load_esm(stress_dir)
    assert Embedder(net, EmbedConfig(include=["mean"]), "cpu").fast is not None
    assert Embedder(net, EmbedConfig(include=["contacts"]), "cpu").fast is None
    out = tmp_path / "pt"
    assert main(["embed", "--model", str(stress_dir), str(path), "-o", str(out), "--repr-layers", "0", "2", "-1",
                 "--include", "mean", "per_tok", "bos", "logits", "--toks-per-batch", "64", "--nogpu", "--quiet"]) == 0
    ref = padded_reference(net, SEQS)
    with torch.inference_mode():
        tokens, mask = encode(SEQS)
        logits = net(input_ids=tokens, attention_mask=mask).logits
    for i, seq in enumerate(SEQS):
        item = torch.load(out / f"{safe_name(f's{i}')}.pt")
        n = len(seq)
        for layer in (0, 2, 3):
            res = ref[layer][i, 1: n + 1]
            assert torch.allclose(item["representations"][layer], res, atol=2e-5)
            assert torch.allclose(item["mean_representations"][layer], res.mean(0), atol=2e-5)
            assert torch.allclose(item["bos_representations"][layer], ref[layer][i, 0], atol=2e-5)
        assert torch.allclose(item["logits"], logits[i, 1: n + 1], atol=1e-4)


@needs_cuda
@pytest.mark.gpu
def test_graph_replays_match_the_plain_forward_for_new_inputs():
    """One captured graph serves successive batches of the same shape class with their own inputs."""
    from esm_turbo.model.sizes import esm2_config
    from transformers import EsmForMaskedLM
    torch.manual_seed(0)
    cfg = esm2_config(layers=4, hidden=320, heads=20)
    net = EsmForMaskedLM(cfg).cuda().half().eval()
    fast = FastEsm.from_hf(net)
    fast.attention_kernel = "flash"  # what a captured graph runs (its batch has no host-side plan)
    batches = [["MKTAYIAKQRQISFVKSHFSRQ", "GSHMLEDPVDAFQ"], ["MKV", "ACDEFGHIKLMNPQRSTVWY" * 3],
               ["W" * 40, "MADEEKLPPGWEKRMS"]]
    for seqs in batches:
        graphed = fast.embed(seqs, layers=[-1, 2], per_token=True)
        fast.cuda_graphs = False
        plain = fast.embed(seqs, layers=[-1, 2], per_token=True)
        fast.cuda_graphs = True
        for layer in (2, 4):
            assert torch.allclose(graphed["mean"][layer], plain["mean"][layer], atol=2e-3, rtol=2e-3)
            assert torch.allclose(graphed["bos"][layer], plain["bos"][layer], atol=2e-3, rtol=2e-3)
            for g, p in zip(graphed["per_token"][layer], plain["per_token"][layer]):
                assert g.shape == p.shape and torch.allclose(g, p, atol=2e-3, rtol=2e-3)
    assert len(fast._graphs) == 2  # 64- and 128-token buckets of two sequences, reused


def test_padded_path_matches_the_reference():
    from esm_turbo.embed.varlen import padded_layout, varlen_attention_padded
    lengths = [5, 1, 17, 9]
    q, k, v = (torch.randn(sum(lengths), 3, 16, dtype=torch.float64) for _ in range(3))
    batch = PackedBatch.from_arrays(torch.zeros(sum(lengths), dtype=torch.long),
                                    torch.cat([torch.arange(n) for n in lengths]),
                                    torch.tensor([0] + lengths).cumsum(0))
    got = varlen_attention_padded(q, k, v, padded_layout(batch.positions, batch.segment(), lengths))
    assert torch.allclose(got, varlen_attention_reference(q, k, v, lengths), atol=1e-12)



def _needs_triton():
    from esm_turbo.kernels import triton_supported
    if not triton_supported():
        pytest.skip("needs Triton (the kernels run under its interpreter on CPU)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [64, 320, 1280])
def test_add_layer_norm_kernel_matches_the_reference(dtype, width):
    _needs_triton()
    from esm_turbo.kernels.norm import add_layer_norm_reference, add_layer_norm_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(width)
    h, y = (torch.randn(37, width, generator=gen).mul(3).to(dev, dtype) for _ in range(2))
    w, b = torch.randn(width, generator=gen).to(dev, dtype), torch.randn(width, generator=gen).to(dev, dtype)
    for extra in (y, None):
        s, x = add_layer_norm_triton(h, extra, w, b, 1e-5)
        s_ref, x_ref = add_layer_norm_reference(h, extra, w, b, 1e-5)
        assert torch.equal(s, s_ref)  # the add rounds as the reference's does
        # flash-attention rule: within twice the reference's own error against float64 (and a few ulps of the
        # result, where that error is a rounding's)
        _, x64 = add_layer_norm_reference(s.double(), None, w.double(), b.double(), 1e-5)
        own = (x_ref.double() - x64).abs().max().item()
        ulps = 4 * torch.finfo(dtype).eps * x64.abs().max().item()
        assert (x.double() - x64).abs().max().item() <= 2 * own + ulps, (own, (x.double() - x64).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_rope_kernel_is_the_reference_bit_for_bit(dtype):
    _needs_triton()
    from esm_turbo.embed.fast_esm import attention_inputs
    from esm_turbo.kernels.rope import rope_packed_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    heads, dim, n = 5, 80, 29
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(n, dim, generator=gen).to(dev, dtype)
    w = (torch.randn(3 * dim, dim, generator=gen) / dim ** 0.5).to(dev, dtype)
    bias = torch.randn(3 * dim, generator=gen).to(dev, dtype)
    pos = torch.cat([torch.arange(11), torch.arange(18)]).to(dev)
    inv = 1.0 / (10000 ** (torch.arange(0, dim // heads, 2).float() / (dim // heads)))
    freqs = pos.float()[:, None] * inv.to(dev)[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    ones, zeros = torch.ones(dim, device=dev, dtype=dtype), torch.zeros(dim, device=dev, dtype=dtype)
    q_ref, k_ref, v_ref = attention_inputs(h, ones, zeros, w, bias, cos, sin, heads, 1e-5)
    qkv = torch.nn.functional.linear(torch.nn.functional.layer_norm(h, (dim,), ones, zeros, 1e-5), w, bias)
    q, k = rope_packed_triton(qkv, cos, sin, heads)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "swiglu"])
def test_activation_kernel_matches_the_reference(dtype, kind):
    """One launch (column blocks of 1,024: 2,500 spans three) against the reference: equal in float32 up to the
    transcendental functions' last bit; in bf16 (the reference rounds after every op, the kernel once or twice) no
    further from the float64 value than the reference is."""
    _needs_triton()
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("Triton's interpreter rounds float32 to bf16 by truncation")
    from esm_turbo.embed.fast_esm import activation
    from esm_turbo.kernels.activation import activation_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    u = (3 * torch.randn(19, 2 * 2500)).to(dev, dtype)
    got, want = activation_triton(u, kind).float(), activation(u, kind).float()
    assert got.shape == want.shape
    if dtype == torch.float32:
        assert ((got - want).abs() <= 2 ** -21 * want.abs() + 1e-6).all()
    else:
        truth = activation(u.double(), kind)
        assert (got - truth).abs().max() <= (want - truth).abs().max()


def test_layer_norm_runs_in_place_on_a_column_slice():
    """ESM C's query and key LayerNorms: in place on slices of the fused projection's output, the rest untouched."""
    _needs_triton()
    from esm_turbo.kernels.norm import layer_norm_columns_
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    qkv = torch.randn(23, 3 * 96, device=dev)
    w = 1 + 0.3 * torch.randn(96, device=dev)
    before = qkv.clone()
    layer_norm_columns_(qkv[:, 96:192], w, 1e-5)
    want = torch.nn.functional.layer_norm(before[:, 96:192], (96,), w, None, 1e-5)
    assert torch.allclose(qkv[:, 96:192], want, atol=1e-5)
    assert torch.equal(qkv[:, :96], before[:, :96]) and torch.equal(qkv[:, 192:], before[:, 192:])


def test_fused_forward_matches_the_reference_path(net):
    """The nine-launch block (kernels under Triton's interpreter on CPU) gives the reference path's hidden states,
    every layer, and the layer-0 and intermediate outputs are the residual stream, the last one normalised."""
    _needs_triton()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = FastEsm.from_hf(net.to(dev), fused=False)
    fused = FastEsm.from_hf(net.to(dev), fused=True)
    batch = PackedBatch.from_sequences(SEQS, dev)
    a, b = ref(batch, [0, 1, 2, 3]), fused(batch, [0, 1, 2, 3])
    for layer in range(4):
        assert torch.allclose(a[layer], b[layer], atol=2e-5, rtol=1e-5), (layer, (a[layer] - b[layer]).abs().max())
    only = fused(batch, [2])
    assert list(only) == [2] and torch.equal(only[2], b[2])


def test_gelu_tanh_computes_the_tanh_approximation_on_both_paths(net, monkeypatch):
    """FastEsm.gelu = "tanh": transformers' EsmModel with its GELU swapped for F.gelu(approximate="tanh") is what the
    reference path returns, and the fused path with every product folded (GELU's tanh form in FFN-up's epilogue;
    kernels under Triton's interpreter on CPU) returns the same; erf GELU's states differ from both, a little."""
    _needs_triton()
    import transformers.models.esm.modeling_esm as modeling_esm
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    batch = PackedBatch.from_sequences(SEQS, dev)
    erf = FastEsm.from_hf(net.to(dev), fused=False)(batch, [3])[3]
    ref, fused = FastEsm.from_hf(net.to(dev), fused=False), FastEsm.from_hf(net.to(dev), fused=True)
    assert ref.gelu == "erf"
    ref.gelu = fused.gelu = "tanh"
    fused.fused_products = True
    a, b = ref(batch, [3])[3], fused(batch, [3])[3]
    assert torch.allclose(a, b, atol=2e-5, rtol=1e-5), (a - b).abs().max()
    gap = (a - erf).abs().max().item()
    assert 1e-6 < gap < 0.05 * erf.abs().max().item()
    ref.gelu = "erf"
    assert torch.equal(ref(batch, [3])[3], erf)
    monkeypatch.setattr(modeling_esm, "gelu", lambda x: torch.nn.functional.gelu(x, approximate="tanh"))
    want = padded_reference(net, SEQS, device=dev)[3]
    for row, got in enumerate(unpad(a, batch)):
        assert torch.allclose(got, want[row, : len(got)], atol=2e-5, rtol=1e-5), row
    with pytest.raises(ValueError, match="gelu 'sigmoid': one of"):
        ref.gelu = "sigmoid"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp16", "bf16", "fp8", "esmc"])
def test_replayed_blocks_give_the_eager_forward_bit_for_bit(kind):
    """Blocks 2 … L − 1 replayed from one captured block, each layer's tensors copied in, give every layer's hidden
    states exactly as running every block eagerly does (ESM-2 in fp16 and bf16, FP8 weights on a GPU with FP8, and
    ESM C), batch after batch of other shapes."""
    from esm_turbo.embed.fp8 import fp8_supported
    from esm_turbo.testing import stress_esmc
    if kind == "fp8" and not fp8_supported(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if kind in ("bf16", "fp8") else torch.float16
    net = (stress_esmc(layers=5, hidden=128, heads=2) if kind == "esmc" else stress_esm2(layers=6, hidden=320,
                                                                                         heads=20))
    fast = FastEsm.from_hf(net.cuda().to(dtype).eval())
    if kind == "fp8":
        fast.to_fp8()
    layers = list(range(fast.num_layers + 1))
    for seqs in (SEQS, SEQS[:2] * 7, ["W" * 300, "MKV"]):
        batch = PackedBatch.from_sequences(seqs, "cuda")
        fast.block_graphs = False
        eager = fast(batch, layers)
        fast.block_graphs = True
        replayed = fast(batch, layers)
        for layer in layers:
            assert torch.equal(eager[layer], replayed[layer]), (kind, layer)
        assert fast._replayed_blocks(replayed[1], fast.num_layers, fast.fp8_forms(replayed[1].device)) > 2
        assert len(fast._packed) == fast.num_layers - 1 and not fast._packed.stale  # one contiguous copy a replay
    # a block's weights moved after packing (a new tensor, other values): the replay copies leaf by leaf and reads
    # the new values, then the blocks are packed again
    b = fast.blocks[3]
    if b.fp8 is None:
        b.fc2.weight.data = b.fc2.weight.data * 0.5
    else:
        b.fp8[3].scale.data = b.fp8[3].scale.data * 0.5
    batch = PackedBatch.from_sequences(SEQS, "cuda")
    fast.block_graphs = False
    eager = fast(batch, layers)
    fast.block_graphs = True
    moved = fast(batch, layers)
    assert fast._packed.stale
    for layer in layers:
        assert torch.equal(eager[layer], moved[layer]), (kind, layer)
    again = fast(batch, layers)
    assert not fast._packed.stale and torch.equal(again[fast.num_layers], eager[fast.num_layers])
    # to_dtype (as to_fp8 ends) after replays drops the captured graphs and their pool; the next forward captures anew
    fast.to_dtype(dtype)
    fast.block_graphs = False
    eager = fast(batch, layers)
    fast.block_graphs = True
    assert torch.equal(fast(batch, layers)[fast.num_layers], eager[fast.num_layers])


def test_blocks_replay_by_default_only_where_it_measured_faster():
    from esm_turbo.embed.fast_esm import replay_pays
    assert replay_pays(16384, 640, 28)  # 150M-shaped, 16K tokens
    assert replay_pays(4096, 1280, 31)  # 650M-shaped, a short batch
    assert not replay_pays(16384, 1280, 31)  # 650M-shaped, 16K tokens: bound by the GPU
    assert not replay_pays(16384, 320, 4)  # 8M: too few blocks to pay for the capture
    fast = FastEsm.from_hf(stress_esm2(layers=12, hidden=64, heads=4))
    assert fast._replayed_blocks(torch.zeros(8, 64), 12, [False] * 13) == 2  # off CUDA: none


def test_packed_blocks_hold_each_block_in_one_flat_buffer_and_notice_moved_weights():
    """PackedBlocks makes every leaf of blocks 2 … L a view of its block's flat buffer (at aligned offsets, the same
    layout in every block), leaves the forward's numbers as they were, and gives no buffer for a block whose leaves
    were moved afterwards."""
    from esm_turbo.embed.block_replay import FLAT_ALIGN, PackedBlocks, flat_layout
    torch.manual_seed(0)
    fast = FastEsm.from_hf(stress_esm2(layers=4, hidden=64, heads=4).eval())
    batch = PackedBatch.from_sequences(SEQS)
    before = fast(batch, [4])[4]
    with torch.inference_mode():
        packed = PackedBlocks(fast, batch.tokens.shape[0])
    assert len(packed) == 3 and not packed.stale
    layouts = set()
    for i in (2, 3, 4):
        leaves = fast.block_tensors(i, 1).leaves()
        flat = packed.flat(i, leaves)
        offsets, total = flat_layout(leaves)
        layouts.add((tuple(offsets), total))
        assert flat is not None and flat.numel() == total and all(o % FLAT_ALIGN == 0 for o in offsets)
        assert all(t.data_ptr() == flat.data_ptr() + o for t, o in zip(leaves, offsets))
    assert len(layouts) == 1
    assert not fast.blocks[2].qkv.weight.is_inference()  # still an ordinary parameter
    assert torch.equal(fast(batch, [4])[4], before)
    fast.blocks[2].out.weight.data = fast.blocks[2].out.weight.data.clone()
    assert packed.flat(3, fast.block_tensors(3, 1).leaves()) is None and packed.stale
    assert packed.flat(4, fast.block_tensors(4, 1).leaves()) is not None


def test_a_captured_block_stands_only_for_blocks_of_its_input_form():
    """A captured block writes its output over its input: the run it replays holds blocks whose products and whose
    next block's take block 2's form (FP8 rows or not), so blocks kept out of FP8 end it or rule it out."""
    from esm_turbo.embed.fast_esm import replayed_run

    def forms(layers: int, kept: tuple[int, ...]) -> list[bool]:
        return [i not in {k % layers for k in kept} for i in range(layers)] + [False]
    assert replayed_run(forms(6, ()), 6) == 6  # blocks 2 … 5 replayed, the last eager
    assert replayed_run([False] * 7, 6) == 6
    assert replayed_run(forms(6, (0,)), 6) == 6  # block 1 in bf16 runs eagerly before the capture anyway
    assert replayed_run(forms(6, (-1,)), 6) == 5  # block 5's next (6) is in bf16: 2 … 4
    assert replayed_run(forms(6, (3,)), 6) == 3  # block 4 in bf16: only block 2 takes block 2's forms
    assert replayed_run(forms(3, (0, -1)), 3) == 2  # block 2 in FP8 before a bf16 block: none
    assert replayed_run(forms(6, (1,)), 6) == 2  # block 2 in bf16 before FP8 ones: none
