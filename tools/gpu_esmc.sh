#!/usr/bin/env bash
# Device-side checks for ESM C and FP8 (one call per step list): the carried wheels installed, the GPU tests of FastEsm,
# FP8 and ESM C, the embed benchmark at 650M- and ESMC-600M-shaped (GPU 0), the 4-bit ESMC-6B-shaped model's peak
# memory while embedding, and the ESM C testbed's training. Logs and outputs under $OUT. Usage (from the repository
# root):
#   bash tools/gpu_esmc.sh CORPUS "STEPS"      STEPS: any of tests, bench, memory, train
set -u
corpus=${1:-.tb/corpus.fasta}
steps=${2:-tests bench}
has() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site CUDA_VISIBLE_DEVICES=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
export TORCHINDUCTOR_CACHE_DIR=/tmp/w/inductor TRITON_CACHE_DIR=/tmp/w/triton
if has tests; then
echo "== GPU tests"
timeout 300 python3 -m pytest -q -rs tests/test_esmc.py tests/test_fp8.py tests/test_fast_esm.py 2>&1 \
    | tail -15 | tee $OUT/tests_gpu.log
fi
if has bench; then
echo "== bench embed --sizes 650M ESMC-600M"
python3 -m esm_turbo.cli bench embed --sizes 650M ESMC-600M --json --out $OUT/bench_embed_h100.txt \
    > $OUT/bench_embed_h100.json 2> $OUT/bench_progress.log
tail -3 $OUT/bench_progress.log
cat $OUT/bench_embed_h100.txt
fi
if has memory; then
echo "== 4-bit ESMC-6B-shaped: peak memory while embedding"
python3 scripts/esmc_6b_4bit_memory.py --out $OUT/memory_6b_4bit_h100.json 2>&1 | tail -8
fi
if has train; then
echo "== train the ESM C testbed"
python3 scripts/train_esmc_testbed.py $corpus $OUT/esmc_d64_trained --minutes 4 --seed 7 --split even 2>&1 \
    | grep -v "Writing model" | tail -4
fi
