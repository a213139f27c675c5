"""Aggregate every result row under results/rows into CSVs, plots and results/REPORT.md."""

import sys

from esm_turbo.experiments.report import make_report

if __name__ == "__main__":
    rows = sys.argv[1] if len(sys.argv) > 1 else "results/rows"
    print(f"wrote {make_report(rows)}")
