#!/usr/bin/env bash
# The main job: set up, then run a node on the embedded tiny default. Extra arguments go to `sapo run`.
# The demo node listens on loopback only, on a free port: it has no peers to meet.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/sapo run --out runs/demo --listen /ip4/127.0.0.1/tcp/0 "$@"
