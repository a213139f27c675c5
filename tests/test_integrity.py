"""Models are what they claim to be: a weight missing, changed on disk, non-finite or of the wrong shape, edited
metadata, a half-written folder: each refused in one line naming the file and the tensor or field, before any work."""

import json
import shutil
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from esm_turbo.cli import main
from esm_turbo.fasta import write_fasta


@pytest.fixture(scope="module")
def quantized(stress_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "q4"
    assert main(["quantize-weights", "--model", str(stress_dir), "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture
def fasta(tmp_path):
    path = tmp_path / "in.fasta"
    write_fasta(path, [("a", "MKTAYIAKQRQISFVK"), ("b", "GSHMLEDPV")])
    return str(path)


def one_line(capsys, code, *needles) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("esm-turbo: error:"), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


def _copy(src, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


def _rewrite(folder, file, edit, metadata=None):
    """The safetensors file with ``edit`` applied to its tensors (and its metadata replaced when given)."""
    path = folder / file
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata if metadata is not None else meta)


def test_a_transformers_folder_missing_a_weight_or_holding_nan_is_refused(stress_dir, tmp_path, fasta, capsys):
    """Every command that loads through transformers (calibrate here): transformers would fill a missing weight
    with random values; NaN would flow into the calibration."""
    missing = _copy(stress_dir, tmp_path, "missing")
    (missing / "model.pt").unlink()
    _rewrite(missing, "model.safetensors", lambda t: t.pop("esm.encoder.layer.1.attention.self.query.weight"))
    base = ["calibrate", "--fasta", fasta, "--out", str(tmp_path / "c.safetensors"), "--quiet", "--model"]
    one_line(capsys, main(base + [str(missing)]), "layer.1.attention.self.query.weight' is missing")
    nan = _copy(stress_dir, tmp_path, "nan")
    _rewrite(nan, "model.safetensors",
             lambda t: t["esm.encoder.layer.0.intermediate.dense.weight"].__setitem__((0, 0), float("nan")))
    one_line(capsys, main(base + [str(nan)]), "intermediate.dense.weight", "NaN or infinite")
    assert not (tmp_path / "c.safetensors").exists()


def test_a_quantized_folder_changed_on_disk_is_refused(quantized, tmp_path, fasta, capsys):
    damaged = _copy(quantized, tmp_path, "damaged")

    def scribble(t):
        codes = next(k for k in t if k.endswith("codes0"))
        t[codes][:4] = torch.randint(0, 255, t[codes][:4].shape, dtype=t[codes].dtype)
    _rewrite(damaged, "weights.safetensors", scribble)
    line = one_line(capsys, main(["embed", "--model", str(damaged), fasta, "-o", str(tmp_path / "o"), "--nogpu",
                                  "--quiet"]), "content hash differs")
    assert "weights.safetensors" in line and not (tmp_path / "o").exists()


@pytest.mark.parametrize("edit,needle", [
    (lambda meta: "{not json", "is not a JSON object"),
    (lambda meta: json.dumps({k: v for k, v in json.loads(meta).items() if k != "config"}), "missing or unknown field"),
    (lambda meta: json.dumps(dict(json.loads(meta), config=dict(json.loads(meta)["config"], colour=1))),
     "missing or unknown field"),
])
def test_edited_metadata_of_a_quantized_folder_is_one_line(quantized, tmp_path, fasta, capsys, edit, needle):
    folder = _copy(quantized, tmp_path, "edited")
    with safe_open(str(folder / "weights.safetensors"), framework="pt") as fh:
        meta = dict(fh.metadata())
    meta["esm_turbo_weights"] = edit(meta["esm_turbo_weights"])
    _rewrite(folder, "weights.safetensors", lambda t: None, metadata=meta)
    one_line(capsys, main(["embed", "--model", str(folder), fasta, "-o", str(tmp_path / "o"), "--nogpu", "--quiet"]),
             needle)


def test_a_quantized_folder_whose_config_disagrees_is_one_line(quantized, tmp_path, fasta, capsys):
    folder = _copy(quantized, tmp_path, "lying")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, vocab_size=40)))
    one_line(capsys, main(["embed", "--model", str(folder), fasta, "-o", str(tmp_path / "o"), "--nogpu", "--quiet"]),
             "its config.json gives")


def test_a_quantized_folder_is_not_quantized_again(quantized, tmp_path, capsys):
    one_line(capsys, main(["quantize-weights", "--model", str(quantized), "--out", str(tmp_path / "again")]),
             "already quantized")
    assert not (tmp_path / "again").exists()


def test_a_killed_save_leaves_no_half_folder(stress_dir, tmp_path, monkeypatch):
    """The folder appears whole or not at all; the temporary one a killed save left is removed by the next run."""
    import esm_turbo.weights.model as wm
    out = tmp_path / "q"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(wm, "save_file", killed)
    assert main(["quantize-weights", "--model", str(stress_dir), "--out", str(out), "--quiet"]) == 130
    assert not out.exists() and not list(tmp_path.glob(".q.*"))
    (tmp_path / ".q.abc123.tmp").mkdir()  # as a SIGKILL would leave it
    monkeypatch.undo()
    assert main(["quantize-weights", "--model", str(stress_dir), "--out", str(out), "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "weights.safetensors"]
    assert not list(tmp_path.glob(".q.*"))


def test_an_unreachable_hub_fails_at_once(tmp_path, fasta, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    start = time.perf_counter()
    code = main(["calibrate", "--model", "esm-turbo-tests/no-such-model", "--fasta", fasta, "--out",
                 str(tmp_path / "c.safetensors"), "--quiet"])
    assert time.perf_counter() - start < 5
    one_line(capsys, code, "no-such-model", "unreachable", "pass a local path")


def test_a_rerun_removes_what_a_killed_calibration_left(stress_dir, tmp_path, fasta):
    out = tmp_path / "c.safetensors"
    (tmp_path / ".c.safetensors.x1y2.tmp").write_bytes(b"half a checkpoint")  # as SIGKILL mid-write leaves it
    assert main(["calibrate", "--model", str(stress_dir), "--fasta", fasta, "--out", str(out), "--holdout", "0",
                 "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "in.fasta"]
