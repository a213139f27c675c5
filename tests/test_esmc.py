"""ESM C through loading, FastEsm and ``esm-turbo embed``: the same hidden states and logits as transformers'
``EsmcModel`` / ``EsmcForMaskedLM``."""

import copy
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
from esm_turbo.testing import flash_rule, save_stress_esmc, stress_esmc

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


def _folder_matches_transformers(folder):
    """FastEsm read straight from ``folder`` against transformers' net loaded from it: the last layer and the logits.
    Returns the net."""
    net = load_esm(folder)
    fast = FastEsm.from_pretrained(folder, dtype=torch.float32, device="cpu")
    batch = PackedBatch.from_sequences(SEQS)
    last = fast.num_layers
    hidden = fast(batch, [last])[last]
    ref, logits = reference(net, SEQS)
    assert _worst(hidden, batch, ref[last]) < 3e-5
    assert _worst(fast.logits(hidden), batch, logits) < 1e-4
    return net


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
    dev = "cuda" if fused and torch.cuda.is_available() else "cpu"
    ref, _ = reference(net, SEQS)
    fast = FastEsm.from_hf(stress_esmc(layers=3, hidden=128, heads=2, seed=2).to(dev), fused=fused)
    assert fast.family is ESMC and fast.branch_scale == pytest.approx((3 / 36) ** 0.5)
    batch = PackedBatch.from_sequences(SEQS, dev)
    hidden = fast(batch, [0, 1, 2, 3])
    for layer in range(4):
        assert _worst(hidden[layer], batch, ref[layer]) < 3e-5, layer


def test_folder_reads_straight_into_fast_esm_with_logits(esmc_dir):
    """The direct safetensors path (no transformers module) gives transformers' hidden states and logits, and the
    folder's fingerprint equals the loaded net's."""
    net = _folder_matches_transformers(esmc_dir)
    assert type(net).__name__ == "EsmcForMaskedLM" and family_of(net.config) is ESMC
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


def _refused_embed(esmc_dir, tmp_path, capsys, *flags: str) -> str:
    """``esm-turbo embed`` of the ESM C folder with ``flags``: its one-line error, after checking that it failed and
    wrote nothing."""
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, [("a", "MKV")])
    code = main(["embed", "--model", str(esmc_dir), str(fasta), "-o", str(tmp_path / "o"), *flags, "--nogpu",
                 "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()
    return err


def test_contacts_are_refused_in_one_line(esmc_dir, tmp_path, capsys):
    err = _refused_embed(esmc_dir, tmp_path, capsys, "--include", "contacts")
    assert "contact" in err and "ESM C" in err


def test_gelu_tanh_is_refused_for_esmc_in_one_line(esmc_dir, tmp_path, capsys):
    """ESM C's feed-forward is SwiGLU: ``--gelu tanh`` (GELU's tanh form) has nothing to change, and says so."""
    err = _refused_embed(esmc_dir, tmp_path, capsys, "--gelu", "tanh")
    assert "--gelu tanh" in err and "SwiGLU" in err
    fast = FastEsm.from_hf(stress_esmc(layers=1, hidden=128, heads=2, seed=2))
    assert fast.gelu is None
    with pytest.raises(ValueError, match="SwiGLU"):
        fast.gelu = "tanh"


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
    assert net.lm_head.dense.weight.dtype == torch.float32  # the net keeps its own LM head
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
    _folder_matches_transformers(Path(__file__).resolve().parents[1] / "testbeds" / "esmc_d64_trained")


def test_quantize_weights_takes_every_esmc_linear(esmc_dir, tmp_path):
    """``esm-turbo quantize-weights`` on ESM C: q, k, v, o, gate, up and down in 4 bits (q/k/v and gate/up sharing
    launches), the folder loads as an EsmcForMaskedLM, and FastEsm on it computes what transformers does."""
    from esm_turbo.weights.linear import QuantizedLinear
    out = tmp_path / "q4"
    assert main(["quantize-weights", "--model", str(esmc_dir), "--out", str(out), "--quiet"]) == 0
    net = load_esm(out)
    assert type(net).__name__ == "EsmcForMaskedLM" and len(net.weight_quant["quantized"]) == 2 * 7
    layer = net.esmc.layers[0]
    linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
               layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    assert all(isinstance(m, QuantizedLinear) for m in linears)
    assert layer.mlp.gate_proj.shared is layer.mlp.up_proj.shared is not None
    batch = PackedBatch.from_sequences(SEQS)
    ref, _ = reference(net, SEQS)
    assert _worst(FastEsm.from_hf(net)(batch, [2])[2], batch, ref[2]) < 3e-5
    fp32, _ = reference(load_esm(esmc_dir), SEQS)
    cos = torch.nn.functional.cosine_similarity(ref[2][0, 1:34], fp32[2][0, 1:34], dim=-1)
    assert cos.mean() > 0.8  # a random stand-in; the trained testbed's figures are in results/weights


@pytest.fixture(scope="module")
def turbo_net():
    """A stand-in of its own: the KV cache's attention hook is installed in place."""
    return stress_esmc(layers=3, hidden=128, heads=2, seed=4)


@pytest.fixture(scope="module")
def esmc_calibration(turbo_net):
    from esm_turbo import calibrate, read_fasta
    return calibrate(turbo_net, read_fasta("calibration_data/calibration.fasta")[0][:16], progress=False)


@pytest.mark.parametrize("cache", ["turbo", "fp32"])
def test_prefill_is_exact(turbo_net, esmc_calibration, cache):
    """The session's prefill gives transformers' logits and last states bit for bit in fp32 (the query and key
    LayerNorms before RoPE, ESM C's own rotary and attention ops); the hook leaves a plain forward unchanged."""
    from esm_turbo import TurboEsm
    engine = TurboEsm(turbo_net, esmc_calibration)
    tok, mask = encode(SEQS, add_eos=False)
    with torch.no_grad(), engine.original():
        ref = turbo_net(input_ids=tok, attention_mask=mask, output_hidden_states=True)
    with torch.no_grad():
        hooked = turbo_net(input_ids=tok, attention_mask=mask).logits
    out = engine.session(cache).start(SEQS)
    valid = mask.bool()
    assert (out.logits - ref.logits)[valid].abs().max() == 0
    assert (out.hidden - ref.hidden_states[-1])[valid].abs().max() == 0
    assert torch.equal(hooked, ref.logits)


def test_decode_session_on_the_compressed_cache(turbo_net, esmc_calibration):
    """Steps, a peek, fork and rollback on the 4-bit cache: close to the FP32 cache's states, and a rolled-back step
    taken again gives the same output."""
    from esm_turbo import TurboEsm
    engine = TurboEsm(turbo_net, esmc_calibration)
    sessions = {kind: engine.session(kind) for kind in ("turbo", "fp32")}
    outs = {}
    for kind, session in sessions.items():
        session.start(SEQS[:2])
        session.fork(2)
        for residue in "MKVL":
            outs[kind] = session.step([residue] * 4)
    cos = torch.nn.functional.cosine_similarity(outs["turbo"].hidden, outs["fp32"].hidden, dim=-1)
    assert cos.min() > 0.95 and cos.mean() > 0.97  # a random stand-in; the trained testbed holds far more
    session = sessions["turbo"]
    peek = session.step(["<mask>"] * 4, commit=False)
    assert torch.equal(session.lengths, torch.tensor([len(SEQS[0]) + 5] * 2 + [len(SEQS[1]) + 5] * 2))
    session.rollback(1)
    again = session.step(["L"] * 4)
    assert torch.allclose(again.hidden, outs["turbo"].hidden, atol=1e-5) and peek.logits.shape == (4, 1, 64)
    assert session.memory_report() is not None


def test_calibrate_and_evaluate_commands_take_esmc(esmc_dir, tmp_path):
    """``esm-turbo calibrate`` and ``evaluate`` on an ESM C folder, end to end."""
    head = tmp_path / "cal.fasta"
    lines = open("calibration_data/calibration.fasta").read().split(">")[1:13]
    head.write_text("".join(">" + rec for rec in lines))
    ckpt = tmp_path / "esmc.turbo.safetensors"
    assert main(["calibrate", "--model", str(esmc_dir), "--fasta", str(head), "--out", str(ckpt), "--quiet"]) == 0
    report = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(esmc_dir), "--calibration", str(ckpt), "--fasta",
                 "calibration_data/evaluation.fasta", "--limit", "2", "--max-steps", "6", "--json", str(report),
                 "--quiet"]) == 0
    overall = json.loads(report.read_text())["turbo"]["overall"]
    assert overall["prefill_max_abs_diff"] == 0 and overall["decode_tokens"] == 12
    assert 0.95 < overall["decode_cos_mean"] <= 1.0


def test_paged_session_steps_as_the_contiguous_one(turbo_net, esmc_calibration):
    """Shared-prefix forks on the paged cache step to the contiguous cache's states."""
    from esm_turbo import TurboEsm
    engine = TurboEsm(turbo_net, esmc_calibration)
    outs = []
    for paged in (False, True):
        session = engine.session("turbo", paged=paged, block_size=16)
        session.start(SEQS[:1])
        session.fork(3)
        for residue in "MKV":
            out = session.step([residue] * 3)
        outs.append(out.hidden)
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_the_esm_c_package_weight_file_loads_converted(net, tmp_path):
    """A state dict in the original ESM C package's layout (``.pth``) loads as transformers' EsmcForMaskedLM and
    computes what the net it was made from computes; a file of neither layout is refused in one line."""
    from esm_turbo.testing import to_esmc_original
    path = tmp_path / "esmc_300m_2024_12_v0.pth"
    torch.save(to_esmc_original(net), path)
    loaded = load_esm(path)
    assert type(loaded).__name__ == "EsmcForMaskedLM" and loaded.config.num_hidden_layers == 3
    assert loaded.config.num_attention_heads == 2 and loaded.config.intermediate_size == net.config.intermediate_size
    want, want_logits = reference(net, SEQS)
    got, got_logits = reference(loaded, SEQS)
    assert torch.equal(got[-1], want[-1]) and torch.equal(got_logits, want_logits)
    bad = tmp_path / "other.pth"
    torch.save({"embed.weight": torch.zeros(64, 128), "transformer.blocks.0.attn.mystery": torch.zeros(1)}, bad)
    with pytest.raises(ModelLoadError, match="unexpected tensor 'transformer.blocks.0.attn.mystery'"):
        load_esm(bad)


@needs_cuda
@pytest.mark.gpu
@torch.no_grad()
def test_decode_step_replays_as_a_cuda_graph_on_the_4bit_cache(esmc_calibration):
    """The CUDA-graph step of an ESM C session (fused RoPE and decode kernels over the compressed cache) gives the
    eager step's logits; committed replays advance the cache."""
    from esm_turbo import TurboEsm
    model = stress_esmc(layers=3, hidden=128, heads=2, seed=4).cuda()
    session = TurboEsm(model, esmc_calibration).session("turbo", capacity=128)
    session.start(SEQS[:2])
    tokens = torch.full((2, 1), 32, device="cuda")
    eager = session.step(tokens, commit=False).logits
    assert torch.allclose(session.capture_step(tokens).replay().logits, eager, atol=1e-4)
    before = session.lengths.clone()
    committed = session.capture_step(tokens, commit=True, reserve=4)
    for _ in range(3):
        committed.replay()
    assert torch.equal(session.lengths, before + 3)


@needs_cuda
@pytest.mark.gpu
@torch.no_grad()
def test_a_4bit_esmc_step_on_the_fused_kernels_is_the_pytorch_path(monkeypatch):
    """A 4-bit ESM C on CUDA (q/k/v and gate/up each in one launch): a decode step's logits are the PyTorch path's,
    and FastEsm on it embeds as transformers' forward of the same quantized net."""
    import esm_turbo.weights.fusion as fusion
    import esm_turbo.weights.linear as linear
    from esm_turbo import TurboEsm, ops
    from esm_turbo.weights import WeightQuantConfig, quantize_model
    model = quantize_model(stress_esmc(layers=2, hidden=128, heads=2, seed=0), WeightQuantConfig(bits=4, group=32),
                           source="stress").cuda()
    model32 = copy.deepcopy(model)
    model.half()
    tokens = torch.full((4, 1), 5, device="cuda")

    def step(net=model, cache="fp16"):
        s = TurboEsm(net).session(cache, capacity=64)
        s.start(SEQS[:2])
        s.fork(2)
        return s.step(tokens, commit=False).logits

    fused = step()
    for module in (linear, fusion, ops):
        monkeypatch.setattr(module, "use_kernels", lambda _: False)
    # against fp32, beside PyTorch in fp16; a chained step as in test_weights.CHAINED
    err, err_pt, bound = flash_rule(fused, step(model32, "fp32"), step(), times=4.0)
    assert err <= bound, (err, err_pt)


def test_esmc_takes_its_own_longer_context(esmc_dir, stress_dir, tmp_path, capsys):
    """--truncation-seq-length reaches ESM C's 2,046 residues; ESM-2 refuses more than its 1,022 in one line before
    any batch, naming its context."""
    from esm_turbo.embed.writers import safe_name
    fasta = tmp_path / "long.fasta"
    write_fasta(fasta, [("long", "MKTAYIAKQR" * 150)])  # 1,500 residues
    args = [str(fasta), "--truncation-seq-length", "2046", "--include", "mean", "--nogpu", "--quiet"]
    assert main(["embed", "--model", str(esmc_dir), *args, "-o", str(tmp_path / "c")]) == 0
    assert torch.load(tmp_path / "c" / f"{safe_name('long')}.pt")["mean_representations"][2].shape == (128,)
    capsys.readouterr()
    assert main(["embed", "--model", str(stress_dir), *args, "-o", str(tmp_path / "e")]) != 0
    err = capsys.readouterr().err.strip()
    assert "ESM-2's trained context is 1022 residues" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as exit_:  # the flag's own range, at parsing
        main(["embed", "--model", str(esmc_dir), str(fasta), "--truncation-seq-length", "2047", "-o", str(tmp_path)])
    assert exit_.value.code == 2
