#!/usr/bin/env bash
# Set up, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

# apt_install WHY WITHOUT PKG...: Debian packages some tests need, installed when we are root with apt-get;
# otherwise one line saying what runs without them.
apt_install() {
  local why=$1 without=$2
  shift 2
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing $* ($why)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "test: no $*: $without; on Debian/Ubuntu: sudo apt-get install $*" >&2
  fi
}

# Chromium drives the dashboard test in a real headless browser.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  apt_install "the dashboard test's headless browser" "the dashboard test is skipped (fails under CI=true)" chromium
fi
# The network lab (scripts/bench/lab/netlab.py): namespaces and veth pairs (iproute2), a masquerading NAT (nftables).
missing_net=()
command -v ip >/dev/null || missing_net+=(iproute2)
command -v nft >/dev/null || missing_net+=(nftables)
command -v miniupnpd >/dev/null || missing_net+=(miniupnpd-nftables)  # the lab's UPnP router
if [ ${#missing_net[@]} -gt 0 ]; then
  apt_install "the network lab's namespaces and NAT" "the network-lab tests are skipped" "${missing_net[@]}"
fi
# The js-libp2p interop test (tests/test_interop.py) runs a Node.js peer and installs its npm packages itself.
missing_js=()
command -v node >/dev/null || missing_js+=(nodejs)
command -v npm >/dev/null || missing_js+=(npm)
if [ ${#missing_js[@]} -gt 0 ]; then
  apt_install "the js-libp2p interop test's peer" "the interop test is skipped (fails under CI=true)" "${missing_js[@]}"
fi
# SAPO_TEST_LONG=1 (CI sets it): the tests marked `long`, minutes of mostly waiting (a punched pair over 10 minutes),
# run in a lane of their own beside the suite, logged to runs/test-long.log.
long=""
if [ "${SAPO_TEST_LONG:-0}" = 1 ]; then
  mkdir -p runs
  .venv/bin/python -m pytest -p no:xdist -p no:cacheprovider --long -m long -q --basetemp=runs/test-long-tmp \
    >runs/test-long.log 2>&1 &
  long=$!
  trap 'kill "$long" 2>/dev/null || true' EXIT
fi
# Two workers (tests/conftest.py): the slow tests one after another in one, the quick ones beside them in the other.
# Arguments given after these win: `-n 0` runs everything in this process.
status=0
.venv/bin/python -m pytest -n 2 --dist loadgroup "$@" || status=$?
if [ -n "$long" ]; then
  if wait "$long"; then
    echo "test: long lane: $(tail -n 1 runs/test-long.log)"
  else
    cat runs/test-long.log
    echo "test: the long lane failed (log above, runs/test-long.log)" >&2
    status=1
  fi
  trap - EXIT
fi
exit "$status"
