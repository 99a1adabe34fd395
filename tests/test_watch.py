"""A node that notices it is learning nothing, or unlearning (node/watch.py)."""

from __future__ import annotations

import json
import logging

import pytest

from node.metrics import Evaluation
from node.watch import FIRST_ROUNDS, Collapsed, LearningWatch, probe_rounds
from rewards import TaskSource
from rewards.source import DatasetMix
from tests.conftest import run_sapo
from trainer.groups import RolloutGroup

TASKS = TaskSource([DatasetMix("arith", {}, 1.0), DatasetMix("reverse", {}, 1.0)], seed=0)


def group(dataset: str, right: int, g: int = 4, truncated: int = 0, text: str = "<answer>x") -> RolloutGroup:
    task = next(t for t in TASKS.draw(8) if t.ref.dataset == dataset)
    correct = [k < right for k in range(g)]
    return RolloutGroup(task, [text] * g, [float(c) for c in correct], [k < truncated for k in range(g)], correct=correct)


def watched(rounds: list[list[RolloutGroup]]) -> list[str]:
    watch = LearningWatch(max_new_tokens=64, lr=1e-5, held_out={}, probe={})
    return [w for groups in rounds for w in watch.observe(groups)]


def test_a_family_with_no_signal_is_named_once_with_the_setting_to_change():
    too_hard = watched([[group("arith", 0), group("reverse", 2)]] * FIRST_ROUNDS)
    assert len(too_hard) == 1 and too_hard[0].startswith("tasks: arith gave no signal in its first 5 groups")
    assert "too hard" in too_hard[0] and "tasks.datasets" in too_hard[0]
    cut = watched([[group("arith", 0, truncated=3), group("reverse", 1)]] * (FIRST_ROUNDS + 3))
    assert len(cut) == 1 and "75% of them cut off at generation.max_new_tokens 64" in cut[0]
    assert cut[0].endswith("before the answer closed: raise generation.max_new_tokens")
    easy = watched([[group("arith", 4), group("reverse", 4)]] * FIRST_ROUNDS)
    assert [w.split(":")[1] for w in easy] == [" arith gave no signal in its first 5 groups", " reverse gave no signal in its first 5 groups"]
    assert all("too easy" in w for w in easy)
    split = watched([[group("arith", 0), group("arith", 4)]] * FIRST_ROUNDS)
    assert len(split) == 1 and "generation.completions_per_group" in split[0]
    assert watched([[group("arith", 1), group("reverse", 3)]] * FIRST_ROUNDS) == []
    assert watched([[group("arith", 0)]] * (FIRST_ROUNDS - 1)) == []  # not judged before its first rounds


def test_a_model_that_never_writes_an_answer_tag_is_said_to_lack_the_format_not_tokens():
    """An untrained or random model runs every completion to max_new_tokens without an <answer> tag: more tokens
    would not help, and the family is not too hard, the model writes no answer at all."""
    babble = watched([[group("arith", 0, truncated=4, text="the the of"), group("reverse", 0, truncated=3, text="")]]
                     * FIRST_ROUNDS)
    assert len(babble) == 2 and all("none with an <answer> tag" in w and "does not write the answer format" in w
                                    and "raise generation.max_new_tokens" not in w and "too hard" not in w for w in babble)
    assert "(100% cut off at generation.max_new_tokens 64)" in babble[0] and "(75% cut off" in babble[1]


def held_out(overall: float | None, **families: float) -> Evaluation:
    return Evaluation(overall, {name.replace("_", "/"): a for name, a in families.items()})


def products_watch(lr: float = 1e-6) -> LearningWatch:
    """A user's Gemma: 100 rg/products and 300 arith held-out tasks, 0.345 overall at the start."""
    watch = LearningWatch(64, lr, {"rg/products": 100, "arith": 300}, {"rg/products": 40, "arith": 80})
    assert watch.evaluated(0, held_out(0.345, rg_products=0.73, arith=0.217)) == []
    return watch


def test_a_family_that_falls_clearly_is_named_while_the_overall_mean_holds(caplog):
    watch = products_watch()
    with caplog.at_level(logging.WARNING, logger="node.watch"):
        said = watch.evaluated(25, held_out(0.30, rg_products=0.34, arith=0.287))  # overall: 1.4 standard errors
    assert said == [w.getMessage() for w in caplog.records]
    assert len(said) == 1 and said[0].startswith("held-out accuracy of rg/products fell from 0.730 to 0.340 by round 25 "
                                                 "(100 tasks, 6.0 standard errors of the difference): the model is unlearning")
    assert "grpo.lr 1e-06 is too high for it" in said[0] and "--grpo.lr 1e-07" in said[0] and "peers' groups" in said[0]
    adapting = LearningWatch(64, 1e-6, {"rg/products": 100, "arith": 300}, {}, target_kl=0.005)  # the controller's rate
    adapting.evaluated(0, held_out(0.345, rg_products=0.73, arith=0.217))
    line = adapting.evaluated(25, held_out(0.30, rg_products=0.34, arith=0.287))[0]
    assert "toward steps of grpo.target_kl 0.005" in line and "--grpo.target_kl 0.00125" in line
    both = products_watch()  # the user's run: overall 0.345 -> 0.190 as well, not below half its start
    said = both.evaluated(200, held_out(0.19, rg_products=0.34, arith=0.14))
    assert [w.split(" fell")[0] for w in said] == ["held-out accuracy of rg/products", "held-out accuracy"]


def test_a_fall_within_the_noise_or_too_small_to_matter_is_not_said():
    watch = products_watch()
    assert watch.evaluated(25, held_out(0.32, rg_products=0.63, arith=0.217)) == []  # 1.5 standard errors
    few = LearningWatch(64, 1e-6, {"arith": 4000, "count": 8}, {})
    few.evaluated(0, held_out(0.50, arith=0.50, count=1.0))
    # 3.6 standard errors of 4,000 tasks but 4 points; all of a family of 8 tasks lost, too few to judge alone
    assert few.evaluated(25, held_out(0.46, arith=0.46, count=0.0)) == []
    assert watch.evaluated(50, Evaluation()) == []  # an evaluation that failed says nothing


def test_a_fall_is_said_once_and_again_only_when_it_falls_further_or_anew():
    watch = products_watch()
    said = [watch.evaluated(r, held_out(0.33, rg_products=p, arith=0.23)) for r, p in
            [(25, 0.34), (50, 0.36), (75, 0.31), (100, 0.10), (125, 0.70), (150, 0.34)]]
    assert [len(s) for s in said] == [1, 0, 0, 1, 0, 1]  # further by a clear margin (4.3), then a new fall after a recovery
    assert "fell from 0.730 to 0.100 by round 100" in said[3][0] and "by round 150" in said[5][0]


def test_the_stop_rests_on_overall_accuracy_below_half_its_start_never_on_a_family_alone(caplog):
    watch = products_watch(lr=2e-4)
    assert len(watch.evaluated(25, held_out(0.30, rg_products=0.0, arith=0.40))) == 1  # a family alone: said, no stop
    with pytest.raises(Collapsed, match=r"held-out accuracy fell from 0\.345 to 0\.100 by round 50 \(400 tasks, 8\.7 "
                       r"standard errors of the difference\), below half its start: .* grpo\.lr 0\.0002 is too high"):
        watch.evaluated(50, held_out(0.10, rg_products=0.0, arith=0.133))
    with pytest.raises(Collapsed):  # as before: at each evaluation that shows it
        watch.evaluated(75, held_out(0.10, rg_products=0.0, arith=0.133))
    assert watch.evaluated(100, held_out(0.18, rg_products=0.0, arith=0.24)) == []  # above half: said already
    small = LearningWatch(64, 2e-4, {"arith": 20}, {})
    small.evaluated(0, held_out(0.55, arith=0.55))
    with caplog.at_level(logging.WARNING, logger="node.watch"):
        small.evaluated(25, held_out(0.10, arith=0.10))  # a collapse on 20 tasks: said, not stopped on
    assert "fell from 0.550 to 0.100 by round 25" in caplog.text and "not stopping on an evaluation of 20 tasks" in caplog.text
    low = LearningWatch(64, 2e-4, {"arith": 200}, {})
    low.evaluated(0, held_out(0.05, arith=0.05))
    assert low.evaluated(25, held_out(0.02, arith=0.02)) == []  # below half, within the noise of 200 tasks


def test_the_early_probe_runs_before_the_first_evaluation_against_its_own_start_and_never_stops():
    assert probe_rounds(eval_every=25, rounds=600) == [8, 16]
    assert probe_rounds(eval_every=100, rounds=600) == [8, 16, 32, 64]
    assert probe_rounds(eval_every=25, rounds=16) == [8]  # the last round has the full evaluation
    assert probe_rounds(eval_every=8, rounds=600) == []
    watch = products_watch(lr=2e-4)
    watch.probed(0, held_out(0.52, rg_products=0.9, arith=0.35))  # round 0's probe: its own start, not the set's
    said = watch.probed(8, held_out(0.05, rg_products=0.05, arith=0.05))  # below half, on 120 tasks: said, not stopped on
    assert [w.split(" by")[0] for w in said] == ["held-out accuracy of arith in the early probe fell from 0.350 to 0.050",
                                                 "held-out accuracy of rg/products in the early probe fell from 0.900 to 0.050",
                                                 "held-out accuracy in the early probe fell from 0.520 to 0.050"]
    assert watch.held_out.start["overall"] == 0.345 and watch.probed(16, held_out(0.05, rg_products=0.05, arith=0.05)) == []


@pytest.mark.slow
def test_a_run_whose_groups_are_all_wrong_says_so_in_one_line(tiny_a, cache_dir, tmp_path):
    hard = json.dumps([{"name": "arith", "config": {"max_operand": 99999, "ops": "+-"}}])
    r = run_sapo("run", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path), "--rounds", "5", "--local", "3",
                 "--generation.completions_per_group", "4", "--tasks.eval_size", "20", "--run.eval_every", "5",
                 "--external", "0", "--p2p.enabled", "false", "--tasks", hard)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "gave no signal" in line]
    assert len(lines) == 1 and "WARNING tasks: arith gave no signal in its first 15 groups: every completion wrong" in lines[0]
    assert "generation.max_new_tokens" in lines[0] or "too hard" in lines[0]


@pytest.mark.slow
def test_the_early_probe_has_its_own_fields_in_the_metrics_from_round_0_and_can_be_turned_off(tiny_a, cache_dir, tmp_path):
    args = ["run", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path), "--local", "2", "--generation.completions_per_group",
            "4", "--tasks.eval_size", "20", "--run.eval_every", "1000", "--p2p.enabled", "false"]
    r = run_sapo(*args, "--rounds", "9", "--run.probe_tasks", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["round"], m["eval_accuracy"] is not None, m["probe_accuracy"] is not None) for m in rows] == [
        (0, True, True), *[(r, False, False) for r in range(1, 8)], (8, False, True),
        (9, True, False)]  # round 0: both starts; round 8: the probe alone; the last round: the full evaluation
    assert set(rows[8]["probe_by_dataset"]) <= set(rows[0]["eval_by_dataset"]) and rows[8]["eval_by_dataset"] is None
    off = run_sapo(*args, "--rounds", "17", "--run.probe_tasks", "0")  # resumed: round 16 would have been probed
    assert off.returncode == 0, off.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in rows if m["probe_accuracy"] is not None] == [0, 8] and rows[-1]["round"] == 17


@pytest.mark.slow
def test_a_stop_during_the_probe_keeps_its_rounds_line_until_the_resume_has_probed_those_weights(
        tiny_a, cache_dir, tmp_path, monkeypatch):
    from node.config import load_config
    from node.lifecycle import StopSignal
    from node.loop import Node
    from trainer import checkpoint
    from trainer.generation import never
    from trainer.generation.hf import TransformersGenerator

    def config(out):
        return load_config(None, {"model": {"cache_dir": str(cache_dir)}, "status": {"enabled": False},
                                  "p2p": {"enabled": False}, "tasks": {"eval_size": 12},
                                  "generation": {"completions_per_group": 4}, "selection": {"external_groups": 0},
                                  "run": {"out_dir": str(out), "rounds": 9, "eval_every": 100, "local_groups": 2,
                                          "probe_tasks": 6}})

    def lines(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    Node(config(tmp_path / "straight")).run(StopSignal())
    real, stop = TransformersGenerator.generate, StopSignal()

    def generate(self, prompt_ids, params, cancel=never):
        if params.temperature == 0 and node.round == 8 and len(prompt_ids) == 6:
            stop.request("test")
        return real(self, prompt_ids, params, cancel)

    monkeypatch.setattr(TransformersGenerator, "generate", generate)
    out = tmp_path / "stopped"
    node = Node(config(out))
    node.run(stop)
    pending = json.loads((checkpoint.complete(out / "checkpoints")[-1] / "state.json").read_text())["pending_row"]
    assert [m["round"] for m in lines(out)] == list(range(8)) and (pending["round"], pending["probe_accuracy"]) == (8, None)
    node = Node(config(out))
    node.run(StopSignal())
    straight, stopped = lines(tmp_path / "straight"), lines(out)
    assert [m["round"] for m in stopped] == list(range(10))
    assert [m["probe_accuracy"] for m in stopped] == [m["probe_accuracy"] for m in straight] != [None] * 10


@pytest.mark.slow
def test_a_run_that_unlearns_says_so_naming_the_learning_rate_and_can_stop_keeping_its_metrics(tiny_a, cache_dir, tmp_path):
    args = ["run", "--model.cache_dir", str(cache_dir), "--rounds", "6", "--run.eval_every", "3", "--grpo.lr", "0.01",
            "--p2p.enabled", "false", "--run.checkpoint_every", "1"]
    r = run_sapo(*args, "--out", str(tmp_path / "stop"), "--run.stop_on_collapse", "true")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "held-out accuracy fell from" in r.stderr and "grpo.lr 0.01 is too high" in r.stderr
    rows = [json.loads(line) for line in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == 3 and rows[-1]["eval_accuracy"] < rows[0]["eval_accuracy"] / 2  # the line is kept
    saved = sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir())
    assert saved[-1] == "round-000002"  # the collapsed weights are not checkpointed
    on = run_sapo(*args, "--out", str(tmp_path / "on"))  # the default: said at each such evaluation, trained on
    assert on.returncode == 0 and "WARNING held-out accuracy fell from" in on.stderr, on.stderr[-3000:]
    assert "training on (run.stop_on_collapse true stops here" in on.stderr
