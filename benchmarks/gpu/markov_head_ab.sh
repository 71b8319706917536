#!/bin/bash
# On the GPU machine, from the repository root: the Markov head of this tree against the code before
# it, OLD_TREE (default .ab-old/s28: `git archive 2867358 src benchmarks`, carried). The exact chain
# check in bf16 and fp32; markov_step.py's head per tile (TILES) at B = 32 and 1, greedy and
# sampled, and the old head; the tile with the best worst-of-B=32 head (or TILE) then runs
# draft_step_dspark.py --main old/new/old/new; then tests/test_dspark_gpu.py. About 8 minutes;
# to $OUT/r.tgz.
O=$OUT/r; mkdir -p $O
OLD_TREE=${OLD_TREE:-.ab-old/s28}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $O/gpu.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/transport/*.whl
NEW="/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks"
OLD="/tmp/site:$PWD/$OLD_TREE/src:$PWD/tests:$PWD/$OLD_TREE/benchmarks"
export PYTHONUNBUFFERED=1
start=$SECONDS
PYTHONPATH=$NEW timeout 90 python3 -c "
import torch, dflash_triton_check as c
for dt in (torch.bfloat16, torch.float32):
    c.markov_chain('cuda', dt, torch.Generator().manual_seed(1))
print('markov_chain ok')" > $O/chain.log 2>&1; echo "chain rc=$? $((SECONDS-start))s"; tail -1 $O/chain.log
show() { grep -E "^\{'B'" $1 | python3 -c "
import sys, ast
for l in sys.stdin:
    d = ast.literal_eval(l)
    print(d['B'], 'sampled' if d['sampled'] else 'greedy', 'floor', round(d['floor_ms']*1e3,1),
          'head', {k: round(v*1e3,1) for k, v in d.get('head_ms', {'walk_back': d['walk_back_ms']}).items()})"; }
PYTHONPATH=$OLD timeout 60 python3 $OLD_TREE/benchmarks/markov_step.py --tiles 128:4:3 --batches 32,1 --repeats 30 \
  --out $O/markov-old.json > $O/markov-old.log 2>&1
echo "markov old rc=$? $((SECONDS-start))s"; show $O/markov-old.log
PYTHONPATH=$NEW timeout 150 python3 benchmarks/markov_step.py ${TILES:+--tiles $TILES} --batches 32,1 --repeats 30 \
  --out $O/markov-new.json > $O/markov-new.log 2>&1
echo "markov new rc=$? $((SECONDS-start))s"; show $O/markov-new.log
BEST=${TILE:-$(python3 -c "
import json
t = [r for r in json.load(open('$O/markov-new.json'))['table'] if r['B'] == 32]
print(min(t[0]['head_ms'], key=lambda k: max(r['head_ms'][k] for r in t)))")}
echo "tile $BEST"
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then P=$OLD; B=$OLD_TREE/benchmarks; X=""; else P=$NEW; B=benchmarks; X="--markov-tile $BEST"; fi
    PYTHONPATH=$P timeout 80 python3 $B/draft_step_dspark.py --main $X --out $O/main-$v-$i.json > $O/main-$v-$i.log 2>&1
    echo "main $v $i rc=$? $((SECONDS-start))s"; grep -E "^\{'B'" $O/main-$v-$i.log | python3 -c "
import sys, ast
for l in sys.stdin:
    d = ast.literal_eval(l); print(d['B'], round(d['propose_ms'],4), round(d['sampled_ms'],4), round(d['floor_ms'],4), round(d['ratio'],4), round(d.get('graph_device_ms',0),4))"
  done
done
left=$((570 - (SECONDS - start)))
PYTHONPATH=$NEW timeout $left python3 -m pytest -q -x --noconftest -p no:cacheprovider tests/test_dspark_gpu.py > $O/gpu-tests.log 2>&1
echo "dspark gpu tests rc=$? $((SECONDS-start))s"; tail -3 $O/gpu-tests.log
cd $OUT && tar czf r.tgz r && rm -rf r
