"""Supervision: a failing component is retried with backoff; one that keeps failing stops the node
with a clear message and a checkpoint it resumes from."""

import json
import logging
import signal
import subprocess
import sys

import pytest

from node.cli import main
from node.lifecycle import StopSignal
from node.supervise import ComponentFailed, retrying
from trainer import checkpoint
from trainer.generation.hf import TransformersGenerator
from tests.conftest import ROOT


def flaky(failures: int, exc=RuntimeError("CUDA error: an illegal memory access")):
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] <= failures:
            raise exc
        return "ok"
    return fn, calls


def test_retrying_recovers_after_transient_failures_and_logs_each_cause(caplog):
    fn, calls = flaky(2)
    with caplog.at_level(logging.WARNING):
        assert retrying("generation", fn, retries=3, backoff_s=0.01, stop=StopSignal()) == "ok"
    assert calls["n"] == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"generation failed (RuntimeError: CUDA error: an illegal memory access); retry {k} of 3 in 0 s"
                        for k in (1, 2)]


def test_retrying_gives_up_with_the_last_cause():
    fn, calls = flaky(10, ValueError("bad\nsecond line"))
    with pytest.raises(ComponentFailed, match=r"generation failed 3 time\(s\); last error: ValueError: bad$") as e:
        retrying("generation", fn, retries=2, backoff_s=0.0, stop=StopSignal())
    assert calls["n"] == 3 and e.value.resumable


def test_a_stop_during_the_backoff_returns_at_once():
    stop = StopSignal()
    stop.request("test")
    fn, calls = flaky(10)
    assert retrying("generation", fn, retries=5, backoff_s=30.0, stop=stop) is None
    assert calls["n"] == 1


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_harness_stopped_by_ctrl_c_or_sigterm_runs_its_cleanup_and_exits_without_a_traceback(sig, code):
    harness = ("import os, signal, time\n"
               "from node.lifecycle import exit_on_stop_signals\n"
               "exit_on_stop_signals()\n"
               "try:\n"
               "    print('running', flush=True)\n"
               "    time.sleep(60)\n"
               "finally:\n"
               "    os.kill(os.getpid(), signal.SIGINT)  # a second signal during the cleanup is ignored\n"
               "    print('cleaned up', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", harness], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "running\n"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (code, "cleaned up\n", "")


def rounds_in(out):
    return [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def node_args(cache_dir, out, rounds):
    return ["run", "--model.cache_dir", str(cache_dir), "--out", str(out), "--rounds", str(rounds), "--local", "2",
            "--generation.completions_per_group", "4", "--tasks.eval_size", "20", "--run.eval_every", "100",
            "--p2p.enabled", "false", "--status.enabled", "false", "--run.retries", "2", "--run.retry_backoff_s", "0.01"]


@pytest.mark.slow
def test_a_generator_that_keeps_failing_stops_the_node_with_a_checkpoint_it_resumes_from(
        tiny_a, cache_dir, tmp_path, monkeypatch, capsys):
    real = TransformersGenerator.generate
    state = {"calls": 0, "broken_from": 5}  # call 1 is round 0's evaluation; calls 2-4 are rounds 1-3

    def generate(self, prompt_ids, params, cancel):
        state["calls"] += 1
        if state["calls"] >= state["broken_from"]:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return real(self, prompt_ids, params, cancel)

    monkeypatch.setattr(TransformersGenerator, "generate", generate)
    assert main(node_args(cache_dir, tmp_path, 10)) == 1
    err = capsys.readouterr().err
    assert ("sapo: stopped: generation failed 3 time(s); last error: RuntimeError: CUDA error: device-side assert "
            "triggered (checkpoint of round 3 written; fix the cause and run the same command to resume)") in err
    assert "Traceback" not in err
    assert [c.name for c in checkpoint.complete(tmp_path / "checkpoints")] == ["round-000003"]
    assert rounds_in(tmp_path) == [0, 1, 2, 3]

    state["broken_from"] = 10**9  # the cause is fixed: the same command resumes at round 4
    assert main(node_args(cache_dir, tmp_path, 5)) == 0
    assert rounds_in(tmp_path) == [0, 1, 2, 3, 4, 5]


@pytest.mark.slow
def test_a_failing_training_step_stops_without_saving_that_step(tiny_a, cache_dir, tmp_path, monkeypatch, capsys):
    from trainer.grpo import GRPOTrainer

    def step(self, groups):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(GRPOTrainer, "step", step)
    assert main(node_args(cache_dir, tmp_path, 3)) == 1
    err = capsys.readouterr().err
    assert "sapo: stopped: training step of round 1 failed: RuntimeError: CUDA out of memory (the last checkpoint is kept" in err
    assert checkpoint.complete(tmp_path / "checkpoints") == []


@pytest.mark.slow
def test_a_step_that_leaves_non_finite_weights_stops_before_they_reach_a_checkpoint(tiny_a, cache_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    """A diverged step (a NaN gradient) used to be checkpointed, and every resume then failed on the weights."""
    import torch

    from trainer.grpo import GRPOTrainer

    real_step, steps = GRPOTrainer.step, []

    def step(self, groups):  # the second round's step diverges
        stats = real_step(self, groups)
        steps.append(stats.optimizer_steps)
        if stats.optimizer_steps and len(steps) >= 2:
            with torch.no_grad():
                next(p for p in self.policy.model.parameters() if p.requires_grad).view(-1)[0] = float("nan")
        return stats

    monkeypatch.setattr(GRPOTrainer, "step", step)
    assert main(node_args(cache_dir, tmp_path, 4) + ["--run.checkpoint_every", "1"]) == 1
    err = capsys.readouterr().err
    assert "sapo: stopped: the training step of round " in err and "left non-finite weights (grpo.lr " in err
    from safetensors.torch import load_file

    kept = checkpoint.load_latest(tmp_path / "checkpoints")
    assert kept is not None and kept.round == 1
    assert all(torch.isfinite(t).all() for t in load_file(kept.model_dir / "model.safetensors").values())


@pytest.mark.slow
def test_a_p2p_layer_that_dies_is_restarted_with_the_same_identity(tiny_a, cache_dir, tmp_path, caplog):
    import threading
    import time

    from node.config import load_config
    from node.loop import Node

    cfg = load_config(None, {"model": {"cache_dir": str(cache_dir)}, "status": {"enabled": False},
                             "run": {"out_dir": str(tmp_path), "rounds": 10_000, "eval_every": 10_000,
                                     "local_groups": 1}, "generation": {"completions_per_group": 2}})
    node, stop = Node(cfg), StopSignal()
    runner = threading.Thread(target=node.run, args=(stop,))
    with caplog.at_level(logging.INFO):
        runner.start()
        try:
            deadline = time.monotonic() + 120
            while node.round < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            first = node.gossip
            first.stop()  # the trio thread ends as if it had crashed (after sending what is queued: rounds go on)
            assert not first.alive
            stopped_at = node.round
            while node.round < stopped_at + 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert node.gossip is not first and node.gossip.alive
            assert node.gossip.peer_id == first.peer_id
        finally:
            stop.request("test over")
            runner.join(60)
    assert not runner.is_alive() and not node.gossip.alive
    assert "p2p layer stopped; restarting it" in caplog.text


HUNG_NODE = """
import sys, time
from trainer.generation.hf import TransformersGenerator
real = TransformersGenerator.generate
calls = []
def generate(self, prompt_ids, params, cancel):
    calls.append(1)
    if len(calls) > 1:  # round 0's evaluation works; round 1's generation hangs like a stuck GPU call
        print("hanging", file=sys.stderr, flush=True)
        time.sleep(3600)
    return real(self, prompt_ids, params, cancel)
TransformersGenerator.generate = generate
from node.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_stop_that_never_reaches_a_safe_point_still_exits_within_the_deadline(tiny_a, cache_dir, tmp_path):
    import time


    log = tmp_path / "node.log"
    args = [*node_args(cache_dir, tmp_path / "out", 5), "--run.stop_timeout_s", "3"]
    proc = subprocess.Popen([sys.executable, "-c", HUNG_NODE, *args], stderr=open(log, "w"), cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while "hanging" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - asked
    finally:
        proc.kill()
    assert code == 3 and 2.5 < took < 15, (code, took)
    assert "did not reach a safe point within 3 s of the stop request" in log.read_text()
    assert checkpoint.complete(tmp_path / "out" / "checkpoints") == []  # no new checkpoint from a stop that gave up


@pytest.mark.slow
def test_a_stop_mid_evaluation_ends_it_within_a_step_and_the_resume_writes_that_rounds_line_once(
        tiny_a, cache_dir, tmp_path, monkeypatch):
    """A SmolLM2 node stopped in its final evaluation outlived the harness's 60 s: the evaluation heard no stop.
    Stopped in round 0's, round 2's and the last round's evaluation in turn, the run ends as one that never stopped."""
    from node.config import load_config
    from node.loop import Node
    from trainer.generation import never

    def config(out):
        return load_config(None, {"model": {"cache_dir": str(cache_dir)}, "status": {"enabled": False},
                                  "p2p": {"enabled": False}, "tasks": {"eval_size": 12},
                                  "generation": {"completions_per_group": 4}, "selection": {"external_groups": 0},
                                  "run": {"out_dir": str(out), "rounds": 4, "eval_every": 2, "local_groups": 2}})

    Node(config(tmp_path / "straight")).run(StopSignal())
    real, asked_after_stop = TransformersGenerator.generate, []

    def generate(self, prompt_ids, params, cancel=never):
        if params.temperature == 0 and node.round == stop_at and not stop.requested:
            stop.request("test")

        def counted():
            asked_after_stop.extend([1] if stop.requested else [])
            return cancel()
        return real(self, prompt_ids, params, counted)

    monkeypatch.setattr(TransformersGenerator, "generate", generate)
    out = tmp_path / "stopped"
    for stop_at, lines in ((0, None), (2, [0, 1]), (4, [0, 1, 2, 3])):
        node, stop, asked_after_stop[:] = Node(config(out)), StopSignal(), []
        node.run(stop)
        assert asked_after_stop == [1]  # the first decoding step after the stop ended the evaluation
        saved = checkpoint.complete(out / "checkpoints")
        if not stop_at:  # nothing to keep: the next start evaluates round 0 again
            assert saved == [] and not (out / "metrics.jsonl").exists()
            continue
        assert rounds_in(out) == lines
        pending = json.loads((saved[-1] / "state.json").read_text())["pending_row"]
        assert (saved[-1].name, pending["round"], pending["eval_accuracy"]) == (f"round-00000{stop_at}", stop_at, None)
    stop_at = None
    Node(config(out)).run(StopSignal())
    straight, stopped = [[json.loads(line) for line in (p / "metrics.jsonl").read_text().splitlines()]
                         for p in (tmp_path / "straight", out)]
    assert [m["round"] for m in stopped] == [0, 1, 2, 3, 4]
    for key in ("eval_accuracy", "eval_by_dataset", "reward_mean", "tokens_generated", "weight_version"):
        assert [m[key] for m in stopped] == [m[key] for m in straight], key
    assert json.loads((checkpoint.complete(out / "checkpoints")[-1] / "state.json").read_text())["pending_row"] is None
