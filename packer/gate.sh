#!/usr/bin/env bash
# The image build's GPU gate (see packer/gate.py): fails unless an NVIDIA GPU is visible, the
# conformance suite passes on the GPU path and every GPU save -> load round trip is bit-exact.
# Usage: packer/gate.sh [--report FILE] [--break-plane-merge]   (the last one: test switch only)
# S4_GATE_PYTHON picks the interpreter (default: python3 on PATH).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${S4_GATE_PYTHON:-python3}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gate: FAIL: no usable GPU: nvidia-smi not found (no NVIDIA driver)" >&2
    exit 3
fi
if ! gpus=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader); then
    echo "gate: FAIL: no usable GPU: nvidia-smi cannot query a GPU" >&2
    exit 3
fi
echo "gate: nvidia-smi: ${gpus}"
exec "${python}" "${here}/gate.py" "$@"
