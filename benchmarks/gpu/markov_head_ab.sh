#!/bin/bash
# On the GPU machine, from the repository root: the one-launch Markov head (branch s26-markov) against
# the code before it, OLD_TREE (default .ab-old/s26: `git archive 922d7fd src benchmarks`, carried):
# its exact chain check in bf16 and fp32, draft_step_dspark.py --main old/new/old/new, markov_step.py
# (walk back vs forward), propose_phases.py, then tests/test_dspark_gpu.py. About 8 minutes; to $OUT/r.tgz.
O=$OUT/r; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $O/gpu.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/transport/*.whl
NEW="/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks"
OLD="/tmp/site:$PWD/${OLD_TREE:-.ab-old/s26}/src:$PWD/tests:$PWD/${OLD_TREE:-.ab-old/s26}/benchmarks"
export PYTHONUNBUFFERED=1
start=$SECONDS
PYTHONPATH=$NEW timeout 90 python3 -c "
import torch, dflash_triton_check as c
for dt in (torch.bfloat16, torch.float32):
    c.markov_chain('cuda', dt, torch.Generator().manual_seed(1))
print('markov_chain ok')" > $O/chain.log 2>&1; echo "chain rc=$? $((SECONDS-start))s"; tail -3 $O/chain.log
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then P=$OLD; B=${OLD_TREE:-.ab-old/s26}/benchmarks; else P=$NEW; B=benchmarks; fi
    PYTHONPATH=$P timeout 80 python3 $B/draft_step_dspark.py --main --out $O/main-$v-$i.json > $O/main-$v-$i.log 2>&1
    echo "main $v $i rc=$? $((SECONDS-start))s"; grep -E "^\{'B'" $O/main-$v-$i.log | python3 -c "
import sys, ast
for l in sys.stdin:
    d = ast.literal_eval(l); print(d['B'], round(d['propose_ms'],4), round(d['sampled_ms'],4), round(d['floor_ms'],4), round(d['ratio'],4), round(d.get('graph_device_ms',0),4))"
  done
done
PYTHONPATH=$NEW timeout 60 python3 benchmarks/markov_step.py --tiles 128:4:3 --batches 1,32 --out $O/markov-new.json > $O/markov-new.log 2>&1
echo "markov new rc=$? $((SECONDS-start))s"; grep -E "^\{'B'" $O/markov-new.log | cut -c1-400
PYTHONPATH=$NEW timeout 60 python3 benchmarks/propose_phases.py --batches 1,32 --iters 100 --out $O/phases.json > $O/phases.log 2>&1
echo "phases rc=$? $((SECONDS-start))s"; grep -E "^\{'B'" $O/phases.log
left=$((560 - (SECONDS - start)))
PYTHONPATH=$NEW timeout $left python3 -m pytest -q -x --noconftest -p no:cacheprovider tests/test_dspark_gpu.py > $O/gpu-tests.log 2>&1
echo "dspark gpu tests rc=$? $((SECONDS-start))s"; tail -4 $O/gpu-tests.log
cd $OUT && tar czf r.tgz r && rm -rf r
