"""The soak benchmark, briefly (scripts/bench/bench_soak.py; its own run lasts hours): one cycle of calm,
churn, junk flood and length flood in 100 s, watched as the long run is."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_a_brief_soak_restarts_resumes_floods_and_records_every_process(tiny_a, cache_dir, tmp_path):
    """The nodes rotate their metrics every 30-odd rounds (a day's node does every 32 MB), so kills and resumes
    fall between archives: no round may be lost or repeated across them."""
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "scripts/bench/bench_soak.py", "--nodes", "3", "--duration", "100", "--phase", "25",
                        "--kill-every", "10", "--settle", "0", "--sample", "2", "--cache-dir", str(cache_dir),
                        "--metrics-rotate-mb", "0.05", "--workdir", str(tmp_path / "swarm"), "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads(out.read_text())
    s = record["summary"]
    assert record["complete"] and out.with_suffix(".png").stat().st_size > 0
    assert [e["kind"] for e in record["events"] if e["event"] == "phase"] == ["calm", "churn", "churn+junk", "churn+length"]
    assert {r["phase"] for r in record["restarts"]} == {1, 2, 3}, record["restarts"]  # every churn phase killed a node
    assert s["resumed_from_checkpoint"] == s["peer_id_kept"] == s["restarts"], s
    assert s["bootstrap_restarts"] == 1 and record["processes"]["bootstrap"]["exit_code"] == 0
    assert set(s["flood_messages"]) == {"junk2", "length3"} and all(s["flood_messages"].values()), s
    floods = [e for e in record["events"] if e["event"] == "flood_end"]
    assert all(e["cpu_s"] > 0 and 0 < e["s_to_first_publish"] < 25 for e in floods), floods
    assert s["error_lines"] == {"bootstrap": 0, "node0": 0, "node1": 0, "node2": 0} and not any(s["tracebacks"].values()), s
    for name, v in s["survivors"].items():
        check_survivor(name, v, record, tmp_path / "swarm")
    machine = s["machine_by_phase"]  # a phase slower than calm: the soak's own work, or the machine's?
    assert [m["kind"] for m in machine] == ["calm", "churn", "churn+junk", "churn+length"]
    assert all(0 < m["busy_cores"] <= 1.05 * record["cpus"] and m["steal_cores"] >= 0 for m in machine), machine


def check_survivor(name: str, v: dict, record: dict, swarm) -> None:
    """A survivor of the brief soak: every round there, metrics archived, every sample whole, each phase compared."""
    assert v["exit_code"] == 0 and v["rounds_contiguous"] and v["rounds"] > 0, (name, v)
    assert list((swarm / name).glob("metrics.*-*.jsonl.gz")), name
    samples = record["processes"][name]["samples"]
    assert all(x["rss_mb"] > 0 and x["fds"] > 0 and x["threads"] > 0 for x in samples), name
    assert not any("scrape_failed" in x for x in samples), name
    scraped = [x for x in samples if "pool" in x]
    assert scraped and all(x["pool_seen"] is not None and x["seen_messages"] is not None for x in scraped), name
    assert v["slopes_per_hour"]["rss_mb"] is None  # under three 10-minute blocks: no slope, rather than a wrong one
    assert all(0 < p["cpu_cores"] <= 1.05 * record["cpus"] for p in v["pace"]), (name, v["pace"])  # (sampling jitter)
    assert {k: r["cycles"] for k, r in v["vs_calm"].items()} == {"churn": 1, "churn+junk": 1, "churn+length": 1}, v


def test_a_restarted_node_counts_as_training_again_only_once_it_writes_a_round_after_its_start(tmp_path):
    """The soak's next kill waits for this: a start slower than --kill-every (torch's import on a loaded machine)
    would otherwise be killed again before it resumes, again and again."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from bench_churn import Node

    node, started = Node(2, tmp_path, 0, []), 1000.0
    assert not node.trained_since(started)  # no metrics file yet
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"round": r, "time": 900.0 + r}) + "\n" for r in range(1, 90)))
    assert not node.trained_since(started)  # the rounds it ran before the kill
    metrics.write_text(metrics.read_text() + json.dumps({"round": 86, "time": 1012.5}) + "\n")
    assert node.trained_since(started)
    metrics.write_text("")  # just rotated: known again at the next round
    assert not node.trained_since(started)


def test_each_kind_of_phase_is_compared_with_its_own_cycles_calm_phase_pace_and_pace_per_core():
    """`--phases calm length` alternates the flood with calm so that a run's drift cancels in each cycle's ratio."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_soak

    def phase(kind: str, cycle: int, rate: float, cores: float) -> dict:
        return {"kind": kind, "cycle": cycle, "rounds_per_min": rate, "cpu_cores": cores}

    phases = [phase("calm", 0, 100, 0.5), phase("length", 0, 50, 0.5),  # half the pace on the same cores
              phase("calm", 1, 300, 0.5), phase("length", 1, 240, 0.4),  # 0.8 of the pace, all of it per core
              phase("calm", 2, None, 0.5), phase("length", 2, 10, 0.5)]  # a cycle without a calm pace counts nothing
    r = bench_soak.vs_calm(phases)["length"]
    assert r["cycles"] == 2
    assert r["pace"]["mean"] == pytest.approx(0.65) and r["per_core"]["mean"] == pytest.approx(0.75)
    assert r["pace"]["ci95"] == pytest.approx(12.71 * 0.15)  # t(1) x stdev / sqrt(2): two cycles say little
    assert bench_soak.vs_calm(phases[:2])["length"]["pace"] == {"mean": 0.5, "ci95": None}


def test_the_disk_reading_counts_a_file_rotated_away_while_the_folder_is_walked_as_gone(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_soak

    (tmp_path / "metrics.jsonl").write_bytes(b"x" * 2**20)
    listed = [(str(tmp_path), ["checkpoints"], ["metrics.jsonl", "node.log"]),  # node.log: listed, then gone
              (str(tmp_path / "checkpoints" / "round-003250"), [], ["model.safetensors"])]  # a folder rotated away
    monkeypatch.setattr(bench_soak.os, "walk", lambda path: iter(listed))
    assert bench_soak.folder_mb(tmp_path) == 1.0


def test_a_soak_stopped_by_ctrl_c_before_its_duration_keeps_what_it_measured_marked_incomplete(tiny_a, cache_dir, tmp_path):
    out, swarm = tmp_path / "soak.json", tmp_path / "swarm"
    soak = subprocess.Popen([sys.executable, "scripts/bench/bench_soak.py", "--nodes", "3", "--duration", "3600",
                             "--sample", "1", "--cache-dir", str(cache_dir), "--workdir", str(swarm), "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and soak.poll() is None and not (swarm / "node2" / "metrics.jsonl").exists():
            time.sleep(0.5)
        time.sleep(3)  # a few samples of running nodes
        soak.send_signal(signal.SIGINT)  # Ctrl-C
        assert soak.wait(120) == 128 + signal.SIGINT, soak.stderr.read()[-3000:]
        assert "Traceback" not in soak.stderr.read()
    finally:
        if soak.poll() is None:
            soak.kill()
            soak.wait()
    record = json.loads(out.read_text())
    assert not record["complete"] and record["ended"] < record["started"] + 3600
    assert record["processes"]["node0"]["samples"] and record["processes"]["node0"]["exit_code"] == 0



@pytest.mark.parametrize("content,says", [(None, "No such file"), ("{oops", "Expecting property name"),
                                          ('{"a": 1}', "not a soak record"), ("[1]", "not a soak record")])
def test_a_report_of_a_missing_or_broken_file_is_one_line_naming_it(tmp_path, content, says):
    path = tmp_path / "soak.json"
    if content is not None:
        path.write_text(content)
    r = subprocess.run([sys.executable, "scripts/bench/bench_soak.py", "--report", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"bench_soak.py: error: --report {path}: ") and says in line, line
