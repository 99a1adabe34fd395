#!/usr/bin/env bash
# Set up, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Test-only system tools: Chromium drives the dashboard test in a real headless browser.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing chromium (the dashboard test's headless browser)" >&2
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else
    echo "test: no chromium: the dashboard test is skipped (fails under CI=true); on Debian/Ubuntu: sudo apt-get install chromium" >&2
  fi
fi
# The network lab (tests/netlab.py): namespaces and veth pairs (iproute2), a masquerading NAT (nftables).
missing_net=()
command -v ip >/dev/null || missing_net+=(iproute2)
command -v nft >/dev/null || missing_net+=(nftables)
if [ ${#missing_net[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing ${missing_net[*]} (the network lab's namespaces and NAT)" >&2
    apt-get update -qq && apt-get install -y -qq "${missing_net[@]}" >/dev/null
  else
    echo "test: no ${missing_net[*]}: the network-lab tests are skipped; on Debian/Ubuntu: sudo apt-get install ${missing_net[*]}" >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
