"""Held out by content: a node never trains on a question of its own evaluation set, drawn locally or taken from a
peer, and counts what it passed over; a family too small to hold out is said to be held out by seed only."""

import json
import logging
import random

import pytest

from node.cli import main
from node.loop import Node
from node.selection import SelectionConfig, Selector
from p2p.config import PoolConfig
from p2p.pool import RolloutPool
from p2p.wire import VERSION, WireGroup, WireMessage
from rewards import TaskError, TaskRef, TaskSource, regenerate
from rewards.config import TasksConfig
from rewards.held_out import content_key, held_out

ARITH_99 = TasksConfig(datasets='[{"name": "arith", "config": {"max_operand": 99}}]').mix()  # ~15,000 questions
ARITH_4 = TasksConfig(datasets='[{"name": "arith", "config": {"max_operand": 4, "ops": "+"}}]').mix()  # 25 questions


class Everything:
    def __contains__(self, task) -> bool:
        return True


def test_a_large_familys_evaluation_is_held_out_by_content_and_a_small_ones_by_seed_only(caplog):
    large = held_out(TaskSource(ARITH_99, seed=7).draw(200))
    assert not large.by_seed and len(large.questions) > 150
    assert list(large.record()["families"].values())[0]["held_out_by"] == "content"
    with caplog.at_level(logging.WARNING):
        small = held_out(TaskSource(ARITH_4, seed=7).draw(200))
    assert small.questions == frozenset() and len(small.by_seed) == 1 and list(small.coverage.values()) == [1.0]
    assert "held out by seed only" in caplog.text


def test_a_task_stream_passes_over_held_out_questions_counts_them_and_resumes_where_it_stood():
    evaluation = TaskSource(TasksConfig(datasets="arith").mix(), seed=7).draw(60)  # arith 0..9: ~150 questions
    excluded = held_out(evaluation)
    assert excluded.questions and not excluded.by_seed
    stream = TaskSource(TasksConfig(datasets="arith").mix(), seed=1, exclude=excluded)
    drawn = stream.draw(100)
    assert stream.skipped > 0 and stream.position == 100 + stream.skipped
    assert not {content_key(t.question) for t in drawn} & {content_key(t.question) for t in evaluation}
    resumed = TaskSource(TasksConfig(datasets="arith").mix(), seed=1, position=stream.position, exclude=excluded)
    assert [t.question for t in resumed.draw(10)] == [t.question for t in stream.draw(10)]
    everything = TaskSource(ARITH_4, seed=1, exclude=Everything())
    with pytest.raises(TaskError, match="evaluation questions"):
        everything.draw(1)


def test_a_peers_group_on_an_evaluation_question_is_dropped_and_counted():
    evaluation = [regenerate(TaskRef("arith", {}, seed=3, index=i)) for i in range(4)]
    sel = Selector(SelectionConfig(rule="signal", external_groups=8), TasksConfig(), held_out=set(evaluation))
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    groups = []
    for index in range(12):  # tasks 0..3 are the evaluation's; every group carries signal
        answer = regenerate(TaskRef("arith", {}, seed=3, index=index)).answer
        groups.append(WireGroup(dataset="arith", config={}, seed=3, index=index,
                                completions=[f"<answer>{answer}</answer>", "<answer>x</answer>"] * 2))
    pool.add(WireMessage(v=VERSION, peer="a", model="m", round=1, created=1e9, groups=groups), now=1e9)
    pick = sel.external(pool, random.Random(0), 1)
    questions = {t.question for t in evaluation}
    taken = {g.task.question for g in pick.groups}
    assert taken and not taken & questions
    assert pick.dropped["held_out"] == len({i for i in range(12) if regenerate(TaskRef("arith", {}, 3, i)).question in questions})


@pytest.mark.slow
def test_a_node_never_trains_on_its_evaluation_questions_and_counts_the_draws_it_passed_over(tiny_a, cache_dir, tmp_path,
                                                                                             monkeypatch):
    trained = []
    train = Node._train

    def recorded(self, r, groups):
        trained.extend(g.task for g in groups)
        return train(self, r, groups)

    monkeypatch.setattr(Node, "_train", recorded)
    out = tmp_path / "run"
    assert main(["run", "--model.cache_dir", str(cache_dir), "--out", str(out), "--rounds", "8", "--local", "2",
                 "--external", "2", "--selection.self_external", "true", "--selection.rule", "signal",
                 "--generation.completions_per_group", "4", "--tasks", "arith", "--tasks.eval_size", "60",
                 "--run.eval_every", "8", "--p2p.enabled", "false", "--status.enabled", "false"]) == 0
    evaluation = {content_key(t.question) for t in TaskSource(TasksConfig(datasets="arith").mix(), seed=7).draw(60)}
    assert len(trained) >= 16 and not {content_key(t.question) for t in trained} & evaluation
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["n_held_out_skipped"] for r in rows[1:]) > 0
    record = json.loads((out / "held_out.json").read_text())
    assert record["questions"] == len(evaluation) and [f["held_out_by"] for f in record["families"].values()] == ["content"]
