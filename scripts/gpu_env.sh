# Sourced by the GPU scripts: the source tree on PYTHONPATH, offline Hugging Face, and the
# packages the device machine lacks installed from the carried .gpu-wheels (no index there).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -d .gpu-wheels ]; then
  for pkg in zstandard msgspec xxhash safetensors hypothesis sortedcontainers pytest_timeout; do
    python -c "import $pkg" 2>/dev/null && continue
    pip install -q --no-index --no-deps --find-links .gpu-wheels "${pkg//_/-}" 2>&1 | tail -1
  done
fi
