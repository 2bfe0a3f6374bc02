python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Everything the GPU machine runs, in one go (from the repo root, with .whl/ carried; fetch the
# wheels here first with `bash ../shared/scripts/gpu-wheels.sh`): GPU tests, the conformance
# suite on the GPU path, then the benchmark.
# Logs and bench/gpu.py's JSON land in $OUT.
set -o pipefail
export OUT=${OUT:-/tmp/s4-gpu-out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu_info.txt"
python3 -m pytest -q -m gpu tests/gpu ${S4_PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
tests=$?
# The AMI-build gate: the conformance suite on the GPU path; fails loudly without a GPU.
python3 -m s4format conformance --device cuda 2>&1 | tee "$OUT/conformance_cuda.log"
conformance=$?
python3 bench/gpu.py 2>&1 | tee "$OUT/gpu_bench.log"
bench=$?
echo "tests exit $tests, conformance exit $conformance, bench exit $bench"
exit $(( tests || conformance || bench ))
