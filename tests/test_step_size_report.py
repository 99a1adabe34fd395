"""scripts/bench/step_size_report.py: the wrong-rate runs' report, from each run's result.json alone."""

from __future__ import annotations

import io
import json

import pytest

import step_size_report as step_size

FIXED, ADAPT = "gemma-fixed 4/0 lr 6.7e-06", "gemma-adapt 4/0 lr 6.7e-06"


def save(out, arm: str, seed: int, evals: list[float], lrs: list[float | None], peak: float = 9.0) -> None:
    folder = out / arm.replace(" ", "-").replace("/", "-") / f"seed{seed}"
    folder.mkdir(parents=True)
    points = [0, 20, 40][: len(evals)]
    node = {"model": "gemma3-270m", "eval_by_dataset_first": {"arith": 0.1, "rg/products": 0.5},
            "timing": {"peak_gb": peak, "planned_peak_gb": 10.0},
            "curves": {"eval": [[k, v] for k, v in zip(points, evals)], "lr": lrs,
                       "eval_by_dataset": [[k, {"arith": v / 2, "rg/products": v}] for k, v in zip(points, evals)]}}
    (folder / "result.json").write_text(json.dumps({"config": arm, "seed": seed, "failed": [], "nodes": [node]}))


def test_a_rate_settles_where_it_last_moved_and_rounds_without_a_step_carry_none():
    lrs = [1e-7, None, 1e-7, 1.5e-7, None, 1.5e-7, 1.5e-7]
    path = step_size.rate_path({"curves": {"lr": lrs + [None] * (step_size.STILL - 3)}})
    assert path == {"first": 1e-7, "last": 1.5e-7, "settled_round": 4, "lowest": 1e-7, "highest": 1.5e-7, "steps": 5}
    assert step_size.rate_path({"curves": {"lr": lrs}})["settled_round"] is None  # moved 3 rounds before the end


def test_the_controller_is_weighed_against_the_same_rate_fixed_paired_by_seed(tmp_path):
    for seed, (a, f) in enumerate([(0.5, 0.2), (0.45, 0.25), (0.4, 0.1)]):
        save(tmp_path, ADAPT, seed, [0.3, a + 0.1, a], [1e-7, 2e-7, None])
        save(tmp_path, FIXED, seed, [0.3, f + 0.05, f], [1e-6, 1e-6, None], peak=10.5 + seed)
    save(tmp_path, FIXED, 3, [0.3, 0.2, 0.1], [1e-6] * 3)  # a seed the controller did not run: left out of the pair
    result = step_size.report(tmp_path, step_size.Console(file=io.StringIO()))
    (pair,) = result["pairs"]
    assert (pair["arm"], pair["against"], pair["seeds"]) == (ADAPT, FIXED, [0, 1, 2])
    last = dict((k, g) for k, g in pair["gaps"])[40]
    assert pair["per_seed"][40] == pytest.approx([0.3, 0.2, 0.3]) and last["gap"] == pytest.approx(0.8 / 3)
    arms = {r["arm"]: r for r in result["arms"]}
    assert arms[FIXED]["peak_gb"] == 12.5 and arms[ADAPT]["eval"] == [[0, 0.3], [20, pytest.approx(0.55)], [40, pytest.approx(0.45)]]
    assert arms[ADAPT]["eval_by_dataset"]["arith"][-1] == [40, pytest.approx(0.225)]
    assert arms[ADAPT]["kept_from"] == 20 and arms[ADAPT]["kept"]["gap"] == pytest.approx(-0.1)  # each seed 0.1 down
    assert arms[FIXED]["kept"]["gap"] == pytest.approx((3 * -0.05 - 0.1) / 4)  # an arm's own seeds, paired or not
    assert (tmp_path / "step-size.png").stat().st_size > 0 and "| 40 | +0.267 ± " in (tmp_path / "step-size.md").read_text()


def test_a_folder_without_finished_runs_is_one_line(tmp_path):
    save(tmp_path, ADAPT, 0, [0.3], [None])
    (tmp_path / "gemma-adapt-4-0-lr-6.7e-06" / "seed0" / "result.json").write_text(json.dumps({"config": ADAPT, "failed": ["x"]}))
    with pytest.raises(SystemExit, match="step_size_report: no finished runs under"):
        step_size.report(tmp_path, step_size.Console())


def test_a_result_that_is_not_json_is_named_in_one_line(tmp_path):
    save(tmp_path, ADAPT, 0, [0.3, 0.4], [1e-7, None])
    broken = tmp_path / "gemma-fixed-4-0-lr-6.7e-06" / "seed0" / "result.json"
    broken.parent.mkdir(parents=True)
    broken.write_text("{broken")
    with pytest.raises(SystemExit, match=f"step_size_report: {broken} is not a run's result.json: Expecting"):
        step_size.report(tmp_path, step_size.Console())
