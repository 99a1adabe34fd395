"""Four owners teach each other: what each SmolLM2 node learned of the three families it never draws, from the grid
`sapo_experiment.py --owners` ran, against the same node alone and against both union silos.

Node k owns family k (`sapo_experiment.OWNER_FAMILIES`). Each seed is one independent replicate: its four nodes'
gaps are averaged into one number per seed, and the intervals are over seeds (95%, t). A gap whose interval holds
zero is reported as "no effect seen" beside the smallest effect the seeds could have detected (80% power). Greedy and
expected accuracy (k samples a task) are both reported. The dose is what each node took from peers, family by
family and by third of the run, with what explains it: the groups it inspected and why the rest went unused.

    .venv/bin/python scripts/bench/sapo_experiment.py --owners --nodes 4 --rounds 30 --eval-every 30 --seeds 5 --out runs/owners --resume
    .venv/bin/python scripts/bench/owners.py --out runs/owners
    .venv/bin/python scripts/bench/owners.py --sizes docs/bench/owners-family-sizes.json   # each family's question space
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from experiment.grids import OWNER_FAMILIES
from experiment.paired import gap_stats, mean
from experiment.report import held_out_gap
from node.argtypes import script_parser
from rewards import TaskSource
from rewards.held_out import content_key
from rewards.source import DatasetMix

ARMS = {"alone": "owners 4/0", "swarm": "owners 2/2 guarded", "union": "owners-union 4/0",
        "union_tokens": "owners-union 2/0", "swarm_3_1": "owners 3/1 guarded"}
COMPARISONS = [("swarm", "alone"), ("swarm", "union"), ("swarm", "union_tokens"), ("swarm_3_1", "alone"),
               ("union", "alone")]
MEASURES = {"expected": "expected_by_dataset_last", "greedy": "eval_by_dataset_last"}
FAMILIES = [f["name"] for f in OWNER_FAMILIES]
THIRDS = 3
SIZE_DRAWS = 40_000
TOP = 200  # a family's most frequent questions, whose share of the draws says how uneven it is
EVAL_PER_FAMILY = 100  # the grid's evaluation: 400 questions over the four families (OWNERS_EVAL)
MOST_TRAINED = {"owner alone (4 groups a round)": 4, "a node that never draws it (2 peers' groups a round at most)": 2}


def question_space(family: dict, draws: int = SIZE_DRAWS, seed: int = 12345, eval_n: int = EVAL_PER_FAMILY) -> dict:
    """A family's question space, estimated from the distinct questions among `draws`: the size S of a uniform space
    that would give as many (S (1 - exp(-draws / S)) = distinct), exact where the draws exhaust it. A family's draws
    need not be uniform, so its spread is measured too: the chance that two draws ask the same question (`repeat`,
    whose inverse is the uniform space with as many repeats), the share of draws taken by its `TOP` most frequent
    questions, and the share of draws that ask one of `eval_n` questions drawn under another seed (an evaluation's)."""
    def questions(seed: int, n: int) -> list[str]:
        return [content_key(t.question) for t in TaskSource([DatasetMix(family["name"], family["config"])], seed=seed).draw(n)]

    counts = Counter(questions(seed, draws))
    distinct = len(counts)
    low, high = float(distinct), 1e12
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if mid * (1 - math.exp(-draws / mid)) < distinct else (low, mid)
    repeat = sum(c * (c - 1) for c in counts.values()) / (draws * (draws - 1))
    held = set(questions(seed + 1, eval_n))
    return {"family": family, "draws": draws, "distinct": distinct, "space": round(low), "repeat": repeat,
            "space_by_repeats": round(1 / repeat), "top": TOP, "top_share": round(sum(c for _, c in counts.most_common(TOP)) / draws, 3),
            "eval_n": eval_n, "eval_hit": round(sum(counts[k] for k in held) / draws, 4)}


def sizes(rounds: int = 30) -> list[dict]:
    """Each family's space against the most questions of it one node trains on in a run of `rounds`."""
    rows = []
    for family in OWNER_FAMILIES:
        row = question_space(family)
        row["per_run"] = {who: per * rounds for who, per in MOST_TRAINED.items()}
        row["space_over_trained"] = {who: round(row["space"] / n, 1) for who, n in row["per_run"].items()}
        row["space_by_repeats_over_trained"] = {who: round(row["space_by_repeats"] / n, 1) for who, n in row["per_run"].items()}
        rows.append(row)
    return rows


def load(out: Path) -> dict[str, dict[int, dict]]:
    """Finished runs by arm and seed."""
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    by_name = {name: arm for arm, name in ARMS.items()}
    for path in sorted(out.glob("*/seed*/result.json")):
        run = json.loads(path.read_text())
        if not run.get("failed") and run["config"] in by_name:
            runs[by_name[run["config"]]][run["seed"]] = run
    return runs


def accuracy(run: dict, node: int, family: str, measure: str) -> float:
    return run["nodes"][node][MEASURES[measure]][family]


def seed_gaps(ours: dict, theirs: dict, measure: str) -> dict[str, float]:
    """One seed's gaps: over every owner's never-drawn families ("taught"), per family over the three nodes that do
    not own it, and on each owner's own family ("own")."""
    cells = {(k, f): accuracy(ours, k, f, measure) - accuracy(theirs, k, f, measure)
             for k in range(len(FAMILIES)) for f in FAMILIES}
    gaps = {"taught": mean([g for (k, f), g in cells.items() if FAMILIES[k] != f]),
            "own": mean([cells[k, FAMILIES[k]] for k in range(len(FAMILIES))])}
    gaps.update({f: mean([g for (k, g_f), g in cells.items() if g_f == f and FAMILIES[k] != f]) for f in FAMILIES})
    return gaps


def numerics(run: dict) -> str:
    """The dtype of a run's matrix products, sampling and training (`sapo_experiment.py --products`): each machine's
    plan picks it, and a pair of runs compared on other numerics would measure the machine as well as the arm."""
    found = {(n["timing"].get("sampling_dtype"), n["timing"].get("compute_dtype")) for n in run["nodes"] if n.get("timing")}
    if len(found) != 1:
        return "mixed" if found else "unrecorded"
    ((sampling, training),) = found
    return str(sampling) if sampling == training else f"sampling {sampling}, training {training}"


def comparisons(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """Each comparison, measure and endpoint: the gap's mean, interval, detectable effect and per-seed values, over
    the seeds whose two runs share their numerics (the rest listed as left out), and both arms' tokens per node there."""
    rows = []
    for ours, theirs in COMPARISONS:
        pairs = {s: (numerics(runs[ours][s]), numerics(runs[theirs][s])) for s in sorted(set(runs[ours]) & set(runs[theirs]))}
        seeds = [s for s, (a, b) in pairs.items() if a == b]
        left_out = [f"seed {s}: {a} against {b}" for s, (a, b) in pairs.items() if a != b]
        if not seeds:
            continue
        tokens = {side: mean([n["tokens_generated"] for s in seeds for n in runs[arm][s]["nodes"]])
                  for side, arm in (("ours", ours), ("theirs", theirs))}
        for measure in MEASURES:
            per_seed = [seed_gaps(runs[ours][s], runs[theirs][s], measure) for s in seeds]
            for endpoint in ["taught", *FAMILIES, "own"]:
                values = [g[endpoint] for g in per_seed]
                rows.append({"arm": ours, "against": theirs, "measure": measure, "endpoint": endpoint,
                             "paired_seeds": seeds, "left_out": left_out, "tokens_per_node": tokens, "per_seed": values,
                             **gap_stats(values)})
    return rows


def levels(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """Each arm's accuracy on never-drawn families and on its own, at the end (mean over seeds), with what it cost
    (`costs`): one row per arm and numerics, since both depend on the machine's."""
    rows = []
    for arm, by_seed in runs.items():
        for label in sorted({numerics(r) for r in by_seed.values()}):
            alike = [r for r in by_seed.values() if numerics(r) == label]
            row = {"arm": arm, "numerics": label, "seeds": sorted(r["seed"] for r in alike)}
            for measure in MEASURES:
                taught = [mean([accuracy(r, k, f, measure) for k in range(len(FAMILIES)) for f in FAMILIES if FAMILIES[k] != f])
                          for r in alike]
                own = [mean([accuracy(r, k, FAMILIES[k], measure) for k in range(len(FAMILIES))]) for r in alike]
                row[f"{measure}_never_drawn"], row[f"{measure}_own"] = mean(taught), mean(own)
            rows.append(row | costs(alike))
    return rows


def costs(runs: list[dict]) -> dict:
    """Runs' starting accuracy, tokens generated, evaluation questions passed over and seconds per node, and memory:
    the largest peak of one node against its plan, and the largest sum of one run's four peaks (an upper bound on the
    machine's, since the peaks need not coincide)."""
    nodes = [n for r in runs for n in r["nodes"]]
    row = {name: mean([n[key] for n in nodes]) for name, key in (
        ("start_expected", "expected_first"), ("start_greedy", "eval_first"), ("tokens_per_node", "tokens_generated"),
        ("seconds_per_node", "seconds"))}
    row["wall_seconds"] = mean([r["wall_seconds"] for r in runs])
    row["peak_gb_per_node"] = max(n["timing"]["peak_gb"] for n in nodes)
    row["planned_gb_per_node"] = max(n["timing"]["planned_peak_gb"] for n in nodes)
    row["peak_gb_sum"] = max(sum(n["timing"]["peak_gb"] for n in r["nodes"]) for r in runs)
    skipped = [n.get("held_out_skipped") for n in nodes]
    row["held_out_skipped_per_node"] = None if None in skipped else mean(skipped)
    return row


def thirds(rounds: int) -> list[range]:
    return [range(i * rounds // THIRDS, (i + 1) * rounds // THIRDS) for i in range(THIRDS)]


def per_third(nodes: list[dict], key: str, total) -> list:
    """`total` of each node's curve `key` over each third of the run, the mean over `nodes` (None values as missing)."""
    parts = thirds(len(nodes[0]["curves"][key]))
    return [mean([total([n["curves"][key][i] for i in part]) for n in nodes]) for part in parts]


def count_of(family: str):
    return lambda taken: sum((t or {}).get(family, 0) for t in taken)


def dropped(nodes: list[dict]) -> list[dict[str, float]]:
    """Pool groups left unused per third of the run, by reason, the mean over `nodes`."""
    parts = thirds(len(nodes[0]["curves"]["external_dropped"]))
    return [{k: v / len(nodes) for k, v in sorted(sum((Counter(n["curves"]["external_dropped"][i] or {})
                                                       for n in nodes for i in part), Counter()).items())} for part in parts]


def dose(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """Per arm that shares, node and family: peers' groups taken, in total and by third of the run (mean over
    seeds), and per third what explains it: groups inspected, why the rest went unused, the support gate's cut-off."""
    rows = []
    for arm in ("swarm", "swarm_3_1"):
        for node, owns in enumerate(FAMILIES):
            nodes = [r["nodes"][node] for r in runs[arm].values()]
            if not nodes:
                continue
            taken = {f: per_third(nodes, "external_families", count_of(f)) for f in FAMILIES if f != owns}
            rows.append({"arm": arm, "node": node, "owns": owns, "taken_by_third": taken,
                         "taken": {f: sum(v) for f, v in taken.items()},
                         "inspected_by_third": per_third(nodes, "external_inspected", lambda xs: sum(x or 0 for x in xs)),
                         "dropped_by_third": dropped(nodes),
                         "cutoff_by_third": per_third(nodes, "support_cutoff",
                                                      lambda xs: mean([x for x in xs if x is not None]))})
    return rows


def report(out: Path, console: Console) -> dict:
    runs = load(out)
    if not runs["alone"] or not runs["swarm"]:
        raise SystemExit(f"owners: no finished 'alone' and 'swarm' runs under {out} (run sapo_experiment.py --owners)")
    first = next(iter(runs["swarm"].values()))
    result = {"families": OWNER_FAMILIES, "rounds": first["rounds"], "cpus": first["cpus"],
              "comparisons": comparisons(runs), "levels": levels(runs), "dose": dose(runs)}
    (out / "owners.json").write_text(json.dumps(result, indent=1))
    (out / "owners.md").write_text(markdown(result))
    gaps = Table(title="what sharing taught: each owner's accuracy on families it never draws, and on its own, paired by seed")
    for col in ("arm", "against", "measure", "endpoint", "gap (95% CI)", "per seed"):
        gaps.add_column(col)
    for r in result["comparisons"]:
        gaps.add_row(r["arm"], r["against"], r["measure"], r["endpoint"], held_out_gap(r), " ".join(f"{v:+.3f}" for v in r["per_seed"]))
    console.print(gaps)
    figure(out / "owners.json", out / "owners.png")
    console.print(f"saved {out / 'owners.json'}, {out / 'owners.md'} and {out / 'owners.png'}")
    return result


def optional(value: float | None) -> str:
    """A figure older runs did not record, as '-'."""
    return "-" if value is None else f"{value:.1f}"


def markdown(result: dict) -> str:
    lines = ["| arm | vs | measure | endpoint | gap (95% CI) | per seed |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['arm']} | {r['against']} | {r['measure']} | {r['endpoint']} | {held_out_gap(r)} | "
              f"{' '.join(f'{v:+.3f}' for v in r['per_seed'])} |" for r in result["comparisons"]]
    left_out = {f"{r['arm']} against {r['against']}: {', '.join(r['left_out'])}" for r in result["comparisons"] if r["left_out"]}
    lines += ["", *(f"Left out, ran on other numerics: {said}." for said in sorted(left_out))] if left_out else []
    lines += ["", "| arm | seeds (numerics) | expected: start -> never drawn / own | greedy: start -> never drawn / own | tokens per node "
              "| evaluation questions passed over per node | seconds per node | peak / planned GB per node | peaks summed, GB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['arm']} | {len(r['seeds'])} ({r['numerics']}) | {r['start_expected']:.3f} -> {r['expected_never_drawn']:.3f} / "
              f"{r['expected_own']:.3f} | {r['start_greedy']:.3f} -> {r['greedy_never_drawn']:.3f} / {r['greedy_own']:.3f} | "
              f"{r['tokens_per_node']:,.0f} | {optional(r['held_out_skipped_per_node'])} | "
              f"{r['seconds_per_node']:,.0f} | {r['peak_gb_per_node']:.2f} / "
              f"{r['planned_gb_per_node']:.2f} | {r['peak_gb_sum']:.1f} |" for r in result["levels"]]
    lines += ["", "| arm | node (owns) | peers' groups taken, by family: per third of the run | inspected per third | "
              "unused per third, by reason |", "| --- | --- | --- | --- | --- |"]
    for d in result["dose"]:
        taken = "; ".join(f"{f}: {' / '.join(f'{v:.1f}' for v in by)}" for f, by in d["taken_by_third"].items())
        dropped = " / ".join(", ".join(f"{k} {v:.1f}" for k, v in sorted(t.items())) or "-" for t in d["dropped_by_third"])
        lines.append(f"| {d['arm']} | {d['node']} ({d['owns']}) | {taken} | "
                     f"{' / '.join(f'{v:.1f}' for v in d['inspected_by_third'])} | {dropped} |")
    return "\n".join(lines) + "\n"


def plot_gaps(ax, data: dict) -> None:
    """Per family, the expected-accuracy gap of the nodes that never draw it, in each comparison (95% CI)."""
    points = ["taught", *[f["name"] for f in data["families"]]]
    shown = [(a, b) for a, b in COMPARISONS if any(r["arm"] == a and r["against"] == b for r in data["comparisons"])]
    width = 0.8 / max(1, len(shown))
    for j, (arm, against) in enumerate(shown):
        rows = {r["endpoint"]: r for r in data["comparisons"] if (r["arm"], r["against"], r["measure"]) == (arm, against, "expected")}
        ax.bar([i + j * width for i in range(len(points))], [rows[p]["gap"] for p in points], width,
               yerr=[0 if rows[p]["ci95"] != rows[p]["ci95"] else rows[p]["ci95"] for p in points],
               capsize=3, label=f"{arm} vs {against}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(points))], ["all never drawn", *points[1:]], fontsize=7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(title="expected accuracy on families a node never draws:\ngap (95% CI over seeds)")
    ax.legend(fontsize=7)


def plot_dose(ax, data: dict) -> None:
    """Peers' groups taken per third of the run, by family: the mean over the nodes that do not own it."""
    for arm, style in (("swarm", "-"), ("swarm_3_1", "--")):
        rows = [d for d in data["dose"] if d["arm"] == arm]
        for f in (f["name"] for f in data["families"]):
            per = [d["taken_by_third"][f] for d in rows if f in d["taken_by_third"]]
            if per:
                ax.plot(range(1, THIRDS + 1), [mean(list(v)) for v in zip(*per)], style, marker="o", label=f"{arm}: {f}")
    ax.set(title="the dose: peers' groups taken per third of the run\n(mean over the nodes that do not own the family)",
           xlabel="third of the run", xticks=range(1, THIRDS + 1))
    ax.legend(fontsize=7)


def figure(results_json: Path, path: Path) -> None:
    """The gaps and the dose, from the JSON alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results_json.read_text())
    fig, (ax_gap, ax_dose) = plt.subplots(1, 2, figsize=(15, 4.8))
    plot_gaps(ax_gap, data)
    plot_dose(ax_dose, data)
    fig.suptitle(f"Four SmolLM2-135M owners, {data['rounds']} rounds, {data['cpus']}-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--out", type=Path, help="the grid's folder (sapo_experiment.py --owners --out)")
    parser.add_argument("--sizes", type=Path, metavar="JSON", help="estimate each family's question space, save it here")
    args = parser.parse_args()
    if args.sizes:
        rows = sizes()
        args.sizes.write_text(json.dumps(rows, indent=1))
        for r in rows:
            print(f"{r['family']['name']}: ~{r['space']:,} questions, repeating as ~{r['space_by_repeats']:,} would; "
                  f"{r['top_share']:.0%} of draws in its {r['top']} most frequent, {r['eval_hit']:.1%} in {r['eval_n']} evaluation questions")
        return
    if args.out is None:
        parser.error("give the grid's folder as --out (or --sizes to estimate the families' question spaces)")
    if not args.out.is_dir():
        parser.error(f"argument --out: {args.out} is not a folder")
    report(args.out, Console(width=200))


if __name__ == "__main__":
    main()
