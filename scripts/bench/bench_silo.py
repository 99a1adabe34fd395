"""Benchmark: a silo node on a tiny preset for a fixed wall-clock budget.

Prints a table and saves JSON with greedy eval accuracy before and after, rounds per minute and
the share of time spent generating, training and elsewhere. Building the preset is not timed.

    .venv/bin/python scripts/bench/bench_silo.py --minutes 10 --out runs/bench-silo
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from node.argtypes import bounded, count, positive, script_parser
from node.config import load_config
from node.lifecycle import StopSignal


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default="tiny-a")
    parser.add_argument("--minutes", type=positive, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-silo"))
    parser.add_argument("--seed", type=bounded(int, ge=0), default=0)
    parser.add_argument("--eval-every", type=count, default=50)
    args = parser.parse_args()
    import torch  # the model stack loads once the flags are checked: --help or a bad flag costs no 8 s of imports
    from node.loop import Node
    from trainer.presets import resolve_model_path

    logging.basicConfig(level=logging.WARNING)

    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"bench_silo: {args.out} is not empty; choose a new --out (a benchmark never resumes)")
    cfg = load_config(None, {
        "model": {"name": args.model},
        "run": {"out_dir": str(args.out), "rounds": 10**6, "seed": args.seed, "eval_every": args.eval_every,
                "checkpoint_every": 10**6, "local_groups": 8}, "selection": {"external_groups": 0},
        "p2p": {"enabled": False},  # a silo: 8 local groups per round, no network
        "status": {"enabled": False},
    })
    resolve_model_path(cfg.model)  # build the preset before the clock starts

    stop = StopSignal()
    node = Node(cfg)
    timer = threading.Timer(args.minutes * 60, stop.request, args=("(time budget spent)",))
    started = time.perf_counter()
    timer.start()
    try:
        node.run(stop)
    finally:
        timer.cancel()
    wall = time.perf_counter() - started
    final = node.evaluate()

    rows = [json.loads(line) for line in node.metrics.path.read_text().splitlines()]
    rounds = [r for r in rows if r["round"] > 0]
    phase = {k: sum(r[f"seconds_{k}"] for r in rounds) for k in ("generate", "train", "other")}
    total = sum(phase.values()) or 1.0
    result = {
        "model": args.model,
        "minutes_budget": args.minutes,
        "wall_seconds": round(wall, 1),
        "rounds": len(rounds),
        "rounds_per_minute": round(len(rounds) / (wall / 60), 1),
        "eval_accuracy_before": rows[0]["eval_accuracy"],
        "eval_accuracy_after": final.accuracy,
        "eval_gain_points": round(100 * (final.accuracy - rows[0]["eval_accuracy"]), 1),
        "eval_by_dataset_before": rows[0]["eval_by_dataset"],
        "eval_by_dataset_after": final.by_dataset,
        "eval_curve": [[r["round"], r["eval_accuracy"]] for r in rows if r["eval_accuracy"] is not None],
        "share_generate": round(phase["generate"] / total, 3),
        "share_train": round(phase["train"] / total, 3),
        "share_other": round(phase["other"] / total, 3),
        "eval_size": cfg.tasks.eval_size,
        "local_groups": cfg.run.local_groups,
        "completions_per_group": cfg.generation.completions_per_group,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()},
    }
    (args.out / "bench_silo.json").write_text(json.dumps(result, indent=2))

    table = Table(title=f"silo node, {args.model}, {args.minutes:g} min budget")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("eval_accuracy_before", "eval_accuracy_after", "eval_gain_points", "rounds", "rounds_per_minute",
                "share_generate", "share_train", "share_other"):
        table.add_row(key, str(result[key]))
    Console().print(table)
    print(f"saved {args.out / 'bench_silo.json'}")


if __name__ == "__main__":
    main()
