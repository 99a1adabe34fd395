"""The SAPO paper's swarm-vs-silo experiment on CPU: tiny presets, and a short grid on a real model.

Every configuration runs a swarm of N node processes on 127.0.0.1 with the same seeds, rounds and
I + J = 8 groups of G completions per round; only where the groups come from and how external ones
are chosen differ: 8/0 is the silo, then 6/2, 4/4 and 2/6 under each swarm sampling rule (uniform,
signal, adaptive), on two testbeds: a homogeneous swarm (one preset, one task mix) and a
heterogeneous one (tiny-a and tiny-b nodes alternating, an arith-heavy and a reverse-heavy node of each). The
control (4 local + 4 of the node's own extra groups sent through the external path, no network)
checks that the external path costs nothing when external groups are as good as local ones. The
silo with local over-draw (16 tasks sampled, the 8 slots filled with informative groups first) asks
whether a gain comes from sharing or merely from training on informative groups.

Cumulative reward = the sum over rounds of a node's mean reward on its own (local) completions,
averaged over the swarm's nodes. Each configuration is paired with the silo of its testbed and
seed. Every finished run writes `<out>/<config>/seed<k>/result.json` as it ends, so a long grid runs in
pieces: stopped (Ctrl-C, or the machine's session ending) and continued with `--resume`, which skips
finished runs and continues an unfinished one from its nodes' last checkpoints (every eval point; a finished run's
checkpoints are deleted once its result is saved);
without `--resume` an `--out` that holds runs is refused rather than mixed. `--only` splits the grid
by configuration; `--report` merges whatever has finished into `results.json`, the table and the
figure, which is drawn from that JSON alone.

    .venv/bin/python scripts/bench/sapo_experiment.py --out runs/experiment                   # the whole grid
    .venv/bin/python scripts/bench/sapo_experiment.py --out runs/experiment --resume --only "homogeneous 8/0" "homogeneous 4/4 signal"
    .venv/bin/python scripts/bench/sapo_experiment.py --out runs/experiment --report
    .venv/bin/python scripts/bench/sapo_experiment.py --quick --out runs/experiment-quick     # 5-minute smoke run
    .venv/bin/python scripts/bench/sapo_experiment.py --real --nodes 2 --rounds 40 --eval-every 10 --seeds 4 --rules signal guarded --out runs/real --resume

The real-model grid (`--real`) runs SmolLM2-135M-Instruct with its recipe: two such nodes, and one beside
a tiny-a node, at 4 + 0 against 2 + 2 groups per round. Both testbeds pair with the same silo (two
SmolLM2 nodes, no network: the tiny companion cannot change a silo), which runs once per seed.

On a GPU (issue 32, part 5) the same grid takes the paper's round of 8 groups, 8 + 0 against 4 + 4, for more
rounds; `--first-seed` lets one process per configuration and seed run at once on one card. Every run records
each node's seconds per round and its peak memory beside its plan's estimate (as `sapo doctor --bench` does):

    python3 scripts/bench/sapo_experiment.py --real --groups 8 --nodes 2 --rounds 80 --eval-every 20 --seeds 1 --first-seed 0 --rules guarded --only "smollm2 8/0" --out runs/gpu-grid --resume

The quantized check (`--quantized --nodes 1`) runs that silo with full fine-tuning and with LoRA adapters on a
frozen NF4 base; the NF4 row's "vs silo" columns compare it with full fine-tuning at the same seed:

    .venv/bin/python scripts/bench/sapo_experiment.py --quantized --nodes 1 --rounds 30 --eval-every 10 --seeds 3 --out docs/bench/nf4-check-2cpu --resume

Issue 52's check of the training step's bfloat16 autocast (`--autocast --nodes 1`): the same silo with float32
products and with bfloat16 ones (`grpo.compute_dtype`), paired at each seed:

    .venv/bin/python scripts/bench/sapo_experiment.py --autocast --nodes 1 --rounds 30 --eval-every 30 --seeds 6 --out docs/bench/autocast-check-2cpu --resume

Issue 55's measurements. Every node records its own reward (the primary measure: its completions on fresh tasks),
the paper's batch reward (its training batch, the external groups it kept included), the informative groups it
trained (the dose) and, with `--tasks.eval_samples`, an expected held-out accuracy over k samples a task; the report
gives each with paired intervals against the same nodes alone, and the smallest effect its seeds could have
detected beside any "no effect". Runs that start from the same model share its round-0 evaluation
(`run.eval_cache_dir`, kept in OUT/eval-cache). The learning-rate sweep (`--lr-sweep`, one node a run) and the swarm of specialists
(`--specialists`: node A on arith and basic_arithmetic, node B on products; A's products accuracy is the endpoint):

    .venv/bin/python scripts/bench/sapo_experiment.py --lr-sweep --nodes 1 --rounds 30 --eval-every 30 --seeds 3 --out runs/lr-sweep --resume
    .venv/bin/python scripts/bench/sapo_experiment.py --specialists --nodes 2 --rounds 30 --eval-every 30 --seeds 5 --out runs/specialists --resume

Issue 53's tiny testbed (`--hetero`): the demo's swarm of tiny-a, tiny-b and tiny-a under `signal`, `guarded`, `scoped`
and `guarded` with `selection.when_short = peer_tasks` (the same generation as filling with local tasks):

    .venv/bin/python scripts/bench/sapo_experiment.py --hetero --nodes 3 --rounds 300 --eval-every 50 --seeds 5 --out runs/hetero --resume

and its pair of real families (`--gemma`): Gemma 3 270M beside SmolLM2-135M, each paired with the same seed's silo
node; the command accepts the Gemma Terms of Use, and nothing else does:

    .venv/bin/python scripts/bench/sapo_experiment.py --gemma --accept-license gemma --nodes 2 --rounds 40 --eval-every 40 --seeds 4 --out runs/gemma --resume
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from node.argtypes import count
from node.bench import measured
from node.metrics import MetricsLog
from node.swarm import SwarmError, SwarmSpec, run
from node.recipes import RECIPES
from node.selection_config import RULES, SelectionConfig
from trainer.config import default_cache_dir
from trainer.presets import ensure
from trainer.pretrained import TERMS, unaccepted_terms

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided t, df
G = 8  # completions per group (the node default)
# The testbed's tasks: families a 0.3M-parameter model learns within the run. Measured in 300-round silos of tiny-a:
# `reverse` (defaults) and `arith` with operands 0..4 and '+' only (0.27 -> 0.80 held-out) learn; `count` stayed at its
# warm start's constant answer in every variant tried (alphabets ab and abc, lengths 1-3 to 4-8), so it is left out:
# a family that nobody learns has nothing to share. The node's default mix (arith 0..9 with +-, reverse, count) was the
# testbed of the earlier runs in docs/bench/sapo-experiment-default-tasks-2cpu.*.
ARITH = {"name": "arith", "config": {"max_operand": 4, "ops": "+"}}


def tasks(arith: int, reverse: int) -> str:
    """A `--tasks` value weighting the two families."""
    return json.dumps([{**ARITH, "weight": arith}, {"name": "reverse", "weight": reverse}])


SMOLLM2 = json.dumps(RECIPES["smollm2-135m"]["tasks"]["datasets"])  # its calibrated mix, spelled out in the results
TESTBEDS = {
    "homogeneous": {"presets": ["tiny-a"], "task_mixes": [tasks(1, 1)]},
    # each preset has an arith-heavy and a reverse-heavy node, so one node's strength is another's gap; two tokenizers
    "heterogeneous": {"presets": ["tiny-a", "tiny-b"], "task_mixes": [tasks(3, 1), tasks(3, 1), tasks(1, 3), tasks(1, 3)]},
    # a real pretrained model (node/recipes.py), alone and beside a tiny one of another family and tokenizer; their task
    # mixes differ, so the pair accepts every task it can regenerate rather than only its own. The tiny node, a
    # hundred times cheaper per round, is a companion: it runs until SmolLM2 is done, so they share the whole time;
    # its own learning is the tiny grid's subject, and the table reports the SmolLM2 nodes
    "smollm2": {"presets": ["smollm2-135m"], "task_mixes": [SMOLLM2]},
    "smollm2+tiny": {"presets": ["smollm2-135m", "tiny-a"], "task_mixes": [SMOLLM2, tasks(1, 1)], "companions": [False, True],
                     "extra": ["--selection.accept", "any"], "silo": "smollm2"},
}
# the same silo on a frozen 4-bit base with LoRA adapters (issue 36's learning check). LoRA's best learning rate is
# about 10x full fine-tuning's (Schulman et al., "LoRA Without Regret", 2025), so the adapters train at 10x the
# recipe's 1e-5: the comparison is each arm as a user would run it, not one learning rate for both
TESTBEDS["smollm2-nf4"] = {**TESTBEDS["smollm2"], "extra": ["--model.quantize", "nf4", "--model.lora.enabled", "true",
                                                            "--grpo.lr", "1e-4"], "silo": "smollm2"}
# issue 55's powered evaluation: k = 4 completions a task at the sampling temperature beside the greedy one
POWERED = ["--tasks.eval_samples", "4"]
# its learning-rate sweep: SmolLM2 silos at several rates, paired with the recipe's (1e-5); the LoRA rows train adapters
# on the full-precision base
TESTBEDS["smollm2-sweep"] = {**TESTBEDS["smollm2"], "extra": POWERED, "silo": "smollm2-sweep", "silo_lr": 1e-5}
TESTBEDS["smollm2-sweep-lora"] = {**TESTBEDS["smollm2-sweep"], "extra": POWERED + ["--model.lora.enabled", "true"]}
SWEEP = [("smollm2-sweep", lr) for lr in (1e-5, 3e-5, 1e-4)] + [("smollm2-sweep-lora", lr) for lr in (1e-4, 3e-4)]
# its swarm of specialists: the recipe's arithmetic mix split between two owners, A (arith and basic_arithmetic) and B
# (products); both accept any task they can regenerate, and both are evaluated on the whole mix, products twice as
# often (about 200 of 400 tasks: the endpoint is A's products accuracy). Alone, each trains on its own mix (node k of
# the 4/0 arm is node k of the swarm without peers); the union silo trains both nodes on all three families
ARITHMETIC = RECIPES["smollm2-135m"]["tasks"]["datasets"]
SPECIALISTS_EVAL = ["--tasks.eval_datasets", json.dumps([{**d, "weight": 2 if d["name"] == "rg/products" else 1} for d in ARITHMETIC]),
                    "--tasks.eval_size", "400", *POWERED]
TESTBEDS["specialists"] = {"presets": ["smollm2-135m"],
                           "task_mixes": [json.dumps([d for d in ARITHMETIC if d["name"] != "rg/products"]),
                                          json.dumps([d for d in ARITHMETIC if d["name"] == "rg/products"])],
                           "extra": ["--selection.accept", "any", *SPECIALISTS_EVAL]}
TESTBEDS["specialists-union"] = {"presets": ["smollm2-135m"], "task_mixes": [json.dumps(ARITHMETIC)], "extra": SPECIALISTS_EVAL,
                                 "silo": "specialists"}
# issue 52's learning check of the training step's bfloat16 autocast (grpo.compute_dtype): the same silo trained with
# float32 products and with bfloat16 ones, paired at each seed, on the powered evaluation
TESTBEDS["smollm2-f32"] = {**TESTBEDS["smollm2"], "extra": POWERED + ["--grpo.compute_dtype", "model"], "silo": "smollm2-f32"}
TESTBEDS["smollm2-bf16"] = {**TESTBEDS["smollm2-f32"], "extra": POWERED + ["--grpo.compute_dtype", "bfloat16"]}
REAL = ("smollm2", "smollm2+tiny")  # testbeds of the short real-model grid (--real)
# issue 53's tiny testbed: the demo's swarm (tiny-a, tiny-b, tiny-a with --nodes 3), every node on the same mix: the
# weaker tiny-b learns from tiny-a's groups, and the rules that would let a peer of another model teach are compared
TESTBEDS["demo"] = {"presets": ["tiny-a", "tiny-b"], "task_mixes": [tasks(1, 1)]}
# and its pair of real families: Gemma 3 270M, the base model, beside SmolLM2-135M, both on the arithmetic mix their
# recipes share, where SmolLM2 passes about twice as often (docs/bench: the Gemma recipe). Node k is model k % 2;
# SmolLM2 rounds about twice as fast on a CPU (its vocabulary is a fifth of Gemma's 262k), so it runs twice the rounds
# and the two share for the whole run; each node is paired with its silo of the same rounds and evaluated per family
# on 300 held-out tasks, 4 samples each. Both fine-tune fully, as their recipes do: pinned, so that an arm started on
# a busier machine is refused rather than planned into LoRA. The Gemma Terms of Use are accepted on the command line
# (--accept-license gemma), never here
TESTBEDS["gemma+smollm2"] = {"presets": ["gemma3-270m", "smollm2-135m"], "task_mixes": [SMOLLM2], "round_multiples": [1, 2],
                             "extra": ["--tasks.eval_size", "300", *POWERED, "--model.lora.enabled", "false"]}
# the step-size controller (grpo.target_kl): each model alone at its recipe with the rate fixed, against the controller
# from the recipe's rate and from a rate that destroyed the model when fixed (SmolLM2's sweep: 1e-4; Gemma's size rule,
# what a folder of it got: 6.7e-6); full fine-tuning pinned, as the recipes were measured
PINNED = ["--model.lora.enabled", "false"]
TESTBEDS["smollm2-fixed"] = {**TESTBEDS["smollm2"], "extra": PINNED + ["--grpo.target_kl", "null"], "silo": "smollm2-fixed"}
TESTBEDS["smollm2-adapt"] = {**TESTBEDS["smollm2"], "extra": PINNED, "silo": "smollm2-fixed"}
TESTBEDS["gemma-fixed"] = {"presets": ["gemma3-270m"], "task_mixes": [SMOLLM2], "extra": PINNED + ["--grpo.target_kl", "null"],
                           "silo": "gemma-fixed"}
TESTBEDS["gemma-adapt"] = {**TESTBEDS["gemma-fixed"], "extra": PINNED}
# four owners: SmolLM2-135M nodes that each draw one family, every family large enough that a node that never draws it
# trains on at most a thirtieth of its questions (sizes estimated from 40,000 draws, pass rates before training:
# docs/bench/pass-rates-large-families-smollm2-135m-2cpu.json), every node evaluated on all four, 100 tasks each,
# whose questions no node trains on (rewards/held_out.py). Alone, node k trains on family k; the union silos train
# each node on all four, with 4 groups a round or with 2 (the swarm's own generation); full fine-tuning pinned, in the
# planner's share of the machine for four nodes (4.6 of 5.0 GB each)
OWNER_FAMILIES = [
    {"name": "arith", "config": {"max_operand": 9, "max_second": 199, "ops": "*"}},  # 2,000 questions, pass rate 0.14
    {"name": "rg/chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},  # ~12,000; 0.31
    {"name": "rg/basic_arithmetic", "config": {"min_terms": 3, "max_terms": 4, "min_digits": 1, "max_digits": 1,  # ~35,000; 0.07
                                               "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}},
    {"name": "rg/decimal_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "min_num_decimal_places": 1,  # ~80,000; 0.05
                                                 "max_num_decimal_places": 1, "precision": 3}},
]
OWNERS_EVAL = ["--tasks.eval_datasets", json.dumps(OWNER_FAMILIES), "--tasks.eval_size", "400", *POWERED,
               "--model.lora.enabled", "false"]
TESTBEDS["owners"] = {"presets": ["smollm2-135m"], "task_mixes": [json.dumps([f]) for f in OWNER_FAMILIES],
                      "extra": ["--selection.accept", "any", *OWNERS_EVAL]}
TESTBEDS["owners-union"] = {"presets": ["smollm2-135m"], "task_mixes": [json.dumps(OWNER_FAMILIES)], "extra": OWNERS_EVAL,
                            "silo": "owners"}
STEP_SIZE = [("smollm2-adapt", 1e-4), ("gemma-adapt", 6.7e-6), ("smollm2-fixed", None), ("smollm2-adapt", None),
             ("gemma-fixed", None), ("gemma-adapt", None), ("smollm2-fixed", 1e-4), ("gemma-fixed", 6.7e-6)]  # the rescues first
RATE_GRIDS = {"lr": SWEEP, "step-size": STEP_SIZE}  # silos of 4 groups a round, each (testbed, grpo.lr or the model's)
GRIDS = ("paper", "quick", "real", "quantized", "autocast", "lr", "specialists", "owners", "hetero", "gemma", "step-size")
KIND_FLAGS = {"lr": "lr_sweep"}  # a grid's flag where it is not the grid's own name (--lr-sweep)
EVAL_TASKS = 200  # held-out tasks a node evaluates on, unless its testbed's flags say otherwise
DEFAULT_RULE = SelectionConfig().rule  # what another rule or channel must beat to become the default
T80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889, 9: 0.883}  # one-sided t at 80%


@dataclass(frozen=True)
class Config:
    testbed: str
    local: int
    external: int
    rule: str = "uniform"
    control: bool = False
    negatives: bool = False  # grpo.external_negatives: the ablation of learning only from peers' successes
    overdraw: float = 1.0  # selection.local_overdraw: local tasks sampled per local slot
    lr: float | None = None  # grpo.lr (None: the model's own)
    when_short: str = "fill_local"  # selection.when_short: peer_tasks samples unusable peer groups' tasks in empty slots

    @property
    def name(self) -> str:
        suffix = (" +negatives" if self.negatives else "") + (f" overdraw {self.overdraw:g}" if self.overdraw != 1 else "")
        suffix += f" lr {self.lr:g}" if self.lr is not None else ""
        suffix += f" {self.when_short}" if self.when_short != "fill_local" else ""
        if self.control:
            return f"{self.testbed} control {self.local}+{self.external} own" + suffix
        return f"{self.testbed} {self.local}/{self.external}" + (f" {self.rule}" if self.external else "") + suffix

    @property
    def silo(self) -> Config:
        bed = TESTBEDS[self.testbed]
        return Config(bed.get("silo", self.testbed), self.local + self.external, 0, lr=bed.get("silo_lr"))

    @property
    def default_twin(self) -> Config | None:
        """The same arm under the default rule, filling short rounds with local groups: what this arm's rule or
        channel is weighed against (None for that arm itself, silos and controls)."""
        if not self.network:
            return None
        twin = replace(self, rule=DEFAULT_RULE, when_short="fill_local")
        return None if twin == self else twin

    def node_args(self, rounds: int, eval_every: int) -> list[str]:
        args = ["--tasks.eval_size", str(EVAL_TASKS), "--run.eval_every", str(eval_every), "--run.checkpoint_every", str(eval_every),
                "--run.keep_checkpoints", "1",
                "--selection.rule", self.rule, "--grpo.external_negatives", str(self.negatives).lower(),
                "--selection.local_overdraw", str(self.overdraw), "--selection.when_short", self.when_short]
        args += ["--grpo.lr", f"{self.lr:g}"] if self.lr is not None else []
        return args + (["--selection.self_external", "true"] if self.control else [])

    @property
    def network(self) -> bool:
        """A silo's learning does not depend on the network (tested): spare the CPU."""
        return self.external > 0 and not self.control


# learning checks: an arm against the SmolLM2 silo it changes one thing of (issue 36's NF4 base, issue 52's autocast)
CHECKS = {"quantized": (Config("smollm2", 4, 0), Config("smollm2-nf4", 4, 0)),
          "autocast": (Config("smollm2-f32", 4, 0), Config("smollm2-bf16", 4, 0))}


FIXED_GRIDS = {
    # alone, the swarm and the union of their data (an over-draw control would add a quarter to a grid of about 45
    # minutes a seed on 2 cores)
    "specialists": [Config("specialists", 4, 0), Config("specialists", 2, 2, "guarded"), Config("specialists-union", 4, 0)],
    # alone, the swarm, both union silos, and a second split for the dose-response
    "owners": [Config("owners", 4, 0), Config("owners", 2, 2, "guarded"), Config("owners-union", 4, 0),
               Config("owners-union", 2, 0), Config("owners", 3, 1, "guarded")],
    # the sampling rules for a peer of another model, and task sharing at the same generation
    "hetero": [Config("demo", 8, 0), *(Config("demo", 4, 4, rule) for rule in ("signal", "guarded", "scoped")),
               Config("demo", 4, 4, "guarded", when_short="peer_tasks")],
    # the default rule and the one that lets a stronger peer of another family in
    "gemma": [Config("gemma+smollm2", 4, 0), Config("gemma+smollm2", 2, 2, "guarded"), Config("gemma+smollm2", 2, 2, "scoped")],
    "quick": [Config("homogeneous", 8, 0), Config("homogeneous", 4, 4, "guarded"), Config("homogeneous", 4, 4, control=True)],
}


def grid(rules: list[str], kind: str = "paper", groups: int = 4) -> list[Config]:
    """The configurations of one of GRIDS: the paper's (tiny presets), its smoke run, the real-model grid (`groups`
    a round: I + 0 against I/2 + I/2), and the 4-bit base against full fine-tuning (SmolLM2 silos; the NF4 row's
    'silo' is the full fine-tuning one)."""
    if kind in CHECKS:
        return list(CHECKS[kind])
    if kind in RATE_GRIDS:
        return [Config(bed, 4, 0, lr=lr) for bed, lr in RATE_GRIDS[kind]]
    if kind in FIXED_GRIDS:
        return list(FIXED_GRIDS[kind])
    if kind == "real":  # 4 groups by default: half the paper's round, which is what 2 cores carry for a real model
        configs = [Config(bed, i, groups - i, rule) for bed in REAL for i in (groups, groups // 2)
                   for rule in (rules if i < groups else ["uniform"])]
        return [c for c in configs if c.external or c.silo == c]  # a shared silo runs once
    homo = [Config("homogeneous", 8, 0), Config("homogeneous", 8, 0, overdraw=2), Config("homogeneous", 4, 4, control=True),
            Config("homogeneous", 4, 4, control=True, negatives=True), Config("homogeneous", 4, 4, "signal", negatives=True)]
    homo += [Config("homogeneous", i, 8 - i, rule) for i in (6, 4, 2) for rule in rules]
    homo += [Config("homogeneous", 4, 4, "signal", overdraw=2)]  # does sharing add to filtering local groups?
    hetero = [Config("heterogeneous", 8, 0)] + [Config("heterogeneous", 4, 4, rule) for rule in rules]
    return homo + hetero


def ci95(xs: list[float]) -> float:
    """Half-width of a 95% t interval of the mean; nan for a single value."""
    if len(xs) < 2:
        return float("nan")
    return T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


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
                                               "plan": timing["plan"]["summary"]},
        **{k: summary[k] for k in ("name", "model", "companion", "exit_code", "cumulative_reward", "tokens_generated", "seconds",
                                   "external_used", "external_inspected", "external_informative", "local_groups",
                                   "local_informative")},
        "total_reward": sum(r["reward_mean"] * r["n_local"] * G for r in trained),
        **dose_record(trained), **expected_record(evals),
        "eval_first": evals[0]["eval_accuracy"], "eval_last": evals[-1]["eval_accuracy"],
        "eval_by_dataset_first": evals[0]["eval_by_dataset"], "eval_by_dataset_last": evals[-1]["eval_by_dataset"],
        "curves": {"reward": [r["reward_mean"] for r in trained],
                   "local_informative_share": share("local_informative", "n_local"),
                   "external_informative_share": share("external_informative", "external_inspected"),
                   "eval": [[r["round"], r["eval_accuracy"]] for r in evals],
                   # what a node took from peers, family by family, and what explains it: the groups it looked at, why
                   # the rest went unused, and its support gate's cut-off
                   **{key: [r.get(key) for r in trained] for key in ("external_families", "external_inspected",
                                                                      "external_dropped", "support_cutoff")}},
    }


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


def run_one(cfg: Config, seed: int, args: argparse.Namespace, console: Console) -> dict:
    """One configuration at one seed, saved to `result.json`; a run that lost a node is saved marked as failed
    (and run again by the next invocation), a finished one is kept and skipped next time."""
    out = args.out / slug(cfg.name) / f"seed{seed}"
    done = out / "result.json"
    saved = json.loads(done.read_text()) if done.exists() else {"failed": True}
    if not saved.get("failed"):
        console.log(f"{cfg.name} seed {seed}: finished before, skipped")
        return saved
    bed = TESTBEDS[cfg.testbed]
    spec = SwarmSpec(nodes=args.nodes, rounds=args.rounds, local=cfg.local, external=cfg.external, presets=bed["presets"],
                     out=out, seed=100 * seed, extra=[*cfg.node_args(args.rounds, args.eval_every), *bed.get("extra", []),
                                                      "--run.eval_cache_dir", str((args.out / "eval-cache").resolve()),
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
              "wall_seconds": time.time() - t0, "cpus": os.cpu_count(), "failed": summary["failed"]}
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


def mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


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


def mde(gaps: list[float]) -> float:
    """The smallest mean paired gap these seeds would find at 5% (two-sided) with 80% power, given their spread."""
    if len(gaps) < 2:
        return float("nan")
    df = len(gaps) - 1
    return (T95.get(df, 1.96) + T80.get(df, 0.842)) * statistics.stdev(gaps) / math.sqrt(len(gaps))


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


def gap_stats(gaps: list[float]) -> dict | None:
    return {"gap": mean(gaps), "ci95": ci95(gaps), "mde": mde(gaps), "seeds": len(gaps)} if gaps else None


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


def per_round(row: dict) -> str:
    if row["round_s"] is None:
        return "-"
    peak = "-" if row["peak_gb"] is None else f"{row['peak_gb']:.2f}"
    return f"{row['round_s']:.2f} s, {peak} / {row['planned_peak_gb']:.2f}"


def hardware(first: dict) -> str:
    """Where the runs ran: the card a node's plan names, else the host's cores."""
    device = next((n["timing"]["device"] for n in first["nodes"] if n.get("timing")), "")
    return device.split(" (", 1)[1].split(",", 1)[0] if device.startswith("cuda") else f"{first['cpus']}-core CPU"


def eval_curve(nodes: list[dict]) -> dict[int, float]:
    """Held-out accuracy at each eval round, the mean over `nodes`."""
    by_round: dict[int, list[float]] = {}
    for n in nodes:
        for rnd, acc in n["curves"]["eval"]:
            by_round.setdefault(rnd, []).append(acc)
    return {rnd: mean(accs) for rnd, accs in by_round.items()}


def twins(silo: dict, run: dict, model: str | None) -> list[dict]:
    """The silo's nodes that ran as `run`'s did but alone: node k has the same seed, model and task mix in both, so
    a SmolLM2 node beside a companion is paired with the silo's node of its seed, not with the mean of two seeds."""
    names = {n["name"] for n in picked(run, model)}
    return [n for n in picked(silo, model) if n["name"] in names] or picked(silo, model)


def picked(run: dict, model: str | None) -> list[dict]:
    """The run's nodes of `model` (None: every model), companions left out: they ran for a length of their own."""
    return [n for n in run["nodes"] if model in (None, n["model"]) and not n.get("companion")]


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
                      f"{100 * r['vs_silo']:+.1f}% ± {100 * r['vs_silo_ci95']:.1f}",
                      f"{r['eval_first']:.3f} -> {r['eval_last']:.3f}", versus_silo(r),
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
    console.print(f"saved {out / 'results.json'}, {out / 'results.md'} (the table for docs/bench/README.md) and {out / 'results.png'}")


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
                     f"{100 * r['vs_silo']:+.1f}% ± {ci(100 * r['vs_silo_ci95'])} | {r['eval_first']:.3f} -> {r['eval_last']:.3f} | "
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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=count, default=4)
    p.add_argument("--rounds", type=count, default=300)
    p.add_argument("--eval-every", type=count, default=50)
    p.add_argument("--seeds", type=count, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="run seeds K .. K + seeds - 1 (grids split across processes)")
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    p.add_argument("--only", nargs="+", metavar="CONFIG", help="run only these configurations (names as in the table)")
    p.add_argument("--report", action="store_true", help="merge the finished runs under --out; run nothing")
    p.add_argument("--resume", action="store_true", help="continue the grid under --out: skip finished runs, continue "
                   "unfinished ones from their last checkpoints, redo failed ones")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 nodes, 20 rounds, 1 seed, 3 configurations")
    p.add_argument("--real", action="store_true", help="the real-model grid (SmolLM2-135M, alone and beside tiny-a): "
                   "4 + 0 against 2 + 2 groups per round; pair it with few nodes and rounds on a CPU")
    p.add_argument("--groups", type=count, help="--real: groups per round, I + 0 against I/2 + I/2 (default 4; the "
                   "paper's round is 8)")
    p.add_argument("--quantized", action="store_true", help="issue 36's learning check: a SmolLM2 silo (4 groups a "
                   "round) with full fine-tuning against LoRA on an NF4 base; pair it with --nodes 1")
    p.add_argument("--autocast", action="store_true", help="issue 52's learning check: a SmolLM2 silo (4 groups a "
                   "round) training with float32 products and under bfloat16 autocast, paired; pair it with --nodes 1")
    p.add_argument("--lr-sweep", action="store_true", help="issue 55's learning-rate sweep: SmolLM2 silos at 1e-5, 3e-5 "
                   "and 1e-4 (full fine-tuning) and 1e-4, 3e-4 (LoRA), paired with 1e-5, on the powered evaluation")
    p.add_argument("--step-size", action="store_true", help="the step-size controller: SmolLM2-135M and Gemma 3 270M "
                   "alone with the rate fixed at their recipes', against the controller from that rate, and the controller "
                   "and the fixed rate from a rate that destroyed them (1e-4, 6.7e-6); pair it with --nodes 1 and "
                   "--accept-license gemma")
    p.add_argument("--specialists", action="store_true", help="issue 55's swarm of specialists: two SmolLM2 owners "
                   "splitting the arithmetic mix: each alone, the pair at 2/2, and a silo on the union of their tasks")
    p.add_argument("--owners", action="store_true", help="four SmolLM2 owners of one family each (pair it with --nodes 4): "
                   "each alone, the swarm at 2/2 and 3/1, and silos on all four families at 4 and at 2 groups a round; "
                   "scripts/bench/owners.py reports what each learned of the families it never draws")
    p.add_argument("--hetero", action="store_true", help="issue 53's tiny testbed: the demo's tiny-a, tiny-b, tiny-a swarm "
                   "(--nodes 3) alone, and at 4/4 under signal, guarded, scoped and guarded with peer_tasks")
    p.add_argument("--gemma", action="store_true", help="issue 53's pair of real families: Gemma 3 270M beside "
                   "SmolLM2-135M, alone and at 2/2 under guarded and scoped; pair it with --nodes 2 and --accept-license gemma")
    p.add_argument("--accept-license", action="append", default=[], choices=sorted(TERMS), metavar="TERMS",
                   help="terms of use you accept for a preset of the grid under them (gemma for gemma3-270m: "
                   "https://ai.google.dev/gemma/terms); passed to its nodes; nothing accepts them for you")
    p.add_argument("--out", type=Path, default=Path("runs/experiment"))
    args = p.parse_args()
    if args.quick:
        args.nodes, args.rounds, args.seeds, args.eval_every = 2, 20, 1, 10
    if args.groups is not None and (not args.real or args.groups % 2):
        raise SystemExit("sapo_experiment: --groups: an even number of groups per round, for the --real grid only")
    if args.first_seed < 0:
        raise SystemExit(f"sapo_experiment: --first-seed: {args.first_seed} is negative")
    return args


def chosen_configs(args: argparse.Namespace) -> list[Config]:
    """The grid asked for (--only narrows it); refused when --out already holds runs of it and --resume is not given."""
    kind = next((kind for kind in GRIDS if getattr(args, KIND_FLAGS.get(kind, kind).replace("-", "_"), False)), "paper")
    configs = grid(args.rules, kind, args.groups or 4)
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
