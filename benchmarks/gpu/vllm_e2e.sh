#!/bin/bash
# On the H200 (image: Python 3.12, torch 2.11 cu130, no package index), from the repository root:
#   bash benchmarks/gpu/vllm_e2e.sh PIECE_DIR [install] [gputest] [coalesce] [tiny] [p6]   (default: all but coalesce)
# PIECE_DIR is the last piece's folder (carried with this call); the earlier pieces were copied
# to ~/stash by back-to-back calls (benchmarks/gpu/README.md). install: reassemble, check the
# sha256, pip install --no-deps into /tmp/vsite, register k3-accel's vLLM entry point (vLLM finds
# general plugins through installed distributions; the code itself runs from src/), and check
# that vLLM and its stable-ABI libraries load. gputest: the GPU tests of the oracle engine, the fence, coalesced ingest, the launch kernels and held off steps.
# coalesce: benchmarks/coalesce.py (the server's engine alone, no vLLM). tiny: benchmarks/vllm_e2e_tiny.py. p6:
# benchmarks/e2e_p6.py. Results and logs go to $OUT (default /tmp/vllm-e2e).
set -x
OUT=${OUT:-/tmp/vllm-e2e}
SITE=/tmp/vsite
mkdir -p "$OUT"
piece=$1; shift
phases=${*:-install gputest tiny p6}
export PYTHONPATH=$SITE:$PWD/src:$PWD/benchmarks:$PWD/tests PYTHONUNBUFFERED=1 VLLM_USE_V2_MODEL_RUNNER=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_ALLOW_INSECURE_SERIALIZATION=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# no FlashInfer on the image: the V2 sampler would import it (topk_topp_sampler.flashinfer_sampler_supported)
export VLLM_USE_FLASHINFER_SAMPLER=0

install() {
  mkdir -p ~/stash /tmp/vwhl && cp "$piece"/part_* ~/stash/
  ls -l ~/stash
  sums=$(cd "$piece" && pwd)/all.tar.sha256
  cat ~/stash/part_* > /tmp/all.tar && (cd /tmp && sha256sum -c "$sums") || return 1
  tar -xf /tmp/all.tar -C /tmp/vwhl && rm -f /tmp/all.tar
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE /tmp/vwhl/*.whl || return 1
  # a dist-info for k3-accel: its entry point only (the code comes from src/, this checkout)
  d=$SITE/k3_accel-0.0.0.dist-info; mkdir -p $d
  printf 'Metadata-Version: 2.1\nName: k3-accel\nVersion: 0.0.0\n' > $d/METADATA
  printf '[vllm.general_plugins]\nk3_accel = k3_accel.plugin:register\n' > $d/entry_points.txt
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|triton|transformers|tokenizers|huggingface|numba|numpy|pydantic|vllm|msgspec|pyzmq|xgrammar) " | tee "$OUT/versions.txt"
  python3 - <<'PY' 2>&1 | tee "$OUT/import-check.txt"
import importlib, traceback
import torch
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
for step in ("import vllm", "import vllm._C_stable_libtorch", "import vllm._moe_C_stable_libtorch",
             "import vllm.vllm_flash_attn._vllm_fa3_C", "from vllm import LLM",
             "import vllm.v1.worker.gpu.model_runner", "import k3_accel.plugin",
             "from vllm.plugins import load_general_plugins; load_general_plugins()"):
    try:
        exec(step)
        print("OK  ", step)
    except BaseException as exc:
        print("FAIL", step, "->", type(exc).__name__, str(exc)[:400])
        traceback.print_exc(limit=3)
import vllm
print("vllm", vllm.__version__, "ops:", sorted(n for n in dir(torch.ops._C) if not n.startswith("_"))[:12])
PY
}

rc=0
deadline=$((SECONDS + ${TOTAL_S:-540}))    # p6 gets whatever is left of it
for phase in $phases; do
  case $phase in
    install) install > "$OUT/install.log" 2>&1; echo "install rc=$?"; tail -30 "$OUT/install.log" ;;
    tiny) timeout ${TINY_TIMEOUT:-520} python3 benchmarks/vllm_e2e_tiny.py --methods ${TINY_METHODS:-dflash,ngram,dspark} --out "$OUT/vllm-e2e-h200.json" \
            > "$OUT/tiny.log" 2>&1; r=$?; echo "tiny rc=$r"; [ $r -ne 0 ] && rc=$r
          grep -E "attempt|Error|error" "$OUT/tiny.log" | tail -30
          python3 -c "import json,sys; d=json.load(open('$OUT/vllm-e2e-h200.json')); print(json.dumps(d['summary'])); [print(k, json.dumps({x: v.get(x) for x in ('identical_outputs','accepted_per_position','mean_acceptance_length','server_ops_after_engine_start','killed_round','syncs_total','syncs_with_plugin_frames','plugin_sync_sites','memory_by_round','rounds_differing','error')})) for k, v in d['methods'].items()]" ;;
    gputest) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_oracle_engine.py tests/test_v2_gpu_fence.py tests/test_dflash_coalesce.py tests/test_v2_launch_scatter.py tests/test_v2_held_rows.py tests/test_device_plane_gpu.py tests/test_device_plane_streams_gpu.py \
            > "$OUT/gputest.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$OUT/gputest.log" ;;
    coalesce) timeout 300 python3 benchmarks/coalesce.py --out "$OUT/coalesce-h200.json" > "$OUT/coalesce.log" 2>&1
        r=$?; echo "coalesce rc=$r"; [ $r -ne 0 ] && rc=$r
        python3 -c "import json; d=json.load(open('$OUT/coalesce-h200.json')); print(json.dumps(d['summary'])); [print(json.dumps(t)) for t in d['table']]" ;;
    p6) PYTHONPATH=$PWD/benchmarks/gpu/stacks:$PYTHONPATH timeout ${P6_TIMEOUT:-$((deadline - SECONDS))} python3 benchmarks/e2e_p6.py --plugin "${P6_PLUGIN:-{\}}" --variants "${P6_VARIANTS:-fixed,adaptive}" --server-args="${P6_SERVER_ARGS:-}" \
          --out "$OUT/e2e-h200.json" --adaptive-out "$OUT/adaptive-h200.json" > "$OUT/p6.log" 2>&1
        r=$?; echo "p6 rc=$r"; [ $r -ne 0 ] && rc=$r
        grep -E '^\{"(baseline|variant)|Error|error|WATCHDOG' "$OUT/p6.log" | cut -c1-400 | tail -40 ;;
  esac
done
tar -czf "$OUT/logs.tgz" /tmp/k3-e2e/*/*.log /tmp/k3-e2e/*/result.json /tmp/k3-p6/*.log 2>/dev/null
(cd "$OUT" && ls -la)
exit $rc
