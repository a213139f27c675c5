"""Reading ESM-2 straight from a transformers folder: the same model as transformers builds, every tensor checked."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from esm_turbo import FastEsm, ModelLoadError
from esm_turbo.cli import main
from esm_turbo.embed.fast_esm import PackedBatch
from esm_turbo.fasta import write_fasta
from esm_turbo.model.alphabet import ESM2_TOKENS, alphabet
from esm_turbo.model.folder import direct_folder, load_tensors, read_config
from esm_turbo.model.loading import load_esm

SEQS = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "MKV", "GSHMLEDPVDAFQ" * 5, "A", "ACDEFGHIKLMNPQRSTVWYX-B.U"]


def test_the_alphabet_is_fair_esms():
    esm = pytest.importorskip("esm")
    ref = esm.data.Alphabet.from_architecture("ESM-1b")
    ours = alphabet()
    assert tuple(ref.all_toks) == ESM2_TOKENS
    for name in ("padding_idx", "cls_idx", "eos_idx", "mask_idx", "unk_idx"):
        assert getattr(ours, name) == getattr(ref, name), name
    for text in ("MK<mask>AX<cls>", " M K ", "<mask><mask>L-.", "ACDEFGHIKLMNPQRSTVWYXBUZO"):
        assert ours.encode(text) == ref.encode(text), text
    assert ours.get_idx("J") == ref.get_idx("J")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_straight_from_the_folder_equals_transformers_loading(stress_dir, dtype):
    """Every layer's hidden states and the logits bit for bit, whichever way the folder was read."""
    assert direct_folder(stress_dir) == stress_dir
    direct = FastEsm.from_pretrained(stress_dir, dtype=dtype, device="cpu")
    via_hf = FastEsm.from_hf(load_esm(stress_dir, dtype=dtype))
    batch = PackedBatch.from_sequences(SEQS)
    layers = list(range(4))
    a, b = direct(batch, layers), via_hf(batch, layers)
    for layer in layers:
        assert torch.equal(a[layer], b[layer]), layer
    assert torch.equal(direct.logits(a[3]), via_hf.logits(b[3]))


def _edited(stress_dir, tmp_path, edit) -> str:
    out = tmp_path / "edited"
    shutil.copytree(stress_dir, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return str(out)


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("esm.encoder.layer.1.attention.self.query.weight"), "layer.1.attention.self.query.weight' is"
                                                                          " missing"),
    (lambda t: t.update({"esm.encoder.layer.9.LayerNorm.weight": torch.ones(64)}), "unexpected tensor"),
    (lambda t: t.update({"esm.encoder.layer.0.output.dense.weight": torch.ones(64, 8)}), "has shape [64, 8]"),
    (lambda t: t["esm.encoder.layer.2.intermediate.dense.bias"].__setitem__(3, float("nan")), "NaN or infinite"),
])
def test_a_broken_folder_is_refused_naming_the_tensor(stress_dir, tmp_path, capsys, edit, needle):
    folder = _edited(stress_dir, tmp_path, edit)
    with pytest.raises(ModelLoadError, match=None) as err:
        load_tensors(folder, heads=True)
    assert needle in str(err.value), str(err.value)
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, [("a", "MKV")])
    assert main(["embed", "--model", folder, str(fasta), "-o", str(tmp_path / "o"), "--nogpu", "--quiet"]) == 2
    line = capsys.readouterr().err.strip().splitlines()
    assert len(line) == 1 and needle in line[0]
    assert not (tmp_path / "o").exists()


def test_names_in_every_spelling_are_read(stress_dir, tmp_path):
    """An EsmModel checkpoint (no ``esm.`` prefix) with LayerNorms as gamma/beta holds the same model."""
    def respell(t):
        for name in list(t):
            new = name[4:] if name.startswith("esm.") else name
            new = new.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
            t[new] = t.pop(name)
    folder = _edited(stress_dir, tmp_path, respell)
    _, a = load_tensors(folder)
    _, b = load_tensors(stress_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_configs_that_are_not_esm2_are_refused(stress_dir, tmp_path):
    import json
    folder = tmp_path / "bert"
    shutil.copytree(stress_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, model_type="bert")))
    with pytest.raises(ModelLoadError, match="model_type 'bert' is neither ESM-2"):
        read_config(folder)
    (folder / "config.json").write_text(json.dumps(dict(cfg, position_embedding_type="absolute")))
    with pytest.raises(ModelLoadError, match="rotary"):
        read_config(folder)
