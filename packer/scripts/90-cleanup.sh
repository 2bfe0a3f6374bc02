#!/usr/bin/env bash
# Leaves no build-time secrets, keys or logs in the image (AWS Marketplace scans for them).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

apt-get -y -q autoremove
apt-get clean
rm -rf /var/lib/apt/lists/* /tmp/s4-gate* /root/.cache /home/ubuntu/.cache
cloud-init clean --logs
rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub
rm -f /root/.ssh/authorized_keys /home/ubuntu/.ssh/authorized_keys
rm -f /root/.bash_history /home/ubuntu/.bash_history
journalctl --rotate
journalctl --vacuum-time=1s
