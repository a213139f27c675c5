"""esm-turbo embed: outputs match transformers, resume after a kill, HDF5, long sequences, torchrun."""

import os
import subprocess
import sys

import pytest
import torch

from esm_turbo.cli import main
from esm_turbo.embed.batching import owner_ranges, plan_batches, plan_pieces, window_spans
from esm_turbo.embed.extract import resolve_layers
from esm_turbo.embed.writers import read_h5_item, safe_name
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
    assert (out / "manifest.rank0.json").is_file()


def test_killed_run_resumes_to_the_same_files(stress_dir, fasta, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--model", str(stress_dir), str(fasta), "--include", "mean", "per_tok", "--toks_per_batch", "60",
            "--nogpu", "--quiet"]
    assert main(["embed", *args, "-o", str(full)]) == 0
    # a run killed after its first batch: only whole files may be left behind
    code = ("import sys, esm_turbo.embed.writers as w\n"
            "orig = w.PtWriter.write\n"
            "def write(self, items):\n"
            "    orig(self, items)\n"
            "    import os; os._exit(9)\n"
            "w.PtWriter.write = write\n"
            "from esm_turbo.cli import main\n"
            f"main(['embed', *{args!r}, '-o', {str(part)!r}])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    partial = sorted(p.name for p in part.glob("*.pt"))
    assert 0 < len(partial) < len(SEQS)
    assert not list(part.glob(".*tmp"))
    assert main(["embed", *args, "-o", str(part), "--resume"]) == 0
    assert sorted(p.name for p in part.glob("*.pt")) == sorted(p.name for p in full.glob("*.pt"))
    for p in full.glob("*.pt"):
        a, b = torch.load(p), torch.load(part / p.name)
        assert a["label"] == b["label"]
        for kind in ("representations", "mean_representations"):
            for layer in a[kind]:
                assert torch.equal(a[kind][layer], b[kind][layer])


def test_h5_output_and_resume(stress_dir, fasta, tmp_path):
    import h5py
    out = tmp_path / "emb.h5"
    args = ["embed", "--model", str(stress_dir), str(fasta), "-o", str(out), "--format", "h5", "--include", "mean",
            "bos", "--nogpu", "--quiet", "--toks_per_batch", "60"]
    assert main(args) == 0
    with h5py.File(out, "r") as fh:
        items = {read_h5_item(fh[k])["label"]: read_h5_item(fh[k]) for k in fh.keys()}
    assert set(items) == {rid for rid, _ in SEQS}
    hidden, _, _ = direct(stress_dir, SEQS[0][1])
    assert torch.allclose(items[SEQS[0][0]]["mean_representations"][3], hidden[3][0, 1:-1].mean(0), atol=1e-5)
    assert main(args + ["--resume"]) == 0  # nothing left to do; the file is kept whole
    with h5py.File(out, "r") as fh:
        assert len(fh.keys()) == len(SEQS)


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
    import h5py
    with h5py.File(out, "r") as fh:
        labels = {fh[k].attrs["label"] for k in fh.keys()}
    assert labels == {rid for rid, _ in SEQS}
    assert "rank 0/2" in proc.stderr and "rank 1/2" in proc.stderr


@pytest.mark.slow
def test_killed_two_rank_run_resumes(stress_dir, fasta, tmp_path):
    """A two-rank run killed after rank 1 wrote one part: --resume keeps that part's record (not recomputed)
    and embeds the rest, every record once."""
    import h5py
    from esm_turbo.embed.writers import H5Writer
    out = tmp_path / "dist.h5"
    H5Writer(out, rank=1, world=2).write([{"label": SEQS[2][0], "mean_representations": {3: torch.zeros(32)}}])
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29534", "-m", "esm_turbo.cli", "embed", "--model", str(stress_dir),
                           str(fasta), "-o", str(out), "--format", "h5", "--include", "mean", "--resume", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with h5py.File(out, "r") as fh:
        items = [read_h5_item(fh[k]) for k in fh.keys()]
    assert sorted(i["label"] for i in items) == sorted(rid for rid, _ in SEQS)
    kept = next(i for i in items if i["label"] == SEQS[2][0])
    assert kept["mean_representations"][3].abs().sum() == 0
    assert all(i["mean_representations"][3].abs().sum() > 0 for i in items if i is not kept)
    assert proc.stderr.count("skipped 1 (already there)") == 2  # both ranks saw the same finished record
    assert not out.with_name(out.name + ".parts").exists()


def test_parts_are_folded_in_as_they_land(tmp_path):
    """The follower copies parts written while it runs and stops only once told every rank is done."""
    import threading

    import h5py
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
    with h5py.File(out, "r") as fh:
        got = {fh[k].attrs["label"]: fh[k]["mean_representations"]["1"][0] for k in fh.keys()}
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
