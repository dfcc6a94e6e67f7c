#!/usr/bin/env bash
# Run on the GPU machine (device tool): GPU tests, then the runtime benchmark.
set -u
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, cupy; print('jax', jax.__version__, 'cupy', cupy.__version__, jax.devices())"
timeout ${TEST_TIMEOUT:-360} python3 -m pytest -m gpu -q ${PYTEST_FLAGS:--x} -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee $OUT/pytest_gpu.log | tail -40
timeout ${BENCH_TIMEOUT:-200} python3 examples/benchmark_runtime.py --json $OUT/bench.json 2>&1 | tee $OUT/bench.log
timeout ${TRAIN_TIMEOUT:-240} python3 examples/benchmark_train.py --json $OUT/train.json 2>&1 | tee $OUT/train.log
