#!/usr/bin/env bash
# The device checks of the GPU backend, as one prepared run on a machine with a CUDA GPU (the
# device tool's H200: no package index, its own torch/numba/transformers): the `gpu`-marked tests
# of the device kernels, publisher, receiver and targets, then `weighthub bench gpu` on
# Llama-3-8B shapes. Logs and the bench's JSON go to $OUT (default ./gpu-out).
#
#   here:   bash scripts/gpu_wheels.sh          (once: .gpu-wheels/, for the missing packages)
#   there:  bash scripts/gpu_check.sh           (carry .gpu-wheels; ~5-7 minutes on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
{
  python -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, numba; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__)"
} 2>&1 | tee "$out/machine.txt"
rc=0
python -m pytest -q -p no:cacheprovider -m gpu tests/unit 2>&1 | tee "$out/gpu-tests.log" || rc=1
python -m weighthub.cli bench gpu --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.log" \
  || rc=1
exit $rc
