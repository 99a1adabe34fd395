"""The four-owner grid: its evaluation shares no question with any node's training stream, and its report pairs each
owner's accuracy on the families it never draws with the same node alone and with both union silos, seed by seed."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

import owners
import sapo_experiment as driver
from experiment import grids
from node.swarm import SwarmSpec
from rewards import TaskSource
from rewards.config import TasksConfig
from rewards.held_out import content_key, held_out



def flag(extra: list[str], name: str) -> str:
    return extra[extra.index(name) + 1]


def test_the_owners_evaluation_shares_no_question_with_any_training_stream():
    bed, union = grids.TESTBEDS["owners"], grids.TESTBEDS["owners-union"]
    extra = bed["extra"]
    evaluation = TaskSource(TasksConfig(datasets=flag(extra, "--tasks.eval_datasets")).mix(),
                            seed=TasksConfig().eval_seed).draw(int(flag(extra, "--tasks.eval_size")))
    excluded = held_out(evaluation)
    assert not excluded.by_seed, "every family must be large enough to hold out by content"
    assert sorted({t.ref.dataset for t in evaluation}) == sorted(owners.FAMILIES)
    questions = {content_key(t.question) for t in evaluation}
    rounds, slots = 30, 4
    for seed in range(5):
        spec = SwarmSpec(nodes=4, rounds=rounds, local=slots, external=0, presets=["smollm2-135m"], out=None, seed=100 * seed)
        for k in range(4):
            for mixes in (bed["task_mixes"], union["task_mixes"]):
                stream = TaskSource(TasksConfig(datasets=mixes[k % len(mixes)]).mix(), seed=spec.node_seed(k), exclude=excluded)
                drawn = {content_key(t.question) for t in stream.draw(rounds * slots)}
                assert not drawn & questions
    # without the exclusion the streams would share questions: the check above can fail
    plain = TaskSource(TasksConfig(datasets=bed["task_mixes"][0]).mix(), seed=0)
    assert {content_key(t.question) for t in plain.draw(2000)} & questions


def fake_node(name: str, own: str, never: float, own_acc: float, first: float = 0.3) -> dict:
    by = {f: (own_acc if f == own else never) for f in owners.FAMILIES}
    rounds = 6
    taken = [{f: 1 for f in owners.FAMILIES if f != own}] * rounds
    return {"name": name, "expected_by_dataset_last": by, "eval_by_dataset_last": {f: v - 0.05 for f, v in by.items()},
            "expected_first": first, "eval_first": first - 0.05, "tokens_generated": 1000, "seconds": 60.0,
            "timing": {"peak_gb": 5.0 + int(name[-1]) / 10, "planned_peak_gb": 5.0}, "held_out_skipped": int(name[-1]),
            "curves": {"external_families": taken, "external_inspected": [3] * rounds,
                       "external_dropped": [{"off_support": 1}] * rounds, "support_cutoff": [-0.5] * rounds}}


def fake_run(arm: str, seed: int, never: float, own: float) -> dict:
    nodes = [fake_node(f"node{k}", f, never, own) for k, f in enumerate(owners.FAMILIES)]
    return {"config": owners.ARMS[arm], "seed": seed, "rounds": 6, "cpus": 2, "wall_seconds": 100.0, "failed": [],
            "nodes": nodes}


def test_the_report_pairs_never_drawn_families_by_seed_against_alone_and_both_union_silos(tmp_path):
    levels = {"alone": (0.30, 0.6), "swarm": (0.50, 0.6), "union": (0.45, 0.5), "union_tokens": (0.40, 0.5),
              "swarm_3_1": (0.40, 0.62)}
    for seed, shift in ((0, 0.0), (1, 0.02), (2, -0.02)):
        for arm, (never, own) in levels.items():
            folder = tmp_path / driver.slug(owners.ARMS[arm]) / f"seed{seed}"
            folder.mkdir(parents=True)
            up = shift if arm == "swarm" else 0.0
            (folder / "result.json").write_text(json.dumps(fake_run(arm, seed, never + up, own)))
    result = owners.report(tmp_path, Console(file=open(tmp_path / "log.txt", "w"), width=200))
    rows = {(r["arm"], r["against"], r["measure"], r["endpoint"]): r for r in result["comparisons"]}
    taught = rows["swarm", "alone", "expected", "taught"]
    assert taught["per_seed"] == pytest.approx([0.20, 0.22, 0.18]) and taught["gap"] == pytest.approx(0.20)
    assert rows["swarm", "union", "greedy", "taught"]["gap"] == pytest.approx(0.05)
    assert rows["swarm", "union_tokens", "expected", owners.FAMILIES[0]]["gap"] == pytest.approx(0.10)
    assert rows["swarm_3_1", "alone", "expected", "own"]["gap"] == pytest.approx(0.02)
    dose = [d for d in result["dose"] if d["arm"] == "swarm" and d["node"] == 0][0]
    assert dose["taken"] == {f: 6 for f in owners.FAMILIES[1:]} and dose["taken_by_third"][owners.FAMILIES[1]] == [2, 2, 2]
    assert dose["dropped_by_third"] == [{"off_support": 2.0}] * 3
    memory = [r for r in result["levels"] if r["arm"] == "swarm"][0]
    assert (memory["peak_gb_per_node"], memory["planned_gb_per_node"], memory["peak_gb_sum"]) == pytest.approx((5.3, 5.0, 20.6))
    assert memory["held_out_skipped_per_node"] == pytest.approx(1.5)
    assert {p.name for p in tmp_path.iterdir()} >= {"owners.json", "owners.md", "owners.png"}
    assert "no effect seen" in (tmp_path / "owners.md").read_text()  # the swarm against alone on its own family: no gap


def test_the_owners_grid_is_five_arms_paired_with_each_owner_alone():
    names = [c.name for c in grids.grid([], "owners")]
    assert names == list(owners.ARMS.values())
    assert grids.Config("owners-union", 4, 0).silo.name == owners.ARMS["alone"]


def test_a_familys_question_space_is_estimated_from_its_distinct_questions():
    small = owners.question_space({"name": "arith", "config": {"max_operand": 4, "ops": "+"}}, draws=2000)
    assert (small["distinct"], small["space"]) == (25, 25)
    large = owners.question_space({"name": "arith", "config": {"max_operand": 99, "ops": "+"}}, draws=2000)
    assert 5000 < large["space"] < 20000  # 10,000 questions, most draws distinct
    assert 0.9 < small["space_by_repeats"] / 25 < 1.1 and small["top_share"] == 1.0  # uniform: repeats agree


def test_a_family_whose_draws_crowd_a_few_questions_is_measured_by_its_repeats_not_its_distinct_count():
    """`rg/chain_sum` with 1-2 digit terms has ~12,000 distinct questions, but its 200 one-digit sums and differences
    take half its draws: its repeats are those of a uniform space of under a thousand, and an evaluation's 100
    questions catch a tenth of fresh draws."""
    chain = owners.question_space(next(f for f in grids.OWNER_FAMILIES if f["name"] == "rg/chain_sum"), draws=10000)
    assert chain["distinct"] > 3000 and chain["space_by_repeats"] < 1000  # thousands seen, repeating as hundreds
    assert 0.4 < chain["top_share"] < 0.6 and 0.08 < chain["eval_hit"] < 0.2


def test_a_seed_whose_two_runs_ran_other_numerics_is_left_out_of_their_comparison_and_levels_are_kept_by_numerics(tmp_path):
    """Each machine's plan picks bfloat16 products or not: a pair across machines would measure the machine too."""
    for seed in (0, 1):
        for arm in ("alone", "swarm", "swarm_3_1"):
            run = fake_run(arm, seed, 0.5 if arm != "alone" else 0.3, 0.6)
            dtype = "float32" if (arm, seed) == ("swarm_3_1", 1) else "bfloat16"
            for n in run["nodes"]:
                n["timing"] |= {"sampling_dtype": dtype, "compute_dtype": dtype}
                n["seconds"] = 300.0 if dtype == "float32" else 100.0
            folder = tmp_path / driver.slug(owners.ARMS[arm]) / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "result.json").write_text(json.dumps(run))
    result = owners.report(tmp_path, Console(file=open(tmp_path / "log.txt", "w"), width=200))
    rows = {(r["arm"], r["against"], r["measure"], r["endpoint"]): r for r in result["comparisons"]}
    assert rows["swarm", "alone", "expected", "taught"]["paired_seeds"] == [0, 1]
    dose = rows["swarm_3_1", "alone", "expected", "taught"]
    assert dose["paired_seeds"] == [0] and dose["left_out"] == ["seed 1: float32 against bfloat16"]
    three_one = {r["numerics"]: (r["seeds"], r["seconds_per_node"]) for r in result["levels"] if r["arm"] == "swarm_3_1"}
    assert three_one == {"bfloat16": ([0], 100.0), "float32": ([1], 300.0)}
    assert dose["tokens_per_node"] == {"ours": 1000.0, "theirs": 1000.0}
    assert "Left out, ran on other numerics: swarm_3_1 against alone: seed 1: float32 against bfloat16." in (
        tmp_path / "owners.md").read_text()


def test_the_kept_round_0_evaluation_is_the_one_every_float32_run_started_from():
    """docs/bench/owners-2cpu/eval-cache holds the float32 round-0 evaluation a fresh checkout reuses: it must be the
    one the grid's float32 runs recorded, every node of every arm."""
    from tests.conftest import ROOT

    grid = ROOT / "docs" / "bench" / "owners-2cpu"
    (kept,) = [json.loads(p.read_text()) for p in (grid / "eval-cache").glob("*.json")]
    started = [(n["eval_first"], n["eval_by_dataset_first"], n["expected_first"], n["expected_by_dataset_first"])
               for by_seed in owners.load(grid).values() for run in by_seed.values() if owners.numerics(run) == "float32"
               for n in run["nodes"]]
    same = lambda record: json.dumps(record, sort_keys=True)  # noqa: E731
    assert started and set(map(same, started)) == {
        same((kept["accuracy"], kept["by_dataset"], kept["expected"], kept["expected_by_dataset"]))}
