"""The SAPO paper's swarm-vs-silo experiment on a CPU or one GPU: grids of arms, each a swarm of node processes on
127.0.0.1 paired by seed with the same nodes alone.

Every arm of a grid runs the same seeds, rounds and groups a round; only where the groups come from (I local + J
external) and how external ones are chosen differ. The grids, and what each measures, are in
scripts/bench/experiment/grids.py and in --help. Each finished run writes `<out>/<config>/seed<k>/result.json` as it
ends and deletes its checkpoints, so a long grid runs in pieces: stopped (Ctrl-C, or the session ending) and continued
with `--resume`, which skips finished runs and continues an unfinished one where all its nodes stopped at one
checkpoint (else starts it over, so that no node runs out of step with its peers); without
`--resume` an `--out` that holds runs is refused rather than mixed. `--only` splits a grid by arm; `--report` merges
whatever has finished into `results.json`, the tables and the figure, which is drawn from that JSON alone.

    .venv/bin/python scripts/bench/sapo_experiment.py --out runs/experiment                   # the paper's grid, tiny presets
    .venv/bin/python scripts/bench/sapo_experiment.py --out runs/experiment --resume --only "homogeneous 8/0"
    .venv/bin/python scripts/bench/sapo_experiment.py --out runs/experiment --report
    .venv/bin/python scripts/bench/sapo_experiment.py --quick --out runs/experiment-quick     # 5-minute smoke run
    .venv/bin/python scripts/bench/sapo_experiment.py --owners --nodes 4 --rounds 30 --eval-every 30 --seeds 5 --out runs/owners --resume

Cumulative reward is the sum over rounds of a node's mean reward on its own completions, averaged over the nodes;
runs that start from one model share its round-0 evaluation (kept in OUT/eval-cache). On a GPU the real-model grid
takes the paper's round of 8 groups, and `--first-seed` lets one process per arm and seed share one card. Each
machine's plan picks the nodes' numerics (bfloat16 products only on a CPU with bfloat16 matrix instructions), so a
grid run on more than one kind of machine pins them with `--products` and keeps each seed's arms on one setting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from experiment.grids import GRIDS, TESTBEDS, Config, grid
from experiment.paired import mean, picked
from experiment.report import report
from node.argtypes import count, script_parser
from node.bench import measured
from node.doctor import cpu_model
from node.metrics import MetricsLog
from node.selection_config import RULES
from node.swarm import SwarmError, SwarmSpec, run
from trainer.checkpoint import complete, round_of
from trainer.config import default_cache_dir
from trainer.presets import ensure
from trainer.pretrained import TERMS, unaccepted_terms

G = 8  # completions per group (the node default)
# --products: the node flags that pin both users of bfloat16 products (trainer/precision.py), or none for each plan's
PRODUCTS = {"auto": [], **{dtype: ["--generation.sampling_dtype", dtype, "--grpo.compute_dtype", dtype] for dtype in ("model", "bfloat16")}}


def slug(name: str) -> str:
    return name.replace(" ", "-").replace("/", "-").replace("+", "-")


def node_record(node_dir: Path, summary: dict) -> dict:
    """One node's totals and per-round curves, read from its metrics.jsonl."""
    rows = MetricsLog(node_dir / "metrics.jsonl").rows()
    evals = [r for r in rows if r.get("eval_accuracy") is not None]
    trained = [r for r in rows if r["round"] > 0]
    share = lambda num, den: [r[num] / r[den] if r[den] else None for r in trained]  # noqa: E731
    # seconds per round and peak memory beside the plan's estimate, as `sapo doctor --bench` reports them
    timing = measured(node_dir, rows) if (node_dir / "plan.json").exists() and len(trained) > 1 else None
    kept = ("round_s", "generate_s", "train_s", "push_s", "peak_gb", "planned_peak_gb", "verdict")
    return {
        "timing": None if timing is None else {**{k: timing[k] for k in kept}, "device": timing["plan"]["device"],
                                               "plan": timing["plan"]["summary"], **products(timing["plan"])},
        **{k: summary[k] for k in ("name", "model", "companion", "exit_code", "cumulative_reward", "tokens_generated", "seconds",
                                   "external_used", "external_inspected", "external_informative", "local_groups",
                                   "local_informative")},
        "total_reward": sum(r["reward_mean"] * r["n_local"] * G for r in trained),
        # local draws passed over for being evaluation questions (a peer's group on one is dropped as `held_out`)
        "held_out_skipped": sum(r.get("n_held_out_skipped", 0) for r in rows),
        **dose_record(trained), **expected_record(evals),
        "eval_first": evals[0]["eval_accuracy"], "eval_last": evals[-1]["eval_accuracy"],
        "eval_by_dataset_first": evals[0]["eval_by_dataset"], "eval_by_dataset_last": evals[-1]["eval_by_dataset"],
        "curves": {"reward": [r["reward_mean"] for r in trained],
                   "local_informative_share": share("local_informative", "n_local"),
                   "external_informative_share": share("external_informative", "external_inspected"),
                   "eval": [[r["round"], r["eval_accuracy"]] for r in evals],
                   "eval_by_dataset": [[r["round"], r["eval_by_dataset"]] for r in evals],  # each family's path
                   # what a node took from peers, family by family, and what explains it: the groups it looked at, why
                   # the rest went unused, and its support gate's cut-off
                   # the rate each step took (the step-size controller's path) and each round's peak memory (which
                   # rounds a plan was short for)
                   **{key: [r.get(key) for r in trained] for key in ("external_families", "external_inspected",
                                                                      "external_dropped", "support_cutoff", "lr",
                                                                      "memory_peak_gb")}},
    }


def products(plan: dict) -> dict:
    """The dtypes the node's plan resolved for its sampling and its training step's matrix products (`--products`),
    "model" read as the weights' own: runs paired by seed must compare the same numerics."""
    return {key: plan["dtype"] if plan.get(key) == "model" else plan.get(key) for key in ("sampling_dtype", "compute_dtype")}


def dose_record(trained: list[dict]) -> dict:
    """The paper's cumulative reward: each round's training batch, the external groups it kept included; the dose:
    groups that carried signal into the step, a round. None for runs made before the nodes recorded them."""
    return {"paper_cumulative_reward": None if any(r.get("batch_reward_mean") is None for r in trained)
            else sum(r["batch_reward_mean"] for r in trained),
            "dose_per_round": None if any("groups_trained" not in r for r in trained)
            else mean([r["groups_trained"] for r in trained])}


def expected_record(evals: list[dict]) -> dict:
    """The expected held-out accuracy (tasks.eval_samples) at the first and last evaluation, overall and per dataset, and
    its curve; None where the run evaluated greedily only."""
    if evals[0].get("eval_expected") is None:
        return {"expected_first": None, "expected_last": None, "expected_by_dataset_first": None, "expected_by_dataset_last": None}
    return {"expected_first": evals[0]["eval_expected"], "expected_last": evals[-1]["eval_expected"],
            "expected_by_dataset_first": evals[0]["eval_expected_by_dataset"],
            "expected_by_dataset_last": evals[-1]["eval_expected_by_dataset"]}


def in_step(out: Path, console: Console, name: str) -> int | None:
    """An unfinished run continues only where every node of it stopped at a checkpoint of one round: nodes resumed
    from different rounds (or some from none) would run out of step, taking other peers' groups than a run never
    stopped, so the run starts over instead; its folder moves aside to `unfinished-<seed>-<k>` without checkpoints.
    Returns the round the run continues from (its wall time counts from there), or None for a run from the start."""
    nodes = {p.parent for p in out.rglob("metrics.jsonl")} | {p.parent for p in out.rglob("checkpoints")}
    rounds = {str(n.relative_to(out)): (round_of(found[-1]) if (found := complete(n / "checkpoints")) else None)
              for n in nodes}
    if rounds and None not in rounds.values() and len(set(rounds.values())) == 1:
        resumed = next(iter(rounds.values()))
        console.log(f"{name}: every node continues from its checkpoint of round {resumed}")
        return resumed
    if out.is_dir():
        aside = next(p for k in range(1, 10_000) if not (p := out.with_name(f"unfinished-{out.name}-{k}")).exists())
        out.rename(aside)
        for c in aside.rglob("checkpoints"):
            shutil.rmtree(c, ignore_errors=True)
        stopped_at = ", ".join(f"{node} {r if r is not None else 'none'}" for node, r in sorted(rounds.items())) or "none"
        console.print(f"{name}: starting over (the nodes' checkpoints: {stopped_at}); the unfinished run is in {aside}",
                      soft_wrap=True)
    return None


def run_one(cfg: Config, seed: int, args: argparse.Namespace, console: Console) -> dict:
    """One configuration at one seed, saved to `result.json`; a run that lost a node is saved marked as failed
    (and run again by the next invocation), a finished one is kept and skipped next time."""
    out = args.out / slug(cfg.name) / f"seed{seed}"
    done = out / "result.json"
    saved = json.loads(done.read_text()) if done.exists() else {"failed": True}
    if not saved.get("failed"):
        console.log(f"{cfg.name} seed {seed}: finished before, skipped")
        return saved
    resumed_from = in_step(out, console, f"{cfg.name} seed {seed}")
    bed = TESTBEDS[cfg.testbed]
    spec = SwarmSpec(nodes=args.nodes, rounds=args.rounds, local=cfg.local, external=cfg.external, presets=bed["presets"],
                     out=out, seed=100 * seed, extra=[*cfg.node_args(args.rounds, args.eval_every), *bed.get("extra", []),
                                                      "--run.eval_cache_dir", str((args.out / "eval-cache").resolve()),
                                                      *PRODUCTS[args.products],
                                                      *(["--model.accept_license", ",".join(args.accept_license)]
                                                        if args.accept_license else [])],
                     task_mixes=bed["task_mixes"], companions=bed.get("companions", []),
                     round_multiples=bed.get("round_multiples", []), network=cfg.network)
    t0 = time.time()
    try:
        summary = run(spec, cache_dir=default_cache_dir(), console=console, live=False)
    except SwarmError as e:
        raise SystemExit(f"sapo_experiment: {cfg.name} seed {seed}: {e}") from None
    if summary["stopped"]:
        raise SystemExit(f"sapo_experiment: stopped during {cfg.name} seed {seed}; finished runs are kept under {args.out}")
    result = {"config": cfg.name, **asdict(cfg), "seed": seed, "nodes_n": args.nodes, "rounds": args.rounds, **bed,
              "wall_seconds": time.time() - t0, "resumed_from_round": resumed_from, "cpus": os.cpu_count(),
              "cpu": cpu_model(), "products": args.products,
              "failed": summary["failed"]}
    if summary["failed"]:
        for why in summary["failed"]:
            console.print(f"[red]{cfg.name} seed {seed}: failed: {escape(why)}[/]", soft_wrap=True)
    else:
        result["nodes"] = [node_record(out / n["name"], n) for n in summary["per_node"]]
    out.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result))
    if not result["failed"]:  # its record is saved: a real model's checkpoints (1 GB each) would fill the disk
        for node in summary["per_node"]:
            shutil.rmtree(out / node["name"] / "checkpoints", ignore_errors=True)
    return result


def parse_args() -> argparse.Namespace:
    p = script_parser("The SAPO paper's swarm-vs-silo experiment: a grid of arms, each paired by seed with the same "
                      "nodes alone.")
    p.add_argument("--nodes", type=count, default=4, help="node processes a run (default 4)")
    p.add_argument("--rounds", type=count, default=300, help="rounds each node trains (default 300)")
    p.add_argument("--eval-every", type=count, default=50, help="rounds between held-out evaluations and checkpoints")
    p.add_argument("--seeds", type=count, default=3, help="seeds each arm runs (default 3)")
    p.add_argument("--first-seed", type=int, default=0, help="run seeds K .. K + seeds - 1 (grids split across processes)")
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES, help="sampling rules of the paper's and "
                   "the real grid's swarm arms")
    p.add_argument("--products", choices=PRODUCTS, default="auto", help="the nodes' matrix products, sampling and "
                   "training: auto (each machine's plan: bfloat16 on a CPU with bfloat16 matrix instructions, else the "
                   "weights' float32), model (the weights' own dtype on every machine) or bfloat16; a grid split across "
                   "machines keeps each seed's arms on one (default auto)")
    p.add_argument("--only", nargs="+", metavar="CONFIG", help="run only these arms (names as in the table)")
    p.add_argument("--report", action="store_true", help="merge the finished runs under --out; run nothing")
    p.add_argument("--resume", action="store_true", help="continue the grid under --out: skip finished runs, continue "
                   "unfinished ones from their last checkpoints, redo failed ones")
    kinds = p.add_mutually_exclusive_group()
    for name, g in GRIDS.items():
        if name != "paper":
            kinds.add_argument(f"--{g.option(name)}", dest="grid", action="store_const", const=name, help=g.help)
    p.add_argument("--groups", type=count, help="--real: groups a round, I + 0 against I/2 + I/2 (default 4; the "
                   "paper's round is 8)")
    p.add_argument("--accept-license", action="append", default=[], choices=sorted(TERMS), metavar="TERMS",
                   help="terms of use you accept for a preset of the grid under them (gemma for gemma3-270m: "
                   "https://ai.google.dev/gemma/terms); passed to its nodes; nothing accepts them for you")
    p.add_argument("--out", type=Path, default=Path("runs/experiment"), help="the grid's folder (default runs/experiment)")
    p.set_defaults(grid="paper")
    args = p.parse_args()
    if args.grid == "quick":
        args.nodes, args.rounds, args.seeds, args.eval_every = 2, 20, 1, 10
    if args.groups is not None and (args.grid != "real" or args.groups % 2):
        raise SystemExit("sapo_experiment: --groups: an even number of groups per round, for the --real grid only")
    if args.first_seed < 0:
        raise SystemExit(f"sapo_experiment: --first-seed: {args.first_seed} is negative")
    return args


def chosen_configs(args: argparse.Namespace) -> list[Config]:
    """The grid asked for (--only narrows it); refused when --out already holds runs of it and --resume is not given."""
    configs = grid(args.rules, args.grid, args.groups or 4)
    if args.only:
        unknown = set(args.only) - {c.name for c in configs}
        if unknown:
            raise SystemExit(f"sapo_experiment: --only: no configuration named {sorted(unknown)}; "
                             f"choose from {[c.name for c in configs]}")
        configs = [c for c in configs if c.name in args.only]
    require_terms(configs, args.accept_license)
    started_before = sorted(p.relative_to(args.out) for c in configs for p in (args.out / slug(c.name)).glob("seed*"))
    if started_before and not args.resume:
        raise SystemExit(f"sapo_experiment: {args.out} already holds {len(started_before)} run(s) of this grid "
                         f"({started_before[0]}, ...): pass --resume to continue it, or choose another --out")
    return configs


def require_terms(configs: list[Config], accepted: list[str]) -> None:
    """Refuse, before anything runs, a grid with a preset under terms of use the command line did not accept."""
    for preset in dict.fromkeys(p for c in configs for p in TESTBEDS[c.testbed]["presets"]):
        if terms := unaccepted_terms(preset, accepted):
            raise SystemExit(f"sapo_experiment: --accept-license: {preset} is under {terms.title} ({terms.url}), which "
                             f"gate every use of it: read them, then add --accept-license {terms.name}; nothing "
                             "accepts them for you")


def run_grid(configs: list[Config], args: argparse.Namespace, console: Console) -> list[str]:
    """Every configuration at every seed asked for, one run after another; returns the runs that failed."""
    for preset in dict.fromkeys(p for c in configs for p in TESTBEDS[c.testbed]["presets"]):
        ensure(preset, default_cache_dir(), accepted=args.accept_license,
               how=" ".join(["sapo_experiment.py", *(f"--accept-license {t}" for t in args.accept_license)]))
    failed, started = [], time.time()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for cfg in configs:
            result = run_one(cfg, seed, args, console)
            if result.get("failed"):
                failed.append(f"{cfg.name} seed {seed}")
            else:
                console.log(f"{cfg.name} seed {seed}: cumulative reward "
                            f"{mean([n['cumulative_reward'] for n in picked(result, None)]):.2f} "
                            f"({result['wall_seconds']:.0f} s; {time.time() - started:.0f} s so far)")
    return failed


def main() -> None:
    args = parse_args()
    console = Console(width=max(170, Console().width))  # the table is wide; logs and pipes get it whole
    failed = [] if args.report else run_grid(chosen_configs(args), args, console)
    report(args.out, console)
    if failed:
        raise SystemExit(f"sapo_experiment: {len(failed)} run(s) failed and are left out of the report: {', '.join(failed)}")


if __name__ == "__main__":
    main()
