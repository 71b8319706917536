#!/bin/bash
# On the GPU machine, from the repository root: does the host's share of a DSpark propose follow the
# CPU the process runs on? The GPU's NUMA-local CPUs, the machine's topology and clocks, then
# draft_step_dspark.py --main unpinned and pinned (taskset) to a GPU-local CPU and to a remote one,
# twice each, interleaved; propose_phases.py pinned local. To $OUT/a.tgz; key figures on stdout.
O=$OUT/a; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/transport/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed 's/^0000//')
local=$(cat /sys/bus/pci/devices/$bus/local_cpulist 2>/dev/null)
{ echo "gpu bus $bus local_cpulist $local numa_node $(cat /sys/bus/pci/devices/$bus/numa_node 2>/dev/null)"
  nproc; lscpu | grep -iE "model name|socket|numa|mhz|thread|core"; nvidia-smi topo -m
  grep MHz /proc/cpuinfo | sort | uniq -c | head; uptime; } > $O/topo.txt 2>&1
head -3 $O/topo.txt; grep -i numa $O/topo.txt
lo=$(python3 -c "import os; s='$local'.split(',')[0]; a=int(s.split('-')[0]) if s else 0; print(a + 2)")
all=$(python3 -c "import os; print(sorted(os.sched_getaffinity(0)))")
far=$(python3 -c "
import os
s='$local'; cpus=set()
for p in filter(None, s.split(',')):
    a, _, b = p.partition('-'); cpus |= set(range(int(a), int(b or a) + 1))
rest = sorted(set(os.sched_getaffinity(0)) - cpus); print(rest[len(rest)//2] if rest else -1)")
echo "local cpu $lo, remote cpu $far, allowed $all"
run() {  # name, taskset prefix
  timeout 90 $2 python3 benchmarks/draft_step_dspark.py --main --out $O/$1.json > $O/$1.log 2>&1
  echo -n "$1 rc=$? "; python3 -c "
import json; d = json.load(open('$O/$1.json'))
print(' '.join('B%d: %.3f/%.3f host %.3f eager %.2f' % (r['B'], r['propose_ms'], r['graph_device_ms'],
      max(r['propose_ms'], r['sampled_ms']) - r['graph_device_ms'], r['eager_ms']) for r in d['table']),
      'ratio %.3f' % d['summary']['ratio'])"
}
for i in 1 2; do
  run free-$i ""
  run local-$i "taskset -c $lo"
  [ "$far" != "-1" ] && run remote-$i "taskset -c $far"
done
timeout 90 taskset -c $lo python3 benchmarks/propose_phases.py --batches 1,32 --iters 100 --out $O/phases-local.json > $O/phases-local.log 2>&1
echo "phases local rc=$?"; grep "^{'B'" $O/phases-local.log | cut -c1-700
cd $OUT && tar czf a.tgz a && rm -rf a
