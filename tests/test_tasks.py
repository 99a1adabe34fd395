import json
import subprocess
import sys

import pytest

from rewards import TaskError, TaskRef, TaskSource, UnknownDataset, regenerate
from rewards.source import DatasetMix

REFS = [
    TaskRef("arith", {"max_operand": 50, "ops": "+-*"}, seed=11, index=3),
    TaskRef("reverse", {"min_len": 4, "max_len": 9}, seed=2, index=40),
    TaskRef("count", {}, seed=0, index=0),
    TaskRef("rg/basic_arithmetic", {"min_terms": 2, "max_terms": 3}, seed=5, index=17),
    TaskRef("rg/leg_counting", {}, seed=1, index=2),
]


def test_a_reference_regenerates_the_same_task_in_another_process():
    here = [[regenerate(r).question, regenerate(r).answer] for r in REFS]
    code = (
        "import json,sys; from rewards import TaskRef, regenerate\n"
        "refs=[TaskRef(d, c, s, i) for d, c, s, i in json.load(sys.stdin)]\n"
        "print(json.dumps([[regenerate(r).question, regenerate(r).answer] for r in refs]))"
    )
    payload = json.dumps([[r.dataset, dict(r.config), r.seed, r.index] for r in REFS])
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert json.loads(out.stdout) == here


def test_references_with_different_fields_give_different_tasks():
    base = TaskRef("arith", {}, seed=1, index=1)
    variants = [TaskRef("arith", {}, 2, 1), TaskRef("arith", {}, 1, 2), TaskRef("arith", {"max_operand": 99}, 1, 1)]
    questions = [regenerate(r).question for r in [base, *variants]]
    assert len(set(questions)) == len(questions)


def test_builtin_answers_are_correct():
    for i in range(200):
        a = regenerate(TaskRef("arith", {"max_operand": 30, "ops": "+-*"}, 0, i))
        assert str(eval(a.question.removesuffix("=?"))) == a.answer
        r = regenerate(TaskRef("reverse", {}, 0, i))
        assert r.question.split()[-1][::-1] == r.answer
        c = regenerate(TaskRef("count", {}, 0, i))
        _, letter, _, word = c.question.split()
        assert str(word.count(letter)) == c.answer


def test_difficulty_knobs_are_respected():
    for i in range(100):
        q = regenerate(TaskRef("arith", {"max_operand": 5, "ops": "+"}, 0, i)).question
        a, b = q.removesuffix("=?").split("+")
        assert 0 <= int(a) <= 5 and 0 <= int(b) <= 5
        word = regenerate(TaskRef("reverse", {"min_len": 7, "max_len": 7, "alphabet": "xy"}, 0, i)).question.split()[-1]
        assert len(word) == 7 and set(word) <= {"x", "y"}


def test_bad_references_raise_clear_errors():
    with pytest.raises(UnknownDataset, match="nope"):
        regenerate(TaskRef("nope", {}, 0, 0))
    with pytest.raises(UnknownDataset, match="no_such_set"):
        regenerate(TaskRef("rg/no_such_set", {}, 0, 0))
    with pytest.raises(TaskError, match="max_operand"):
        regenerate(TaskRef("arith", {"max_operand": -1}, 0, 0))
    with pytest.raises(TaskError, match="bogus"):
        regenerate(TaskRef("reverse", {"bogus": 1}, 0, 0))
    with pytest.raises(TaskError, match="min_len"):
        regenerate(TaskRef("reverse", {"min_len": 5, "max_len": 2}, 0, 0))
    with pytest.raises(TaskError, match="index"):
        regenerate(TaskRef("arith", {}, 0, -1))
    with pytest.raises(TaskError, match="outside"):
        regenerate(TaskRef("rg/leg_counting", {"size": 10}, 0, 10))


def test_task_source_is_deterministic_and_resumable():
    mix = [DatasetMix("arith"), DatasetMix("reverse", weight=3.0)]
    full = TaskSource(mix, seed=4).draw(40)
    first, resumed = TaskSource(mix, seed=4), None
    head = first.draw(15)
    resumed = TaskSource(mix, seed=4, position=first.position).draw(25)
    assert [t.ref for t in head + resumed] == [t.ref for t in full]
    assert [t.ref for t in TaskSource(mix, seed=5).draw(40)] != [t.ref for t in full]


def test_reasoning_gym_streams_of_neighbouring_seeds_share_no_entries():
    # reasoning-gym builds entry i of seed s from s + i: streams seeded s and s + 1 (nodes base + k of one swarm)
    # would otherwise draw the same entries one place apart
    mix = [DatasetMix("rg/leg_counting", {"size": 50})]
    streams = {seed: TaskSource(mix, seed=seed).draw(120) for seed in (3, 4)}
    rebuilt = {seed: {(t.ref.seed + t.ref.index, t.question) for t in tasks} for seed, tasks in streams.items()}
    assert not rebuilt[3] & rebuilt[4]
    naive = [{(s + i, regenerate(TaskRef("rg/leg_counting", {"size": 50}, s, i)).question) for i in range(50)} for s in (3, 4)]
    assert len(naive[0] & naive[1]) == 49  # what the spread avoids
    # past the dataset's size a stream moves to a fresh seed rather than failing on an index out of range
    assert [t.ref.index for t in streams[3][48:52]] == [48, 49, 0, 1]
    assert streams[3][49].ref.seed != streams[3][50].ref.seed


def test_task_source_follows_mix_weights():
    tasks = TaskSource([DatasetMix("arith", weight=1.0), DatasetMix("count", weight=3.0)], seed=0).draw(2000)
    share = sum(t.ref.dataset == "count" for t in tasks) / len(tasks)
    assert 0.70 < share < 0.80


def test_task_source_rejects_a_bad_mix_up_front():
    with pytest.raises(UnknownDataset):
        TaskSource([DatasetMix("arith"), DatasetMix("typo")], seed=0)


def test_configs_that_make_the_same_tasks_compare_equal_defaults_written_out_or_not():
    from node.recipes import RECIPES
    from rewards.config import TasksConfig

    tasks = TasksConfig(datasets=[{"name": "arith"}, *RECIPES["smollm2-135m"]["tasks"]["datasets"][:1]])
    assert tasks.has("arith", {"max_operand": 9, "ops": "+-"}) and tasks.has("arith", {})
    assert not tasks.has("arith", {"max_operand": 10}) and not tasks.has("reverse", {})
    own = RECIPES["smollm2-135m"]["tasks"]["datasets"][0]["config"]
    assert tasks.has("rg/basic_arithmetic", {**own, "whitespace": "single", "size": 100_000})  # both defaults
    assert tasks.has("rg/basic_arithmetic", {**own, "operators": ("+", "-")})  # a tuple is a list on the wire
    assert not tasks.has("rg/basic_arithmetic", {**own, "max_digits": 2})
    assert not tasks.has("arith", {"max_operand": "many"})  # refused by the dataset: compared as given
