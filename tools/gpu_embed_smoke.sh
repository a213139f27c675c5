#!/usr/bin/env bash
# Device-side check of `esm-turbo embed` (one call): the carried wheels installed, the embed tests on CUDA, outputs on
# the GPU against the CPU's on a small job, then the command on the corpus (cold and warm, h5 and pt) with a
# 650M-shaped random model; on request the embed benchmark and its end-to-end rows (GPU 0) and the multi-GPU run
# (every GPU of the host). Logs under $OUT. Usage (from the repository root):
#   bash tools/gpu_embed_smoke.sh CORPUS [STEPS]
# STEPS: any of tests, small, imports, corpus, suite, e2e, multigpu (default: tests small imports corpus)
set -u
corpus=${1:-.tb/corpus.fasta}
steps=${2:-tests small imports corpus}
has() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch,triton,transformers,h5py;print(torch.__version__,triton.__version__,transformers.__version__)"
work=/tmp/e2e; rm -rf $work; mkdir -p $work
export TORCHINDUCTOR_CACHE_DIR=$work/inductor TRITON_CACHE_DIR=$work/triton
if has tests; then
echo "== tests"
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -x tests/test_folder.py tests/test_fast_esm.py 2>&1 | tail -4
fi
if has imports; then
echo "== imports (cumulative microseconds)"
python3 -X importtime -c "import esm_turbo.cli" 2>&1 | awk -F'|' '{c=$2; gsub(/ /,"",c); print c, $3}' | sort -n | \
    awk '$1>80000' | grep -v "  torch\.\|sympy" | tail -20
fi
if has small; then
echo "== small job: GPU fp32/fp16 against CPU fp32"
head -n 800 $corpus > $work/small.fasta
python3 - <<'PY'
import torch
from pathlib import Path
from esm_turbo.embed.bench_e2e import model_folder
model_folder("8M", Path("/tmp/e2e/m8"), torch.device("cuda"))
PY
for run in "gpu32 --dtype fp32" "gpu16 --dtype fp16" "cpu32 --nogpu"; do
  set -- $run
  CUDA_VISIBLE_DEVICES=0 python3 -m esm_turbo.cli embed --model $work/m8 $work/small.fasta -o $work/$1.h5 --format h5 \
      --include mean per_tok bos --quiet ${@:2} 2>&1 | tail -1
done
python3 - <<'PY'
import numpy as np
from esm_turbo.embed.h5 import open_embeddings
ref = open_embeddings("/tmp/e2e/cpu32.h5")
for name in ("gpu32", "gpu16"):
    with open_embeddings(f"/tmp/e2e/{name}.h5") as e:
        assert sorted(e.ids) == sorted(ref.ids)
        order = [e.ids.index(i) for i in ref.ids]
        a, b = e.mean(6)[order], ref.mean(6)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        tok = max(float(np.abs(e[i]["representations"][6] - ref[i]["representations"][6]).max()) for i in ref.ids[:50])
        print(name, "records", len(e.ids), "min mean cos", cos.min(), "max |d| per-token (50 records)", tok)
PY
fi
if has suite; then
echo "== bench embed --sizes 650M (GPU 0)"
CUDA_VISIBLE_DEVICES=0 python3 -m esm_turbo.cli bench embed --sizes 650M --json \
    --out $OUT/bench_h100.txt > $OUT/bench_h100.json 2> $OUT/bench_progress.log
cat $OUT/bench_h100.txt
fi
if has e2e; then
echo "== bench embed --corpus: end to end (GPU 0)"
CUDA_VISIBLE_DEVICES=0 python3 -m esm_turbo.cli bench embed --sizes 650M --corpus $corpus --json \
    --out $OUT/end_to_end_h100.txt > $OUT/end_to_end_h100.json 2>> $OUT/bench_progress.log
tail -3 $OUT/bench_progress.log; cat $OUT/end_to_end_h100.txt
fi
if has multigpu; then
echo "== multi-GPU: the corpus repeated to 50M tokens, 1 GPU then all"
n=$(nvidia-smi -L | wc -l)
python3 scripts/bench_embed_multigpu.py --fasta $corpus --gpus 1,$n --tokens 50e6 --out $OUT/embed_multigpu.json
fi
if has corpus; then
echo "== corpus, 650M-shaped fp16"
python3 - <<'PY'
import torch
from pathlib import Path
from esm_turbo.embed.bench_e2e import model_folder
model_folder("650M", Path("/tmp/e2e/m650"), torch.device("cuda"))
PY
for run in h5-cold h5-warm pt-warm h5-warm2; do
  fmt=${run%%-*}; out=$work/o.$fmt; rm -rf $out $out.parts
  start=$(date +%s.%N)
  CUDA_VISIBLE_DEVICES=0 python3 -m esm_turbo.cli embed --model $work/m650 $corpus -o $out --format $fmt --include mean \
      --dtype fp16 --quiet 2>&1 | tail -2
  echo "$run: $(awk "BEGIN{print $(date +%s.%N) - $start}") s wall"
done
fi
