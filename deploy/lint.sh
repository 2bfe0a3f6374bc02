#!/usr/bin/env bash
# Checks deploy/ and packer/ with their own tools, installing what is missing: shellcheck,
# packer (Debian's 1.6.6, offline) and systemd-analyze from apt; cfn-lint and checkov from pip,
# each in a venv of its own under .tools/ (git-ignored), so neither touches the project's. Run from anywhere; CI runs it from .ci/run. Exits non-zero on
# the first finding.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CFN_LINT_VERSION=1.51.0
CHECKOV_VERSION=3.3.30
CHECKOV_VENV=.tools/checkov
CFN_LINT_VENV=.tools/cfn-lint
EXPOSURE_MAX=25  # systemd-analyze security's 0-100 scale: 2.5

step() {
    local name=$1 start=$SECONDS
    shift
    "$@"
    echo "deploy lint: ${name}: ok ($((SECONDS - start)) s)"
}

apt_install() {
    local missing=()
    command -v shellcheck >/dev/null || missing+=(shellcheck)
    command -v packer >/dev/null || missing+=(packer)
    command -v systemd-analyze >/dev/null || missing+=(systemd)
    ((${#missing[@]})) || return 0
    export DEBIAN_FRONTEND=noninteractive
    local try
    for try in 1 2 3; do
        if apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends \
            "${missing[@]}" >/dev/null; then
            return 0
        fi
        echo "deploy lint: apt-get failed (try ${try}), retrying" >&2
        sleep $((try * 5))
    done
    return 1
}

quietly() {
    # pip's chatter goes to a log that is shown only when the command fails
    local log rc=0
    log=$(mktemp)
    "$@" >"${log}" 2>&1 || rc=$?
    ((rc == 0)) || cat "${log}" >&2
    rm -f "${log}"
    return "${rc}"
}

venv_install() {
    # venv_install DIR PACKAGE VERSION: PACKAGE==VERSION in the venv DIR, unless it is there
    local dir=$1 package=$2 version=$3
    if [[ -x ${dir}/bin/python ]] && [[ $("${dir}/bin/python" -m pip show "${package}" \
        2>/dev/null | sed -n 's/^Version: //p') == "${version}" ]]; then
        return 0
    fi
    python3 -m venv "${dir}"
    quietly "${dir}/bin/python" -m pip install -q "${package}==${version}"
}

pip_install() {
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
    venv_install "${CFN_LINT_VENV}" cfn-lint "${CFN_LINT_VERSION}"
    venv_install "${CHECKOV_VENV}" checkov "${CHECKOV_VERSION}"
}

shell_scripts() {
    shellcheck deploy/*.sh packer/*.sh packer/scripts/*.sh
}

unit_file() {
    # verify checks that ExecStart's program exists: the image's venv is not here, so a copy
    # names this machine's python3 instead (everything else is checked as written).
    local dir out
    dir=$(mktemp -d)
    sed "s|/opt/s4weights/venv/bin/python|$(command -v python3)|" deploy/s4-runner.service \
        > "${dir}/s4-runner.service"
    out=$(systemd-analyze verify "${dir}/s4-runner.service" 2>&1)
    rm -r "${dir}"
    if [[ -n ${out} ]]; then
        echo "${out}" >&2
        return 1
    fi
    systemd-analyze security --offline=true --threshold="${EXPOSURE_MAX}" \
        deploy/s4-runner.service | tail -n 1
}

cloudformation() {
    "${CFN_LINT_VENV}/bin/cfn-lint" deploy/cfn-train-runner.yaml
    "${CHECKOV_VENV}/bin/checkov" -f deploy/cfn-train-runner.yaml --framework cloudformation \
        --compact --quiet --skip-download
}

packer_template() {
    # The file provisioner wants the source archive to exist: build.sh makes it from HEAD.
    git archive --format=tar.gz -o packer/s4weights-src.tar.gz HEAD
    local rc=0
    packer fmt -check packer/ && packer validate packer/ || rc=$?
    rm -f packer/s4weights-src.tar.gz
    return "${rc}"
}

step "install (apt)" apt_install
step "install (cfn-lint and checkov venvs)" pip_install
step "shellcheck" shell_scripts
step "systemd-analyze verify, security" unit_file
step "cfn-lint, checkov" cloudformation
step "packer fmt, validate (packer $(packer version | head -n 1))" packer_template
