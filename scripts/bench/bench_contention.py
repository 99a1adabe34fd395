"""A node's pace beside other work: `sapo doctor --bench` on idle cores and beside busy loops, for one or more
checkouts in turn, so that a change is measured side by side with what it replaces.

Each measurement starts N busy-loop processes (`while True: pass`, what a user's other work looks like to the
scheduler), runs the recipe round of `--model` for `--rounds` rounds, and stops them. Idle and busy measurements
alternate, checkout by checkout, `--repeats` times, so that a machine that drifts moves every arm alike. The JSON keeps
every measurement; the table gives each checkout's rounds a minute and tokens a second, idle and busy, and the share of
its idle pace it keeps.

    git worktree add /tmp/before <rev>
    .venv/bin/python scripts/bench/bench_contention.py --code /tmp/before . --busy 0 2 --repeats 2 --out docs/bench/contention-smollm2-135m-2cpu.json
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

ROOT = Path(__file__).resolve().parents[2]
BUSY_LOOP = "while True: pass"


def measure(code: Path, model: str, rounds: int, busy: int, extra: list[str]) -> dict:
    """One doctor bench of `code` beside `busy` busy loops."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "node.cli", "doctor", "--model", model, "--bench", "--bench-rounds",
                                   str(rounds), "--bench-out", str(out), *extra], cwd=code, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(code)})
            seconds = time.monotonic() - started
            if done.returncode != 0 or not out.exists():
                raise SystemExit(f"bench_contention: doctor --bench failed in {code}: {done.stderr.strip()[-500:]}")
            backend = json.loads(out.read_text())["backends"][0]
    finally:
        for p in loops:
            p.kill()
            p.wait()
    return {"code": str(code), "busy": busy, "seconds": round(seconds, 1),
            **{k: backend[k] for k in ("rounds_per_minute", "generated_tokens_per_s", "generate_s", "train_s", "round_s")}}


def summary(runs: list[dict]) -> list[dict]:
    """Per checkout and number of busy loops: the mean pace, and its share of the same checkout's idle pace."""
    rows = []
    for code in dict.fromkeys(r["code"] for r in runs):
        idle = [r for r in runs if r["code"] == code and r["busy"] == 0]
        for busy in sorted({r["busy"] for r in runs}):
            mine = [r for r in runs if r["code"] == code and r["busy"] == busy]
            if not mine:
                continue
            rpm = statistics.mean(r["rounds_per_minute"] for r in mine)
            row = {"code": code, "busy": busy, "rounds_per_minute": rpm,
                   "tokens_per_s": statistics.mean(r["generated_tokens_per_s"] for r in mine), "n": len(mine)}
            if idle:
                row["share_of_idle"] = rpm / statistics.mean(r["rounds_per_minute"] for r in idle)
            rows.append(row)
    return rows


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--code", type=Path, nargs="+", default=[ROOT], help="checkouts to measure in turn")
    p.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="busy-loop processes beside the node")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=count, default=4, help="rounds of each doctor bench (at least 3)")
    p.add_argument("--repeats", type=count, default=2)
    p.add_argument("--node-args", default="", help="more flags for the node, e.g. \"--run.torch_threads 1\"")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if any(b < 0 for b in args.busy):
        p.error("argument --busy: a count of busy loops is 0 or more")
    if args.rounds < 3:
        p.error("argument --rounds: doctor --bench takes at least 3")
    missing = [c for c in args.code if not (c / "node" / "cli.py").exists()]
    if missing:
        p.error(f"argument --code: {missing[0]} is not a sapo-node checkout")
    console, runs = Console(), []
    for repeat in range(args.repeats):
        for busy in args.busy:
            for code in args.code:
                runs.append({"repeat": repeat, **measure(code.resolve(), args.model, args.rounds, busy, args.node_args.split())})
                console.log(f"{code} beside {busy} busy loop(s): {runs[-1]['rounds_per_minute']:.2f} rounds/min, "
                            f"{runs[-1]['generated_tokens_per_s']:.0f} tokens/s")
                if args.out:
                    args.out.write_text(json.dumps({"command": sys.argv, "cpus": os.cpu_count(), "runs": runs,
                                                    "summary": summary(runs)}, indent=1))
    table = Table(title=f"{args.model}: doctor --bench beside busy loops, {os.cpu_count()} cores")
    for col in ("checkout", "busy loops", "rounds/min", "tokens/s", "share of idle", "runs"):
        table.add_column(col)
    for r in summary(runs):
        share = f"{r['share_of_idle']:.2f}" if "share_of_idle" in r else "-"
        table.add_row(r["code"], str(r["busy"]), f"{r['rounds_per_minute']:.2f}", f"{r['tokens_per_s']:.0f}", share, str(r["n"]))
    console.print(table)


if __name__ == "__main__":
    main()
