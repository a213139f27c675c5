"""esm-turbo embed: outputs match transformers, resume after a kill, HDF5, long sequences, torchrun."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from esm_turbo.cli import main
from esm_turbo.embed.batching import owner_ranges, plan_batches, plan_pieces, window_spans
from esm_turbo.embed.extract import resolve_layers
from esm_turbo.embed.h5 import open_embeddings, read_h5_item
from esm_turbo.embed.writers import safe_name
from esm_turbo.fasta import Record, write_fasta
from esm_turbo.model.alphabet import encode
from esm_turbo.model.loading import load_esm

SEQS = [("sp|P1|A", "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"), ("b/2", "MKV"), ("c", "GSHMLEDPVDAFQ" * 3),
        ("d", "MADEEKLPPGWEKRMSRSSGRVYYFNHITNASQWERPSG"), ("e", "ACDEFGHIKLMNPQRSTVWYX")]


@pytest.fixture
def fasta(tmp_path):
    path = tmp_path / "in.fasta"
    write_fasta(path, SEQS)
    return path


def direct(model_dir, seq):
    """What transformers gives for one sequence alone: hidden states [L+1, T, D], logits, contacts."""
    model = load_esm(model_dir)
    model.config._attn_implementation = "eager"
    tokens, mask = encode([seq])
    with torch.no_grad():
        out = model.esm(input_ids=tokens, attention_mask=mask, output_hidden_states=True)
        logits = model.lm_head(out.last_hidden_state)
        contacts = model.predict_contacts(tokens, mask)
    return out.hidden_states, logits[0], contacts[0]


def test_pt_outputs_match_transformers(stress_dir, fasta, tmp_path):
    out = tmp_path / "pt"
    assert main(["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--repr_layers", "0", "-1", "2",
                 "--include", "mean", "per_tok", "bos", "contacts", "logits", "--toks_per_batch", "120",
                 "--nogpu", "--quiet"]) == 0
    layers = resolve_layers([0, -1, 2], 3)
    assert layers == [0, 2, 3]
    for rid, seq in SEQS:
        item = torch.load(out / f"{safe_name(rid)}.pt")
        assert item["label"] == rid
        hidden, logits, contacts = direct(stress_dir, seq)
        n = len(seq)
        for layer in layers:
            ref = hidden[layer][0, 1: n + 1]
            assert torch.allclose(item["representations"][layer], ref, atol=1e-5), (rid, layer)
            assert torch.allclose(item["mean_representations"][layer], ref.mean(0), atol=1e-5)
            assert torch.allclose(item["bos_representations"][layer], hidden[layer][0, 0], atol=1e-5)
        assert torch.allclose(item["logits"], logits[1: n + 1], atol=1e-4)
        assert item["contacts"].shape == (n, n) and torch.allclose(item["contacts"], contacts, atol=1e-5)
    import json
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(rid for rid, _ in SEQS)
    assert manifest["meta"]["repr_layers"] == [0, 2, 3] and manifest["meta"]["dtype"] == "fp32"
    assert not list(out.glob("manifest.rank*"))


def _many(tmp_path, n=240):
    """A FASTA of ``n`` records (the five above under new ids, with a residue or two changed)."""
    aa = "ACDEFGHIKLMNPQRSTVWY"
    recs = [(f"{rid}#{k}", seq[: max(3, len(seq) - k % 7)] + aa[k % 20]) for k in range(n // len(SEQS))
            for rid, seq in SEQS]
    path = tmp_path / "many.fasta"
    write_fasta(path, recs)
    return path, recs


def _kill_when(cmd: list[str], ready) -> None:
    """Start ``cmd``, and once ``ready()`` is true kill its whole process group with SIGKILL (as a scheduler
    ending a job does: the writer processes too)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 240
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("fmt", ["pt", "h5"])
def test_kill_9_then_resume_completes_every_record_once(stress_dir, tmp_path, fmt):
    fasta, recs = _many(tmp_path)
    full, part = tmp_path / f"full.{fmt}", tmp_path / f"part.{fmt}"
    args = ["--model", str(stress_dir), str(fasta), "--include", "mean", "per_tok", "--toks_per_batch", "64",
            "--format", fmt, "--nogpu", "--quiet"]
    assert main(["embed", *args, "-o", str(full)]) == 0
    if fmt == "pt":
        ready = lambda: len(list(part.glob("*.pt"))) >= 5  # noqa: E731
    else:
        ready = lambda: len(list(part.with_name(part.name + ".parts").glob("*.h5"))) >= 2  # noqa: E731
    _kill_when([sys.executable, "-m", "esm_turbo.cli", "embed", *args, "-o", str(part)], ready)
    if fmt == "pt":
        assert 0 < len(list(part.glob("*.pt"))) < len(recs)
    assert main(["embed", *args, "-o", str(part), "--resume"]) == 0
    folder = part if fmt == "pt" else part.parent
    assert not [p for p in folder.rglob("*.tmp")], "temporaries left behind"
    if fmt == "pt":
        assert sorted(p.name for p in part.glob("*.pt")) == sorted(p.name for p in full.glob("*.pt"))
        for p in full.glob("*.pt"):
            a, b = torch.load(p), torch.load(part / p.name)
            assert a["label"] == b["label"]
            for kind in ("representations", "mean_representations"):
                for layer in a[kind]:  # resumed in other batches: equal up to float32 rounding
                    assert torch.allclose(a[kind][layer], b[kind][layer], atol=1e-5)
        import json
        assert len(json.loads((part / "manifest.json").read_text())["files"]) == len(recs)
    else:
        assert not part.with_name(part.name + ".parts").exists()
        with open_embeddings(full) as a, open_embeddings(part) as b:
            assert len(b.ids) == len(set(b.ids)) == len(recs)  # every record exactly once
            assert set(a.ids) == set(b.ids)
            for rid in a.ids:
                x, y = a[rid], b[rid]
                assert torch.allclose(x["mean_representations"][3], y["mean_representations"][3], atol=1e-5)
                assert torch.allclose(x["representations"][3], y["representations"][3], atol=1e-5)


def test_h5_output_and_resume(stress_dir, fasta, tmp_path):
    import h5py
    out = tmp_path / "emb.h5"
    args = ["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--format", "h5", "--include", "mean",
            "bos", "--nogpu", "--quiet", "--toks_per_batch", "60"]
    assert main(args) == 0
    with open_embeddings(out) as emb:
        assert set(emb.ids) == {rid for rid, _ in SEQS}
        item = emb[SEQS[0][0]]
        assert emb.meta["include"] == ["bos", "mean"] and emb.meta["repr_layers"] == [3]
        mean = emb.mean(3)
        assert mean.shape == (len(SEQS), 64)
        assert np.array_equal(mean[emb.ids.index(SEQS[0][0])], item["mean_representations"][3].numpy())
    hidden, _, _ = direct(stress_dir, SEQS[0][1])
    assert torch.allclose(item["mean_representations"][3], hidden[3][0, 1:-1].mean(0), atol=1e-5)
    assert torch.allclose(item["bos_representations"][3], hidden[3][0, 0], atol=1e-5)
    assert main(args + ["--resume"]) == 0  # nothing left to do; the file is kept whole
    with h5py.File(out, "r") as fh:
        assert len(fh["ids"]) == len(SEQS)
        assert len(fh.keys()) == 4  # ids, residues and one group per kind: not a group per record


def test_gelu_tanh_is_recorded_and_not_mixed_on_resume(stress_dir, fasta, tmp_path, capsys, monkeypatch):
    """``--gelu tanh``: transformers' model with GELU's tanh approximation in place of its erf GELU is what is written
    (a little off the erf output), the output says so, and a resume asking for erf GELU is refused in one line;
    contacts (transformers' path) are refused with it before any work."""
    import json

    import transformers.models.esm.modeling_esm as modeling_esm
    out = tmp_path / "pt"
    args = ["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--nogpu", "--quiet"]
    assert main(args + ["--gelu", "tanh"]) == 0
    assert json.loads((out / "manifest.json").read_text())["meta"]["gelu"] == "tanh"
    rid, seq = SEQS[3]
    got = torch.load(out / f"{safe_name(rid)}.pt")["mean_representations"][3]
    erf = direct(stress_dir, seq)[0][3][0, 1:-1].mean(0)
    monkeypatch.setattr(modeling_esm, "gelu", lambda x: torch.nn.functional.gelu(x, approximate="tanh"))
    want = direct(stress_dir, seq)[0][3][0, 1:-1].mean(0)
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, erf, atol=1e-6)
    capsys.readouterr()
    assert main(args + ["--resume"]) == 2  # --gelu erf, the default
    err = capsys.readouterr().err.strip()
    assert "made with gelu tanh, this run asks for erf" in err and len(err.splitlines()) == 1
    assert main(args + ["--gelu", "tanh", "--resume"]) == 0
    assert main(["embed", "--model", str(stress_dir), str(fasta), "-o", str(tmp_path / "c"), "--gelu", "tanh",
                 "--include", "contacts", "--nogpu", "--quiet"]) == 2
    assert "--gelu tanh runs in FastEsm" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_bad_input_is_named(stress_dir, tmp_path, capsys):
    bad = tmp_path / "bad.fasta"
    bad.write_text(">ok\nMKV\n>bad one\nMKJV\n>empty\n\n")
    assert main(["embed", "--model", str(stress_dir), str(bad), "-o", str(tmp_path / "o"), "--nogpu"]) == 2
    assert "'bad'" in capsys.readouterr().err
    assert main(["embed", "--model", str(stress_dir), str(bad), "-o", str(tmp_path / "o"), "--nogpu", "--quiet",
                 "--skip-invalid"]) == 0
    err = capsys.readouterr().err
    assert "written 1" in err and "failed 2" in err
    assert "Loading weights" not in err  # --quiet quiets transformers' bar too
    assert main(["embed", "--model", str(stress_dir), str(bad), "-o", str(tmp_path / "o"), "--include",
                 "everything"]) == 2


def test_windows_stitch_every_residue_once():
    spans = window_spans(2500, 1022, 256)
    owners = owner_ranges(spans)
    assert owners[0][0] == 0 and owners[-1][1] == 2500
    assert all(a[1] == b[0] for a, b in zip(owners, owners[1:]))
    assert all(s <= lo and hi <= e for (s, e), (lo, hi) in zip(spans, owners))
    recs = [Record("long", "A" * 2500, "x"), Record("short", "A" * 10, "x")]
    pieces, warnings = plan_pieces(recs, 1022, "truncate")
    assert len(pieces) == 2 and warnings[0][0] == "long" and "'long'" in warnings[0][1]
    pieces, warnings = plan_pieces(recs, 1022, "windows")
    assert len(pieces) == 4 and not warnings
    batches = plan_batches(pieces, 2048)
    assert all(len(b) * (b[0].length + 2) <= 2048 for b in batches)


def test_long_sequence_windows_match_on_a_model(stress_dir, tmp_path):
    fasta = tmp_path / "long.fasta"
    seq = ("MKTAYIAKQRQISFVKSHFSRQ" * 4)[:80]
    write_fasta(fasta, [("long", seq)])
    out = tmp_path / "w"
    assert main(["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--include", "per_tok",
                 "--truncation-seq-length", "30", "--long-policy", "windows", "--window-overlap", "10",
                 "--toks-per-batch", "64", "--nogpu", "--quiet"]) == 0
    item = torch.load(out / "long.pt")
    assert item["representations"][3].shape[0] == 80  # every residue, stitched from the windows


@pytest.mark.slow
def test_torchrun_two_ranks_gloo(stress_dir, fasta, tmp_path):
    out = tmp_path / "dist.h5"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29533", "-m", "esm_turbo.cli", "embed", "--model", str(stress_dir),
                           str(fasta), "-o", str(out), "--format", "h5", "--include", "mean", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open_embeddings(out) as emb:
        assert sorted(emb.ids) == sorted(rid for rid, _ in SEQS)
    assert "rank 0/2" in proc.stderr and "rank 1/2" in proc.stderr


def test_gpus_starts_the_ranks_itself(stress_dir, fasta, tmp_path, monkeypatch):
    """esm-turbo embed --gpus: the launcher (which imports neither torch nor the CLI) runs the ranks as torchrun
    would; a failing rank stops the others and its exit code is the launcher's."""
    from esm_turbo.embed.launch import gpus_asked, launch_ranks, rank_count
    out = tmp_path / "ranks.h5"
    argv = ["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--gpus", "2", "--nogpu", "--quiet"]
    assert gpus_asked(argv) == "2" and gpus_asked(["calibrate", "--gpus", "2"]) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert launch_ranks(argv, 2) == 0
    with open_embeddings(out) as emb:
        assert sorted(emb.ids) == sorted(rid for rid, _ in SEQS)
    bad = [*argv[:2], str(tmp_path / "missing"), *argv[3:5], str(tmp_path / "other.h5"), *argv[6:]]
    assert launch_ranks(bad, 2) == 2
    code = "import sys; from esm_turbo.main import main; main(sys.argv[1:]); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code, *argv[:-4], "--gpus", "9"], capture_output=True, text=True)
    assert "--gpus 9: only" in proc.stderr and proc.stdout.strip() == "False"
    with pytest.raises(Exception, match="whole number"):
        rank_count("0")


@pytest.mark.slow
def test_killed_two_rank_run_resumes(stress_dir, fasta, tmp_path):
    """A two-rank run killed after rank 1 wrote one part: --resume keeps that part's record (not recomputed)
    and embeds the rest, every record once."""
    from esm_turbo.embed.writers import H5Writer
    out = tmp_path / "dist.h5"
    H5Writer(out, rank=1, world=2).write([{"label": SEQS[2][0], "mean_representations": {3: torch.zeros(64)}}])
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29534", "-m", "esm_turbo.cli", "embed", "--model", str(stress_dir),
                           str(fasta), "-o", str(out), "--format", "h5", "--include", "mean", "--resume", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open_embeddings(out) as emb:
        items = [emb[rid] for rid in emb.ids]
    assert sorted(i["label"] for i in items) == sorted(rid for rid, _ in SEQS)
    kept = next(i for i in items if i["label"] == SEQS[2][0])
    assert kept["mean_representations"][3].abs().sum() == 0
    assert all(i["mean_representations"][3].abs().sum() > 0 for i in items if i is not kept)
    assert proc.stderr.count("skipped 1 (already there)") == 2  # both ranks saw the same finished record
    assert not out.with_name(out.name + ".parts").exists()


def test_parts_are_folded_in_as_they_land(tmp_path):
    """The follower copies parts written while it runs and stops only once told every rank is done."""
    import threading

    from esm_turbo.embed.writers import H5Writer, follow_parts
    out = tmp_path / "o.h5"
    writer = H5Writer(out)
    item = lambda k: {"label": f"r{k}", "mean_representations": {1: torch.full((4,), float(k))}}  # noqa: E731
    writer.write([item(0), item(1)])
    done = threading.Event()
    follower = threading.Thread(target=follow_parts, args=(out, done.is_set, 0.01))
    follower.start()
    for k in range(2, 6):
        writer.write([item(k)])
    writer.finalize()
    done.set()
    follower.join(timeout=60)
    with open_embeddings(out) as emb:
        got = {rid: float(row[0]) for rid, row in zip(emb.ids, emb.mean(1))}
    assert got == {f"r{k}": float(k) for k in range(6)}
    assert not writer.parts.exists()


def test_ranks_are_balanced_by_tokens():
    from esm_turbo.embed.batching import shard_by_tokens
    gen = torch.Generator().manual_seed(0)
    tokens = (torch.rand(997, generator=gen) ** 3 * 1000).long().add(22).tolist()  # a long tail of long records
    for world in (2, 3, 4, 8):
        shards = shard_by_tokens(tokens, world)
        assert sorted(i for s in shards for i in s) == list(range(len(tokens)))  # every record once
        loads = [sum(tokens[i] for i in s) for s in shards]
        assert max(loads) - sum(loads) / world <= max(tokens)
        assert max(loads) / min(loads) < 1.01, loads
    # round-robin by length would give rank 0 the two longest records here
    assert [sum([500, 499, 1, 1, 1, 1][i] for i in s) for s in shard_by_tokens([500, 499, 1, 1, 1, 1], 2)] == [502, 501]


@pytest.mark.parametrize("fmt", ["pt", "h5"])
def test_an_output_is_added_to_only_as_it_was_made(stress_dir, fasta, tmp_path, capsys, fmt):
    """--resume with other layers, includes, dtype or model is refused before any work; so is a plain re-run; the
    output keeps its bytes. --overwrite replaces it."""
    from esm_turbo.testing import save_stress_model
    out = tmp_path / f"o.{fmt}"
    base = ["embed", str(fasta), "-o", str(out), "--format", fmt, "--nogpu", "--quiet"]
    assert main([*base, "--model", str(stress_dir)]) == 0
    files = sorted(out.glob("*")) if fmt == "pt" else [out]
    before = {p: p.read_bytes() for p in files}
    other = save_stress_model(tmp_path / "other", layers=3, hidden=64, heads=4, seed=7)
    for extra, needle in ((["--repr-layers", "2"], "repr_layers [3]"), (["--include", "mean", "per_tok"], "include"),
                          (["--dtype", "bf16"], "dtype fp32"), ([], "already holds")):
        resume = ["--resume"] if needle != "already holds" else []
        capsys.readouterr()
        assert main([*base, "--model", str(stress_dir), *resume, *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert main([*base, "--model", str(other), "--resume"]) == 2
    assert "another model" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in files} == before
    assert main([*base, "--model", str(other), "--overwrite", "--repr-layers", "2"]) == 0
    if fmt == "h5":
        with open_embeddings(out) as emb:
            assert emb.meta["repr_layers"] == [2] and emb.layers() == [2]
    else:
        item = torch.load(out / "c.pt")
        assert list(item["mean_representations"]) == [2]


def test_files_of_the_earlier_hdf5_layout_are_read_and_resumed(stress_dir, fasta, tmp_path):
    """A group per record (the earlier layout): open_embeddings reads it, and --resume folds it into the columns."""
    import h5py
    out = tmp_path / "old.h5"
    ref = tmp_path / "ref.h5"
    args = ["embed", "--model", str(stress_dir), str(fasta), "--format", "h5", "--include", "mean", "per_tok",
            "--nogpu", "--quiet"]
    assert main([*args, "-o", str(ref)]) == 0
    with open_embeddings(ref) as emb, h5py.File(out, "w") as fh:
        for rid in emb.ids[:2]:  # two records in the earlier layout
            item = emb[rid]
            group = fh.create_group(safe_name(rid))
            group.attrs["label"] = rid
            for key in ("mean_representations", "representations"):
                sub = group.create_group(key)
                for layer, t in item[key].items():
                    sub.create_dataset(str(layer), data=t.numpy())
        kept = emb.ids[:2]
    with open_embeddings(out) as old:
        assert not old.columnar and old.ids == kept and old.layers() == [3]
        assert torch.equal(old[kept[0]]["representations"][3], read_h5_item(h5py.File(out)[safe_name(kept[0])])[
            "representations"][3])
        assert old.mean(3).shape == (2, 64)
    assert main([*args, "-o", str(out), "--resume"]) == 0
    with open_embeddings(out) as new, open_embeddings(ref) as emb:
        assert new.columnar and sorted(new.ids) == sorted(emb.ids)
        for rid in emb.ids:
            # other batches than the reference run's: the same values up to float32 rounding
            assert torch.allclose(new[rid]["representations"][3], emb[rid]["representations"][3], atol=1e-5)


def test_chunks_round_trip_through_records():
    """Chunk.items and chunk_of_items are inverses, every kind included (ragged residues and contact maps)."""
    from esm_turbo.embed.chunk import chunk_of_items
    from esm_turbo.embed.h5 import columns_of
    gen = torch.Generator().manual_seed(0)
    items = []
    for k, n in enumerate((3, 7, 1)):
        items.append({"label": f"r{k}", "representations": {0: torch.randn(n, 4, generator=gen),
                                                             5: torch.randn(n, 4, generator=gen)},
                      "mean_representations": {0: torch.randn(4, generator=gen), 5: torch.randn(4, generator=gen)},
                      "bos_representations": {0: torch.randn(4, generator=gen), 5: torch.randn(4, generator=gen)},
                      "contacts": torch.randn(n, n, generator=gen), "logits": torch.randn(n, 33, generator=gen)})
    chunk = chunk_of_items(items)
    back = list(chunk.items())
    for a, b in zip(items, back):
        assert a["label"] == b["label"]
        for key in ("representations", "mean_representations", "bos_representations"):
            assert all(torch.equal(a[key][layer], b[key][layer]) for layer in a[key])
        assert torch.equal(a["contacts"], b["contacts"]) and torch.equal(a["logits"], b["logits"])
    cols = columns_of(chunk)
    assert cols["contacts"].shape == (9 + 49 + 1,) and cols["representations/5"].shape == (11, 4)


@pytest.mark.parametrize("include", [["mean"], ["mean", "per_tok", "logits"]])
def test_windows_and_whole_records_share_a_batch(stress_dir, tmp_path, include):
    """A batch mixing windows of a long record with short records (windows planned first by length): each record
    gets the same values as when embedded alone."""
    long = ("MKTAYIAKQRQISFVKSHFSRQ" * 4)[:80]
    fasta = tmp_path / "mix.fasta"
    write_fasta(fasta, [("long", long), ("s1", "MKV" * 9), ("s2", "GSHMLEDPVDAFQ" * 2)])
    args = ["--model", str(stress_dir), "--include", *include, "--truncation-seq-length", "30", "--long-policy",
            "windows", "--window-overlap", "10", "--nogpu", "--quiet"]
    assert main(["embed", str(fasta), "-o", str(tmp_path / "mix"), "--toks-per-batch", "400", *args]) == 0
    for rid, seq in (("long", long), ("s1", "MKV" * 9)):
        alone = tmp_path / f"{rid}.fasta"
        write_fasta(alone, [(rid, seq)])
        assert main(["embed", str(alone), "-o", str(tmp_path / rid), "--toks-per-batch", "400", *args]) == 0
        a, b = torch.load(tmp_path / "mix" / f"{rid}.pt"), torch.load(tmp_path / rid / f"{rid}.pt")
        for key in a:
            if key != "label":
                x, y = (a[key], b[key]) if isinstance(a[key], torch.Tensor) else (a[key][3], b[key][3])
                assert torch.allclose(x, y, atol=1e-5), (rid, key)


def test_embed_imports_only_what_it_uses(stress_dir, fasta, tmp_path):
    """The command's start-up: a folder model embeds without importing transformers, scipy, fair-esm or the
    benchmarks (each adds seconds to every run on a slow filesystem)."""
    code = ("import sys; from esm_turbo.cli import main; rc = main(sys.argv[1:]); "
            "print(sorted(m for m in ('transformers', 'scipy', 'esm', 'esm_turbo.bench', 'esm_turbo.testing', "
            "'torch._dynamo') if m in sys.modules))")
    out = tmp_path / "o.h5"
    proc = subprocess.run([sys.executable, "-c", code, "embed", "--model", str(stress_dir), str(fasta), "-o", str(out),
                           "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert len(open_embeddings(out).ids) == len(SEQS)
