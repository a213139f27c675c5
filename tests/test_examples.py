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
])
def test_example_runs(script, args, expect):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert expect in run.stdout, run.stdout
    if script == "design_loop.py":  # two designs, each the scaffold plus three residues
        designs = [line for line in run.stdout.splitlines() if line.startswith("MKTAYIAKQR")]
        assert len(designs) == 2 and all(len(d) == 33 + 3 for d in designs), run.stdout
