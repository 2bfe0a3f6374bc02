#!/usr/bin/env bash
# Everything measured on a GPU machine, in one go, from the repository root of an install with
# the gpu extra (docs/gpu.md):
#
#   bash bench/run_gpu.sh [STAGE...]  # default: tests conformance gate gpu checkpoints flat dcp cpu
#
# Stages: tests (the GPU tests), conformance (the suite on the GPU path), gate (the image build's
# gate), gpu, checkpoints, flat, dcp (the benches on CUDA), cpu (bench/cpu_speed.py with the GPU
# hidden), breakdown (bench/breakdown.py with the GPU hidden, at 8, 4 and 2 threads), kernels
# (the CPU kernels built ahead of time for the host's CPU, and their tests).
# Each stage's log and the benches' JSON land in $OUT; the exit status is 0 only when every
# stage passed.
set -o pipefail
export OUT=${OUT:-/tmp/s4-gpu-out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests conformance gate gpu checkpoints flat dcp cpu)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    | tee "$OUT/gpu_info.txt"
failed=()
for stage in "${stages[@]}"; do
    echo "=== $stage $(date -u +%H:%M:%S)"
    case $stage in
        tests) python3 -m pytest -q -m gpu tests/gpu && python3 -m pytest -q tests/dcp/test_gpu.py ;;
        conformance) python3 -m s4format conformance --device cuda ;;
        gate) python3 packer/gate.py --report "$OUT/gate.json" ;;
        gpu) python3 bench/gpu.py ;;
        checkpoints) python3 bench/checkpoints.py --device cuda ;;
        flat) python3 bench/flat.py --device cuda ;;
        dcp) python3 bench/dcp.py --device cuda --ranks 1 ;;
        cpu) CUDA_VISIBLE_DEVICES="" python3 bench/cpu_speed.py --reps 3 ;;
        breakdown) for t in 8 4 2; do
                       CUDA_VISIBLE_DEVICES="" S4_THREADS=$t OUT="$OUT/threads-$t" \
                           python3 bench/breakdown.py --reps 5 || exit 1
                   done ;;
        kernels) python3 -m pytest -q tests/format/test_kernels_built.py ;;
        *) echo "unknown stage $stage"; false ;;
    esac 2>&1 | tee "$OUT/$stage.log"
    status=$?
    [ $status -eq 0 ] || failed+=("$stage (exit $status)")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all stages passed: ${stages[*]}"
