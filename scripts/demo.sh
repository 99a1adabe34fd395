#!/usr/bin/env bash
# The main job: set up, then run a local swarm on 127.0.0.1: three nodes (tiny-a, tiny-b, tiny-a), each
# learning two verifiable task families (sums of two operands 0..4, reversing words) from 4 local + 4 shared
# groups per round, and beside it the same three nodes alone (8 local groups, no peers), so the gain from
# sharing is measured, not asserted. These are the families the tiny models learn within the run (the
# swarm-vs-silo experiment's testbed). Extra arguments go to `sapo swarm`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/sapo swarm --out runs/demo --baseline \
    --task-mixes '[{"name": "arith", "config": {"max_operand": 4, "ops": "+"}}, {"name": "reverse"}]' "$@"
