"""The experiment's tables (terminal and markdown) and its figure, drawn from the finished runs' result.json files
and then from the results.json they are merged into, alone."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from experiment.grids import DEFAULT_RULE, EVAL_TASKS
from experiment.paired import picked, summarize

def report(out: Path, console: Console) -> None:
    """Tables and the figure from the finished runs under `out`; runs saved as failed are left out of all of
    them, and named."""
    saved = [json.loads(p.read_text()) for p in sorted(out.glob("*/seed*/result.json"))]
    results = [r for r in saved if not r.get("failed")]
    left_out = [r for r in saved if r.get("failed")]
    if left_out:
        console.print(f"left out {len(left_out)} failed run{'s' if len(left_out) > 1 else ''} (a node failed; "
                      "run the experiment again to redo them):", soft_wrap=True)
        for r in left_out:
            console.print(f"  {r['config']} seed {r['seed']}: {'; '.join(r['failed'])}", soft_wrap=True, markup=False)
    if not results:
        raise SystemExit(f"sapo_experiment: no finished runs under {out}")
    rows = summarize(results)
    first = results[0]
    models = ", ".join(dict.fromkeys(n["model"] for r in results for n in r["nodes"]))
    subtitle = (f"{models}; {first['nodes_n']} nodes x {first['rounds']} rounds, "
                f"seeds per config: up to {max(len(r['seeds']) for r in rows)}, {hardware(first)}")
    table = Table(title=f"SAPO swarm vs silo: {subtitle}")
    for col in ("configuration", "cumulative reward", "vs silo (paired)", "eval before -> after", "eval vs silo: last / worst",
                "local / ext informative", "ext used /round", "tokens /node", "reward /1k tokens", "round, peak / plan GB",
                "seeds"):
        table.add_column(col, justify="right", no_wrap=col == "configuration")
    for r in rows:
        ext = "-" if r["external_informative_share"] is None else f"{r['external_informative_share']:.2f}"
        table.add_row(r["config"], f"{r['cumulative_reward']:.2f} ± {r['cumulative_reward_ci95']:.2f}",
                      reward_vs_silo(r), f"{r['eval_first']:.3f} -> {r['eval_last']:.3f}", versus_silo(r),
                      f"{r['local_informative_share']:.2f} / {ext}", f"{r['external_used_per_round']:.2f}",
                      f"{r['tokens_per_node']:,.0f}", f"{r['reward_per_1k_tokens']:.2f}", per_round(r), str(len(r["seeds"])))
    console.print(table)
    tables = [(MEASURES_TITLE, MEASURES, measurement_lines(rows)), (AGAINST_DEFAULT_TITLE, AGAINST_DEFAULT, default_lines(rows))]
    tables = [t for t in tables if t[2]]
    for title, columns, lines in tables:
        console.print(lines_table(title, columns, lines))
    (out / "results.json").write_text(json.dumps({"subtitle": subtitle, "configs": rows, "runs": results,
                                                  "failed_runs_left_out": len(left_out)}))
    (out / "results.md").write_text("\n".join([markdown(rows), *(lines_markdown(columns, lines) for _, columns, lines in tables)]))
    figure(out / "results.json", out / "results.png")
    console.print(f"saved {out / 'results.json'}, {out / 'results.md'} (the table for a docs/bench page) and {out / 'results.png'}")


def reward_vs_silo(row: dict) -> str:
    """Cumulative reward against the paired silo (95% CI); '-' in a grid that ran no silo beside the row (the
    step-size grids weigh their arms against each other instead)."""
    if math.isnan(row["vs_silo"]):
        return "-"
    ci = "n/a" if math.isnan(row["vs_silo_ci95"]) else f"{100 * row['vs_silo_ci95']:.1f}"
    return f"{100 * row['vs_silo']:+.1f}% ± {ci}"


def versus_silo(row: dict) -> str:
    """Held-out accuracy minus the paired silo's: at the last eval point (95% CI) and at the worst one."""
    if row["eval_last_vs_silo"] is None or row["reference"] == row["run_config"]:
        return "-"
    ci = "" if math.isnan(row["eval_last_vs_silo_ci95"]) else f" ± {row['eval_last_vs_silo_ci95']:.3f}"
    return f"{row['eval_last_vs_silo']:+.3f}{ci} / {row['eval_vs_silo_worst']:+.3f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| configuration | cumulative reward (95% CI) | vs silo, paired (95% CI) | eval before -> after | "
             "eval vs silo, last (95% CI) / worst point | informative share local / external | tokens per node | "
             "reward per 1k tokens | seconds per round, peak / planned GB | seeds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ext = "-" if r["external_informative_share"] is None else f"{r['external_informative_share']:.2f}"
        ci = lambda x: "n/a" if math.isnan(x) else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {r['config']} | {r['cumulative_reward']:.2f} ± {ci(r['cumulative_reward_ci95'])} | "
                     f"{reward_vs_silo(r)} | {r['eval_first']:.3f} -> {r['eval_last']:.3f} | "
                     f"{versus_silo(r)} | {r['local_informative_share']:.2f} / {ext} | {r['tokens_per_node']:,.0f} | "
                     f"{r['reward_per_1k_tokens']:.2f} | {per_round(r)} | {len(r['seeds'])} |")
    return "\n".join(lines) + "\n"


def held_out_gap(stats: dict | None, percent: bool = False) -> str:
    """A gap with its 95% interval (a ratio in percent); where the interval holds zero, 'no effect' and the smallest
    effect the design could have detected beside it."""
    show = (lambda x, sign="+": f"{100 * x:{sign}.1f}%") if percent else (lambda x, sign="+": f"{x:{sign}.3f}")
    if not stats or math.isnan(stats["ci95"]):
        return "-" if not stats else f"{show(stats['gap'])} (1 seed)"
    said = f"{show(stats['gap'])} ± {show(stats['ci95'], '')}"
    return said if abs(stats["gap"]) > stats["ci95"] else f"{said}: no effect seen (detectable: {show(stats['mde'], '')})"


def per_round(row: dict) -> str:
    if row["round_s"] is None:
        return "-"
    peak = "-" if row["peak_gb"] is None else f"{row['peak_gb']:.2f}"
    return f"{row['round_s']:.2f} s, {peak} / {row['planned_peak_gb']:.2f}"


def hardware(first: dict) -> str:
    """Where the runs ran: the card a node's plan names, else the host's cores."""
    device = next((n["timing"]["device"] for n in first["nodes"] if n.get("timing")), "")
    return device.split(" (", 1)[1].split(",", 1)[0] if device.startswith("cuda") else f"{first['cpus']}-core CPU"


def measurement_lines(rows: list[dict]) -> list[list[str]]:
    """Per row: dose, the paper's batch reward against the silo, the expected held-out accuracy and its gap to the same
    nodes alone, and each node's gap on each dataset (gaps left out of the reference row itself)."""
    lines = []
    for r in rows:
        reference = r["reference"] == r["run_config"]
        paper = ("-" if r["paper_vs_silo"] is None or reference else f"{100 * r['paper_vs_silo']:+.1f}%"
                 + ("" if math.isnan(r["paper_vs_silo_ci95"]) else f" ± {100 * r['paper_vs_silo_ci95']:.1f}"))
        expected = "-" if r["expected_last"] is None else f"{r['expected_first']:.3f} -> {r['expected_last']:.3f}"
        gaps = {} if reference else r["expected_vs_silo"]
        per = "; ".join(f"{k}: {held_out_gap(v)}" for k, v in gaps.items() if k != "all")
        dose = "-" if math.isnan(r["dose_per_round"]) else f"{r['dose_per_round']:.2f}"
        lines.append([r["config"], dose, paper, expected, held_out_gap(gaps.get("all")), per or "-"])
    return lines


MEASURES = ("configuration", "informative groups trained /round", "paper's batch reward vs silo",
            "expected held-out before -> after", "expected held-out vs alone", "per node and dataset vs alone")
MEASURES_TITLE = ("the dose each arm received, the paper's metric (its training batch, peers' kept groups included) "
                  "and the expected held-out accuracy (k samples a task) against the same nodes alone")
AGAINST_DEFAULT = ("configuration", f"cumulative reward vs {DEFAULT_RULE}, paired", f"held-out vs {DEFAULT_RULE}, paired",
                   "held-out measure")
AGAINST_DEFAULT_TITLE = f"each rule or channel against the same nodes under the default rule ({DEFAULT_RULE}) at the same seed"


def default_lines(rows: list[dict]) -> list[list[str]]:
    """Per arm that has the default rule's arm beside it: its cumulative reward and held-out accuracy against that
    arm's, seed by seed (what a rule must beat to become the default)."""
    return [[r["config"], held_out_gap(r["vs_default"]["reward"], percent=True), held_out_gap(r["vs_default"]["held_out"]),
             r["vs_default"]["held_out_measure"]] for r in rows if r["vs_default"]]


def lines_table(title: str, columns: tuple[str, ...], lines: list[list[str]]) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right", no_wrap=col == "configuration")
    for line in lines:
        table.add_row(*line)
    return table


def lines_markdown(columns: tuple[str, ...], lines: list[list[str]]) -> str:
    rows = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return "\n".join(rows + ["| " + " | ".join(line) + " |" for line in lines]) + "\n"


RULE_COLORS = {"uniform": "tab:blue", "signal": "tab:orange", "guarded": "tab:cyan", "scoped": "tab:pink", "adaptive": "tab:green"}


def row_color(r: dict) -> str:
    if r["external"] == 0:  # the silo, or another arm compared with it (the quantized grid's NF4 silo)
        return "tab:gray" if r["reference"] == r["run_config"] else "tab:brown"
    if r["control"]:
        return "tab:purple"
    if r["when_short"] != "fill_local":  # peers' tasks sampled here
        return "tab:olive"
    return "tab:red" if r["negatives"] else RULE_COLORS[r["rule"]]


def mean_curve(runs: list[dict], row: dict, key: str) -> list[float]:
    """A row's per-round curve `key`, the mean over its nodes (rounds without a value skipped) and then its seeds."""
    curves = [[statistics.mean(x for x in xs if x is not None) if any(x is not None for x in xs) else float("nan")
               for xs in zip(*[n["curves"][key] for n in picked(r, row["model"])])]
              for r in runs if r["config"] == row["run_config"]]
    return [statistics.mean(xs) for xs in zip(*curves)]


def mean_eval(runs: list[dict], row: dict) -> tuple[list[int], list[float]]:
    """A row's held-out curve, the mean over its nodes and seeds at the evaluation points they share (a node of a
    faster model, given more rounds, evaluates past the others)."""
    evals = [n["curves"]["eval"] for r in runs if r["config"] == row["run_config"] for n in picked(r, row["model"])]
    means = [statistics.mean(acc) for acc in zip(*[[a for _, a in e] for e in evals])]
    return [rnd for rnd, _ in min(evals, key=len)], means


def moving_mean(curve: list[float], window: int = 15) -> list[float]:
    return [statistics.mean(c for c in curve[max(0, i - window): i + 1] if not math.isnan(c))
            if any(not math.isnan(c) for c in curve[max(0, i - window): i + 1]) else float("nan")
            for i in range(len(curve))]


def plot_vs_silo(ax, rows: list[dict]) -> None:
    ax.barh([r["config"] for r in rows], [100 * r["vs_silo"] for r in rows],
            xerr=[0 if math.isnan(r["vs_silo_ci95"]) else 100 * r["vs_silo_ci95"] for r in rows],
            color=[row_color(r) for r in rows], capsize=3)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set(title="cumulative reward vs the same seed's silo (95% CI)", xlabel="%")


def plot_curves(ax_cum, ax_eval, rows: list[dict], runs: list[dict]) -> None:
    """The silo and the even split; a mixed testbed's models apart, rather than averaged together (dotted)."""
    per_model = [r for r in rows if r["model"] is not None]
    mixed_models = {r["config"]: len({n["model"] for n in r["nodes"]}) > 1 for r in runs}
    for r in rows:
        if (r["external"] == 0 or r["external"] == r["local"]) and (r["model"] is not None or not any(
                m["run_config"] == r["run_config"] for m in per_model)):
            cum = mean_curve(runs, r, "reward")
            style = {"color": row_color(r), "label": r["config"], "linestyle": ":" if mixed_models[r["run_config"]] else "-"}
            ax_cum.plot([sum(cum[: i + 1]) for i in range(len(cum))], **style)
            ax_eval.plot(*mean_eval(runs, r), marker=".", **style)
    ax_cum.set(title="cumulative reward (mean of nodes and seeds)", xlabel="round")
    sizes = sorted({eval_size(r) for r in runs})
    ax_eval.set(title=f"held-out accuracy (greedy, {' or '.join(map(str, sizes))} tasks; mean of nodes and seeds)", xlabel="round")
    for ax in (ax_cum, ax_eval):
        ax.legend(fontsize=6)


def eval_size(run: dict) -> int:
    """The held-out tasks a run evaluated on: `EVAL_TASKS` (`Config.node_args`) unless its testbed's own flags say otherwise."""
    extra = run.get("extra") or []
    flagged = [extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--tasks.eval_size"]
    return int(flagged[-1]) if flagged else EVAL_TASKS


def plot_informative(ax, rows: list[dict], runs: list[dict]) -> None:
    """The even split's informative shares, local and external, per rule; a grid of silos alone: their local shares."""
    split = [r for r in rows if r["external"] == r["local"] and r["testbed"] == rows[0]["testbed"] and not r["control"]]
    for r in [r for r in split or [r for r in rows if r["external"] == 0] if r["model"] is None]:
        for key, style in (("local_informative_share", "-"), ("external_informative_share", "--")):
            curve = mean_curve(runs, r, key)
            if not all(math.isnan(c) for c in curve):  # a silo inspects no external group
                arm = r["config"].removeprefix(f"{r['testbed']} {r['local']}/{r['external']} ") if split else r["config"]
                ax.plot(moving_mean(curve), color=row_color(r), linestyle=style, label=f"{arm}: {key.split('_')[0]}")
    even = f"{split[0]['testbed']} {split[0]['local']}/{split[0]['external']}" if split else ""
    ax.set(title=f"share of informative groups, {even}\n(local sampled, external inspected; moving mean)",
           xlabel="round", ylim=(0, 1))
    ax.legend(fontsize=7)


def figure(results_json: Path, path: Path) -> None:
    """Bars of cumulative reward against the silo, cumulative reward and held-out accuracy curves, and informative
    shares, from the JSON alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results_json.read_text())
    rows, runs = data["configs"], data["runs"]
    fig, (ax_bar, ax_cum, ax_eval, ax_inf) = plt.subplots(1, 4, figsize=(22, 4.8))
    plot_vs_silo(ax_bar, rows)
    plot_curves(ax_cum, ax_eval, rows, runs)
    plot_informative(ax_inf, rows, runs)
    for ax in (ax_cum, ax_eval, ax_inf):
        ax.grid(alpha=0.3)
    fig.suptitle(f"SAPO swarm vs silo: {data['subtitle']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
