#!/usr/bin/env bash
# Remote speculative drafting with two processes:
#   1. k3-draft-server runs the draft model (its own process, its own GPU or the CPU);
#   2. vLLM's OpenAI server runs the target and ships context to it (the k3-accel plugin
#      is loaded automatically once k3-accel is pip-installed next to vLLM).
# The target side needs only the draft's config.json (aux layer ids, mask token); no draft
# weights are loaded on the target's GPUs. Stop with Ctrl-C: the draft server goes too.
#
#   TARGET=/models/target DRAFT=/models/dflash-draft examples/two_process.sh
#   ENGINE=ngram TARGET=/models/target examples/two_process.sh          # prompt lookup, no draft
#
# Settings (environment): ENGINE dflash|ngram (default dflash), K draft tokens per step (4),
# DRAFT_PORT (5557), DRAFT_HTTP_PORT (8095: /healthz /readyz /metrics), API_PORT (8000),
# DRAFT_DEVICE cpu|cuda|cuda:N (cpu), PYTHON (python), VLLM_ARGS (more vLLM flags, e.g.
# "--enforce-eager --max-model-len 4096").
# tests/test_e2e_openai.py runs this very script.
set -euo pipefail

ENGINE=${ENGINE:-dflash}
TARGET=${TARGET:?set TARGET to the target checkpoint directory}
K=${K:-4}
DRAFT_PORT=${DRAFT_PORT:-5557}
DRAFT_HTTP_PORT=${DRAFT_HTTP_PORT:-8095}
API_PORT=${API_PORT:-8000}
DRAFT_DEVICE=${DRAFT_DEVICE:-cpu}
PYTHON=${PYTHON:-python}
ADDRESS="tcp://127.0.0.1:${DRAFT_PORT}"

case "$ENGINE" in
  dflash)
    DRAFT=${DRAFT:?set DRAFT to the DFlash draft checkpoint directory}
    SERVER_ARGS=(--engine dflash --draft-model "$DRAFT" --target-model "$TARGET" --device "$DRAFT_DEVICE")
    SPEC="{\"method\": \"dflash\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": $K}" ;;
  ngram)
    SERVER_ARGS=(--engine ngram)
    SPEC="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 3}" ;;
  *) echo "ENGINE must be dflash or ngram" >&2; exit 2 ;;
esac

# 1. the draft server (loopback only; see docs/remote-drafting.md for CURVE across hosts)
k3-draft-server "${SERVER_ARGS[@]}" --num-speculative-tokens "$K" \
  --host 127.0.0.1 --port "$DRAFT_PORT" --http-port "$DRAFT_HTTP_PORT" &
DRAFT_PID=$!
trap 'kill "$DRAFT_PID" 2>/dev/null || true; wait "$DRAFT_PID" 2>/dev/null || true' EXIT
until k3-accel probe "$ADDRESS" --timeout-ms 500 >/dev/null 2>&1; do
  kill -0 "$DRAFT_PID" 2>/dev/null || { echo "k3-draft-server exited" >&2; exit 1; }
  sleep 0.5
done
echo "draft server ready at $ADDRESS (metrics: http://127.0.0.1:${DRAFT_HTTP_PORT}/metrics)"

# 2. the target: stock vLLM flags plus the plugin's draft address
# shellcheck disable=SC2086
"$PYTHON" -m vllm.entrypoints.openai.api_server --model "$TARGET" --port "$API_PORT" \
  --speculative-config "$SPEC" \
  --additional-config "{\"k3_accel\": {\"draft_address\": \"$ADDRESS\"}}" \
  ${VLLM_ARGS:-}
