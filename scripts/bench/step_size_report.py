"""The step-size controller from a wrong rate: each arm's held-out path family by family, where its rate went, and the
controller against the same rate fixed, from the runs `sapo_experiment.py --step-size` saved under one folder.

Each seed is one replicate; intervals are 95% t intervals over seeds of the paired (same seed) gaps, and a gap whose
interval holds zero is given beside the smallest gap the seeds could have detected (80% power). A rate "settled" at
the round from which it no longer moved, if that was `STILL` rounds or more before the run's end; else it was still
moving.

    .venv/bin/python scripts/bench/sapo_experiment.py --step-size --accept-license gemma --nodes 1 --rounds 80 --eval-every 20 --seeds 3 --out runs/step-size-80 --resume \\
      --only "gemma-adapt 4/0 lr 6.7e-06" "gemma-fixed 4/0 lr 6.7e-06" "smollm2-adapt 4/0 lr 0.001" "gemma-adapt 4/0 lr 6.7e-06 kl 0.001"
    .venv/bin/python scripts/bench/step_size_report.py --out runs/step-size-80
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from experiment.paired import gap_stats, mean
from experiment.report import held_out_gap
from node.argtypes import script_parser
from node.progress import print_table

STILL = 20  # rounds a rate must not have moved, to the run's end, to count as settled
# (controller arm, the arm it is weighed against), where both ran
PAIRS = [("gemma-adapt 4/0 lr 6.7e-06", "gemma-fixed 4/0 lr 6.7e-06"),
         ("gemma-adapt 4/0 lr 6.7e-06 kl 0.001", "gemma-fixed 4/0 lr 6.7e-06"),
         ("gemma-adapt 4/0 lr 6.7e-06 kl 0.001", "gemma-adapt 4/0 lr 6.7e-06")]


def arms_of(runs: Iterable[dict]) -> dict[str, dict[int, dict]]:
    """Arm -> seed -> its one node's record, for every finished run of `runs` (tests/results_figures.py reads the
    docs' runs through this too)."""
    arms: dict[str, dict[int, dict]] = {}
    for run in runs:
        if not run.get("failed") and run.get("nodes"):
            arms.setdefault(run["config"], {})[run["seed"]] = run["nodes"][0]
    return arms


def load(out: Path) -> dict[str, dict[int, dict]]:
    """`arms_of` every run saved under `out`; a file that is not JSON stops the report, naming it."""
    runs = []
    for path in sorted(out.glob("*/seed*/result.json")):
        try:
            runs.append(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise SystemExit(f"step_size_report: {path} is not a run's result.json: {e}") from None
    return arms_of(runs)


def rate_path(node: dict) -> dict:
    """The rate of each step taken (rounds without a step carry none), where it started and ended, and the round from
    which it stayed put (None: it moved in the last `STILL` rounds)."""
    rounds = len(node["curves"]["lr"])
    steps = [(r, lr) for r, lr in enumerate(node["curves"]["lr"], start=1) if lr is not None]
    settled = None
    for r, lr in reversed(steps):
        if lr != steps[-1][1]:
            break
        settled = r
    settled = settled if settled is not None and rounds - settled >= STILL else None
    return {"first": steps[0][1] if steps else None, "last": steps[-1][1] if steps else None,
            "settled_round": settled, "lowest": min((lr for _, lr in steps), default=None),
            "highest": max((lr for _, lr in steps), default=None), "steps": len(steps)}


def evals(node: dict) -> dict[int, float]:
    """Round -> held-out accuracy, at each evaluation of the run."""
    return {k: v for k, v in node["curves"]["eval"]}


def arm_rows(arms: dict[str, dict[int, dict]]) -> list[dict]:
    rows = []
    for arm, seeds in arms.items():
        nodes = [seeds[s] for s in sorted(seeds)]
        overall = [evals(n) for n in nodes]
        by_round = [dict(n["curves"]["eval_by_dataset"]) for n in nodes]
        points = sorted(set.intersection(*map(set, overall)))
        families = sorted(nodes[0]["eval_by_dataset_first"])
        by_family = {f: [[k, mean([by[k][f] for by in by_round])] for k in points] for f in families}
        rows.append({"arm": arm, "model": nodes[0]["model"], "seeds": sorted(seeds),
                     "eval": [[k, mean([e[k] for e in overall])] for k in points],
                     "eval_per_seed": {s: [e[k] for k in points] for s, e in zip(sorted(seeds), overall)},
                     "eval_by_dataset": by_family,
                     # kept: the last evaluation minus the first after round 0, paired by seed (what the rate it
                     # settled at did with what the model had learned early)
                     "kept_from": points[1] if len(points) > 2 else None,
                     "kept": gap_stats([e[points[-1]] - e[points[1]] for e in overall]) if len(points) > 2 else None,
                     "rates": {s: rate_path(seeds[s]) for s in sorted(seeds)},
                     "rate_curves": {s: seeds[s]["curves"]["lr"] for s in sorted(seeds)},
                     "peak_gb": max(n["timing"]["peak_gb"] for n in nodes), "planned_gb": nodes[0]["timing"]["planned_peak_gb"]})
    return rows


def pair_rows(arms: dict[str, dict[int, dict]]) -> list[dict]:
    """Each pair's paired gap at every evaluation both arms have, over the seeds both ran."""
    rows = []
    for arm, against in PAIRS:
        seeds = sorted(set(arms.get(arm, {})) & set(arms.get(against, {})))
        if not seeds:
            continue
        curves = [(evals(arms[arm][s]), evals(arms[against][s])) for s in seeds]
        points = sorted(set.intersection(*(set(a) & set(b) for a, b in curves)))
        rows.append({"arm": arm, "against": against, "seeds": seeds,
                     "gaps": [[k, gap_stats([a[k] - b[k] for a, b in curves])] for k in points if k > 0],
                     "per_seed": {k: [a[k] - b[k] for a, b in curves] for k in points if k > 0}})
    return rows


def rate(lr: float | None) -> str:
    return "-" if lr is None else f"{lr:.2g}"


def markdown(result: dict) -> str:
    lines = ["| arm | seeds | held-out at each evaluation (mean over seeds) | per family, at the same evaluations | "
             "last evaluation minus the first after round 0 (paired) | rate: first -> last, where it settled (per seed) | "
             "peak / planned GB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["arms"]:
        path = " -> ".join(f"{v:.3f} ({k})" for k, v in r["eval"])
        fams = "; ".join(f"{f} {' '.join(f'{v:.2f}' for _, v in c)}" for f, c in r["eval_by_dataset"].items())
        rates = "; ".join(f"{rate(p['first'])} -> {rate(p['last'])}, "
                          + (f"settled from {p['settled_round']}" if p["settled_round"] else "still moving")
                          for p in r["rates"].values())
        kept = f"{held_out_gap(r['kept'])} (from {r['kept_from']})" if r["kept"] else "-"
        lines.append(f"| {r['arm']} | {len(r['seeds'])} | {path} | {fams} | {kept} | {rates} | "
                     f"{r['peak_gb']:.2f} / {r['planned_gb']:.2f} |")
    lines += ["", "| arm | against | round | gap (95% CI) | per seed |", "| --- | --- | --- | --- | --- |"]
    for p in result["pairs"]:
        lines += [f"| {p['arm']} | {p['against']} | {k} | {held_out_gap(g)} | "
                  f"{' '.join(f'{v:+.3f}' for v in p['per_seed'][k])} |" for k, g in p["gaps"]]
    return "\n".join(lines) + "\n"


def figure(result: dict, path: Path) -> None:
    """Held-out accuracy by evaluation round, and each seed's rate by round (log scale), arm by arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eval, ax_rate) = plt.subplots(1, 2, figsize=(14, 4.8))
    for i, r in enumerate(result["arms"]):
        color = f"C{i}"
        ax_eval.plot(*zip(*r["eval"]), marker="o", color=color, label=f"{r['arm']} ({len(r['seeds'])} seeds)")
        for curve in r["rate_curves"].values():
            steps = [(k, lr) for k, lr in enumerate(curve, start=1) if lr is not None]
            if steps:
                ax_rate.step(*zip(*steps), where="post", color=color, alpha=0.7)
        ax_rate.plot([], [], color=color, label=r["arm"])
    ax_eval.set(title="held-out accuracy (greedy, mean over seeds)", xlabel="round")
    ax_rate.set(title="the rate of each step, each seed", xlabel="round", yscale="log")
    for ax in (ax_eval, ax_rate):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, console: Console) -> dict:
    arms = load(out)
    if not arms:
        raise SystemExit(f"step_size_report: no finished runs under {out} (run sapo_experiment.py --step-size --out {out})")
    result = {"arms": arm_rows(arms), "pairs": pair_rows(arms)}
    (out / "step-size.json").write_text(json.dumps(result, indent=1))
    (out / "step-size.md").write_text(markdown(result))
    figure(result, out / "step-size.png")
    table = Table(title="the controller against the same rate fixed: held-out gap, paired by seed")
    for col in ("arm", "against", "round", "gap (95% CI)"):
        table.add_column(col)
    for p in result["pairs"]:
        for k, g in p["gaps"]:
            table.add_row(p["arm"], p["against"], str(k), held_out_gap(g))
    print_table(console, table)
    console.print(f"saved {out / 'step-size.json'}, {out / 'step-size.md'} and {out / 'step-size.png'}")
    return result


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the grid's folder (sapo_experiment.py --step-size --out)")
    args = parser.parse_args()
    if not args.out.is_dir():
        parser.error(f"argument --out: {args.out} is not a folder")
    report(args.out, Console(width=200))


if __name__ == "__main__":
    main()
