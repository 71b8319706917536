#!/bin/bash
# On the GPU machine (one H200 is enough), from the repository root, with .gpu-wheels/transport
# carried (pyzmq and msgspec wheels for the image's Python): the device data plane's tests (GPU and
# the CPU refusal tests, which hold on a GPU host too) plus the transport's GPU tests, then the
# device-vs-host benchmarks (draft_rpc.py: propose round trip at B = 1, 8, 32, with the server's timeline,
# --trace-server; ingest.py: target blocking per deferred chunk), then one server for four targets
# (multi_client.py: which path the rows took is in its JSON); also the V2 launch's GPU tests and
# launch_host.py (held off steps). Everything lands in $OUT (JSON, logs, junit XML); about 9 minutes.
set -x
OUT=${OUT:-/tmp/device-plane}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/transport/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, zmq, msgspec; print(torch.__version__, torch.version.cuda, zmq.__version__, msgspec.__version__)" \
    >> "$OUT/gpu.txt" 2>&1
timeout 150 python3 -m pytest -q -rA -p no:cacheprovider --junitxml="$OUT/device-plane-tests.xml" \
    tests/test_device_plane_gpu.py tests/test_device_plane.py tests/test_transport_hidden.py \
    > "$OUT/device-plane-tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/rc.txt"; tail -5 "$OUT/device-plane-tests.log"
# the V2 launch on the GPU: held off steps against launched ones, the kernels against the torch ops, and
# the step thread's host time of a held step against a launch's (benchmarks/launch_host.py)
timeout 150 python3 -m pytest -q -rA -p no:cacheprovider --junitxml="$OUT/v2-launch-tests.xml" \
    tests/test_v2_held_rows.py tests/test_v2_launch_scatter.py > "$OUT/v2-launch-tests.log" 2>&1
echo "v2 launch tests rc=$?" | tee -a "$OUT/rc.txt"; tail -3 "$OUT/v2-launch-tests.log"
timeout 120 python3 benchmarks/launch_host.py --out "$OUT/launch-host.json" > "$OUT/launch-host.log" 2>&1
echo "launch_host rc=$?" | tee -a "$OUT/rc.txt"; grep -E '"(B|kernels_ms|held_kernels_ms|held_over_launch)"' "$OUT/launch-host.json" | tr -d '\n '; echo
timeout 200 python3 benchmarks/draft_rpc.py --iters 100 --batches 1,8,32 --paths host,device \
    --trace-server "$OUT/draft-rpc-server-trace.json" --out "$OUT/draft-rpc-h200.json" > "$OUT/draft-rpc.log" 2>&1
echo "draft_rpc rc=$?" | tee -a "$OUT/rc.txt"; grep -E '"(path_used|B|round_trip_ms|engine_ms|ratio)' "$OUT/draft-rpc.log" | tr -d '\n '; echo
timeout 60 python3 benchmarks/ingest.py --sizes 1536x21504,512x21504,128x21504 --iters 8 --warmup 2 \
    --gap-ms 40 --paths host,device --out "$OUT/ingest-h200.json" > "$OUT/ingest.log" 2>&1
echo "ingest rc=$?" | tee -a "$OUT/rc.txt"; grep '^{"rows"' "$OUT/ingest.log"
timeout 120 python3 benchmarks/multi_client.py --engine dflash --seconds 5 --out "$OUT/multi-client-h200.json" \
    > "$OUT/multi-client.log" 2>&1
echo "multi_client rc=$?" | tee -a "$OUT/rc.txt"; grep -E '"(ratio|requests_per_engine_call)"' "$OUT/multi-client-h200.json"
