#!/bin/bash
# On the GPU machine, from the repository root: NEW_TREE's DSpark engine (default: this tree; else an
# archive of src, tests and benchmarks, carried) against OLD_TREE's
# (default .ab-old/s28: `git archive 2867358 src benchmarks`, carried), both timed by NEW_TREE's
# benchmarks: draft_step_dspark.py --main old/new/old/new (ROUNDS pairs), once more with OLD_TREE's
# own benchmark (its timer also held a device synchronize; OWN=0 skips it), graph_run_steps.py and propose_phases.py
# at B = 1 and 32 (new), then the GPU tests (TESTS). To $OUT/r.tgz.
O=$OUT/r; mkdir -p $O
OLD_TREE=${OLD_TREE:-.ab-old/s28}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $O/gpu.txt
lscpu | grep -E "Model name|^CPU\(s\)|MHz" | tee -a $O/gpu.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/transport/*.whl
N=${NEW_TREE:-.}
NEW="/tmp/site:$PWD/$N/src:$PWD/$N/tests:$PWD/$N/benchmarks"
OLD="/tmp/site:$PWD/$OLD_TREE/src:$PWD/tests:$PWD/$OLD_TREE/bench-new"
rm -rf $OLD_TREE/bench-new && cp -r $N/benchmarks $OLD_TREE/bench-new   # a benchmark puts its own ../src first
export PYTHONUNBUFFERED=1
start=$SECONDS
show() { grep -E "^\{'B'" $1 | python3 -c "
import sys, ast
for l in sys.stdin:
    d = ast.literal_eval(l); print(d['B'], round(d['propose_ms'],4), round(d['sampled_ms'],4), round(d['floor_ms'],4), round(d['ratio'],4), round(d.get('graph_device_ms',0),4))"; }
for i in $(seq 1 ${ROUNDS:-2}); do
  for v in old new; do
    if [ $v = old ]; then P=$OLD; B=$OLD_TREE/bench-new; else P=$NEW; B=$N/benchmarks; fi
    PYTHONPATH=$P timeout 80 python3 $B/draft_step_dspark.py --main --out $O/main-$v-$i.json > $O/main-$v-$i.log 2>&1
    echo "main $v $i rc=$? $((SECONDS-start))s"; show $O/main-$v-$i.log
  done
done
if [ "${OWN:-1}" = 1 ]; then
  PYTHONPATH="/tmp/site:$PWD/$OLD_TREE/src:$PWD/tests:$PWD/$OLD_TREE/benchmarks" timeout 80 python3 $OLD_TREE/benchmarks/draft_step_dspark.py \
    --main --out $O/main-old-own.json > $O/main-old-own.log 2>&1
  echo "main old (its own benchmark) rc=$? $((SECONDS-start))s"; show $O/main-old-own.log
fi
PYTHONPATH=$NEW timeout 100 python3 $N/benchmarks/graph_run_steps.py --batches 1,32 --iters 300 --out $O/steps.json > $O/steps.log 2>&1
echo "steps rc=$? $((SECONDS-start))s"; grep -E "^\{'B'" $O/steps.log
PYTHONPATH=$NEW timeout 100 python3 $N/benchmarks/propose_phases.py --batches 1,32 --iters 200 --out $O/phases.json > $O/phases.log 2>&1
echo "phases rc=$? $((SECONDS-start))s"; grep -E "^\{'B'" $O/phases.log | cut -c1-400
left=$((${LIMIT:-580} - (SECONDS - start)))
PYTHONPATH=$NEW timeout $left python3 -m pytest -q --noconftest -p no:cacheprovider ${TESTS:-$N/tests/test_dspark_gpu.py $N/tests/test_dflash_gpu.py} > $O/gpu-tests.log 2>&1
echo "gpu tests rc=$? $((SECONDS-start))s"; tail -4 $O/gpu-tests.log
cd $OUT && tar czf r.tgz r && rm -rf r
