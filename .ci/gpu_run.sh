#!/usr/bin/env bash
# Run on the GPU machine (device tool): GPU tests, then the runtime benchmark (looped,
# blocked and GPU time), then the model suite (looped next to blocked), the coverage
# benchmarks (COVERAGE=1), the data-parallel step (DATA_PARALLEL=1) and the library
# programs (LIBRARIES=1) if asked.
set -u
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
# jax would take 75% of the GPU at start-up in each test worker.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, cupy; print('jax', jax.__version__, 'cupy', cupy.__version__, jax.devices())"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu -q -rf ${PYTEST_FLAGS:--n 4} -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee $OUT/pytest_gpu.log | grep -E "^FAILED|passed|failed" | tail -40
fi
if [ -z "${SKIP_RUNTIME:-}" ]; then
  timeout ${BENCH_TIMEOUT:-200} python3 examples/gpu/benchmark_runtime.py --json $OUT/bench.json 2>&1 | tee $OUT/bench.log
fi
if [ -n "${SUITE:-}" ]; then
  timeout ${SUITE_TIMEOUT:-420} python3 -m nimblejax.bench --models ${SUITE} --batch ${SUITE_BATCH:-1,32} --repeat ${SUITE_REPEAT:-50} --no-cold --json $OUT/suite.json 2>&1 | tee $OUT/suite.log | tail -60
fi
if [ -n "${BENCH_MAIN:-}" ]; then
  # The main command with its defaults: wall time and when each row appeared.
  start=$(date +%s)
  timeout ${BENCH_MAIN_TIMEOUT:-400} python3 -m nimblejax.bench --json $OUT/bench_main.json 2>$OUT/bench_main.err \
    | while IFS= read -r line; do echo "[+$(( $(date +%s) - start ))s] $line"; done | tee $OUT/bench_main.log
  echo "bench main: $(( $(date +%s) - start )) s"
fi
if [ -n "${COVERAGE:-}" ]; then
  # Issue 13: embedding lookup / scatter-add against jax.jit, and the fuzzer's summary.
  timeout ${COVERAGE_TIMEOUT:-200} python3 -m nimblejax.bench.indexing --out $OUT/indexing.json 2>&1 | tee $OUT/indexing.log
  NIMBLE_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-300} timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/end_to_end/test_fuzz.py 2>&1 | grep -E "nimble fuzz|passed|failed" | tee $OUT/fuzz.log
fi
if [ -n "${LIBRARIES:-}" ]; then
  # Issue 33: the library programs of tests/end_to_end/test_lib_*.py looped, jax.jit against
  # nimble; equinox's checks as host callbacks (co-execution), then without (one plan).
  timeout ${LIB_TIMEOUT:-300} python3 examples/gpu/benchmark_libraries.py --json $OUT/libraries.json 2>&1 | tee $OUT/libraries.log
  EQX_ON_ERROR=nan timeout ${LIB_TIMEOUT:-300} python3 examples/gpu/benchmark_libraries.py --json $OUT/libraries_nan.json 2>&1 | tee $OUT/libraries_nan.log
fi
if [ -n "${DATA_PARALLEL:-}" ]; then
  # Issue 16: samples/s of the data-parallel step on 1 and all GPUs, nimble vs jax.jit.
  timeout ${DP_TIMEOUT:-400} python3 -m nimblejax.bench.data_parallel --models mlp,resnet50 --per-device-batch 32 --json $OUT/data_parallel.json 2>&1 | tee $OUT/data_parallel.log
fi

