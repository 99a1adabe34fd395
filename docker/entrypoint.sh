#!/usr/bin/env bash
# Entrypoint of both images (docker/Dockerfile, docker/Dockerfile.gpu) and of docker/compose.yaml.
# It prepares two settings a container cannot know in advance, then runs `sapo "$@"`:
#
#   SAPO_SLOT_DIR=DIR        when SAPO_RUN__OUT_DIR is unset or empty: take the first free DIR/node-<k>
#                            (k = 1, 2, ...) as the out dir. A slot is "taken" while a process holds an
#                            exclusive flock on DIR/node-<k>/.node.lock, the lock every `sapo run` takes on
#                            its out dir. The descriptor is inherited by the node through `exec` and named
#                            in SAPO_OUT_LOCK_FD, so the node holds the claim's lock from the claim on and
#                            for exactly as long as it lives. Scaled replicas that restart (compose down /
#                            up) get the slots back, and with them their identity key and checkpoints.
#   SAPO_BOOTSTRAP_KEY=FILE  the bootstrap node's key file (a read-only shared volume) and
#   SAPO_BOOTSTRAP_HOST=MA   its reachable address without the peer id (e.g. /dns4/bootstrap/tcp/7420):
#                            when SAPO_P2P__BOOTSTRAP is unset or empty, wait for FILE and set
#                            SAPO_P2P__BOOTSTRAP to the full multiaddr MA/p2p/<peer id>.
#   SAPO_BOOTSTRAP_WAIT=S    how long to wait for that key file, in seconds (default 60).
set -euo pipefail

log() { echo "entrypoint: $*" >&2; }
die() { log "error: $*"; exit 1; }

claim_slot() {
  local dir=$1 k=1 max=${SAPO_SLOT_MAX:-256} fd
  mkdir -p "$dir" || die "cannot create the slot dir $dir (is the volume writable by uid $(id -u)?)"
  while [ "$k" -le "$max" ]; do
    mkdir -p "$dir/node-$k" || die "cannot create $dir/node-$k"
    # No close-on-exec on this descriptor: the exec'd node inherits it and keeps the lock.
    exec {fd}<>"$dir/node-$k/.node.lock" || die "cannot open $dir/node-$k/.node.lock"
    if flock --nonblock "$fd"; then
      export SAPO_RUN__OUT_DIR="$dir/node-$k" SAPO_OUT_LOCK_FD="$fd"
      log "out dir $SAPO_RUN__OUT_DIR (slot $k)"
      return 0
    fi
    exec {fd}>&-
    k=$((k + 1))
  done
  die "no free slot in $dir: node-1 .. node-$max are all held by running nodes (raise SAPO_SLOT_MAX)"
}

discover_bootstrap() {
  local key=$1 host=$2 wait=${SAPO_BOOTSTRAP_WAIT:-60} out addr
  local deadline=$((SECONDS + wait))
  # The key appears atomically (written aside, then linked into place), so existing means complete.
  if [ ! -e "$key" ]; then
    log "waiting up to ${wait}s for the bootstrap node's key $key"
    while [ ! -e "$key" ]; do
      [ "$SECONDS" -lt "$deadline" ] \
        || die "the bootstrap node's key $key did not appear within ${wait}s: is the bootstrap node running, and its volume mounted here?"
      sleep 1
    done
  fi
  out=$(sapo id --p2p.key_file "$key" --p2p.announce "$host") || die "sapo id could not read the bootstrap key $key"
  # Lines: "peer id: ...", "key file: ...", then one full multiaddr per address.
  addr=$(printf '%s\n' "$out" | awk '/^\// && /\/p2p\// {print $1; exit}')
  [ -n "$addr" ] || die "sapo id printed no /p2p/ address for $host: $out"
  export SAPO_P2P__BOOTSTRAP="$addr"
  log "bootstrap $SAPO_P2P__BOOTSTRAP"
}

if [ -n "${SAPO_SLOT_DIR:-}" ] && [ -z "${SAPO_RUN__OUT_DIR:-}" ]; then
  claim_slot "$SAPO_SLOT_DIR"
fi

if [ -n "${SAPO_BOOTSTRAP_KEY:-}" ] && [ -z "${SAPO_P2P__BOOTSTRAP:-}" ]; then
  [ -n "${SAPO_BOOTSTRAP_HOST:-}" ] || die "SAPO_BOOTSTRAP_KEY is set but SAPO_BOOTSTRAP_HOST is not (e.g. /dns4/bootstrap/tcp/7420)"
  discover_bootstrap "$SAPO_BOOTSTRAP_KEY" "$SAPO_BOOTSTRAP_HOST"
fi

exec sapo "$@"
