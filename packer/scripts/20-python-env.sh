#!/usr/bin/env bash
# The runner's Python environment: /opt/s4weights/venv with torch (its CUDA 12 runtime wheels)
# and s4weights[gpu,s3,runner] built from the uploaded archive of the repository, which stays
# in /opt/s4weights/src (the gate reads its conformance vectors from there).
set -euo pipefail
torch_version=${TORCH_VERSION:?TORCH_VERSION is not set}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
install -d -m 0755 /opt/s4weights /opt/s4weights/src
tar -xzf /tmp/s4weights-src.tar.gz -C /opt/s4weights/src
rm -f /tmp/s4weights-src.tar.gz
python3 -m venv /opt/s4weights/venv
venv=/opt/s4weights/venv/bin
"${venv}/python" -m pip install -q --upgrade pip
"${venv}/python" -m pip install -q "torch==${torch_version}"
# CuPy compiles the kernels with NVRTC: [ctk] brings the CUDA 12 toolkit's libraries as wheels.
"${venv}/python" -m pip install -q "cupy-cuda12x[ctk]>=13"
"${venv}/python" -m pip install -q "/opt/s4weights/src[gpu,s3,runner,kernels]"
"${venv}/python" -c "import s4weights.runner, s4weights.gpu as g, torch; \
print('s4weights', __import__('s4weights').__version__, 'torch', torch.__version__, \
'gpu path available:', g.available())"
# The CPU kernels compiled ahead of time for this CPU: a fresh job's first save or load then
# skips numba's start-up (about 0.5 s). The runner's unit sets S4_KERNEL_DIR to this folder; on
# an instance with another CPU the kernels are not used and numba compiles them as before.
install -d -m 0755 /opt/s4weights/kernels
S4_KERNEL_DIR=/opt/s4weights/kernels "${venv}/python" -m s4format kernels build
