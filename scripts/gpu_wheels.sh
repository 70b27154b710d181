#!/usr/bin/env bash
# Wheels a GPU machine without a package index needs to run weighthub from this source tree
# (`scripts/gpu_check.sh`): the device tool's H200s ship torch, numba and transformers, not
# these. Downloaded into .gpu-wheels/ (git-ignored) for CPython 3.10-3.13 on x86-64, ~30 MB;
# carry that folder with the run (`carry: [".gpu-wheels"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-wheels
mkdir -p "$out"
for v in 310 311 312 313; do
  pip download -q --only-binary=:all: --no-deps -d "$out" --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 zstandard msgspec xxhash safetensors
done
pip download -q --no-deps -d "$out" hypothesis sortedcontainers pytest-timeout
du -sh "$out"
