#!/usr/bin/env bash
# Device-side checks for the contracts work: the GPU tests of the kernels, caches, weights and ESM C, then the decode,
# design and weights benchmarks (each under its own time limit), logs and outputs under $OUT. Usage (from the
# repository root):   bash tools/gpu_contracts.sh "STEPS"      STEPS: any of tests decode design weights
set -u
steps=${1:-tests decode design weights}
has() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site CUDA_VISIBLE_DEVICES=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export TORCHINDUCTOR_CACHE_DIR=/tmp/w/inductor TRITON_CACHE_DIR=/tmp/w/triton
if has tests; then
echo "== GPU tests"
timeout 280 python3 -m pytest -q -rfs tests/test_weights.py tests/test_esmc.py tests/test_kernels.py \
    tests/test_contracts.py tests/test_codec_contract.py tests/test_cache.py tests/test_paged.py 2>&1 \
    > $OUT/tests_gpu.log; tail -25 $OUT/tests_gpu.log
fi
for b in decode design weights; do
  if has $b; then
    echo "== bench $b"
    timeout ${LIMIT:-200} python3 -m esm_turbo.cli bench $b --out $OUT/bench_$b.txt > $OUT/bench_$b.stdout 2>&1
    echo "rc=$?"; tail -40 $OUT/bench_$b.txt 2>/dev/null
  fi
done
