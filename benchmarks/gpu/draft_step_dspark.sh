#!/bin/bash
# On the GPU machine, from the repository root: the DSpark draft-step benchmark, its fused Markov
# step against the two-kernel one (markov_step.py), then the
# GPU-marked DSpark tests (and the DFlash ones, whose graph runner DSpark shares, if time is left).
# Results and logs go to $OUT (default /tmp/draft-step-dspark); about 4 minutes at most.
# conftest.py imports pyzmq, which the GPU image lacks: these tests need none of it.
set -x
OUT=${OUT:-/tmp/draft-step-dspark}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${BENCH_TIMEOUT:-110}" python3 benchmarks/draft_step_dspark.py --out "$OUT/draft-step-dspark-h200.json" \
    > "$OUT/bench.log" 2>&1
echo "benchmark rc=$? after $((SECONDS - start)) s"
grep -E "^\{|Error|error|\"ratio\"" "$OUT/bench.log" | tail -40
timeout 60 python3 benchmarks/markov_step.py --tiles 32:4:3:4,128:4:3:2 --out "$OUT/markov-step.json" > "$OUT/markov.log" 2>&1
echo "markov step rc=$? after $((SECONDS - start)) s"; grep -E '"ratio"' "$OUT/markov.log"
timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q --noconftest -p no:cacheprovider \
    tests/test_dspark_gpu.py > "$OUT/gpu-tests.log" 2>&1
echo "dspark gpu tests rc=$? after $((SECONDS - start)) s"
tail -25 "$OUT/gpu-tests.log"
left=$((${DSPARK_TOTAL_S:-225} - (SECONDS - start)))
if [ "$left" -gt 20 ]; then
  timeout "$left" python3 -m pytest -q -x --noconftest -p no:cacheprovider \
      tests/test_dflash_gpu.py > "$OUT/dflash-gpu-tests.log" 2>&1
  echo "dflash gpu tests rc=$? after $((SECONDS - start)) s"
  tail -8 "$OUT/dflash-gpu-tests.log"
fi
