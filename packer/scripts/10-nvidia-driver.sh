#!/usr/bin/env bash
# The NVIDIA driver from Ubuntu's archive (signed kernel modules for the AWS kernel), then a
# reboot so it loads; the next provisioner waits for the instance to come back.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
branch=${NVIDIA_DRIVER_BRANCH:?NVIDIA_DRIVER_BRANCH is not set}

apt-get update -q
apt-get -y -q upgrade
apt-get install -y -q --no-install-recommends \
    "linux-modules-nvidia-${branch}-aws" "nvidia-driver-${branch}" \
    "nvidia-utils-${branch}" python3.10-venv python3-pip git \
    gcc python3.10-dev  # (s4format compiles its CPU kernels for the image's CPU with these)
systemctl enable nvidia-persistenced.service || true
echo "nvidia driver ${branch} installed; rebooting"
systemctl reboot
