"""FASTA reading with Biopython, strict: errors name the file, the record and the position."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from Bio.SeqIO.FastaIO import SimpleFastaParser

from .errors import EsmTurboError, FastaError
from .model.alphabet import NOT_A_TOKEN, check_sequence, strip_gaps as _strip_gaps

#: the repository's FASTA sets (calibration_data/; an editable install keeps them beside the package)
CALIBRATION_DATA = Path(__file__).resolve().parents[1] / "calibration_data"


@dataclass(frozen=True)
class Record:
    id: str
    sequence: str
    source: str  # "file:line" of the header
    description: str = ""  # the header after the id


def read_fasta(path: str | Path, max_residues: int | None = None, skip_invalid: bool = False,
               seen: set[str] | None = None, strip_gaps: bool = False) -> tuple[list[Record], list[str]]:
    """Read and validate one FASTA file. Returns (records, problems skipped when ``skip_invalid``).

    Checked: the file exists, is not empty and starts with '>', no text before the first header,
    non-empty sequences, ESM-2 tokens only (residues, and the gaps '-' and '.', which are removed
    first when ``strip_gaps``), length ≤ ``max_residues``, unique ids (also across files when the
    caller passes the same ``seen`` set).
    """
    path = Path(path)
    if not path.is_file():
        raise FastaError(f"{path}: no such FASTA file")
    text = path.read_text(errors="replace")
    if not text.strip():
        raise FastaError(f"{path}: empty file (no FASTA records)")
    seen = set() if seen is None else seen
    fast = _clean_file(path, text, seen, strip_gaps, max_residues)
    if fast is not None:
        seen.update(r.id for r in fast)
        check_not_nucleotides(fast, path)
        return fast, []
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    if not first.startswith(">"):
        raise FastaError(f"{path}: line 1 is not a FASTA header ('>' expected), found {first[:40]!r}")
    header_lines = [i + 1 for i, ln in enumerate(lines) if ln.startswith(">")]
    del lines
    records: list[Record] = []
    problems: list[str] = []
    with path.open(errors="replace") as fh:
        for n, (title, seq) in enumerate(SimpleFastaParser(fh)):
            rid = title.split()[0] if title.strip() else ""
            where = f"{path}:{header_lines[n]}"
            try:
                if not rid:
                    raise FastaError(f"{where}: record {n + 1} has an empty id")
                if rid in seen:
                    raise FastaError(f"{where}: duplicate record id {rid!r}")
                try:
                    seq = seq.replace(" ", "")
                    clean = check_sequence(_strip_gaps(seq) if strip_gaps else seq,
                                           f"FASTA record {rid!r} ({where})", max_residues)
                except EsmTurboError as err:
                    raise FastaError(str(err)) from None
            except FastaError as err:
                if not skip_invalid:
                    raise
                problems.append(str(err))
                continue
            seen.add(rid)
            records.append(Record(rid, clean, where, title[len(rid):].strip()))
    if not records and not problems:
        raise FastaError(f"{path}: no FASTA records")
    check_not_nucleotides(records, path)
    return records, problems


def _clean_file(path: Path, text: str, seen: set[str], strip_gaps: bool,
                max_residues: int | None) -> list[Record] | None:
    """The records of a file that passes every check, read at once (string operations over the whole text, no
    per-line Python): the same records the record-by-record reader gives. ``None`` for any file that is unusual
    (carriage returns, tabs, text before the first header) or fails a check: the record-by-record reader then reads
    it and names the first problem."""
    if not text.startswith(">") or "\r" in text or "\t" in text or "\n\n" in text:
        return None
    name, records, line = str(path), [], 1
    for chunk in text[1:].split("\n>"):
        title, _, body = chunk.partition("\n")
        title = title.rstrip()
        rid = title.split(maxsplit=1)[0] if title else ""
        if not rid:
            return None
        seq = body.replace("\n", "").replace(" ", "").upper()
        records.append(Record(rid, _strip_gaps(seq) if strip_gaps else seq, f"{name}:{line}",
                              title[len(rid):].strip()))
        line += chunk.count("\n") + 1
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids) or not seen.isdisjoint(ids):
        return None
    lengths = [len(r.sequence) for r in records]
    if min(lengths) == 0 or (max_residues is not None and max(lengths) > max_residues):
        return None
    if NOT_A_TOKEN.search("".join(r.sequence for r in records)):
        return None
    return records


_NUCLEOTIDES = frozenset("ACGTUN")


def check_not_nucleotides(records: list[Record], path: str | Path) -> None:
    """A FASTA whose every record is written in A, C, G, T/U and N alone (and at least one of 10 or more letters) is
    DNA or RNA, which ESM-2 would embed as the amino acids those letters also name: refused, naming the file."""
    if records and all(_NUCLEOTIDES.issuperset(r.sequence) for r in records) and max(
            len(r.sequence) for r in records) >= 10:
        raise FastaError(f"{path}: every record is written in A, C, G, T/U and N only (first: {records[0].id!r}, "
                         f"{records[0].source}): nucleotides, not a protein; translate it first")


def read_fastas(paths: list[str | Path], **kwargs) -> list[Record]:
    """Read several files with ids unique across all of them."""
    seen: set[str] = set()
    out: list[Record] = []
    for p in paths:
        out.extend(read_fasta(p, seen=seen, **kwargs)[0])
    return out


def records_hash(records: list[Record]) -> str:
    """sha256 over (id, sequence) pairs in order: identifies a calibration set."""
    h = hashlib.sha256()
    for r in records:
        h.update(f"{r.id}\t{r.sequence}\n".encode())
    return h.hexdigest()


def write_fasta(path: str | Path, records: list[tuple[str, str]], width: int = 60) -> None:
    with Path(path).open("w") as fh:
        for rid, seq in records:
            fh.write(f">{rid}\n")
            for i in range(0, len(seq), width):
                fh.write(seq[i:i + width] + "\n")
