"""The experiment's testbeds (models, task mixes, node flags) and its grids (the arms each runs), as data.

An arm is a `Config`: a testbed and a split of I local + J external groups a round, with the sampling rule and the
few knobs an arm may change. Each arm is paired with its testbed's silo (the same nodes, I + J local groups, no
network) at the same seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Callable

from node.recipes import RECIPES
from node.selection_config import SelectionConfig

EVAL_TASKS = 200  # held-out tasks a node evaluates on, unless its testbed's flags say otherwise
DEFAULT_RULE = SelectionConfig().rule  # what another rule or channel must beat to become the default
POWERED = ["--tasks.eval_samples", "4"]  # k = 4 completions a held-out task at the sampling temperature, beside the greedy one
PINNED = ["--model.lora.enabled", "false"]  # full fine-tuning: an arm started on a busier machine is refused, not planned into LoRA

# The tiny testbed's tasks: families a 0.3M-parameter model learns within the run. Measured in 300-round silos of
# tiny-a: `reverse` (defaults) and `arith` with operands 0..4 and '+' only (0.27 -> 0.80 held-out) learn; `count`
# stayed at its warm start's constant answer in every variant tried, so it is left out: a family nobody learns has
# nothing to share.
ARITH = {"name": "arith", "config": {"max_operand": 4, "ops": "+"}}


def tasks(arith: int, reverse: int) -> str:
    """A `--tasks` value weighting the two tiny families."""
    return json.dumps([{**ARITH, "weight": arith}, {"name": "reverse", "weight": reverse}])


SMOLLM2 = json.dumps(RECIPES["smollm2-135m"]["tasks"]["datasets"])  # its calibrated mix, spelled out in the results
ARITHMETIC = RECIPES["smollm2-135m"]["tasks"]["datasets"]
# specialists: the recipe's arithmetic mix split between owner A (arith, basic_arithmetic) and owner B (products), both
# evaluated on the whole mix with products twice as often (about 200 of 400 tasks: A's products accuracy is the endpoint)
SPECIALISTS_EVAL = ["--tasks.eval_datasets", json.dumps([{**d, "weight": 2 if d["name"] == "rg/products" else 1} for d in ARITHMETIC]),
                    "--tasks.eval_size", "400", *POWERED]
# four owners: one family each, every family large enough that a node that never draws it trains on at most a
# thirteenth of what its draws spread over (sizes from 40,000 draws and pass rates before training: docs/bench/learning.md);
# every node is evaluated on all four, 100 tasks each, whose questions no node trains on (rewards/held_out.py)
OWNER_FAMILIES = [
    {"name": "arith", "config": {"max_operand": 9, "max_second": 199, "ops": "*"}},  # 2,000 questions, pass rate 0.14
    {"name": "rg/chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},  # ~12,000 distinct, repeating as ~780 would; 0.31
    {"name": "rg/basic_arithmetic", "config": {"min_terms": 3, "max_terms": 4, "min_digits": 1, "max_digits": 1,  # ~34,000; 0.07
                                               "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}},
    {"name": "rg/decimal_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "min_num_decimal_places": 1,  # ~82,000; 0.05
                                                 "max_num_decimal_places": 1, "precision": 3}},
]
OWNERS_EVAL = ["--tasks.eval_datasets", json.dumps(OWNER_FAMILIES), "--tasks.eval_size", "400", *POWERED, *PINNED]
SMOLLM2_BED = {"presets": ["smollm2-135m"], "task_mixes": [SMOLLM2]}
GEMMA_FIXED = {"presets": ["gemma3-270m"], "task_mixes": [SMOLLM2], "extra": PINNED + ["--grpo.target_kl", "null"],
               "silo": "gemma-fixed"}

# name -> presets (node k runs preset k % n), task_mixes (likewise), extra node flags, and optionally: the testbed of
# its silo, the silo's learning rate, companions (nodes that run beside the others and are left out of the report),
# round_multiples (node k runs rounds x m[k % n])
TESTBEDS: dict[str, dict] = {
    "homogeneous": {"presets": ["tiny-a"], "task_mixes": [tasks(1, 1)]},
    # each preset has an arith-heavy and a reverse-heavy node, so one node's strength is another's gap; two tokenizers
    "heterogeneous": {"presets": ["tiny-a", "tiny-b"], "task_mixes": [tasks(3, 1), tasks(3, 1), tasks(1, 3), tasks(1, 3)]},
    # a real pretrained model alone, and beside a tiny companion of another family and tokenizer (a hundred times
    # cheaper a round, it runs until SmolLM2 is done); the pair accepts every task it can regenerate
    "smollm2": SMOLLM2_BED,
    "smollm2+tiny": {"presets": ["smollm2-135m", "tiny-a"], "task_mixes": [SMOLLM2, tasks(1, 1)], "companions": [False, True],
                     "extra": ["--selection.accept", "any"], "silo": "smollm2"},
    # LoRA on a frozen NF4 base at 10x the recipe's rate (LoRA's best rate is about 10x full fine-tuning's: Schulman et
    # al., "LoRA Without Regret", 2025): each arm as a user would run it
    "smollm2-nf4": {**SMOLLM2_BED, "extra": ["--model.quantize", "nf4", "--model.lora.enabled", "true", "--grpo.lr", "1e-4"],
                    "silo": "smollm2"},
    "smollm2-sweep": {**SMOLLM2_BED, "extra": POWERED, "silo": "smollm2-sweep", "silo_lr": 1e-5},
    "smollm2-sweep-lora": {**SMOLLM2_BED, "extra": POWERED + ["--model.lora.enabled", "true"], "silo": "smollm2-sweep",
                           "silo_lr": 1e-5},
    "specialists": {"presets": ["smollm2-135m"],
                    "task_mixes": [json.dumps([d for d in ARITHMETIC if d["name"] != "rg/products"]),
                                   json.dumps([d for d in ARITHMETIC if d["name"] == "rg/products"])],
                    "extra": ["--selection.accept", "any", *SPECIALISTS_EVAL]},
    "specialists-union": {"presets": ["smollm2-135m"], "task_mixes": [json.dumps(ARITHMETIC)], "extra": SPECIALISTS_EVAL,
                          "silo": "specialists"},
    # the training step's products in float32 and under bfloat16 autocast (grpo.compute_dtype)
    "smollm2-f32": {**SMOLLM2_BED, "extra": POWERED + ["--grpo.compute_dtype", "model"], "silo": "smollm2-f32"},
    "smollm2-bf16": {**SMOLLM2_BED, "extra": POWERED + ["--grpo.compute_dtype", "bfloat16"], "silo": "smollm2-f32"},
    # the demo's swarm (tiny-a, tiny-b, tiny-a with --nodes 3), every node on the same mix
    "demo": {"presets": ["tiny-a", "tiny-b"], "task_mixes": [tasks(1, 1)]},
    # Gemma 3 270M beside SmolLM2-135M on the mix their recipes share; SmolLM2 rounds about twice as fast on a CPU
    # (its vocabulary is a fifth of Gemma's), so it runs twice the rounds and the two share for the whole run
    "gemma+smollm2": {"presets": ["gemma3-270m", "smollm2-135m"], "task_mixes": [SMOLLM2], "round_multiples": [1, 2],
                      "extra": ["--tasks.eval_size", "300", *POWERED, *PINNED]},
    # the step-size controller (grpo.target_kl) against the rate fixed
    "smollm2-fixed": {**SMOLLM2_BED, "extra": PINNED + ["--grpo.target_kl", "null"], "silo": "smollm2-fixed"},
    "smollm2-adapt": {**SMOLLM2_BED, "extra": PINNED, "silo": "smollm2-fixed"},
    "gemma-fixed": GEMMA_FIXED,
    "gemma-adapt": {**GEMMA_FIXED, "extra": PINNED},
    "owners": {"presets": ["smollm2-135m"], "task_mixes": [json.dumps([f]) for f in OWNER_FAMILIES],
               "extra": ["--selection.accept", "any", *OWNERS_EVAL]},
    "owners-union": {"presets": ["smollm2-135m"], "task_mixes": [json.dumps(OWNER_FAMILIES)], "extra": OWNERS_EVAL,
                     "silo": "owners"},
}


@dataclass(frozen=True)
class Config:
    """One arm: where a node's groups come from and how external ones are chosen."""
    testbed: str
    local: int
    external: int
    rule: str = "uniform"
    control: bool = False  # the node's own extra groups sent through the external path, no network
    negatives: bool = False  # grpo.external_negatives: the ablation of learning only from peers' successes
    overdraw: float = 1.0  # selection.local_overdraw: local tasks sampled per local slot
    lr: float | None = None  # grpo.lr (None: the model's own)
    target_kl: float | None = None  # grpo.target_kl (None: the testbed's)
    when_short: str = "fill_local"  # selection.when_short: peer_tasks samples unusable peer groups' tasks in empty slots

    @property
    def name(self) -> str:
        suffix = (" +negatives" if self.negatives else "") + (f" overdraw {self.overdraw:g}" if self.overdraw != 1 else "")
        suffix += f" lr {self.lr:g}" if self.lr is not None else ""
        suffix += f" kl {self.target_kl:g}" if self.target_kl is not None else ""
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
        args += ["--grpo.target_kl", f"{self.target_kl:g}"] if self.target_kl is not None else []
        return args + (["--selection.self_external", "true"] if self.control else [])

    @property
    def network(self) -> bool:
        """A silo's learning does not depend on the network (tested): spare the CPU."""
        return self.external > 0 and not self.control


def paper_grid(rules: list[str], groups: int) -> list[Config]:
    """The paper's grid on the tiny presets: the silo, its over-draw, the controls, 6/2, 4/4 and 2/6 under each
    rule, and the heterogeneous testbed's silo and 4/4."""
    homo = [Config("homogeneous", 8, 0), Config("homogeneous", 8, 0, overdraw=2), Config("homogeneous", 4, 4, control=True),
            Config("homogeneous", 4, 4, control=True, negatives=True), Config("homogeneous", 4, 4, "signal", negatives=True)]
    homo += [Config("homogeneous", i, 8 - i, rule) for i in (6, 4, 2) for rule in rules]
    homo += [Config("homogeneous", 4, 4, "signal", overdraw=2)]  # does sharing add to filtering local groups?
    return homo + [Config("heterogeneous", 8, 0)] + [Config("heterogeneous", 4, 4, rule) for rule in rules]


def real_grid(rules: list[str], groups: int) -> list[Config]:
    """SmolLM2 alone and beside tiny-a, I + 0 against I/2 + I/2 (`groups` = I); the two share one silo, run once."""
    configs = [Config(bed, i, groups - i, rule) for bed in ("smollm2", "smollm2+tiny") for i in (groups, groups // 2)
               for rule in (rules if i < groups else ["uniform"])]
    return [c for c in configs if c.external or c.silo == c]


def fixed(*configs: Config) -> Callable[[list[str], int], list[Config]]:
    return lambda rules, groups: list(configs)


def silos(*arms: tuple) -> Callable[[list[str], int], list[Config]]:
    """Silos of 4 groups a round, each (testbed, grpo.lr or None for the model's own[, grpo.target_kl])."""
    return fixed(*(Config(bed, 4, 0, lr=lr, target_kl=kl) for bed, lr, kl in (arm + (None,) * (3 - len(arm)) for arm in arms)))


@dataclass(frozen=True)
class Grid:
    """A grid: what it measures (its --help line) and its arms, from the rules asked for and the groups a round."""
    help: str
    configs: Callable[[list[str], int], list[Config]]
    flag: str = ""  # its command-line flag, where it is not the grid's own name

    def option(self, name: str) -> str:
        return self.flag or name


GRIDS: dict[str, Grid] = {
    "paper": Grid("the paper's grid on the tiny presets (the default): the silo 8/0, 6/2, 4/4 and 2/6 under each "
                  "--rules, controls and over-draw", paper_grid),
    "quick": Grid("smoke run: 2 nodes, 20 rounds, 1 seed, the tiny silo, 4/4 guarded and the 4+4 control", fixed(
        Config("homogeneous", 8, 0), Config("homogeneous", 4, 4, "guarded"), Config("homogeneous", 4, 4, control=True))),
    "real": Grid("SmolLM2-135M alone and beside a tiny-a companion, I + 0 against I/2 + I/2 groups a round (--groups, "
                 "default 4); pair it with few nodes and rounds on a CPU", real_grid),
    "quantized": Grid("does LoRA on a 4-bit (NF4) base learn as full fine-tuning does: a SmolLM2 silo of 4 groups a "
                      "round both ways, paired by seed; pair it with --nodes 1",
                      fixed(Config("smollm2", 4, 0), Config("smollm2-nf4", 4, 0))),
    "autocast": Grid("does the training step under bfloat16 autocast learn as float32 does: a SmolLM2 silo both ways, "
                     "paired by seed; pair it with --nodes 1", fixed(Config("smollm2-f32", 4, 0), Config("smollm2-bf16", 4, 0))),
    "lr": Grid("SmolLM2's learning rate: silos at 1e-5, 3e-5 and 1e-4 (full fine-tuning) and 1e-4, 3e-4 (LoRA), "
               "each paired with 1e-5; pair it with --nodes 1", silos(
                   *(("smollm2-sweep", lr) for lr in (1e-5, 3e-5, 1e-4)), *(("smollm2-sweep-lora", lr) for lr in (1e-4, 3e-4))),
               flag="lr-sweep"),
    "step-size": Grid("the step-size controller: SmolLM2-135M and Gemma 3 270M alone at their recipes' rate fixed, "
                      "against the controller from that rate, both from a rate that destroyed them fixed (1e-4, "
                      "6.7e-6), SmolLM2 from 1e-3, whose tenth (the controller's first step) destroys it, and Gemma from "
                      "6.7e-6 at a fifth of the target KL; pair it with --nodes 1 and --accept-license gemma",
                      silos(("smollm2-adapt", 1e-3), ("smollm2-adapt", 1e-4), ("gemma-adapt", 6.7e-6),
                          ("gemma-adapt", 6.7e-6, 1e-3), ("smollm2-fixed", None), ("smollm2-adapt", None),
                          ("gemma-fixed", None), ("gemma-adapt", None), ("smollm2-fixed", 1e-4), ("gemma-fixed", 6.7e-6))),
    "specialists": Grid("two SmolLM2 owners splitting the arithmetic mix (A: arith and basic arithmetic, B: products): "
                        "each alone, the pair at 2/2, and a silo on the union of their tasks; pair it with --nodes 2",
                        fixed(Config("specialists", 4, 0), Config("specialists", 2, 2, "guarded"),
                              Config("specialists-union", 4, 0))),
    "owners": Grid("four SmolLM2 owners of one family each: each alone, the swarm at 2/2 and 3/1, and silos on all four "
                   "families at 4 and at 2 groups a round; pair it with --nodes 4 (scripts/bench/owners.py reports "
                   "what each learned of the families it never draws)",
                   fixed(Config("owners", 4, 0), Config("owners", 2, 2, "guarded"), Config("owners-union", 4, 0),
                         Config("owners-union", 2, 0), Config("owners", 3, 1, "guarded"))),
    "hetero": Grid("the demo's swarm (tiny-a, tiny-b, tiny-a: pair it with --nodes 3) alone, and at 4/4 under signal, "
                   "guarded, scoped, and guarded sampling peers' tasks when short", fixed(
                       Config("demo", 8, 0), *(Config("demo", 4, 4, rule) for rule in ("signal", "guarded", "scoped")),
                       Config("demo", 4, 4, "guarded", when_short="peer_tasks"))),
    "gemma": Grid("Gemma 3 270M beside SmolLM2-135M, alone and at 2/2 under guarded and scoped; pair it with --nodes 2 "
                  "and --accept-license gemma", fixed(Config("gemma+smollm2", 4, 0), Config("gemma+smollm2", 2, 2, "guarded"),
                                                      Config("gemma+smollm2", 2, 2, "scoped"))),
}


def grid(rules: list[str], kind: str = "paper", groups: int = 4) -> list[Config]:
    """The arms of grid `kind`."""
    return GRIDS[kind].configs(rules, groups)
