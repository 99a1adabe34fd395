"""Regenerate docs/dashboard.png: a three-node tiny swarm on 127.0.0.1 (the demo's task mix), and the live
dashboard of its second node after some rounds, in headless Chromium.

    .venv/bin/python scripts/tools/screenshot_dashboard.py [--rounds 150] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = '[{"name": "arith", "config": {"max_operand": 4, "ops": "+"}}, {"name": "reverse"}]'


def rounds_done(node: Path) -> int:
    path = node / "metrics.jsonl"
    return len(path.read_text().splitlines()) - 1 if path.exists() else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=150, help="rounds node1 has done when the picture is taken")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = p.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("screenshot_dashboard: needs Chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        swarm = subprocess.Popen([sys.executable, "-m", "node.cli", "swarm", "--nodes", "3", "--rounds", "100000",
                                  "--task-mixes", TASKS, "--out", tmp], cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        node = Path(tmp) / "node1"
        try:
            deadline = time.monotonic() + 900
            while rounds_done(node) < args.rounds and time.monotonic() < deadline and swarm.poll() is None:
                time.sleep(1)
            if rounds_done(node) < args.rounds:
                sys.exit(f"screenshot_dashboard: node1 reached only {rounds_done(node)} rounds")
            url = re.search(r"dashboard at (http://127\.0\.0\.1:\d+/)", (node / "node.log").read_text()).group(1)
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            "--window-size=1280,900", "--virtual-time-budget=5000", f"--screenshot={args.out}", url],
                           capture_output=True, timeout=120, check=True)
            last = json.loads((node / "metrics.jsonl").read_text().splitlines()[-1])
            print(f"{args.out}: node1 at round {last['round']}, {last['peers']} peers")
        finally:
            swarm.send_signal(signal.SIGINT)  # every node checkpoints and exits
            swarm.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
