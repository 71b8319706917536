#!/usr/bin/env bash
# The 2x H200 re-run of the DMA router (issue 12) in one command, from the repository root:
#
#   bash benchmarks/gpu/run_h200x2.sh OUT_DIR [WHEELS_B_DIR]
#
# Runs benchmarks/gpu/dma_checks.py and benchmarks/allreduce.py under torchrun on every GPU of the
# host, then benchmarks/gpu/verdict.py, which prints one PASS/FAIL line per acceptance criterion
# (bit-exactness vs NCCL, CUDA-graph replay, teardown memory, sleep mode, a set-up fault, the auto
# crossover, router / best single backend >= 0.97 at every size) and exits non-zero on any FAIL.
# If b12x is not importable, WHEELS_B_DIR/install.sh (from ../shared/tools/gpu-wheels) installs it;
# see benchmarks/gpu/README.md. OUT_DIR receives at most 7 files.
set -uo pipefail
out=${1:?usage: run_h200x2.sh OUT_DIR [WHEELS_B_DIR]}
wheels=${2:-}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -c "import b12x.comm.pcie" 2>/dev/null; then
  if [ -z "$wheels" ]; then echo "b12x is not importable and no wheel folder was given" >&2; exit 2; fi
  # shellcheck disable=SC1091
  source "$wheels/install.sh"
fi
gpus=$(nvidia-smi -L | wc -l)
{ nvidia-smi topo -m; python3 -c "import torch, b12x; print('torch', torch.__version__, 'b12x', getattr(b12x, '__version__', '?'))"; } \
  > "$out/host.txt" 2>&1
torchrun --nproc-per-node "$gpus" benchmarks/gpu/dma_checks.py --out "$out" --machine h200x2 \
  > "$out/dma-checks.log" 2>&1
echo "dma_checks exit $?" | tee -a "$out/host.txt"
torchrun --nproc-per-node "$gpus" benchmarks/allreduce.py --out "$out" --machine h200x2 \
  > "$out/allreduce.log" 2>&1
echo "allreduce exit $?" | tee -a "$out/host.txt"
python3 benchmarks/gpu/verdict.py "$out" --machine h200x2 | tee "$out/verdict.txt"
exit "${PIPESTATUS[0]}"
