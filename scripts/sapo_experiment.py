"""The SAPO paper's swarm-vs-silo experiment at tiny scale on CPU.

Every configuration runs the same swarm (N node processes on 127.0.0.1, the same seeds, the same
rounds, I + J = 8 groups per round) and differs only in how many groups come from peers: 8/0 is the
silo, then 6/2, 4/4 and 2/6. A heterogeneous swarm (tiny-a and tiny-b nodes mixed) runs 8/0 and 4/4.
Cumulative reward = the sum over rounds of a node's mean reward on its own (local) completions,
averaged over the swarm's nodes; each configuration is compared with the silo of the same seed.

    .venv/bin/python scripts/sapo_experiment.py --out runs/experiment            # the full grid
    .venv/bin/python scripts/sapo_experiment.py --quick --out runs/experiment-quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.swarm import SwarmSpec, run  # noqa: E402
from trainer.config import default_cache_dir  # noqa: E402
from trainer.tiny import ensure_preset  # noqa: E402

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided t, df


def ci95(xs: list[float]) -> float:
    """Half-width of a 95% t interval of the mean; nan for a single value."""
    if len(xs) < 2:
        return float("nan")
    return T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def grid(quick: bool) -> list[tuple[str, int, int, list[str]]]:
    """(name, local, external, presets)."""
    homo = [(f"{i}/{8 - i}", i, 8 - i, ["tiny-a"]) for i in (8, 6, 4, 2)]
    hetero = [(f"mixed {i}/{8 - i}", i, 8 - i, ["tiny-a", "tiny-b"]) for i in (8, 4)]
    return [homo[0], homo[2], hetero[0], hetero[1]] if quick else homo + hetero


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 nodes, 20 rounds, 1 seed, fewer configurations")
    p.add_argument("--out", type=Path, default=Path("runs/experiment"))
    args = p.parse_args()
    if args.quick:
        args.nodes, args.rounds, args.seeds = 2, 20, 1
    console = Console()
    cache = default_cache_dir()
    for preset in ("tiny-a", "tiny-b"):
        ensure_preset(preset, cache)

    configs = grid(args.quick)
    node_args = ["--tasks.eval_size", "100", "--run.eval_every", str(args.rounds), "--run.checkpoint_every", str(args.rounds)]
    results: dict[str, list[dict]] = {name: [] for name, *_ in configs}
    started = time.time()
    for seed in range(args.seeds):
        for name, local, external, presets in configs:
            out = args.out / name.replace(" ", "-").replace("/", "-") / f"seed{seed}"
            spec = SwarmSpec(nodes=args.nodes, rounds=args.rounds, local=local, external=external, presets=presets,
                             out=out, seed=100 * seed, extra=node_args)
            t0 = time.time()
            summary = run(spec, cache_dir=cache, console=console, live=False)
            per_node = summary["per_node"]
            results[name].append({
                "seed": seed, "seconds": time.time() - t0, "cumulative_reward": summary["cumulative_reward_mean"],
                "eval_first": statistics.mean(n["eval_first"] for n in per_node),
                "eval_last": statistics.mean(n["eval_last"] for n in per_node),
                "external_used": sum(n["external_used"] for n in per_node),
                "failed_nodes": sum(n["exit_code"] != 0 for n in per_node), "out": str(out)})
            console.log(f"{name} seed {seed}: cumulative reward {summary['cumulative_reward_mean']:.2f} "
                        f"({time.time() - t0:.0f} s, {time.time() - started:.0f} s so far)")

    rows = []
    for name, local, external, presets in configs:
        silo_name = "mixed 8/0" if len(presets) > 1 else "8/0"
        runs, silo = results[name], results[silo_name]
        cum = [r["cumulative_reward"] for r in runs]
        ratios = [r["cumulative_reward"] / s["cumulative_reward"] for r, s in zip(runs, silo)]
        rows.append({"config": name, "local": local, "external": external, "presets": presets,
                     "cumulative_reward_mean": statistics.mean(cum), "cumulative_reward_ci95": ci95(cum),
                     "ratio_to_silo_mean": statistics.mean(ratios), "ratio_to_silo_ci95": ci95(ratios),
                     "eval_first": statistics.mean(r["eval_first"] for r in runs),
                     "eval_last": statistics.mean(r["eval_last"] for r in runs), "runs": runs})

    table = Table(title=f"SAPO at tiny scale: {args.nodes} nodes x {args.rounds} rounds, {args.seeds} seed(s), 2-core CPU")
    for col in ("config (local/external)", "cumulative reward", "vs silo", "eval before -> after"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["config"], f"{r['cumulative_reward_mean']:.2f} ± {r['cumulative_reward_ci95']:.2f}",
                      f"{100 * (r['ratio_to_silo_mean'] - 1):+.1f}% ± {100 * r['ratio_to_silo_ci95']:.1f}",
                      f"{r['eval_first']:.3f} -> {r['eval_last']:.3f}")
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({
        "command": "scripts/sapo_experiment.py " + " ".join(sys.argv[1:]), "nodes": args.nodes, "rounds": args.rounds,
        "seeds": args.seeds, "cpus": os.cpu_count(), "minutes": (time.time() - started) / 60, "configs": rows}, indent=2))
    figure(rows, args.out / "results.png", f"{args.nodes} nodes x {args.rounds} rounds, {args.seeds} seed(s)")
    console.print(f"saved {args.out / 'results.json'} and {args.out / 'results.png'} ({(time.time() - started) / 60:.1f} min)")


def figure(rows: list[dict], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bar, ax_curve) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [r["config"] for r in rows]
    ax_bar.bar(names, [r["cumulative_reward_mean"] for r in rows],
               yerr=[0 if math.isnan(r["cumulative_reward_ci95"]) else r["cumulative_reward_ci95"] for r in rows],
               color=["tab:gray" if r["external"] == 0 else "tab:blue" for r in rows], capsize=4)
    ax_bar.set(title="cumulative reward (mean over nodes, 95% CI over seeds)", xlabel="local/external groups per round")
    ax_bar.tick_params(axis="x", rotation=30)
    for r in rows:
        curves = []
        for run_ in r["runs"]:
            nodes = [[json.loads(line)["reward_mean"] for line in (Path(run_["out"]) / d / "metrics.jsonl").read_text().splitlines()[1:]]
                     for d in sorted(os.listdir(run_["out"])) if d.startswith("node")]
            curves.append([statistics.mean(xs) for xs in zip(*nodes)])
        mean_curve = [statistics.mean(xs) for xs in zip(*curves)]
        cumulative = [sum(mean_curve[: i + 1]) for i in range(len(mean_curve))]
        ax_curve.plot(range(1, len(cumulative) + 1), cumulative, label=r["config"],
                      linestyle="--" if r["external"] == 0 else "-")
    ax_curve.set(title="cumulative reward over rounds (mean of seeds)", xlabel="round", ylabel="cumulative reward")
    ax_curve.legend(fontsize=8)
    ax_curve.grid(alpha=0.3)
    fig.suptitle(f"SAPO swarm vs silo at tiny scale: {subtitle}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
