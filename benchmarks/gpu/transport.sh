#!/bin/bash
# On the GPU machine, from the repository root, with .gpu-wheels/transport carried (pyzmq and
# msgspec wheels for the image's Python): the GPU-marked transport and engine tests, then the
# transport benchmarks (rpc.py, ingest.py), the client round trip to a GPU DFlash server
# (draft_rpc.py, merged into the draft-step JSON) and one server for several targets
# (multi_client.py). Results and logs go to $OUT (default /tmp/transport).
set -x
OUT=${OUT:-/tmp/transport}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/transport/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|MHz"
python3 -m timeit -n 100000 "sum(range(100))"
timeout 120 python3 benchmarks/hotpath.py --steps 1000 --profile "$OUT/hotpath-profile.txt" > "$OUT/hotpath.json"
echo "hotpath rc=$?"; grep -E '"B"|_us' "$OUT/hotpath.json" | tr -d '\n '; echo
if [ -z "$SKIP_TESTS" ]; then
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_transport_hidden.py \
      tests/test_dflash_gpu.py > "$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"; tail -4 "$OUT/gpu-tests.log"
fi
timeout 200 python3 benchmarks/rpc.py --out "$OUT/rpc-h200.json" > "$OUT/rpc.log" 2>&1
echo "rpc rc=$?"; grep '^{"B"' "$OUT/rpc.log"
timeout 200 python3 benchmarks/ingest.py --out "$OUT/ingest-h200.json" > "$OUT/ingest.log" 2>&1
echo "ingest rc=$?"; grep '^{"rows"' "$OUT/ingest.log"
cp benchmarks/results/draft-step-h200.json "$OUT/"
timeout 200 python3 benchmarks/draft_rpc.py --merge "$OUT/draft-step-h200.json" > "$OUT/draft-rpc.log" 2>&1
echo "draft_rpc rc=$?"; grep -E 'round_trip_ms|store_plus|ping_pong' "$OUT/draft-rpc.log"
timeout 200 python3 benchmarks/multi_client.py --engine dflash --seconds 5 --out "$OUT/multi-client-h200.json" \
    > "$OUT/multi.log" 2>&1; echo "multi rc=$?"; grep -E '"ratio"|engine_calls|requests_per_engine' "$OUT/multi.log"
