#!/usr/bin/env bash
# Entrypoint of both images (docker/Dockerfile, docker/Dockerfile.gpu) and of docker/compose.yaml.
# It prepares two settings a container cannot know in advance, then runs `sapo "$@"`:
#
#   SAPO_SLOT_DIR=DIR        when SAPO_RUN__OUT_DIR is unset or empty: claim a free DIR/node-<k> as the out
#                            dir. A slot is "free" unless a process holds an exclusive flock on
#                            DIR/node-<k>/.node.lock, the lock every `sapo run` takes on its out dir. The
#                            descriptor is inherited by the node through `exec` and named in
#                            SAPO_OUT_LOCK_FD, so the node holds the claim's lock from the claim on and for
#                            exactly as long as it lives. Of the free slots, a replica takes, in this order:
#                              1. the slot it claimed last time (its owner, in node-<k>/.owner), so a
#                                 restarted replica (compose stop / start) gets its own key and checkpoints
#                                 back even where another replica's node finished first and freed its slot;
#                              2. a slot another replica left before its last round (SAPO_RUN__ROUNDS, read
#                                 from its last checkpoint), as new replicas do after compose down / up;
#                              3. any other slot, lowest k first, and at last a new one.
#   SAPO_SLOT_OWNER=NAME     who claims (default: the hostname, which is the container's id in compose and
#                            stays the same across a restart).
#   SAPO_BOOTSTRAP_KEY=FILE  the bootstrap node's key file (a read-only shared volume) and
#   SAPO_BOOTSTRAP_HOST=MA   its reachable address without the peer id (e.g. /dns4/bootstrap/tcp/7420):
#                            when SAPO_P2P__BOOTSTRAP is unset or empty, wait for FILE and set
#                            SAPO_P2P__BOOTSTRAP to the full multiaddr MA/p2p/<peer id>.
#   SAPO_BOOTSTRAP_WAIT=S    how long to wait for that key file, in seconds (default 60).
set -euo pipefail

log() { echo "entrypoint: $*" >&2; }
die() { log "error: $*"; exit 1; }

slot_finished() {  # slot_finished SLOT: its last checkpoint is at SAPO_RUN__ROUNDS or past it
  local rounds=${SAPO_RUN__ROUNDS:-} last
  [[ $rounds =~ ^[0-9]+$ ]] || return 1
  last=$(find "$1/checkpoints" -mindepth 1 -maxdepth 1 -name 'round-*' 2>/dev/null | sort | tail -n 1)
  [[ ${last##*/round-} =~ ^[0-9]+$ ]] && [ $((10#${last##*/round-})) -ge "$rounds" ]
}

wanted() {  # wanted PASS SLOT: whether this pass of claim_slot tries SLOT
  case $1 in
    own) [ -d "$2" ] && [ "$(cat "$2/.owner" 2>/dev/null)" = "$OWNER" ] ;;
    unfinished) [ -d "$2" ] && ! slot_finished "$2" ;;
    any) mkdir -p "$2" || die "cannot create $2" ;;
  esac
}

try_slot() {  # try_slot SLOT K: lock SLOT and make it the out dir, or return 1 where a node holds it
  local fd
  # No close-on-exec on this descriptor: the exec'd node inherits it and keeps the lock.
  exec {fd}<>"$1/.node.lock" || die "cannot open $1/.node.lock"
  if ! flock --nonblock "$fd"; then
    exec {fd}>&-
    return 1
  fi
  printf '%s\n' "$OWNER" >"$1/.owner" || die "cannot write $1/.owner"
  export SAPO_RUN__OUT_DIR="$1" SAPO_OUT_LOCK_FD="$fd"
  log "out dir $SAPO_RUN__OUT_DIR (slot $2)"
}

claim_slot() {
  local dir=$1 max=${SAPO_SLOT_MAX:-256} pass k
  mkdir -p "$dir" || die "cannot create the slot dir $dir (is the volume writable by uid $(id -u)?)"
  for pass in own unfinished any; do
    for ((k = 1; k <= max; k++)); do
      if wanted "$pass" "$dir/node-$k" && try_slot "$dir/node-$k" "$k"; then return 0; fi
    done
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
  OWNER=${SAPO_SLOT_OWNER:-$HOSTNAME}
  claim_slot "$SAPO_SLOT_DIR"
fi

if [ -n "${SAPO_BOOTSTRAP_KEY:-}" ] && [ -z "${SAPO_P2P__BOOTSTRAP:-}" ]; then
  [ -n "${SAPO_BOOTSTRAP_HOST:-}" ] || die "SAPO_BOOTSTRAP_KEY is set but SAPO_BOOTSTRAP_HOST is not (e.g. /dns4/bootstrap/tcp/7420)"
  discover_bootstrap "$SAPO_BOOTSTRAP_KEY" "$SAPO_BOOTSTRAP_HOST"
fi

exec sapo "$@"
