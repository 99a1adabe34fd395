"""What a node's rounds were made of, window by window: its pace beside the work that sets it, so that a pace that
drifts within a run can be told from a machine that drifts.

A round's seconds follow what it does: how many groups carried signal into the step (a group whose completions all
score alike is dropped before the step), how many came from peers, how many tokens it generated. Each window gives a
node's rounds a minute, the mean seconds generating, training and otherwise, the groups trained and taken from peers,
the tokens and the reward, and the training seconds per group trained (steady when the machine is: a pace that moves
with a steady cost per group moved with the work). With `--soak` (the JSON of `bench_soak.py` that ran those nodes),
each window also gives the cores the node used and its CPU seconds a round, and the windows end where the soak's
measurement did (its nodes' last rounds, while they are stopped one by one, are not the run's).

    .venv/bin/python scripts/bench/bench_soak.py --nodes 5 --phases calm --phase 1200 --duration 1200 --settle 0 --workdir runs/calm --out runs/calm.json
    .venv/bin/python scripts/bench/round_work.py runs/calm/node0 runs/calm/node1 --soak runs/calm.json --out docs/bench/round-work-calm-2cpu.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_soak import cores
from node.argtypes import positive, script_parser
from node.metrics import MetricsLog

PARTS = ("seconds_generate", "seconds_train", "seconds_other", "groups_trained", "n_external", "tokens_generated",
         "reward_mean")


def windows(rows: list[dict], window_s: float, cpu: list[tuple[float, float, object]] | None = None) -> list[dict]:
    """Each full window of `window_s` seconds from a node's first round: its pace and the means of its rounds' parts
    (a trailing part-window is left out: a pace over a few seconds says little)."""
    rows = [r for r in rows if r["round"] > 0]
    if not rows:
        return []
    start, end = rows[0]["time"], rows[-1]["time"]
    out = []
    for k in range(int((end - start) // window_s)):
        lo, hi = start + k * window_s, start + (k + 1) * window_s
        inside = [r for r in rows if lo <= r["time"] < hi]
        if not inside:
            continue
        w = {"start_s": round(lo - start, 1), "rounds": len(inside), "rounds_per_min": 60 * len(inside) / window_s,
             **{p: statistics.mean(r.get(p) or 0 for r in inside) for p in PARTS}}
        trained = sum(r.get("groups_trained") or 0 for r in inside)
        w["train_s_per_group"] = sum(r.get("seconds_train") or 0 for r in inside) / trained if trained else None
        if cpu is not None:
            used = cores([c for c in cpu if lo <= c[0] < hi])
            w["cores"] = used
            w["cpu_s_per_round"] = used * window_s / len(inside) if used is not None else None
        out.append(w)
    return out


def spread(ws: list[dict], key: str) -> dict | None:
    """Lowest, highest and their ratio of a window value over a run."""
    xs = [w[key] for w in ws if w.get(key)]
    return {"min": min(xs), "max": max(xs), "max_over_min": max(xs) / min(xs)} if xs else None


def soak_cpu(path: Path) -> tuple[dict[str, list[tuple[float, float, object]]], float]:
    """Each process's (time, cumulative CPU seconds, pid) samples from a soak's JSON, by process name, and the time
    its measurement ended."""
    record = json.loads(path.read_text())
    return ({name: [(s["t"], s.get("cpu_s"), s.get("pid")) for s in p["samples"]]
             for name, p in record["processes"].items()}, record["ended"])


def table(name: str, ws: list[dict]) -> Table:
    t = Table(title=f"{name}: each window's pace and what its rounds did")
    for col in ("from s", "rounds/min", "cores", "CPU s/round", "gen s", "train s", "other s", "groups trained",
                "from peers", "train s/group", "tokens", "reward"):
        t.add_column(col, justify="right")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for w in ws:
        t.add_row(f"{w['start_s']:.0f}", f"{w['rounds_per_min']:.1f}", fmt(w.get("cores"), ".2f"),
                  fmt(w.get("cpu_s_per_round"), ".3f"), f"{w['seconds_generate']:.3f}", f"{w['seconds_train']:.3f}",
                  f"{w['seconds_other']:.3f}", f"{w['groups_trained']:.2f}", f"{w['n_external']:.2f}",
                  fmt(w["train_s_per_group"], ".3f"), f"{w['tokens_generated']:.0f}", f"{w['reward_mean']:.2f}")
    return t


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("runs", type=Path, nargs="+", help="node run folders (each holds metrics.jsonl)")
    p.add_argument("--window", type=positive, default=120.0, help="seconds a window")
    p.add_argument("--soak", type=Path, help="the bench_soak.py JSON of the run: each window's cores and CPU a round")
    p.add_argument("--out", type=Path, help="write the windows here as JSON")
    args = p.parse_args()
    for run in args.runs:
        if not (run / "metrics.jsonl").exists():
            p.error(f"{run} holds no metrics.jsonl: give a node's run folder")
    if args.soak and not args.soak.exists():
        p.error(f"--soak {args.soak}: no such file")
    cpu, ended = soak_cpu(args.soak) if args.soak else ({}, float("inf"))
    record = {"command": "scripts/bench/round_work.py " + " ".join(sys.argv[1:]), "window_s": args.window, "nodes": {}}
    console = Console(width=170)
    for run in args.runs:
        rows = [r for r in MetricsLog(run / "metrics.jsonl").rows() if r["time"] <= ended]
        ws = windows(rows, args.window, cpu.get(run.name))
        record["nodes"][run.name] = {"windows": ws, **{f"{k}_spread": spread(ws, k) for k in (
            "rounds_per_min", "cpu_s_per_round", "train_s_per_group", "groups_trained")}}
        console.print(table(run.name, ws))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
