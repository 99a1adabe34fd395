#!/usr/bin/env bash
# The main job: set up, then run a node on the embedded tiny default. Extra arguments go to `sapo run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/sapo run --out runs/demo "$@"
