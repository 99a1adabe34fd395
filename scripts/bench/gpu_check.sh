#!/usr/bin/env bash
# The GPU check (scripts/bench/gpu_check.py says what it runs): here `prepare` and `run --dry-run`, on the card
# `stage` once per bundle and then `run --out "$OUT"`. The card's python3 holds torch; here the checkout's venv does.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
exec "$py" scripts/bench/gpu_check.py "$@"
