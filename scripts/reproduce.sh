#!/usr/bin/env bash
# Regenerate the stress models' sweep rows from scratch (CPU, a few minutes per model), then every table and plot.
# The trained testbeds' rows (results/rows/fidelity, results/rows/methods/trained-*) need the testbeds and a GPU:
# results/fidelity/README.md gives their commands. GPU benches (results/gpu, results/embed) are only read here.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf results/rows/methods/stress-*
ALL=$(ls conf/quant/*.yaml | xargs -n1 basename | sed 's/\.yaml$//' | paste -sd, -)
for model in stress6 stress4; do
  python scripts/experiment.py -m "quant=${ALL}" "model=${model}" data.eval_every=1 hydra/job_logging=disabled
done
python scripts/report.py
