"""Wrong invocations end in one line, exit code 2, before any work, with nothing written."""

import json
import os

import pytest
import torch

from esm_turbo.cli import main
from esm_turbo.fasta import write_fasta

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture
def place(tmp_path, stress_dir):
    """A folder with a valid FASTA, a plain file and an existing sub-folder; the stress model's path."""
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, [("a", "MKTAYIAKQRQISFVK"), ("b", "GSHMLEDPV")])
    (tmp_path / "plain.txt").write_text("not hdf5\n")
    (tmp_path / "folder").mkdir()
    return tmp_path, str(fasta), str(stress_dir)


def refused(argv, capsys, tmp_path, *needles):
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's refusals
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("esm-turbo: error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    return lines[0]


@pytest.mark.parametrize("args,needles", [
    (["--bits", "0"], ["--bits", "0"]),
    (["--bits", "9"], ["--bits", "9"]),
    (["--bits", "5"], ["--bits", "5"]),
    (["--head-dim", "3"], ["--head-dim", "3"]),
    (["--head-dim", "20"], ["--head-dim", "20", "multiple of 8"]),
    (["--vectors", "0"], ["--vectors", "0"]),
    (["--vectors", "1"], ["--vectors", "1"]),
    (["--bits", "three"], ["--bits", "three"]),
])
def test_validate_codec_ranges(args, needles, capsys, tmp_path):
    refused(["validate-codec", *args], capsys, tmp_path, *needles)


def test_bad_devices(place, capsys):
    tmp, fasta, model = place
    refused(["embed", "--model", model, fasta, "-o", str(tmp / "o"), "--device", "foo"], capsys, tmp,
            "--device", "'foo'")
    refused(["calibrate", "--model", model, "--fasta", fasta, "--out", str(tmp / "c.safetensors"),
             "--device", "gpu0"], capsys, tmp, "--device", "'gpu0'")


@no_cuda
def test_cuda_without_cuda(place, capsys):
    tmp, fasta, model = place
    refused(["embed", "--model", model, fasta, "-o", str(tmp / "o"), "--device", "cuda"], capsys, tmp,
            "--device", "no CUDA")
    refused(["evaluate", "--model", model, "--fasta", fasta, "--calibration", fasta, "--device", "cuda:0"],
            capsys, tmp, "no CUDA")


def test_calibrate_output_places(place, capsys):
    tmp, fasta, model = place
    base = ["calibrate", "--model", model, "--fasta", fasta, "--quiet", "--out"]
    refused(base + [str(tmp / "folder")], capsys, tmp, "--out", "is a folder")
    refused(base + [str(tmp / "plain.txt" / "c.safetensors")], capsys, tmp, "--out", "is a file, not a folder")
    refused(base + [str(tmp / "c.safetensors"), "--max-channel-bits", "2"], capsys, tmp,
            "--max-channel-bits 2", "below the mean index width 3")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_folder(place, capsys):
    tmp, fasta, model = place
    ro = tmp / "folder"
    ro.chmod(0o500)
    try:
        refused(["calibrate", "--model", model, "--fasta", fasta, "--out", str(ro / "c.safetensors")], capsys, tmp,
                "permission denied")
        refused(["embed", "--model", model, fasta, "-o", str(ro / "emb")], capsys, tmp, "permission denied")
    finally:
        ro.chmod(0o700)


def test_model_path_that_does_not_exist(place, capsys):
    tmp, fasta, _ = place
    for model in ("/no/such/esm2", "./esm2_t6.pt", "my_models/esm2/8M"):
        refused(["calibrate", "--model", model, "--fasta", fasta, "--out", str(tmp / "c.safetensors")], capsys, tmp,
                f"'{model}'", "no such local path")


def test_embed_output_places(place, capsys):
    tmp, fasta, model = place
    base = ["embed", "--model", model, fasta, "--quiet", "--nogpu"]
    refused(base + ["--format", "h5", "-o", str(tmp / "folder")], capsys, tmp, "--output", "is a folder")
    refused(base + ["--format", "h5", "-o", str(tmp / "plain.txt")], capsys, tmp, "not an HDF5 file")
    refused(base + ["--format", "h5", "-o", str(tmp / "plain.txt" / "e.h5")], capsys, tmp, "is a file, not a folder")
    refused(base + ["-o", str(tmp / "plain.txt")], capsys, tmp, "is a file; name a folder")
    refused(base + ["-o", str(tmp / "plain.txt" / "deeper" / "emb")], capsys, tmp, "is a file, not a folder")
    refused(["embed", "--model", model, str(tmp / "missing.fasta"), "-o", str(tmp / "o")], capsys, tmp,
            "missing.fasta", "no such FASTA file")


def test_evaluate_and_bench_outputs(place, capsys):
    tmp, fasta, model = place
    refused(["evaluate", "--model", model, "--fasta", fasta, "--calibration", str(tmp / "none.safetensors")],
            capsys, tmp, "--calibration", "no such calibration checkpoint")
    refused(["evaluate", "--model", model, "--fasta", fasta, "--calibration", fasta, "--json",
             str(tmp / "plain.txt" / "r.json")], capsys, tmp, "--json", "is a file, not a folder")
    refused(["bench", "embed", "--out", str(tmp / "folder")], capsys, tmp, "--out", "is a folder")
    refused(["bench", "embed", "--sizes", "15B"], capsys, tmp, "--sizes 15B", "the embed suite takes")
    if not torch.cuda.is_available():
        refused(["bench", "weights"], capsys, tmp, "bench weights", "needs a CUDA device")


def test_window_overlap(place, capsys):
    tmp, fasta, model = place
    refused(["embed", "--model", model, fasta, "-o", str(tmp / "o"), "--long-policy", "windows",
             "--truncation-seq-length", "8", "--window-overlap", "8"], capsys, tmp, "--window-overlap 8")
    # the default overlap adapts to a short window instead of failing
    assert main(["embed", "--model", model, fasta, "-o", str(tmp / "w"), "--long-policy", "windows",
                 "--truncation-seq-length", "8", "--include", "per_tok", "--nogpu", "--quiet"]) == 0
    assert torch.load(tmp / "w" / "a.pt")["representations"][3].shape[0] == 16


def test_ids_too_long_for_a_file_name_are_shortened_and_resume(place, capsys):
    tmp, _, model = place
    long_id = "sp|" + "Q" * 400
    fasta = tmp / "long.fasta"
    write_fasta(fasta, [(long_id, "MKTAYIAKQR"), ("short", "MKV")])
    out = tmp / "emb"
    args = ["embed", "--model", model, str(fasta), "-o", str(out), "--nogpu", "--quiet"]
    assert main(args) == 0
    (name,) = [p.name for p in out.glob("sp*.pt")]
    assert len(name.encode()) <= 255 and "~" in name
    assert torch.load(out / name)["label"] == long_id
    assert main(args + ["--resume"]) == 0
    assert "written 0, skipped 2" in capsys.readouterr().err


def test_unexpected_errors_keep_their_traceback(monkeypatch, capsys):
    import esm_turbo.quant.validate as validate

    def boom(*a, **k):
        raise RuntimeError("a bug")
    monkeypatch.setattr(validate, "validate_codec", boom)
    assert main(["validate-codec", "--bits", "3", "--head-dim", "64"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug" in err and "please report it" in err


def test_calibrate_widths_out_of_range(place, capsys):
    tmp, fasta, model = place
    base = ["calibrate", "--model", model, "--fasta", fasta, "--out", str(tmp / "c.safetensors")]
    for args in (["--key-index-bits", "0"], ["--value-index-bits", "5"], ["--index-bits", "8"],
                 ["--max-channel-bits", "8"], ["--rotation", "spin"], ["--attention-weight", "2"]):
        refused(base + args, capsys, tmp, args[0], args[1])


def test_a_model_file_that_is_not_a_checkpoint(place, capsys):
    tmp, fasta, _ = place
    line = refused(["embed", "--model", fasta, fasta, "-o", str(tmp / "o"), "--nogpu"], capsys, tmp,
                   "cannot read as a fair-esm checkpoint")
    assert len(line) < 400


def test_repr_layers_refused_before_loading(place, capsys, monkeypatch):
    import esm_turbo.model.loading as loading
    tmp, fasta, model = place
    monkeypatch.setattr(loading, "load_esm", lambda *a, **k: pytest.fail("the model was loaded"))
    refused(["embed", "--model", model, fasta, "-o", str(tmp / "o"), "--repr-layers", "7"], capsys, tmp,
            "--repr-layers 7", "layers 0..3")


def test_bad_calibration_refused_before_the_model_loads(place, capsys, monkeypatch):
    import esm_turbo.model.loading as loading
    tmp, fasta, model = place
    monkeypatch.setattr(loading, "load_esm", lambda *a, **k: pytest.fail("the model was loaded"))
    refused(["evaluate", "--model", model, "--fasta", fasta, "--calibration", fasta], capsys, tmp,
            "not a readable calibration checkpoint")


def test_outputs_never_replace_inputs_or_special_files(place, capsys):
    """An output naming an input (the FASTA, the model), a device node, a pipe, or a place under /proc, /sys or /dev
    is refused before any work, and the thing named is untouched."""
    tmp, fasta, model = place
    before = open(fasta, "rb").read()
    base = ["embed", "--model", model, fasta, "--quiet", "--nogpu"]
    refused(base + ["-o", fasta, "--format", "h5", "--overwrite"], capsys, tmp, "--output", "is the input")
    refused(base + ["-o", model, "--overwrite"], capsys, tmp, "is the input")  # .pt files over the model's
    refused(base + ["-o", "/dev/null", "--format", "h5"], capsys, tmp, "lies under /dev")
    refused(base + ["-o", "/proc/esm_turbo_out"], capsys, tmp, "lies under /proc")
    calibrate = ["calibrate", "--model", model, "--fasta", fasta, "--out"]
    refused(calibrate + ["/dev/null"], capsys, tmp, "--out '/dev/null'", "lies under /dev")
    refused(calibrate + [fasta], capsys, tmp, "is the input")
    fifo = tmp / "pipe"
    os.mkfifo(fifo)
    refused(calibrate + [str(fifo)], capsys, tmp, "not a regular file")
    import stat
    assert open(fasta, "rb").read() == before and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_nucleotide_fasta_is_refused(place, capsys):
    tmp, _, model = place
    dna = tmp / "dna.fasta"
    write_fasta(dna, [("g1", "ATGGCGTACGTTAGCAAT"), ("g2", "ATGNNNACGU")])
    refused(["embed", "--model", model, str(dna), "-o", str(tmp / "o"), "--nogpu"], capsys, tmp, "dna.fasta",
            "nucleotides")


def test_an_output_named_h5_is_one_hdf5_file(place):
    from esm_turbo.embed.h5 import open_embeddings
    tmp, fasta, model = place
    assert main(["embed", "--model", model, fasta, "-o", str(tmp / "e.h5"), "--nogpu", "--quiet"]) == 0
    assert (tmp / "e.h5").is_file()
    with open_embeddings(tmp / "e.h5") as emb:
        assert sorted(emb.ids) == ["a", "b"]


def test_requests_that_cannot_be_met_are_refused_before_any_work(place, capsys):
    tmp, fasta, model = place
    refused(["calibrate", "--model", model, "--fasta", fasta, "--out", str(tmp / "c.safetensors"), "--holdout", "0.9"],
            capsys, tmp, "--holdout 0.9 of 2 sequences leaves none")
    refused(["demo", "--size", "7B", "--out", str(tmp / "demo")], capsys, tmp, "--size", "7B")
    refused(["validate-codec", "--vectors", "100000000000"], capsys, tmp, "--vectors", "out of range")
    refused(["bench", "decode", "--sizes", "8M"], capsys, tmp, "--sizes", "decode suite")


@pytest.mark.parametrize("edit,needle", [
    (lambda meta: "{not json", "malformed"),
    (lambda meta: json.dumps({k: v for k, v in json.loads(meta).items() if k != "layers"}), "malformed"),
    (lambda meta: json.dumps(dict(json.loads(meta), config=dict(json.loads(meta)["config"], colour=1))), "malformed"),
])
def test_edited_calibration_metadata_is_one_line(place, capsys, edit, needle):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    tmp, fasta, model = place
    cal = tmp / "c.safetensors"
    assert main(["calibrate", "--model", model, "--fasta", fasta, "--out", str(cal), "--holdout", "0",
                 "--quiet"]) == 0
    with safe_open(str(cal), framework="pt") as fh:
        meta = dict(fh.metadata())
    meta["esm_turbo"] = edit(meta["esm_turbo"])
    save_file(load_file(cal), str(cal), metadata=meta)
    capsys.readouterr()
    refused(["evaluate", "--model", model, "--fasta", fasta, "--calibration", str(cal)], capsys, tmp, needle)


def test_ids_that_look_like_paths_are_stored_as_given(place):
    from esm_turbo.embed.h5 import open_embeddings
    tmp, _, model = place
    odd = tmp / "odd.fasta"
    write_fasta(odd, [(".", "MKTAYIAKQRQ"), ("..", "GSHMLEDPV"), ("a/../b", "MKV")])
    assert main(["embed", "--model", model, str(odd), "-o", str(tmp / "e.h5"), "--nogpu", "--quiet"]) == 0
    with open_embeddings(tmp / "e.h5") as emb:
        assert sorted(emb.ids) == [".", "..", "a/../b"] and emb["."]["mean_representations"][3].shape == (64,)
    assert main(["embed", "--model", model, str(odd), "-o", str(tmp / "pt"), "--nogpu", "--quiet"]) == 0
    assert sorted(torch.load(p)["label"] for p in (tmp / "pt").glob("*.pt")) == [".", "..", "a/../b"]
