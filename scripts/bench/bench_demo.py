"""The demo's swarm under two or more sets of node flags, alternated: its wall time, its gain over the same nodes
alone, and each node's pace, whole and by thirds of its rounds (a pace that drifts within a run shows there).

Each arm runs `scripts/demo.sh` (three tiny nodes, 4 local + 4 external groups, beside their silo) with its
`--node-args`; arms alternate `--repeats` times, so that a machine that drifts moves every arm alike. The JSON keeps
every run; the table gives each arm's means. Besides pace, each node's seconds in Python's collector a round
(`seconds_gc`, node/collector.py).

    .venv/bin/python scripts/bench/bench_demo.py --arm "--run.gc_freeze false" --arm "--run.gc_freeze true" --repeats 2 --out docs/bench/demo-gc-freeze-2cpu.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from node.argtypes import count, script_parser
from node.metrics import MetricsLog

ROOT = Path(__file__).resolve().parents[2]


def node_pace(folder: Path) -> dict:
    """One node's rounds a minute over its training rounds, by thirds, and its collector seconds a round."""
    rows = [r for r in MetricsLog(folder / "metrics.jsonl").rows() if r["round"] > 0]
    thirds = [rows[i * len(rows) // 3:(i + 1) * len(rows) // 3 + 1] for i in range(3)]
    pace = lambda part: 60 * (len(part) - 1) / (part[-1]["time"] - part[0]["time"])  # noqa: E731
    return {"rounds": len(rows), "rounds_per_min": pace(rows), "rounds_per_min_thirds": [pace(t) for t in thirds],
            "seconds_gc_per_round": statistics.mean(r.get("seconds_gc", 0.0) for r in rows)}


def run_demo(node_args: str, rounds: int) -> dict:
    """One demo run with `node_args`: its wall seconds, its gain over the silo and each swarm node's pace."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "demo"
        started = time.monotonic()
        done = subprocess.run(["bash", "scripts/demo.sh", "--out", str(out), "--rounds", str(rounds),
                               "--node-args", node_args], cwd=ROOT, capture_output=True, text=True)
        seconds = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"bench_demo: the demo failed with {node_args!r}: {done.stderr.strip()[-500:]}")
        summary = json.loads((out / "summary.json").read_text())
        nodes = {n["name"]: {"model": n["model"], **node_pace(out / n["name"])} for n in summary["per_node"]}
    return {"node_args": node_args, "seconds": round(seconds, 1), "vs_baseline": summary["vs_baseline"], "nodes": nodes}


def arm_row(runs: list[dict]) -> dict:
    nodes = [n for r in runs for n in r["nodes"].values()]
    return {"node_args": runs[0]["node_args"], "runs": len(runs), "seconds": statistics.mean(r["seconds"] for r in runs),
            "vs_baseline": statistics.mean(r["vs_baseline"] for r in runs),
            "rounds_per_min": statistics.mean(n["rounds_per_min"] for n in nodes),
            "thirds": [statistics.mean(n["rounds_per_min_thirds"][i] for n in nodes) for i in range(3)],
            "seconds_gc_per_round": statistics.mean(n["seconds_gc_per_round"] for n in nodes)}


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--arm", action="append", required=True, metavar="FLAGS", help="node flags of one arm, e.g. "
                   "\"--run.gc_freeze false\" (give --arm once per arm)")
    p.add_argument("--repeats", type=count, default=2, help="runs of each arm, alternated (default 2)")
    p.add_argument("--rounds", type=count, default=300, help="rounds of each demo (default 300, the demo's)")
    p.add_argument("--out", type=Path, help="the JSON to write")
    args = p.parse_args()
    console, runs = Console(), []
    for repeat in range(args.repeats):
        for arm in args.arm:
            runs.append({"repeat": repeat, **run_demo(arm, args.rounds)})
            console.log(f"{arm!r}: {runs[-1]['seconds']:.0f} s, {100 * runs[-1]['vs_baseline']:+.1f}% over the silo")
            rows = [arm_row([r for r in runs if r["node_args"] == a]) for a in dict.fromkeys(r["node_args"] for r in runs)]
            if args.out:
                args.out.write_text(json.dumps({"command": sys.argv, "cpus": os.cpu_count(), "runs": runs, "arms": rows},
                                               indent=1))
    table = Table(title=f"the demo, {args.rounds} rounds, {os.cpu_count()} cores")
    for col in ("node flags", "runs", "wall s", "gain over silo", "rounds/min a node", "by thirds", "collector s a round"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["node_args"], str(r["runs"]), f"{r['seconds']:.0f}", f"{100 * r['vs_baseline']:+.1f}%",
                      f"{r['rounds_per_min']:.0f}", " / ".join(f"{x:.0f}" for x in r["thirds"]),
                      f"{r['seconds_gc_per_round']:.4f}")
    console.print(table)


if __name__ == "__main__":
    main()
