#!/usr/bin/env bash
# Builds the image from the committed tree: an archive of HEAD, then `packer build packer/`.
# Extra arguments go to packer build (e.g. -var region=eu-west-1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! git diff --quiet HEAD --; then
    echo "build: note: uncommitted changes are not in the image (it is built from HEAD)" >&2
fi
git archive --format=tar.gz -o packer/s4weights-src.tar.gz HEAD
exec packer build "$@" packer/
