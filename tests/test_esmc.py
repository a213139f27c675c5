"""ESM C through loading, FastEsm and ``esm-turbo embed``: the same hidden states and logits as transformers'
``EsmcModel`` / ``EsmcForMaskedLM``."""

import json
import shutil

import pytest
import torch

from esm_turbo import FastEsm
from esm_turbo.cli import main
from esm_turbo.embed.fast_esm import PackedBatch
from esm_turbo.embed.h5 import open_embeddings
from esm_turbo.errors import ModelLoadError
from esm_turbo.fasta import write_fasta
from esm_turbo.model.alphabet import encode
from esm_turbo.model.family import ESM2, ESMC, family_of
from esm_turbo.model.folder import load_tensors, read_config
from esm_turbo.model.loading import load_esm, model_fingerprint
from esm_turbo.testing import save_stress_esmc, stress_esmc

pytest.importorskip("transformers.models.esmc", reason="this transformers has no ESM C")

SEQS = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "MKV", "GSHMLEDPVDAFQ" * 5, "A", "ACDEFGHIKLMNPQRSTVWYX-B.U"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference(net, seqs, device="cpu"):
    """transformers' hidden states (list over layers of [B, T, D], float32 on the host) and logits [B, T, 64]."""
    tokens, mask = encode(seqs)
    with torch.inference_mode():
        out = net(input_ids=tokens.to(device), attention_mask=mask.to(device), output_hidden_states=True)
    return [h.float().cpu() for h in out.hidden_states], out.logits.float().cpu()


@pytest.fixture(scope="module")
def net():
    return stress_esmc(layers=3, hidden=128, heads=2, seed=2)


@pytest.fixture(scope="module")
def esmc_dir(tmp_path_factory):
    return save_stress_esmc(tmp_path_factory.mktemp("esmc"), layers=2, hidden=128, heads=2, seed=5)


def _worst(hidden: torch.Tensor, batch: PackedBatch, ref: torch.Tensor) -> float:
    """The largest difference from the padded reference, relative to the reference's largest value (at least 1)."""
    worst = max((got.float().cpu() - ref[row, : len(got)]).abs().max().item()
                for row, got in enumerate(hidden.split(batch.lengths)))
    return worst / max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("fused", [False, True])
def test_hidden_states_match_transformers_on_mixed_lengths(net, fused):
    """Every layer (0 the embeddings, the last after the final norm), both block paths (the fused one's kernels
    under Triton's interpreter on CPU)."""
    if fused:
        from esm_turbo.kernels import triton_supported
        if not triton_supported():
            pytest.skip("needs Triton")
    fast = FastEsm.from_hf(net, fused=fused)
    assert fast.family is ESMC and fast.branch_scale == pytest.approx((3 / 36) ** 0.5)
    batch = PackedBatch.from_sequences(SEQS)
    hidden = fast(batch, [0, 1, 2, 3])
    ref, _ = reference(net, SEQS)
    for layer in range(4):
        assert _worst(hidden[layer], batch, ref[layer]) < 3e-5, layer


def test_folder_reads_straight_into_fast_esm_with_logits(esmc_dir):
    """The direct safetensors path (no transformers module) gives transformers' hidden states and logits, and the
    folder's fingerprint equals the loaded net's."""
    net = load_esm(esmc_dir)
    assert type(net).__name__ == "EsmcForMaskedLM" and family_of(net.config) is ESMC
    fast = FastEsm.from_pretrained(esmc_dir, dtype=torch.float32, device="cpu")
    batch = PackedBatch.from_sequences(SEQS)
    hidden = fast(batch, [2])[2]
    ref, logits = reference(net, SEQS)
    assert _worst(hidden, batch, ref[2]) < 3e-5
    assert _worst(fast.logits(hidden), batch, logits) < 1e-4
    shape, tensors = load_tensors(esmc_dir, dtype=torch.float32)
    assert shape.family == "esmc" and shape.vocab_size == 64 and not shape.token_dropout
    assert read_config(esmc_dir) == shape


def test_embed_command_writes_what_transformers_computes(esmc_dir, tmp_path):
    """``esm-turbo embed`` on an ESM C folder, to .pt files and to HDF5, per-token, mean, <cls> and logits."""
    from esm_turbo.embed.writers import safe_name
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, [(f"s{i}", s) for i, s in enumerate(SEQS)])
    args = ["--model", str(esmc_dir), str(fasta), "--repr-layers", "0", "-1", "--include", "mean", "per_tok", "bos",
            "logits", "--toks-per-batch", "64", "--nogpu", "--quiet"]
    assert main(["embed", *args, "-o", str(tmp_path / "pt")]) == 0
    assert main(["embed", *args, "-o", str(tmp_path / "out.h5")]) == 0
    net = load_esm(esmc_dir)
    ref, logits = reference(net, SEQS)
    with open_embeddings(tmp_path / "out.h5") as emb:
        assert emb.mean(2).shape == (len(SEQS), 128)
        h5_means, h5_order = torch.from_numpy(emb.mean(2)), list(emb.ids)
    for i, seq in enumerate(SEQS):
        item = torch.load(tmp_path / "pt" / f"{safe_name(f's{i}')}.pt")
        n = len(seq)
        for layer in (0, 2):
            res = ref[layer][i, 1: n + 1]
            assert torch.allclose(item["representations"][layer], res, atol=3e-5)
            assert torch.allclose(item["mean_representations"][layer], res.mean(0), atol=3e-5)
            assert torch.allclose(item["bos_representations"][layer], ref[layer][i, 0], atol=3e-5)
        assert item["logits"].shape == (n, 64)
        assert torch.allclose(item["logits"], logits[i, 1: n + 1], atol=1e-4)
        assert torch.allclose(h5_means[h5_order.index(f"s{i}")], ref[2][i, 1: n + 1].mean(0), atol=3e-5)


def test_contacts_are_refused_in_one_line(esmc_dir, tmp_path, capsys):
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, [("a", "MKV")])
    code = main(["embed", "--model", str(esmc_dir), str(fasta), "-o", str(tmp_path / "o"), "--include", "contacts",
                 "--nogpu", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "contact" in err and "ESM C" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field, value", [("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"),
                                          ("num_key_value_heads", 1)])
def test_configs_esmc_does_not_compute_are_refused(esmc_dir, tmp_path, field, value):
    folder = tmp_path / "m"
    shutil.copytree(esmc_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, **{field: value})))
    with pytest.raises(ModelLoadError, match=f"config.json: {field} .* is not what ESM C computes"):
        read_config(folder)
    with pytest.raises(ModelLoadError, match=field):
        load_esm(folder)


def test_a_missing_tensor_is_named(esmc_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "m"
    shutil.copytree(esmc_dir, folder)
    state = load_file(folder / "model.safetensors")
    del state["esmc.layers.1.self_attn.k_norm.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.1.self_attn.k_norm.weight' is missing"):
        load_tensors(folder)
    with pytest.raises(ModelLoadError, match="k_norm.weight' is missing"):
        load_esm(folder)


def test_sizes_and_families():
    from esm_turbo.model.sizes import ESMC_SIZES, esmc_config, resolve_model_id
    for name, (layers, hidden, heads, ffn, hub) in ESMC_SIZES.items():
        cfg = esmc_config(name)
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (layers, hidden, ffn)
        assert hidden // heads == 64 and resolve_model_id(name) == hub
    assert family_of({"model_type": "esm"}) is ESM2 and family_of(esmc_config(layers=1, hidden=64, heads=1)) is ESMC
    with pytest.raises(ModelLoadError, match="neither ESM-2"):
        family_of({"model_type": "bert"})


def test_fingerprints_tell_the_families_apart(net):
    """An ESM C fingerprint names its family; ESM-2's keep the fields they always had."""
    from esm_turbo.model.folder import arch_of
    assert arch_of(net.config)["family"] == "esmc"
    assert len(model_fingerprint(net)) == 64


def test_fp8_reference_runs_esmc(net):
    """FP8 products (the PyTorch reference on CPU) on the stacked gate-up matrix: close to fp32 on every token of a
    random stand-in (trained models keep far more; results/fp8 has the trained testbeds)."""
    fast = FastEsm.from_hf(net)
    batch = PackedBatch.from_sequences(SEQS)
    want = fast(batch, [3])[3]
    got = FastEsm.from_hf(net).to_fp8()(batch, [3])[3].float()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.95 and cos.mean() > 0.98


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_forward_within_twice_transformers_low_precision_error(dtype):
    """Against transformers' EsmcModel in fp32: our fused fp16/bf16 forward's error ≤ 2× transformers' own in the
    same dtype, per token and per mean, over mixed lengths in one batch."""
    torch.manual_seed(0)
    net32 = stress_esmc(layers=6, hidden=512, heads=8, seed=1).cuda()
    seqs = SEQS[:4] + ["MADEEKLPPGWEKRMSRSSGRVYYFNHITNASQWERPSG" * 12]
    ref, _ = reference(net32, seqs, "cuda")
    low = stress_esmc(layers=6, hidden=512, heads=8, seed=1).cuda().to(dtype)
    theirs, _ = reference(low, seqs, "cuda")
    fast = FastEsm.from_hf(low)
    assert fast.uses_kernels()
    batch = PackedBatch.from_sequences(seqs, "cuda")
    ours = fast(batch, [6])[6]
    mean_ours, _ = fast.pool(ours, batch)
    err = err_pt = err_mean = err_mean_pt = 0.0
    for row, got in enumerate(ours.split(batch.lengths)):
        n = len(got)
        want = ref[6][row, :n]
        err = max(err, (got.float().cpu() - want).abs().max().item())
        err_pt = max(err_pt, (theirs[6][row, :n] - want).abs().max().item())
        err_mean = max(err_mean, (mean_ours[row].cpu() - want[1:-1].mean(0)).abs().max().item())
        err_mean_pt = max(err_mean_pt, (theirs[6][row, 1: n - 1].mean(0) - want[1:-1].mean(0)).abs().max().item())
    assert err <= 2 * err_pt, (err, err_pt)
    assert err_mean <= 2 * err_mean_pt, (err_mean, err_mean_pt)


def test_trained_testbed_embeds_as_transformers():
    """The trained ESM C testbed (fp16 on disk, read in fp32): FastEsm's last layer and logits are transformers'."""
    from pathlib import Path
    folder = Path(__file__).resolve().parents[1] / "testbeds" / "esmc_d64_trained"
    net = load_esm(folder)
    fast = FastEsm.from_pretrained(folder, dtype=torch.float32, device="cpu")
    batch = PackedBatch.from_sequences(SEQS)
    hidden = fast(batch, [6])[6]
    ref, logits = reference(net, SEQS)
    assert _worst(hidden, batch, ref[6]) < 3e-5
    assert _worst(fast.logits(hidden), batch, logits) < 1e-4
