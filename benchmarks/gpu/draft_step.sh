#!/bin/bash
# On the GPU machine, from the repository root: the draft-step benchmark, then the
# GPU-marked DFlash tests. Results and logs go to $OUT (default /tmp/draft-step).
# conftest.py imports pyzmq, which the GPU image lacks: the GPU tests need none of it.
set -x
OUT=${OUT:-/tmp/draft-step}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/draft_step.py --out "$OUT/draft-step-h200.json" \
    --profile-out "$OUT/profile.txt" > "$OUT/bench.log" 2>&1
echo "benchmark rc=$?"
grep -E "^\{|Error|error" "$OUT/bench.log" | tail -40
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -x --noconftest -p no:cacheprovider \
    tests/test_dflash_gpu.py > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$?"
tail -25 "$OUT/gpu-tests.log"
