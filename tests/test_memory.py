"""Nodes that share a machine share its memory: the budget a node plans in (its share, or what is free less
a margin), shares handed out by a launcher and refused as a whole when they cannot fit, and a node that
halves its micro-batch after a round past its plan."""

from __future__ import annotations

import json
import logging

import pytest

from node.cli import main
from node.flags import config_from_flags
from node.pressure import MemoryWatch
from trainer import memory
from trainer.memory import GB, MemoryPlanError
from trainer.plan import Device, probe


def test_a_node_with_no_share_plans_in_what_is_available_less_a_margin_and_a_container_limit_is_a_share(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemTotal": 16 * GB, "MemAvailable": 12 * GB})
    monkeypatch.setattr(memory, "cgroup_limit", lambda: float("inf"))
    assert memory.host_budget() == pytest.approx(12 * GB - 0.15 * 16 * GB)
    assert memory.total_bytes() == 16 * GB
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemTotal": 4 * GB, "MemAvailable": 3 * GB})
    assert memory.host_budget() == pytest.approx(2 * GB)  # the margin is at least 1 GB
    monkeypatch.setattr(memory, "cgroup_limit", lambda: 1.5 * GB)
    assert memory.host_budget() == 1.5 * GB and memory.total_bytes() == 1.5 * GB


def test_a_cgroup_limit_is_read_from_v2_and_v1_and_no_limit_is_none(tmp_path, monkeypatch):
    import pathlib

    real = pathlib.Path
    files = {"/sys/fs/cgroup/memory.max": None, "/sys/fs/cgroup/memory/memory.limit_in_bytes": None}

    def fake_path(p, *rest):
        return real(tmp_path / p.strip("/").replace("/", "_")) if p in files else real(p, *rest)

    monkeypatch.setattr(memory, "Path", fake_path)
    assert memory.cgroup_limit() == float("inf")  # neither file
    (tmp_path / "sys_fs_cgroup_memory_memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory.cgroup_limit() == float("inf")  # cgroup v1's "no limit"
    (tmp_path / "sys_fs_cgroup_memory_memory.limit_in_bytes").write_text("6442450944\n")
    assert memory.cgroup_limit() == 6442450944
    (tmp_path / "sys_fs_cgroup_memory.max").write_text("max\n")
    assert memory.cgroup_limit() == float("inf")  # v2 first
    (tmp_path / "sys_fs_cgroup_memory.max").write_text("4294967296\n")
    assert memory.cgroup_limit() == 4294967296


def test_the_peak_resident_size_is_measured_per_window():
    if memory.peak_rss_bytes() is None:  # ends the window of whatever ran before in this process
        pytest.skip("no /proc/self/status on this system")
    first = memory.peak_rss_bytes()
    block = bytearray(300_000_000)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    grown = memory.peak_rss_bytes()
    del block
    memory.peak_rss_bytes()  # this window still saw the block
    after = memory.peak_rss_bytes()
    assert grown >= first + 250e6 and after < grown - 250e6  # each read started a new window


def test_a_share_is_the_budget_and_a_share_larger_than_the_machine_is_refused():
    device = probe("cpu", 2.5)
    assert device.kind == "cpu" and device.free_bytes == 2.5 * GB and device.total_bytes == memory.total_bytes()
    assert probe("cpu").free_bytes == pytest.approx(memory.host_budget(), rel=0.05)
    with pytest.raises(MemoryPlanError, match=r"run.memory_gb 100000 is more than the [\d.]+ GB this machine has"):
        probe("cpu", 100_000)


def test_a_round_past_the_plan_halves_the_micro_batch_down_to_one(caplog):
    # a peak that is not a heap's (a card's reserve, node/pressure.py): each halving lowers the next round's peak,
    # until micro-batch 1
    peaks = iter([9 * GB, 0.9 * GB, 1.6 * GB, 1.4 * GB, 1.2 * GB, 1.2 * GB, 1.3 * GB, None])
    watch = MemoryWatch(planned_bytes=1 * GB, read=lambda: next(peaks))
    watch.start()  # the window up to here held the model's loading (9 GB): not a round's
    with caplog.at_level(logging.WARNING):
        assert watch.after_round(4) == (0.9 * GB, 4)
        assert not caplog.records
        assert watch.after_round(4) == (1.6 * GB, 2)
        assert "peaked at 1.60 GB, past the plan's 1.00 GB; the next rounds train in micro-batches of 2 (was 4)" in caplog.text
        assert watch.after_round(2) == (1.4 * GB, 1)
        assert watch.after_round(1) == (1.2 * GB, 1)
        assert "1.20 GB, past the plan's 1.00 GB, at micro-batch 1; give the node more memory (run.memory_gb)" in caplog.text
        caplog.clear()
        assert watch.after_round(1) == (1.2 * GB, 1)
        assert not caplog.records  # the same peak again is not warned about every round
        assert watch.after_round(1) == (1.3 * GB, 1)
        assert "peaked at 1.30 GB" in caplog.text  # a higher one is
        assert watch.after_round(1) == (None, 1)  # nothing to read (not Linux): nothing changes


def test_a_halving_that_did_not_lower_the_peak_is_the_last_and_a_round_under_the_plan_between_resets_it(caplog):
    # Gemma 3 270M before its head's gradient was planned: 7.81 GB at micro-batch 8, 7.71 at 4 (the excess was
    # not the micro-batch's); halving on to 1 cost speed and changed nothing
    peaks = iter([1.6, 1.6, 1.55, 0.9, 1.5, 1.2])
    watch = MemoryWatch(planned_bytes=1 * GB, read=lambda: next(peaks) * GB)
    with caplog.at_level(logging.WARNING):
        assert watch.after_round(8) == (1.6 * GB, 4)
        assert watch.after_round(4) == (1.6 * GB, 4)
        assert ("peaked at 1.60 GB, past the plan's 1.00 GB, no lower than the 1.60 GB before the micro-batch was halved "
                "to 4: what exceeds the plan does not shrink with the micro-batch, so it stays at 4") in caplog.text
        assert watch.after_round(4) == (1.55 * GB, 4)
    watch = MemoryWatch(planned_bytes=1 * GB, read=lambda: next(peaks) * GB)
    assert watch.after_round(8) == (0.9 * GB, 8)
    assert watch.after_round(8) == (1.5 * GB, 4)
    assert watch.after_round(4) == (1.2 * GB, 2)  # a fifth lower: the halving helped, so the next one goes ahead


def reports(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if "rounds peaked at" in r.getMessage()]


def test_after_a_few_rounds_the_node_says_once_how_its_peak_compares_with_the_plan_for_rounds_like_them(caplog):
    from node.pressure import REPORT_AFTER

    asked = []

    def expect(rows: int, positions: int, longest: int) -> float:
        asked.append((rows, positions, longest))
        return 0.64 * GB

    peaks = iter([0.5 * GB, 0.7 * GB] + [0.6 * GB] * (REPORT_AFTER + 3))
    watch = MemoryWatch(planned_bytes=2 * GB, read=lambda: next(peaks), expect=expect)
    watch.start()
    with caplog.at_level(logging.INFO, logger="node.pressure"):
        for longest, part in [(10, (300, 8)), (40, (200, 8)), (20, (310, 6))] + [(30, (100, 8))] * (REPORT_AFTER - 1):
            watch.after_round(8, longest, part)
    # once, for the micro-batch that ran the most positions and the longest completion of those rounds
    assert asked == [(6, 310, 40)]
    assert reports(caplog) == [("INFO", f"memory: the first {REPORT_AFTER} rounds peaked at 0.70 GB, +9% against the "
                                "plan's 0.64 GB for rounds like them (largest micro-batch 6 rows in 310 positions, "
                                "completions up to 40 tokens); it reserves 2.00 GB for the worst round")]


@pytest.mark.parametrize("measured, level", [(1.3, "WARNING"), (1.15, "INFO"), (0.5, "INFO")])
def test_a_peak_more_than_a_fifth_above_the_plan_for_such_rounds_is_a_warning_and_one_below_is_by_design(caplog, measured,
                                                                                                        level):
    from node.pressure import REPORT_AFTER

    watch = MemoryWatch(planned_bytes=2 * GB, read=lambda: measured * GB, expect=lambda rows, positions, longest: 1.0 * GB)
    with caplog.at_level(logging.INFO, logger="node.pressure"):
        for _ in range(REPORT_AFTER):
            watch.after_round(4, 32, (200, 4))
    [(logged, said)] = reports(caplog)
    assert logged == level and f"{100 * (measured - 1):+.0f}% against the plan's 1.00 GB" in said
    assert ("errs low by more than 20% on this machine" in said) == (level == "WARNING")


def test_without_the_rounds_shape_the_peak_is_set_beside_the_worst_round_and_never_warned_about(caplog):
    from node.pressure import REPORT_AFTER

    watch = MemoryWatch(planned_bytes=2 * GB, read=lambda: 0.7 * GB)
    with caplog.at_level(logging.INFO, logger="node.pressure"):
        for _ in range(REPORT_AFTER):
            watch.after_round(4)
    assert reports(caplog) == [("INFO", f"memory: the first {REPORT_AFTER} rounds peaked at 0.70 GB, 35% of the plan's "
                                "2.00 GB for the worst round")]


def test_the_watch_reads_the_resident_peak_on_a_host_and_apple_and_the_reserved_peak_on_a_card():
    from node import pressure

    assert pressure.round_peak_reader("cpu") is pressure.round_peak_reader("mps") is memory.peak_rss_bytes
    assert pressure.round_peak_reader("cuda") is not memory.peak_rss_bytes


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA-only: reads torch.cuda.max_memory_reserved")
def test_the_cuda_reader_measures_each_round_on_its_own():
    import torch

    from node.pressure import round_peak_reader

    read = round_peak_reader("cuda")
    read()
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    assert read() >= 256 * 2**20
    del block
    torch.cuda.empty_cache()
    read()  # this window began with the block reserved
    assert read() < 256 * 2**20


@pytest.mark.slow
@pytest.mark.parametrize("peaks, micro_batches", [
    ([40, 30, 20, 10], [8, 8, 4, 2]),  # the heap given back first, then each halving lowers the peak
    ([40, 40, 40, 40], [8, 8, 4, 4]),  # the first halving changed nothing: no more
])
def test_a_node_past_its_plan_lowers_its_micro_batch_round_by_round_and_records_it(
        tiny_a, cache_dir, tmp_path, monkeypatch, capsys, peaks, micro_batches):
    from node import pressure

    read = iter([peaks[0], *peaks])  # the first read opens the first round's window
    monkeypatch.setattr(pressure, "peak_rss_bytes", lambda: next(read) * GB)  # every round far past any plan
    assert main(["run", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path), "--rounds", "4", "--local", "2",
                 "--generation.completions_per_group", "4", "--tasks.eval_size", "10", "--p2p.enabled", "false",
                 "--status.enabled", "false"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    planned = json.loads((tmp_path / "config.json").read_text())["grpo"]["micro_batch"]
    assert planned == 8
    assert [r["micro_batch"] for r in rows] == micro_batches and [r["memory_peak_gb"] for r in rows] == peaks
    assert "past the plan's" in capsys.readouterr().err


def tiny(k: int, *flags: str):
    """Node k of a set on one machine (seeds from 100: none draws the held-out set's seed)."""
    return config_from_flags(["--model", "tiny-a", "--seed", str(100 + k), "--tasks.eval_size", "10", *flags])


def test_nodes_on_one_machine_get_equal_shares_whose_plans_add_up_to_less_than_it(tiny_a, monkeypatch):
    from node import planner

    machine = Device("cpu", "a described CPU", 4 * GB, 8 * GB)
    monkeypatch.setattr(planner, "probe", lambda kind="auto", memory_gb=None: machine)
    shared = planner.fit_together({f"node{k}": tiny(k) for k in range(3)})
    assert shared.share_gb == 1.33 and list(shared.plans) == ["node0", "node1", "node2"]
    assert all(p.peak_bytes <= p.budget_bytes == 1.33 * GB for p in shared.plans.values())
    assert sum(p.peak_bytes for p in shared.plans.values()) <= machine.free_bytes
    assert shared.lines()[-1].startswith("memory: 3 nodes plan ") and \
        "each may use 1.33 GB of the 4.0 GB this machine can give now (8.0 GB in all)" in shared.lines()[-1]
    own = planner.fit_together({"node0": tiny(0, "--run.memory_gb", "1.5"), "node1": tiny(1), "node2": tiny(2)})
    assert own.share_gb == 1.25 and own.plans["node0"].budget_bytes == 1.5 * GB  # a node's own share stands


def test_nodes_that_cannot_share_the_machine_are_refused_as_a_whole_naming_what_would_fit(tiny_a, monkeypatch):
    from node import planner

    machine = Device("cpu", "a described CPU", 4 * GB, 8 * GB)
    monkeypatch.setattr(planner, "probe", lambda kind="auto", memory_gb=None: machine)
    with pytest.raises(MemoryPlanError) as refused:
        planner.fit_together({f"node{k}": tiny(k) for k in range(8)})
    message = str(refused.value)
    assert message.startswith("8 nodes cannot share 4.0 GB: node0 in its 0.50 GB: ")
    assert "usable on cpu" in message and message.endswith("; at most 3 such nodes would fit")
    with pytest.raises(MemoryPlanError, match="^2 nodes cannot share the 4.0 GB this machine can give now: their "
                                              "run.memory_gb adds up to 6.0 GB$"):
        planner.fit_together({f"node{k}": tiny(k, "--run.memory_gb", "3") for k in range(2)})
