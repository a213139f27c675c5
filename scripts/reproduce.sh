#!/usr/bin/env bash
# Regenerate every sweep row, table and plot under results/ from scratch (CPU, a few minutes per model).
# GPU rows (results/gpu/) come from `esm-turbo bench all` on a GPU and are only read here.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf results/rows results/sweeps results/plots
ALL=$(ls conf/quant/*.yaml | xargs -n1 basename | sed 's/\.yaml$//' | paste -sd, -)
for model in stress6 stress4; do
  python scripts/experiment.py -m "quant=${ALL}" "model=${model}" data.eval_every=1 hydra/job_logging=disabled
done
python scripts/report.py
