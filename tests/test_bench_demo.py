"""The demo bench's reading of a node's pace (scripts/bench/bench_demo.py)."""

from __future__ import annotations

import json

import bench_demo


def test_a_nodes_pace_is_read_whole_and_by_thirds_with_its_collector_seconds(tmp_path):
    # rounds 1-6 a second apart, then 7-9 two seconds apart: the last third runs at half the pace
    times = [0, 1, 2, 3, 4, 5, 7, 9, 11]
    lines = [{"round": 0, "time": -5.0}] + [{"round": r + 1, "time": float(t), "seconds_gc": 0.01 * (r + 1)}
                                             for r, t in enumerate(times)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    pace = bench_demo.node_pace(tmp_path)
    assert pace["rounds"] == 9 and pace["rounds_per_min"] == 60 * 8 / 11
    assert pace["rounds_per_min_thirds"] == [60.0, 60 * 3 / 4, 30.0]
    assert abs(pace["seconds_gc_per_round"] - 0.05) < 1e-12
