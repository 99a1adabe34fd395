"""What the hostile benchmark counts as an attack's damage beyond its figures: ERROR lines, unclean exits and
metrics rounds lost or repeated (issue 33's "no ERROR line, no traceback, nothing lost")."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

import bench_hostile as hostile


def write_metrics(out, rounds):
    out.mkdir()
    lines = [{"round": 0}] + [{"round": r} for r in rounds]
    (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


def test_round_gaps_count_rounds_missing_and_rounds_written_twice(tmp_path):
    assert hostile.round_gaps(write_metrics(tmp_path / "clean", [1, 2, 3, 4])) == 0
    assert hostile.round_gaps(write_metrics(tmp_path / "missing", [1, 2, 5])) == 2
    assert hostile.round_gaps(write_metrics(tmp_path / "twice", [1, 2, 2, 3, 3])) == 2
    assert hostile.round_gaps(write_metrics(tmp_path / "none", [])) == 0


def test_outcome_keeps_each_error_with_its_context_exit_codes_and_gaps(tmp_path, capsys):
    procs = hostile.Procs(tmp_path, ROOT)
    (tmp_path / "a.log").write_text("12:00 INFO fine\n12:01 ERROR p2p.host: boom\n  detail\n")
    (tmp_path / "b.log").write_text("Traceback (most recent call last):\n  File x\nValueError: bad\n")
    procs.procs = {name: subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
                   for name, code in (("a", 0), ("b", 3))}
    for p in procs.procs.values():
        p.wait(30)
    run = procs.outcome(["a", "b"], {"a": write_metrics(tmp_path / "a", [1, 3])})
    assert run["errors"]["a"] == ["12:01 ERROR p2p.host: boom\n  detail"]
    assert run["errors"]["b"][0].startswith("Traceback") and run["errors"]["b"][0].endswith("ValueError: bad")
    assert run["exit_codes"] == {"a": 0, "b": 3} and run["round_gaps"] == {"a": 1}
    assert hostile.error_lines(run) == 2 and hostile.lost(run) == 2  # b's exit, a's missing round 2
    assert "a.log: 12:01 ERROR p2p.host: boom" in capsys.readouterr().err


def test_an_error_logged_with_its_traceback_counts_once(tmp_path):
    procs = hostile.Procs(tmp_path, ROOT)
    (tmp_path / "c.log").write_text("12:00 ERROR node.loop: step failed\nTraceback (most recent call last):\n  File x\n"
                                    "RuntimeError: oom\n12:01 INFO retrying\n12:02 ERROR node.loop: again\n")
    found = procs.errors("c")
    assert len(found) == 2
    assert found[0].startswith("12:00 ERROR node.loop: step failed\nTraceback") and "RuntimeError: oom" in found[0]
    assert found[1].startswith("12:02 ERROR node.loop: again")
