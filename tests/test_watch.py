"""A node that notices it is learning nothing, or unlearning (node/watch.py)."""

from __future__ import annotations

import json
import logging

import pytest

from node.watch import FIRST_ROUNDS, Collapsed, LearningWatch
from rewards import TaskSource
from rewards.source import DatasetMix
from tests.conftest import run_sapo
from trainer.groups import RolloutGroup

TASKS = TaskSource([DatasetMix("arith", {}, 1.0), DatasetMix("reverse", {}, 1.0)], seed=0)


def group(dataset: str, right: int, g: int = 4, truncated: int = 0) -> RolloutGroup:
    task = next(t for t in TASKS.draw(8) if t.ref.dataset == dataset)
    correct = [k < right for k in range(g)]
    return RolloutGroup(task, ["x"] * g, [float(c) for c in correct], [k < truncated for k in range(g)], correct=correct)


def watched(rounds: list[list[RolloutGroup]]) -> list[str]:
    watch = LearningWatch(max_new_tokens=64, lr=1e-5, eval_size=200)
    return [w for groups in rounds for w in watch.observe(groups)]


def test_a_family_with_no_signal_is_named_once_with_the_setting_to_change():
    too_hard = watched([[group("arith", 0), group("reverse", 2)]] * FIRST_ROUNDS)
    assert len(too_hard) == 1 and too_hard[0].startswith("tasks: arith gave no signal in its first 5 groups")
    assert "too hard" in too_hard[0] and "tasks.datasets" in too_hard[0]
    cut = watched([[group("arith", 0, truncated=3), group("reverse", 1)]] * (FIRST_ROUNDS + 3))
    assert len(cut) == 1 and "75% of them cut off at generation.max_new_tokens 64" in cut[0]
    easy = watched([[group("arith", 4), group("reverse", 4)]] * FIRST_ROUNDS)
    assert [w.split(":")[1] for w in easy] == [" arith gave no signal in its first 5 groups", " reverse gave no signal in its first 5 groups"]
    assert all("too easy" in w for w in easy)
    split = watched([[group("arith", 0), group("arith", 4)]] * FIRST_ROUNDS)
    assert len(split) == 1 and "generation.completions_per_group" in split[0]
    assert watched([[group("arith", 1), group("reverse", 3)]] * FIRST_ROUNDS) == []
    assert watched([[group("arith", 0)]] * (FIRST_ROUNDS - 1)) == []  # not judged before its first rounds


def test_held_out_accuracy_far_below_its_start_is_a_collapse_and_noise_is_not(caplog):
    watch = LearningWatch(max_new_tokens=64, lr=2e-4, eval_size=200)
    watch.evaluated(0, 0.26)
    watch.evaluated(25, 0.20)  # lower, not half
    with pytest.raises(Collapsed, match=r"fell from 0\.260 to 0\.025 by round 2: .* grpo\.lr 0\.0002 is too high"):
        watch.evaluated(2, 0.025)
    small = LearningWatch(max_new_tokens=64, lr=2e-4, eval_size=20)
    small.evaluated(0, 0.55)
    with caplog.at_level(logging.WARNING, logger="node.watch"):
        small.evaluated(25, 0.15)  # a fall as large, on 20 tasks: said, not stopped on
    assert "fell from 0.550 to 0.150 by round 25" in caplog.text and "not stopping on an evaluation of 20 tasks" in caplog.text
    low = LearningWatch(max_new_tokens=64, lr=2e-4, eval_size=200)
    low.evaluated(0, 0.05)
    low.evaluated(25, 0.02)  # below half, but within three standard errors of a 0.05 start on 200 tasks
    low.evaluated(50, None)  # an evaluation that failed says nothing


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
