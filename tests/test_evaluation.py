"""What a node measures: the held-out set's own mix, the expected accuracy beside the greedy one, and the paper's
batch reward beside the node's own."""

import json

import pytest

from node.cli import main
from node.config import load_config
from node.loop import Node
from rewards import score_completion
from trainer.rollout import mean_reward

pytestmark = pytest.mark.slow


def run_args(cache_dir, out, rounds, *extra):
    return ["run", "--model.cache_dir", str(cache_dir), "--out", str(out), "--rounds", str(rounds), "--local", "2",
            "--generation.completions_per_group", "4", "--tasks.eval_size", "24", "--run.eval_every", str(rounds),
            "--p2p.enabled", "false", "--status.enabled", "false", *extra]


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_evaluation_draws_from_its_own_mix_when_given_one(tiny_a, cache_dir, tmp_path):
    assert main(run_args(cache_dir, tmp_path / "own", 1, "--tasks", "arith", "--tasks.eval_datasets", "reverse,count")) == 0
    assert all(set(r["eval_by_dataset"]) == {"reverse", "count"} for r in rows(tmp_path / "own") if r["eval_accuracy"] is not None)
    assert main(run_args(cache_dir, tmp_path / "training", 1, "--tasks", "arith")) == 0  # default: the training mix
    assert all(set(r["eval_by_dataset"]) == {"arith"} for r in rows(tmp_path / "training") if r["eval_accuracy"] is not None)


def test_the_expected_accuracy_scores_k_completions_a_task_sampled_as_the_rounds_sample(tiny_a, cache_dir, tmp_path):
    cfg = load_config(None, {"model": {"cache_dir": str(cache_dir)}, "status": {"enabled": False}, "p2p": {"enabled": False},
                             "run": {"out_dir": str(tmp_path)}, "generation": {"temperature": 0.9},
                             "tasks": {"eval_size": 12, "eval_samples": 5}})
    node = Node(cfg)
    calls = []
    sample = node.generator.generate

    def recorded(prompts, params, cancel):
        out = sample(prompts, params, cancel)
        calls.append((params, out))
        return out

    node.generator.generate = recorded
    first, again = node.evaluate(), node.evaluate()
    (greedy, greedy_out), (sampled, sampled_out) = calls[:2]
    assert (greedy.n, greedy.temperature) == (1, 0.0)
    assert (sampled.n, sampled.temperature, sampled.top_p, sampled.seed) == (5, 0.9, cfg.generation.top_p, cfg.tasks.eval_seed)
    flags = [score_completion(task, c.text).correct for task, group in zip(node.eval_tasks, sampled_out) for c in group]
    assert len(flags) == 60 and first.expected == pytest.approx(sum(flags) / len(flags))
    assert first.accuracy == pytest.approx(sum(score_completion(t, g[0].text).correct
                                               for t, g in zip(node.eval_tasks, greedy_out)) / 12)
    assert again == first  # seeded alike each time: two evaluations of one model agree
    assert set(first.expected_by_dataset) == set(first.by_dataset)


def test_greedy_only_by_default_and_both_in_the_metrics_when_asked(tiny_a, cache_dir, tmp_path):
    assert main(run_args(cache_dir, tmp_path / "greedy", 1)) == 0
    assert all(r["eval_expected"] is None for r in rows(tmp_path / "greedy"))
    assert main(run_args(cache_dir, tmp_path / "both", 1, "--tasks.eval_samples", "3", "--generation.temperature", "0")) == 0
    evaluated = [r for r in rows(tmp_path / "both") if r["eval_accuracy"] is not None]
    assert len(evaluated) == 2  # at the start and at the end
    for r in evaluated:  # at temperature 0 each of the k samples is the greedy answer
        assert r["eval_expected"] == pytest.approx(r["eval_accuracy"])
        assert r["eval_expected_by_dataset"] == pytest.approx(r["eval_by_dataset"])


def test_the_papers_batch_reward_counts_the_groups_the_step_was_given(tiny_a, cache_dir, tmp_path, monkeypatch):
    """The paper's reward is the mean over the step's batch, local groups and the external ones it kept; the node's
    own reward counts only the completions it sampled. `self_external` sends 2 extra groups of its own through the
    external path each round (no network), so the batch holds external groups from the second round on."""
    batches = []
    train = Node._train

    def recorded(self, r, groups):
        batches.append(list(groups))
        return train(self, r, groups)

    monkeypatch.setattr(Node, "_train", recorded)
    assert main(run_args(cache_dir, tmp_path, 6, "--external", "2", "--selection.self_external", "true")) == 0
    trained = rows(tmp_path)[1:]
    assert len(trained) == len(batches) == 6
    for row, batch in zip(trained, batches):
        assert row["batch_reward_mean"] == pytest.approx(mean_reward(batch))
        assert len(batch) == 4 and sum(g.source != "local" for g in batch) == row["n_external"]  # empty slots go local
    assert any(r["n_external"] for r in trained)
    assert any(r["batch_reward_mean"] != pytest.approx(r["reward_mean"]) for r in trained if r["n_external"])


def test_a_run_from_the_same_model_reuses_its_starting_evaluation_and_trains_the_same(tiny_a, cache_dir, tmp_path, monkeypatch):
    """An experiment's arms share a base model: with run.eval_cache_dir the second run skips round 0's evaluation
    and its metrics are the first run's; a different evaluation set is measured anew."""
    cache = tmp_path / "evals"
    pinned = ("--tasks.eval_samples", "2", "--run.torch_threads", "1")  # the thread governor follows the machine's load
    common = (*pinned, "--run.eval_cache_dir", str(cache))
    assert main(run_args(cache_dir, tmp_path / "first", 2, *common)) == 0
    assert len(list(cache.glob("*.json"))) == 1
    measured = []
    monkeypatch.setattr(Node, "evaluate", lambda self, cancel, original=Node.evaluate: measured.append(self.round)
                        or original(self, cancel))
    assert main(run_args(cache_dir, tmp_path / "second", 2, *common)) == 0
    assert measured == [2]  # the last round's model is new: it is measured
    assert main(run_args(cache_dir, tmp_path / "uncached", 2, *pinned)) == 0  # measures 0 and 2

    def trajectory(out):  # what the model did, to float noise; not the clock or the memory it took
        return [{k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in r.items()
                 if k not in ("time", "memory_peak_gb") and not k.startswith("seconds")} for r in rows(out)]
    assert trajectory(tmp_path / "second") == trajectory(tmp_path / "first") == trajectory(tmp_path / "uncached")
    assert main(run_args(cache_dir, tmp_path / "other-set", 1, *common, "--tasks.eval_seed", "8")) == 0
    assert measured == [2, 0, 2, 0, 1] and len(list(cache.glob("*.json"))) == 2


def test_a_damaged_or_unwritable_evaluation_cache_costs_time_not_the_run(tmp_path, caplog):
    from node.eval_cache import EvalCache
    from node.metrics import Evaluation
    cache = EvalCache(tmp_path / "evals")
    assert cache.get("k") is None
    cache.put("k", Evaluation(0.5, {"arith": 0.5}, 0.25, {"arith": 0.25}))
    assert cache.get("k") == Evaluation(0.5, {"arith": 0.5}, 0.25, {"arith": 0.25})
    (tmp_path / "evals" / "k.json").write_text('{"accuracy": 0.5, "by_')
    assert cache.get("k") is None and "unreadable" in caplog.text
    (tmp_path / "file").write_text("")
    EvalCache(tmp_path / "file").put("k", Evaluation(0.5))  # a file where the folder should be: warned, not raised
    assert "cannot write" in caplog.text
