#!/usr/bin/env bash
# Device-side checks for the contracts work: the GPU tests of the kernels, caches, weights and ESM C, then the decode,
# design and weights benchmarks (each under its own time limit), logs and outputs under $OUT. Usage (from the
# repository root):   bash tools/gpu_contracts.sh "STEPS"      STEPS: any of tests ab decode widths design weights
# TESTS names the tests to run (default: the GPU-heavy files), TEST_LIMIT their time limit in seconds.
# With BASE=DIR (a tree of an earlier commit, e.g. `git archive REV esm_turbo pyproject.toml calibration_data`), each
# bench runs there first and then here, on the same GPU in the same call: a before/after pair (bench_NAME.base.txt).
# ARGS adds arguments to every bench (e.g. --quick); LIMIT is each bench's time limit in seconds. The step "ab" runs
# tools/step_ab.py (the decode, design and 3B weight steps) in BASE and here, alternating as AB_RUNS names them.
set -u
steps=${1:-tests decode design weights}
has() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export TORCHINDUCTOR_CACHE_DIR=/tmp/w/inductor TRITON_CACHE_DIR=/tmp/w/triton
here=$PWD
if has tests; then
echo "== GPU tests"
SECONDS=0
set -f  # TESTS may name parametrized tests: their brackets are not patterns
# with pytest-xdist among the carried wheels, WORKERS processes share the tests (kernel compiles are CPU-bound)
# (one CPU thread each: the CPU references of 12 processes with a thread per core each crawl), every result named in
# the log so that a run cut off at its limit still says which tests passed
xdist=$(PYTHONPATH=/tmp/site python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-12}")
[ -n "$xdist" ] && export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# with pytest-timeout carried too, a test that runs past TEST_TIMEOUT seconds fails with the stack it was stuck in
per_test=$(PYTHONPATH=/tmp/site python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_TIMEOUT:-240}")
PYTHONPATH=$here:/tmp/site timeout ${TEST_LIMIT:-280} python3 -m pytest -v --durations=25 -rfs -p no:benchmark $xdist $per_test ${TESTS:-tests/test_weights.py \
    tests/test_esmc.py tests/test_kernels.py tests/test_contracts.py tests/test_codec_contract.py tests/test_cache.py \
    tests/test_paged.py tests/test_paged_capture.py tests/test_step_floor.py tests/test_bench.py} 2>&1 > $OUT/tests_gpu.log
set +f
if [ -n "$xdist" ] && grep -q " failed" $OUT/tests_gpu.log; then  # failures under load (memory, timing): once alone
  echo "== the failed tests again, one process" >> $OUT/tests_gpu.log
  PYTHONPATH=$here:/tmp/site timeout ${TEST_LIMIT:-280} python3 -m pytest -q -rfs --lf >> $OUT/tests_gpu.log 2>&1
fi
tail -25 $OUT/tests_gpu.log; echo "tests: ${SECONDS}s"
fi
bench() {  # NAME TREE SUFFIX
  SECONDS=0
  (cd "$2" && PYTHONPATH=$2:/tmp/site timeout ${LIMIT:-200} python3 -m esm_turbo.cli bench $1 ${ARGS:-} \
      --out $OUT/bench_$1$3.txt > $OUT/bench_$1$3.stdout 2>&1)
  echo "== bench $1 ($2): rc=$? ${SECONDS}s"; tail -40 $OUT/bench_$1$3.txt 2>/dev/null
}
if has ab; then  # each part in a process of its own: a profiler leaves its process slower (CUPTI stays attached)
  n=0
  for tag in ${AB_RUNS:-base head base head}; do
    n=$((n + 1)); tree=$([ $tag = head ] && echo "$here" || echo "$here/$BASE")
    for part in ${AB_PARTS:-decode design weights}; do
      SECONDS=0
      (cd "$tree" && PYTHONPATH=$tree:/tmp/site timeout ${LIMIT:-200} python3 $here/tools/step_ab.py \
          $OUT/ab_${tag}_${n}_$part.json $part > $OUT/ab_${tag}_${n}_$part.log 2>&1)
      echo "== ab $tag ($n) $part: rc=$? ${SECONDS}s"; grep "^$part" $OUT/ab_${tag}_${n}_$part.log | tail -2
    done
  done
fi
for b in decode widths design weights; do
  if has $b; then
    if [ -n "${BASE:-}" ]; then bench $b "$here/$BASE" .base; fi
    bench $b "$here" ""
  fi
done
