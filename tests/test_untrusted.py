"""Peers' tasks cannot stall or sink the node: the sandbox's deadline and memory cap, config bounds,
remembered failures, and the round's re-scoring budget."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

from node.recipes import RECIPES
from node.selection import SelectionConfig, Selector
from p2p.config import PoolConfig
from p2p.pool import RolloutPool
from lab.probe import ProbeProcess
from p2p.wire import VERSION, WireGroup, WireMessage
from rewards import TaskError, TaskRef, regenerate
from rewards.config import TasksConfig
from rewards.sandbox import Sandbox, SandboxError
from rewards.untrusted import UntrustedTasks, check_bounds
from tests.conftest import ROOT, node_beside
from trainer import checkpoint

# The 315-byte group: reasoning-gym looks for an exact 24-digit division and never finds one.
RUNAWAY = {"min_terms": 2, "max_terms": 2, "min_digits": 24, "max_digits": 24, "operators": ["/"]}
# Within the bounds, yet seconds per task (3 s on the 2-core CI machine): only the deadline stops it.
SLOW = {**RUNAWAY, "min_digits": 16, "max_digits": 16}


@pytest.fixture
def sandbox():
    box = Sandbox("tests.sandbox_target:behave", memory_mb=512)
    assert box.ready(wait=60)
    yield box
    box.close()


def test_a_call_past_its_deadline_is_killed_and_the_next_call_gets_a_fresh_worker(sandbox):
    with pytest.raises(SandboxError) as e:
        sandbox.call(("hang",), timeout=0.5)
    assert e.value.reason == "regen_timeout" and sandbox.restarts == 1
    assert sandbox.ready(wait=60) and sandbox.call(("echo", 7), timeout=30) == 7


def test_a_call_past_the_memory_cap_fails_alone_and_the_worker_goes_on(sandbox):
    with pytest.raises(SandboxError) as e:
        sandbox.call(("hog", 2048), timeout=30)
    assert e.value.reason == "regen_memory"
    assert sandbox.call(("hog", 64), timeout=30) == 64 * 2**20 and sandbox.restarts == 0


def test_a_worker_that_dies_is_a_crash_and_is_replaced(sandbox):
    with pytest.raises(SandboxError) as e:
        sandbox.call(("exit",), timeout=30)
    assert e.value.reason == "regen_crashed"
    assert sandbox.ready(wait=60) and sandbox.call(("echo", 1), timeout=30) == 1


def test_untrusted_reasoning_gym_configs_are_bounded_by_the_datasets_defaults_before_any_work():
    with pytest.raises(TaskError) as e:
        check_bounds("rg/basic_arithmetic", RUNAWAY)
    assert e.value.reason == "config_bounds" and "min_digits = 24 exceeds 16" in str(e.value)
    for bad in ({"size": 10**7}, {"min_size": 10**6}, {"max_grid_size": 4000}, {"min_dist": float("nan")}):
        with pytest.raises(TaskError):
            check_bounds("rg/arc_1d" if "size" in next(iter(bad)) else "rg/maze", bad)
    check_bounds("rg/basic_arithmetic", SLOW)
    for spec in RECIPES["smollm2-135m"]["tasks"]["datasets"]:  # what honest nodes send passes
        check_bounds(spec["name"], spec["config"])


@pytest.fixture
def untrusted():
    tasks = UntrustedTasks(timeout_s=0.3, memory_mb=1024, warm=("reasoning_gym",))
    assert tasks.ready(wait=60)
    yield tasks
    tasks.close()


def test_a_runaway_task_times_out_and_its_config_is_then_refused_without_work(untrusted):
    with pytest.raises(SandboxError) as e:
        untrusted.score(TaskRef("rg/basic_arithmetic", SLOW, 1, 1), ["<answer>1</answer>"], 0.0, trusted=False)
    assert e.value.reason == "regen_timeout" and untrusted.sandbox.restarts == 1
    started = time.monotonic()
    with pytest.raises(SandboxError) as e:
        untrusted.score(TaskRef("rg/basic_arithmetic", SLOW, 2, 5), ["<answer>1</answer>"], 0.0, trusted=False)
    assert e.value.reason == "regen_timeout" and untrusted.sandbox.restarts == 1
    assert time.monotonic() - started < 0.3  # refused at once: no second deadline spent
    with pytest.raises(SandboxError) as e:
        untrusted.score(TaskRef("rg/basic_arithmetic", RUNAWAY, 1, 1), ["x"], 0.0, trusted=False)
    assert e.value.reason == "config_bounds"


def test_a_deadline_missed_on_the_nodes_own_config_drops_only_that_group(untrusted):
    """A busy machine can miss the deadline on a task of the node's own family: that group is dropped,
    the config is not refused, so peers' later groups of it are still scored (a peer's config is)."""
    right = f"<answer>{regenerate(TaskRef('reverse', {}, 1, 2)).answer}</answer>"
    assert untrusted.ready(wait=60)
    # the deadline has passed before the answer is read (CI answered a 1e-4 s deadline in time: reverse is fast)
    untrusted.timeout_s = 0.0
    for trusted in (True, False):
        with pytest.raises(SandboxError) as e:
            untrusted.score(TaskRef("reverse", {}, 1, 1), [right], 0.0, trusted=trusted)
        assert e.value.reason == "regen_timeout"
        assert untrusted.ready(wait=60)
    untrusted.timeout_s = 60.0  # a deadline no busy machine misses
    _, scores = untrusted.score(TaskRef("reverse", {}, 1, 2), [right, "x"], 0.0, trusted=True)
    assert [s.reward for s in scores] == [1.0, 0.0]
    with pytest.raises(SandboxError, match="failed before"):
        untrusted.score(TaskRef("reverse", {}, 1, 2), [right], 0.0, trusted=False)


def test_a_drop_reason_is_always_one_of_the_counted_labels(untrusted, monkeypatch):
    """An exception's own `reason` attribute (UnicodeDecodeError has one) must not become a metrics label."""
    from rewards.untrusted import DROP_REASONS

    def fails(*args, **kwargs):
        raise SandboxError("invalid start byte", "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff")

    monkeypatch.setattr(untrusted.sandbox, "call", fails)
    with pytest.raises(SandboxError) as e:
        untrusted.score(TaskRef("arith", {}, 1, 1), ["<answer>1</answer>"], 0.0, trusted=False)
    assert e.value.reason == "regen_failed" and e.value.reason in DROP_REASONS


def test_a_trusted_config_skips_the_bounds_and_scores_like_the_node_itself(untrusted):
    ref = TaskRef("rg/products", {"min_digits": 1, "max_digits": 1, "size": 10**7}, 3, 9)
    want = regenerate(ref)
    assert untrusted.ready(wait=60)
    untrusted.timeout_s = 60.0  # about bounds, not deadlines: no busy machine misses this one
    task, scores = untrusted.score(ref, [f"<answer>{want.answer}</answer>", "<answer>-1</answer>"], 0.0, trusted=True)
    assert (task.question, task.answer) == (want.question, want.answer)
    assert [s.reward for s in scores] == [1.0, 0.0]
    with pytest.raises(SandboxError) as e:
        untrusted.score(ref, ["x"], 0.0, trusted=False)
    assert e.value.reason == "config_bounds"


def test_a_round_takes_honest_groups_past_runaway_ones_within_its_budget():
    honest = [WireGroup(dataset="arith", config={}, seed=1, index=i, completions=[f"<answer>{i}</answer>", "x"])
              for i in range(4)]
    runaway = [WireGroup(dataset="rg/basic_arithmetic", config=SLOW if i % 2 else {**SLOW, "format_style": "natural"},
                         seed=1, index=1 + i // 2, completions=["<answer>1</answer>", "x"]) for i in range(6)]
    pool = RolloutPool(PoolConfig(max_peer_share=1.0))
    for peer, groups in (("hostile", runaway), ("honest", honest)):
        pool.add(WireMessage(v=VERSION, peer=peer, model="m", round=1, created=time.time(), groups=groups))
    selector = Selector(SelectionConfig(external_groups=4, rule="uniform", accept="any", budget_s=3.0,
                                        regen_timeout_s=0.5), TasksConfig())
    try:
        assert selector.untrusted.ready(wait=60)
        rounds, started = [], time.monotonic()
        while len(pool) and len(rounds) < 10:
            t0 = time.monotonic()
            pick = selector.external(pool, random.Random(0), len(rounds) + 1)
            rounds.append((time.monotonic() - t0, pick))
    finally:
        selector.close()
    assert all(seconds < 3.0 + 1.0 for seconds, _ in rounds)  # the budget, plus one restart's slack
    assert sum(len(p.groups) for _, p in rounds) == 4
    assert {g.source for _, p in rounds for g in p.groups} == {"honest"}
    assert sum(p.dropped["regen_timeout"] for _, p in rounds) == 6  # two configs: two deadlines, four refusals
    assert selector.untrusted.sandbox.restarts == 2 and time.monotonic() - started < 60


def test_a_probe_that_cannot_build_its_groups_stops_with_one_line_not_silently(tmp_path):
    # Seed 1's first SLOW task fails inside reasoning-gym; the probe used to keep running and publish nothing.
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.lab.probe", "--key", str(tmp_path / "k"), "--rate", "2",
                           "--events", str(tmp_path / "events"),
                           "--task", json.dumps({"dataset": "rg/basic_arithmetic", "config": SLOW, "seed": 1})],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == "probe: publish failed: IndexError('Cannot choose from an empty sequence')"
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_node_flooded_with_runaway_tasks_keeps_training_and_checkpoints_on_stop(tiny_a, cache_dir, tmp_path):
    # --wrong: the probe itself could not build these tasks' answers in time (some indices fail outright)
    hostile = ProbeProcess(tmp_path, "hostile", "--rate", "2", "--groups", "2", "--completions", "4", "--chars", "30",
                           "--wrong", "--task", json.dumps({"dataset": "rg/basic_arithmetic", "config": SLOW, "seed": 1}))
    out = tmp_path / "node"
    code, err, rows = node_beside(
        hostile, out, ["--model.cache_dir", str(cache_dir), "--rounds", "100000", "--selection.accept", "any",
                       "--selection.regen_timeout_s", "0.3", "--selection.budget_s", "1", "--tasks.eval_size", "10",
                       "--run.eval_every", "1000", "--run.checkpoint_every", "1000", "--status.listen", "127.0.0.1:0"],
        lambda rows: any((r.get("external_dropped") or {}).get("regen_timeout") for r in rows) and len(rows) > 12,
        240, "a timed-out task and 12 rounds")
    assert code == 0, err[-3000:]
    assert "Traceback" not in err
    last = rows[-1]
    assert checkpoint.load_latest(out / "checkpoints").round == last["round"]
    assert max(r["seconds_other"] for r in rows[1:]) < 1 + 1  # the budget, plus one restart's slack
    assert sum(r["external_dropped"].get("regen_timeout", 0) for r in rows[1:]) >= 1
