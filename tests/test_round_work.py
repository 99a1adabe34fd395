"""What a node's rounds were made of, window by window (scripts/bench/round_work.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import round_work

ROOT = Path(__file__).resolve().parents[1]


def rows(times: list[float], **parts) -> list[dict]:
    return [{"round": i + 1, "time": t, **{k: (v(i) if callable(v) else v) for k, v in parts.items()}}
            for i, t in enumerate(times)]


def test_each_full_window_gives_its_pace_and_its_rounds_mean_work():
    # 10 s windows: 5 rounds training 2 groups each, then 10 rounds training 1, then a part-window of 2 rounds
    times = [0, 2, 4, 6, 8] + [10 + i for i in range(10)] + [20, 21]
    train = lambda i: 0.2 if i < 5 else 0.1  # noqa: E731
    groups = lambda i: 2 if i < 5 else 1  # noqa: E731
    ws = round_work.windows([{"round": 0, "time": -3.0}, *rows(times, seconds_train=train, groups_trained=groups,
                                                                 n_external=1, reward_mean=None)], 10)
    assert [w["rounds"] for w in ws] == [5, 10]  # round 0 (the start-up evaluation) and the part-window left out
    assert [w["rounds_per_min"] for w in ws] == [30.0, 60.0]
    assert [w["groups_trained"] for w in ws] == [2, 1] and [w["seconds_train"] for w in ws] == [0.2, 0.1]
    assert all(abs(w["train_s_per_group"] - 0.1) < 1e-12 for w in ws)  # the pace doubled, the cost per group held
    assert all(w["reward_mean"] == 0 and "cores" not in w for w in ws)


def test_with_cpu_samples_a_window_gives_its_cores_and_cpu_seconds_a_round():
    cpu = [(0.0, 0.0, 1), (5.0, 2.0, 1), (10.0, 4.0, 1), (15.0, 4.5, 1), (19.9, 5.0, 1)]
    ws = round_work.windows(rows([float(t) for t in range(21)], seconds_train=0.0, groups_trained=0), 10, cpu)
    assert abs(ws[0]["cores"] - 0.4) < 1e-12 and abs(ws[0]["cpu_s_per_round"] - 0.4) < 1e-12
    assert abs(ws[1]["cores"] - 1.0 / 9.9) < 1e-12  # the samples inside the window: 10 to 19.9 s
    assert ws[0]["train_s_per_group"] is None  # nothing trained: no cost per group to give


def test_spread_gives_a_runs_lowest_highest_and_their_ratio():
    s = round_work.spread([{"x": 2.0}, {"x": 3.0}, {"x": None}], "x")
    assert s == {"min": 2.0, "max": 3.0, "max_over_min": 1.5}
    assert round_work.spread([{"x": None}], "x") is None


def test_a_folder_without_metrics_is_refused_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "scripts/bench/round_work.py", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "holds no metrics.jsonl" in r.stderr and "Traceback" not in r.stderr


def test_the_windows_are_written_with_the_command_that_made_them(tmp_path):
    run = tmp_path / "node0"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(
        [float(t) for t in range(25)], seconds_train=0.1, groups_trained=1)))
    out = tmp_path / "work.json"
    r = subprocess.run([sys.executable, "scripts/bench/round_work.py", str(run), "--window", "10", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    assert record["command"].startswith("scripts/bench/round_work.py") and record["window_s"] == 10
    node = record["nodes"]["node0"]
    assert [w["rounds"] for w in node["windows"]] == [10, 10]
    assert node["rounds_per_min_spread"]["max_over_min"] == 1.0
