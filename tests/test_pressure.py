"""A node past its memory plan first gives back what sampling freed, then halves its micro-batch, and says so once, not
every round (node/pressure.py)."""

from __future__ import annotations

import inspect
import logging

import pytest

from node.cli import main
from node.pressure import HIGHER_BY, MemoryWatch
from trainer.memory import GB


def past_the_plan(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "past the plan" in r.getMessage()]


def test_a_node_that_cannot_shrink_says_it_is_past_its_plan_once_then_only_for_a_notably_higher_peak(caplog):
    """Gemma 3 270M's full fine-tuning at micro-batch 1: 40 rounds peaking between 11.0 and 11.3 GB against a plan of
    10.6 GB were 10 warnings, one for each new hundredth of a GB."""
    creeping = [11.0 + 0.3 * k / 39 for k in range(40)]
    peaks = iter([*creeping, 10.2, 11.3 * (1 + HIGHER_BY) + 0.01, 11.9])
    watch = MemoryWatch(planned_bytes=10.6 * GB, read=lambda: next(peaks) * GB, heap=True)
    with caplog.at_level(logging.WARNING, logger="node.pressure"):
        for _ in creeping:
            assert watch.after_round(1)[1] == 1
        gave_back, said = past_the_plan(caplog)
        assert "goes back to the system before each step" in gave_back and watch.giving_back
        assert said.startswith("memory: this round peaked at 11.01 GB, past the plan's 10.60 GB, at micro-batch 1; give "
                               "the node more memory") and said.endswith("(said again only for a peak 5% higher)")
        watch.after_round(1)  # under the plan: nothing to say
        watch.after_round(1)  # 5% above the highest said
        watch.after_round(1)  # above the last, but not by 5% of it
    assert [m.split(",")[0] for m in past_the_plan(caplog)[1:]] == ["memory: this round peaked at 11.01 GB",
                                                                     "memory: this round peaked at 11.88 GB"]


def test_the_first_round_past_the_plan_gives_memory_back_and_only_a_later_one_halves_the_micro_batch(caplog):
    peaks = iter([9.0, 11.0, 11.0, 10.0, 10.9])
    watch = MemoryWatch(planned_bytes=10.6 * GB, read=lambda: next(peaks) * GB, heap=True)
    with caplog.at_level(logging.WARNING, logger="node.pressure"):
        assert watch.after_round(8)[1] == 8 and not watch.giving_back  # under the plan
        assert watch.after_round(8)[1] == 8 and watch.giving_back  # past it: the heap first
        assert watch.after_round(8)[1] == 4  # past it again, giving back: the micro-batch
        assert watch.after_round(4)[1] == 4  # under
        assert watch.after_round(4)[1] == 2  # past, and the halving had lowered the peak
    assert len(past_the_plan(caplog)) == 3


def test_a_peak_that_is_not_a_heaps_halves_the_micro_batch_at_the_first_round_past_the_plan():
    peaks = iter([11.0, 10.0])
    watch = MemoryWatch(planned_bytes=10.6 * GB, read=lambda: next(peaks) * GB)  # a card's reserve
    assert watch.after_round(8)[1] == 4 and not watch.giving_back


@pytest.mark.slow
def test_a_node_gives_back_after_each_evaluation_and_before_each_step_once_past_its_plan(tiny_a, cache_dir, tmp_path,
                                                                                       monkeypatch):
    """The reader's third window is round 2's: 1 PB, past any plan. Round 0 and round 2 evaluate (run.eval_every 2)."""
    import node.loop

    callers, windows = [], iter([0.0, 1.0, 1e15, *[1.0] * 10])
    monkeypatch.setattr(node.loop, "round_peak_reader", lambda kind: lambda: next(windows))
    monkeypatch.setattr(node.loop.allocator, "give_back_freed_memory", lambda: callers.append(inspect.stack()[1].function))
    assert main(["run", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path), "--rounds", "4", "--local", "2",
                 "--generation.completions_per_group", "4", "--tasks.eval_size", "8", "--run.eval_every", "2",
                 "--p2p.enabled", "false", "--status.enabled", "false"]) == 0
    assert callers == ["_evaluate", "_evaluate", "_train", "_train", "_evaluate"]  # rounds 0, 2; 3, 4; 4
