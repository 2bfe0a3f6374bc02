#!/usr/bin/env bash
# The runner's system user and its unit, enabled. The unit starts once the stack's user data
# has written /etc/s4weights/runner.toml.
set -euo pipefail

if ! id s4runner >/dev/null 2>&1; then
    useradd --system --user-group --no-create-home --home-dir /var/lib/s4-runner \
        --shell /usr/sbin/nologin s4runner
fi
install -d -m 0750 -o root -g s4runner /etc/s4weights
install -m 0644 /opt/s4weights/src/deploy/s4-runner.service /etc/systemd/system/s4-runner.service
systemd-analyze verify /etc/systemd/system/s4-runner.service
systemctl daemon-reload
systemctl enable s4-runner.service
echo "s4-runner.service: exposure $(systemd-analyze security s4-runner.service | tail -n 1)"
