#!/usr/bin/env bash
# The LoGRA device check (#14), as one prepared run on a machine with a CUDA GPU: the LoGRA
# unit tests there, then `weighthub bench logra --gpu` (Llama-3.2-1B shapes, fused AdamW vs
# LoGRA at ranks 16/64/256, memory variants, the 40 GB capacity search). Logs and JSON go to
# $OUT (default ./gpu-out). A second call after scripts/gpu_check.sh (each call ≤ 600 s):
#
#   there:  bash scripts/gpu_logra.sh           (carry .gpu-wheels; ~3-5 minutes, not yet measured)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
rc=0
python -m pytest -q -p no:cacheprovider tests/unit/test_logra.py tests/unit/test_logra_gpu.py 2>&1 \
  | tee "$out/logra-tests.log" || rc=1
python -m weighthub.cli bench logra --gpu --json "$out/bench-logra.json" 2>&1 \
  | tee "$out/bench-logra.log" || rc=1
exit $rc
