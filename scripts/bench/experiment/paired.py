"""Each arm's runs paired with the same nodes alone (its silo) and under the default rule at the same seed: means,
95% intervals over seeds, and beside any interval that holds zero the smallest effect the seeds could have detected."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict

from experiment.grids import DEFAULT_RULE, GRIDS, Config, grid
from node.selection_config import RULES

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided t, df
T80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889, 9: 0.883}  # one-sided t at 80%


def mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def ci95(xs: list[float]) -> float:
    """Half-width of a 95% t interval of the mean; nan for a single value."""
    if len(xs) < 2:
        return float("nan")
    return T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def mde(gaps: list[float]) -> float:
    """The smallest mean paired gap these seeds would find at 5% (two-sided) with 80% power, given their spread."""
    if len(gaps) < 2:
        return float("nan")
    df = len(gaps) - 1
    return (T95.get(df, 1.96) + T80.get(df, 0.842)) * statistics.stdev(gaps) / math.sqrt(len(gaps))


def gap_stats(gaps: list[float]) -> dict | None:
    return {"gap": mean(gaps), "ci95": ci95(gaps), "mde": mde(gaps), "seeds": len(gaps)} if gaps else None


def picked(run: dict, model: str | None) -> list[dict]:
    """The run's nodes of `model` (None: every model), companions left out: they ran for a length of their own."""
    return [n for n in run["nodes"] if model in (None, n["model"]) and not n.get("companion")]


def twins(silo: dict, run: dict, model: str | None) -> list[dict]:
    """The silo's nodes that ran as `run`'s did but alone: node k has the same seed, model and task mix in both, so
    a SmolLM2 node beside a companion is paired with the silo's node of its seed, not with the mean of two seeds."""
    names = {n["name"] for n in picked(run, model)}
    return [n for n in picked(silo, model) if n["name"] in names] or picked(silo, model)


def eval_curve(nodes: list[dict]) -> dict[int, float]:
    """Held-out accuracy at each eval round, the mean over `nodes`."""
    by_round: dict[int, list[float]] = {}
    for n in nodes:
        for rnd, acc in n["curves"]["eval"]:
            by_round.setdefault(rnd, []).append(acc)
    return {rnd: mean(accs) for rnd, accs in by_round.items()}


def summarize(results: list[dict]) -> list[dict]:
    """Per configuration: means and 95% intervals over seeds, paired with the same seed's silo; where a testbed mixes
    models, one more row per model (its nodes only), since a swarm can help one model and cost another."""
    by_config: dict[str, list[dict]] = {}
    for r in results:
        by_config.setdefault(r["config"], []).append(r)
    rows = []
    for name, runs in by_config.items():
        cfg = Config(**{k: runs[0][k] for k in ("testbed", "local", "external", "rule", "control", "negatives")},
                     overdraw=runs[0].get("overdraw", 1.0), lr=runs[0].get("lr"), when_short=runs[0].get("when_short", "fill_local"))
        silo = {r["seed"]: r for r in by_config.get(cfg.silo.name, [])}
        twin = cfg.default_twin
        default = {r["seed"]: r for r in by_config.get(twin.name, [])} if twin else {}
        runs = sorted(runs, key=lambda r: r["seed"])
        models = list(dict.fromkeys(n["model"] for r in runs for n in picked(r, None)))
        for model in [None, *models] if len(models) > 1 else [None]:
            rows.append({**config_row(name, cfg, runs, silo, model), "vs_default": against_default(runs, default, model)})
    sizes = sorted({r["local"] + r["external"] for r in results})  # the real grid's round: 4 groups, or 8 on a GPU
    names = dict.fromkeys(c.name for kind in GRIDS for groups in sizes for c in grid(list(RULES), kind, groups))
    order = {name: i for i, name in enumerate(names)}
    return sorted(rows, key=lambda r: (order.get(r["run_config"], len(order)), r["model"] or ""))


def config_row(name: str, cfg: Config, runs: list[dict], silo: dict[int, dict], model: str | None = None) -> dict:
    """One table row: the nodes of `model` (None: all), over every seed of `runs`, paired with the same nodes of each
    seed's silo."""
    nodes = lambda r: picked(r, model)  # noqa: E731
    cum = [mean([n["cumulative_reward"] for n in nodes(r)]) for r in runs]
    ratios = [c / mean([n["cumulative_reward"] for n in twins(silo[r["seed"]], r, model)]) - 1
              for c, r in zip(cum, runs) if r["seed"] in silo]
    eval_gain = [mean([n["eval_last"] - n["eval_first"] for n in nodes(r)]) for r in runs]
    eval_vs_silo, last_gap = held_out_vs_silo(runs, silo, model)
    node = lambda key: mean([n[key] for r in runs for n in nodes(r)])  # noqa: E731
    every = [n for r in runs for n in nodes(r)]
    return {
        "config": name + (f" [{model}]" if model else ""), "run_config": name, "model": model, **asdict(cfg),
        "reference": cfg.silo.name,
        "seeds": [r["seed"] for r in runs],
        "cumulative_reward": mean(cum), "cumulative_reward_ci95": ci95(cum),
        "vs_silo": mean(ratios), "vs_silo_ci95": ci95(ratios), "vs_silo_per_seed": ratios,
        "eval_first": node("eval_first"), "eval_last": node("eval_last"), "eval_gain_ci95": ci95(eval_gain),
        "eval_vs_silo": eval_vs_silo, "eval_vs_silo_worst": min((g for _, g in eval_vs_silo), default=None),
        "eval_last_vs_silo": mean(last_gap) if last_gap else None, "eval_last_vs_silo_ci95": ci95(last_gap),
        "tokens_per_node": node("tokens_generated"), "seconds_per_node": node("seconds"),
        **informative_row(every, node), "external_used_per_round": mean([n["external_used"] / max(1, len(n["curves"]["reward"])) for n in every]),
        **timing_row([n["timing"] for n in every if n.get("timing")]),
        **measurement_row(runs, silo, model),
    }


def measurement_row(runs: list[dict], silo: dict[int, dict], model: str | None) -> dict:
    """Issue 55's measures: the dose (informative groups trained a round), the paper's cumulative reward and its paired
    ratio to the silo, and the expected held-out accuracy's gaps to the same nodes alone (`expected_gaps`)."""
    every = [n for r in runs for n in picked(r, model)]
    complete = [r for r in runs if all(n.get("paper_cumulative_reward") is not None for n in picked(r, model))]
    ratios = paper_ratios(complete, silo, model)
    expected = [n for n in every if n.get("expected_last") is not None]
    return {"dose_per_round": mean([n["dose_per_round"] for n in every if n.get("dose_per_round") is not None]),
            "paper_cumulative_reward": mean([paper_reward(picked(r, model)) for r in complete]) if complete else None,
            "paper_vs_silo": mean(ratios) if ratios else None, "paper_vs_silo_ci95": ci95(ratios),
            "expected_first": mean([n["expected_first"] for n in expected]) if expected else None,
            "expected_last": mean([n["expected_last"] for n in expected]) if expected else None,
            "expected_vs_silo": expected_gaps(runs, silo, model)}


def paper_reward(nodes: list[dict]) -> float:
    return mean([n["paper_cumulative_reward"] for n in nodes])


def paper_ratios(runs: list[dict], silo: dict[int, dict], model: str | None) -> list[float]:
    """The paper's cumulative reward of each run against the same nodes alone at its seed, where both recorded it."""
    pairs = [(picked(r, model), twins(silo[r["seed"]], r, model)) for r in runs if r["seed"] in silo]
    return [paper_reward(ours) / paper_reward(theirs) - 1 for ours, theirs in pairs
            if all(n.get("paper_cumulative_reward") for n in theirs)]


def expected_gaps(runs: list[dict], silo: dict[int, dict], model: str | None) -> dict[str, dict]:
    """The last expected held-out accuracy minus that of the same nodes alone at the same seed: over the row's nodes
    ("all"), and per node and dataset ("node0 rg/products": specialist A's endpoint), each with its 95% interval and
    minimum detectable effect over the seeds."""
    gaps: dict[str, list[float]] = {}
    for r in runs:
        ours, theirs = picked(r, model), twins(silo[r["seed"]], r, model) if r["seed"] in silo else []
        if not theirs or any(n.get("expected_last") is None for n in ours + theirs):
            continue
        gaps.setdefault("all", []).append(mean([n["expected_last"] for n in ours]) - mean([n["expected_last"] for n in theirs]))
        alone = {n["name"]: n["expected_by_dataset_last"] for n in theirs}
        for n in ours:
            for dataset, acc in n["expected_by_dataset_last"].items():
                if dataset in alone.get(n["name"], {}):
                    gaps.setdefault(f"{n['name']} {dataset}", []).append(acc - alone[n["name"]][dataset])
    return {k: gap_stats(g) for k, g in gaps.items()}


def against_default(runs: list[dict], default: dict[int, dict], model: str | None) -> dict | None:
    """The arm against the same nodes under the default rule at the same seed: the ratio of cumulative reward and the
    gap in held-out accuracy (expected, where every run measured it), each with its interval and smallest detectable
    effect (None: no such arm)."""
    pairs = [(picked(r, model), twins(default[r["seed"]], r, model)) for r in runs if r["seed"] in default]
    if not pairs:
        return None
    reward = [mean([n["cumulative_reward"] for n in ours]) / mean([n["cumulative_reward"] for n in theirs]) - 1
              for ours, theirs in pairs]
    measured = all(n.get("expected_last") is not None for ours, theirs in pairs for n in ours + theirs)
    key = "expected_last" if measured else "eval_last"  # runs before the powered evaluation: the node's own eval
    held = [mean([n[key] for n in ours]) - mean([n[key] for n in theirs]) for ours, theirs in pairs]
    return {"rule": DEFAULT_RULE, "reward": gap_stats(reward), "held_out": gap_stats(held), "held_out_measure": key}


def held_out_vs_silo(runs: list[dict], silo: dict[int, dict], model: str | None) -> tuple[list[list], list[float]]:
    """Held-out accuracy against the same seed's silo at each eval point every seed has (the mean over seeds), and
    each seed's gap at the last of them."""
    gaps = [{k: acc - silo_curve[k] for k, acc in eval_curve(picked(r, model)).items() if k in silo_curve}
            for r in runs if r["seed"] in silo for silo_curve in [eval_curve(twins(silo[r["seed"]], r, model))]]
    points = sorted(set.intersection(*(set(g) for g in gaps))) if gaps else []
    return [[k, mean([g[k] for g in gaps])] for k in points], [g[points[-1]] for g in gaps] if points else []


def informative_row(every: list[dict], node) -> dict:
    """Reward per 1k tokens generated, and the shares of local groups sampled and external groups inspected that
    carried signal (None where no external group was inspected)."""
    inspected = node("external_inspected")
    return {"reward_per_1k_tokens": 1000 * sum(n["total_reward"] for n in every) / max(1, sum(n["tokens_generated"] for n in every)),
            "local_informative_share": node("local_informative") / max(1e-9, node("local_groups")),
            "external_informative_share": node("external_informative") / inspected if inspected else None}


def timing_row(timings: list[dict]) -> dict:
    """Seconds per round (mean) and the peak memory (the highest) beside the plan's estimate (the mean) over a row's
    nodes; None where the runs predate plan.json."""
    if not timings:
        return {"round_s": None, "peak_gb": None, "planned_peak_gb": None}
    peaks = [t["peak_gb"] for t in timings if t["peak_gb"] is not None]
    return {"round_s": mean([t["round_s"] for t in timings]), "peak_gb": max(peaks, default=None),
            "planned_peak_gb": mean([t["planned_peak_gb"] for t in timings])}
