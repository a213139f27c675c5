"""The examples run as a user runs them (offline, on their stand-in model) and print what they promise."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("script,args,expect", [
    ("design_loop.py", ["--designs", "2", "--length", "3"], "bits per value"),
    ("iterative_resample.py", ["--rounds", "2"], "design tail:"),
    ("beam_search.py", ["--length", "3", "--beam", "8"], "saved by sharing"),
])
def test_example_runs(script, args, expect):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert expect in run.stdout, run.stdout
    if script == "design_loop.py":  # two designs, each the scaffold plus three residues
        designs = [line for line in run.stdout.splitlines() if line.startswith("MKTAYIAKQR")]
        assert len(designs) == 2 and all(len(d) == 33 + 3 for d in designs), run.stdout


def test_beam_search_keeps_the_best_beams():
    """Every kept beam's score is the sum of its residues' log-probabilities under the contiguous session, and the
    beams come best first."""
    import torch

    from esm_turbo import TurboEsm
    from esm_turbo.model.alphabet import alphabet
    from esm_turbo.testing import stress_esm2
    sys.path.insert(0, str(ROOT / "examples"))
    from beam_search import beam_search
    turbo = TurboEsm(stress_esm2(layers=2, hidden=32, heads=2))
    turbo.calibration = None
    prefix = "MKTAYIAKQRQISFVKSH"
    session_kind = turbo.session

    def oblivious(**kw):  # the stand-in has no calibration: a data-oblivious compressed cache
        return session_kind("turboquant-3", **kw)
    turbo.session = oblivious
    tails, scores = beam_search(turbo, prefix, 3, beam=5, expand=3, block_size=4, log=lambda _: None)
    assert len(tails) == 5 and scores == sorted(scores, reverse=True)
    for tail, score in zip(tails, scores):  # rescored one position at a time on a contiguous session
        check = session_kind("turboquant-3")
        check.start([prefix])
        total = 0.0
        allowed = [alphabet().get_idx(c) for c in "ACDEFGHIKLMNPQRSTVWY"]
        for residue in tail:
            logits = check.step(["<mask>"], commit=False).logits[0, 0, allowed]
            total += torch.log_softmax(logits.float(), -1)[allowed.index(alphabet().get_idx(residue))].item()
            check.step([residue])
        assert abs(total - score) < 1e-3, (tail, total, score)


def test_examples_and_the_readme_use_only_the_public_api():
    """Everything the examples and the README's Python import comes from ``esm_turbo`` itself, and exists there."""
    import ast
    import re

    import esm_turbo
    sources = {p.name: p.read_text() for p in (ROOT / "examples").glob("*.py")}
    readme = (ROOT / "README.md").read_text()
    sources.update({f"README block {i}": b for i, b in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S))})
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("esm_turbo"):
                assert node.module == "esm_turbo", f"{name}: from {node.module} import …"
                assert all(hasattr(esm_turbo, a.name) for a in node.names), name
