python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Everything the GPU machine runs, in one go (from the repo root, with .whl/ carried; fetch the
# wheels here first with `bash ../shared/scripts/gpu-wheels.sh`): GPU tests, the conformance
# suite on the GPU path, then the benchmarks.
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
# save_checkpoint in a training loop (GPU memory, time), and the host's share of the d2d calls
python3 bench/checkpoint_gpu.py 2>&1 | tee "$OUT/checkpoint_gpu.log"
checkpoint=$?
python3 bench/host_stages.py 2>&1 | tee "$OUT/host_stages.log"
# a base -> delta chain loaded back on the GPU at every depth
python3 bench/chain_load_gpu.py 2>&1 | tee "$OUT/chain_load_gpu.log"
chainload=$?
# states under 640 MiB at their default workspace; a fresh process's first save and load
python3 bench/small_states.py 2>&1 | tee "$OUT/small_states.log"
small=$?
python3 bench/cold_start.py 2>&1 | tee "$OUT/cold_start.log"
cold=$?
echo "tests exit $tests, conformance exit $conformance, bench exit $bench, checkpoint exit $checkpoint, chain load exit $chainload, small states exit $small, cold start exit $cold"
exit $(( tests || conformance || bench || checkpoint || chainload || small || cold ))
