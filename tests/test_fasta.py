"""FASTA reading: the whole-file reader gives exactly what the record-by-record reader gives, and hands every unusual
or faulty file to it (which names the problem)."""

import pytest

from esm_turbo import fasta as fasta_mod
from esm_turbo.errors import FastaError
from esm_turbo.fasta import CALIBRATION_DATA, read_fasta

CASES = {
    "plain": ">a desc here\nMKTAYIAK\nQRQISF\n>b\nmkv\n",
    "no final newline": ">a\nMKT\n>b x\tdesc\nGSH",
    "spaces and gaps": ">a  two  words \nMK T-A.Y \n>b\n--MKV..\n",
    "lower case, X and mask-free": ">x1\nacdefghiklmnpqrstvwyxbuzo\n",
    "carriage returns": ">a\r\nMKT\r\nAY\r\n>b\r\nGS\r\n",
    "blank lines": ">a\nMKT\n\nAY\n\n>b\nGS\n",
    "text before the header": "\n>a\nMKT\n",
    "tabs in a sequence": ">a\nMK\tT\n",
    "a bad residue": ">a\nMKT\n>b\nMK1V\n",
    "an empty record": ">a\nMKT\n>b\n>c\nGS\n",
    "a duplicate id": ">a\nMKT\n>a\nGS\n",
    "an empty id": ">a\nMKT\n> \nGS\n",
    "too long": ">a\nMKTAYIAKQRQ\n",
}


def _slow(monkeypatch, *args, **kwargs):
    monkeypatch.setattr(fasta_mod, "_clean_file", lambda *a: None)
    try:
        return read_fasta(*args, **kwargs)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("opts", [dict(), dict(strip_gaps=True, max_residues=10), dict(skip_invalid=True)])
def test_the_fast_reader_is_the_record_by_record_reader(tmp_path, monkeypatch, name, opts):
    path = tmp_path / "in.fasta"
    path.write_text(CASES[name])
    try:
        want = _slow(monkeypatch, path, **opts)
    except FastaError as err:
        with pytest.raises(FastaError) as got:
            read_fasta(path, **opts)
        assert str(got.value) == str(err)
        return
    assert read_fasta(path, **opts) == want


def test_the_fast_reader_takes_clean_files_and_keeps_ids_unique_across_files(tmp_path, monkeypatch):
    path = CALIBRATION_DATA / "evaluation.fasta"
    records, _ = read_fasta(path)
    assert records == _slow(monkeypatch, path)[0] and len(records) > 20
    assert fasta_mod._clean_file(path, path.read_text(), set(), False, None) is not None  # taken at once
    seen = set()
    read_fasta(path, seen=seen)
    with pytest.raises(FastaError, match="duplicate record id"):
        read_fasta(path, seen=seen)
