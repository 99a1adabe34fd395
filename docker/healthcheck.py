#!/usr/bin/env python3
"""Container health check: exit 0 when the node's status endpoint answers GET /status with 200 and
reports itself healthy (not failed, not stalled).

Installed as /usr/local/bin/sapo-healthcheck in both images (slim images have no curl). The port is
read from SAPO_STATUS__LISTEN (HOST:PORT, as the node reads it); a wildcard host is probed on loopback.
"""

import json
import os
import sys
import urllib.request

listen = os.environ.get("SAPO_STATUS__LISTEN") or "127.0.0.1:8080"
host, _, port = listen.rpartition(":")
host = host.strip("[]")
if host in ("", "0.0.0.0", "::"):
    host = "127.0.0.1"
if ":" in host:
    host = f"[{host}]"
url = f"http://{host}:{port}/status"
try:
    with urllib.request.urlopen(url, timeout=float(os.environ.get("SAPO_HEALTHCHECK_TIMEOUT", "4"))) as reply:
        status = json.load(reply)
except Exception as e:  # refused, timed out, an HTTP error status (urlopen raises on >= 400), not JSON
    print(f"unhealthy: {url}: {e}", file=sys.stderr)
    sys.exit(1)
if not status.get("healthy", True):
    print(f"unhealthy: {url}: {status.get('state')}", file=sys.stderr)
    sys.exit(1)
sys.exit(0)
