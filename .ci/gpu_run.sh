#!/usr/bin/env bash
# Run on the GPU machine (device tool): GPU tests, then the runtime benchmark (looped,
# blocked and GPU time), then the model suite (looped next to blocked) if asked.
set -u
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, cupy; print('jax', jax.__version__, 'cupy', cupy.__version__, jax.devices())"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q ${PYTEST_FLAGS:-} -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee $OUT/pytest_gpu.log | tail -40
fi
if [ -z "${SKIP_RUNTIME:-}" ]; then
  timeout ${BENCH_TIMEOUT:-200} python3 examples/benchmark_runtime.py --json $OUT/bench.json 2>&1 | tee $OUT/bench.log
fi
if [ -n "${SUITE:-}" ]; then
  timeout ${SUITE_TIMEOUT:-420} python3 -m nimblejax.bench --models ${SUITE} --batch ${SUITE_BATCH:-1,32} --repeat ${SUITE_REPEAT:-50} --no-cold --json $OUT/suite.json 2>&1 | tee $OUT/suite.log | tail -60
fi
