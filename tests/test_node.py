"""The silo node end to end, through the CLI as a user runs it."""

import json
import re
import shutil
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, run_sapo
from trainer import checkpoint
from trainer.generation import vllm_available

pytestmark = pytest.mark.slow
REQUIRED = {"round", "time", "reward_mean", "accuracy_train", "eval_accuracy", "n_local", "n_external",
            "tokens_generated", "seconds_generate", "seconds_train", "seconds_other"}


def small_run(cache_dir, out, rounds, *extra):
    return ["run", "--model.cache_dir", str(cache_dir), "--out", str(out), "--rounds", str(rounds),
            "--local", "3", "--generation.completions_per_group", "4", "--tasks.eval_size", "40",
            "--run.eval_every", "2", "--run.checkpoint_every", "2", "--external", "0", *extra]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_silo_run_writes_metrics_and_checkpoints(tiny_a, cache_dir, tmp_path):
    r = run_sapo(*small_run(cache_dir, tmp_path, 3))
    assert r.returncode == 0, r.stderr
    rows = metrics(tmp_path)
    assert [m["round"] for m in rows] == [0, 1, 2, 3]
    assert all(REQUIRED <= m.keys() for m in rows)
    assert rows[0]["reward_mean"] is None and rows[0]["eval_accuracy"] is not None
    assert [m["eval_accuracy"] is None for m in rows[1:]] == [True, False, False]  # every 2 rounds and at the end
    assert all(m["n_local"] == 3 and m["n_external"] == 0 and m["tokens_generated"] > 0 for m in rows[1:])
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in rows[1:])
    assert all(m["seconds_gc"] >= 0 for m in rows[1:])
    assert [p.name for p in checkpoint.complete(tmp_path / "checkpoints")] == ["round-000002", "round-000003"]
    assert json.loads((tmp_path / "config.json").read_text())["run"]["rounds"] == 3


def test_a_node_without_peers_runs_as_a_silo_without_warnings_and_with_p2p_off_has_no_network(tiny_a, cache_dir, tmp_path):
    alone = run_sapo(*small_run(cache_dir, tmp_path / "alone", 2))
    assert alone.returncode == 0, alone.stderr
    assert "WARNING" not in alone.stderr and "ERROR" not in alone.stderr, alone.stderr
    assert [m["peers"] for m in metrics(tmp_path / "alone")[1:]] == [0, 0]
    assert (tmp_path / "alone" / "node.key").exists()
    off = run_sapo(*small_run(cache_dir, tmp_path / "off", 2, "--p2p.enabled", "false"))
    assert off.returncode == 0, off.stderr
    assert "p2p" not in off.stderr and not (tmp_path / "off" / "node.key").exists()
    assert metrics(tmp_path / "off")[-1]["p2p"] is None


@pytest.mark.untimed  # one node that waits on no peer: its only limit is a generous timeout
def test_a_resumed_run_continues_exactly_where_it_stopped(tiny_a, cache_dir, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    # local groups chosen by the selector; the step-size controller's factor carried across the resume
    # one key for both folders (the selection state names peers by it); a fixed seed, since an unset run.seed is
    # the key's and a fresh key's stream may train too little for the controller to cut the rate
    overdraw = ("--selection.local_overdraw", "2", "--grpo.target_kl", "1e-5", "--p2p.key_file", str(tmp_path / "node.key"),
                "--run.seed", "0")
    assert run_sapo(*small_run(cache_dir, straight, 4, *overdraw)).returncode == 0
    assert run_sapo(*small_run(cache_dir, split, 2, *overdraw)).returncode == 0
    r = run_sapo(*small_run(cache_dir, split, 4, *overdraw))
    assert r.returncode == 0, r.stderr
    a, b = metrics(straight), metrics(split)
    assert [m["round"] for m in b] == [0, 1, 2, 3, 4]
    for key in ("reward_mean", "accuracy_train", "tokens_generated", "eval_accuracy", "weight_version"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert [m["loss"] for m in a[1:]] == pytest.approx([m["loss"] for m in b[1:]], abs=1e-6)
    trained = [m for m in a[1:] if m["lr"] is not None]
    # the controller cut the rate (a step past SPIKE times the target), and a resume goes on from the cut rate:
    assert len({m["lr_next"] for m in trained}) > 1
    # the rates alike; a step's KL alike up to float noise (a step at 3e-6 a token differed by 1e-8 between runs)
    for key, noise in (("lr", 0.0), ("lr_next", 0.0), ("step_kl", 1e-7)):
        assert [m[key] for m in b[1:] if m["lr"] is not None] == pytest.approx([m[key] for m in trained], rel=1e-3,
                                                                                abs=noise), key
    assert all(m["n_local"] == 6 for m in b[1:])

    def selection_state(out: Path) -> dict:
        return json.loads((out / "checkpoints" / "round-000004" / "state.json").read_text())["selection"]

    resumed, whole = selection_state(split), selection_state(straight)
    assert resumed["peers"] == whole["peers"]
    assert resumed["own_logprobs"] == pytest.approx(whole["own_logprobs"], abs=1e-5)  # the log-probs, as the losses


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_checkpoints_exits_zero_and_the_restart_resumes(sig, tiny_a, cache_dir, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", *small_run(cache_dir, tmp_path, 100000)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (
            (tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 4
        ):
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    last = metrics(tmp_path)[-1]["round"]
    saved = checkpoint.load_latest(tmp_path / "checkpoints")
    pending = saved.state.get("pending_row")  # the stop came during an evaluation: that round's line waits for it
    assert saved.round == last + (pending is not None) and (pending is None or pending["round"] == saved.round)
    r = run_sapo(*small_run(cache_dir, tmp_path, last + 2))
    assert r.returncode == 0, r.stderr
    rounds = [m["round"] for m in metrics(tmp_path)]
    assert rounds == list(range(last + 3))


def test_a_second_node_on_a_running_nodes_folder_is_refused_in_one_line_and_touches_nothing(tiny_a, cache_dir, tmp_path):
    """Two nodes on one run folder resumed each other's checkpoints, shared one identity and interleaved their metrics."""
    from node.preflight import lock_out_dir

    quick = ["--tasks.eval_size", "4", "--run.eval_every", "1000"]
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", *small_run(cache_dir, tmp_path, 100000, *quick)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 2):
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
        key = (tmp_path / "node.key").read_bytes()
        r = run_sapo(*small_run(cache_dir, tmp_path, 5), "--listen", "/ip4/127.0.0.1/tcp/0", "--status.listen", "127.0.0.1:0")
        assert r.returncode == 2 and r.stderr.strip() == (f"sapo: config error: run.out_dir: {tmp_path} is in use by "
                                                          f"another node (pid {proc.pid}): stop that node, or choose another --out")
        assert proc.poll() is None and (tmp_path / "node.key").read_bytes() == key
    finally:
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, err
    last = metrics(tmp_path)[-1]["round"]
    assert [m["round"] for m in metrics(tmp_path)] == list(range(last + 1))  # one writer: no round twice
    os.close(lock_out_dir(tmp_path))  # the lock went with its node


def test_tiny_presets_differ_in_size_and_tokenizer_and_start_with_room_to_learn(tiny_a, tiny_b):
    from transformers import AutoConfig

    from trainer.policy import load_tokenizer

    meta = {p: json.loads((p / "sapo_preset.json").read_text()) for p in (tiny_a, tiny_b)}
    assert AutoConfig.from_pretrained(tiny_a).model_type == "qwen2"
    assert AutoConfig.from_pretrained(tiny_b).model_type == "llama"
    assert meta[tiny_a]["parameters"] != meta[tiny_b]["parameters"]
    text = "12+34=?\nReply with <answer>final answer</answer>.\n"
    assert load_tokenizer(str(tiny_a))(text)["input_ids"] != load_tokenizer(str(tiny_b))(text)["input_ids"]
    for m in meta.values():
        assert 0.05 <= m["held_out_accuracy"] <= 0.40, m


def test_preset_build_is_deterministic(tmp_path):
    from dataclasses import replace

    from trainer.tiny import PRESETS, build_preset

    short = replace(PRESETS["tiny-b"], max_sft_steps=12, target_accuracy=1.0)
    a = build_preset("tiny-b", tmp_path / "a", short)
    b = build_preset("tiny-b", tmp_path / "b", short)
    assert a["sft_steps"] == b["sft_steps"] == 12
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_the_seed_changes_the_model_and_gets_its_own_cache_folder(tmp_path):
    from dataclasses import replace

    from trainer.tiny import PRESETS, build_preset, preset_dir

    short = replace(PRESETS["tiny-b"], max_sft_steps=2, target_accuracy=1.0)
    build_preset("tiny-b", tmp_path / "s0", short)
    build_preset("tiny-b", tmp_path / "s1", replace(short, seed=1))
    w0, w1 = load_file(tmp_path / "s0" / "model.safetensors"), load_file(tmp_path / "s1" / "model.safetensors")
    assert any(not (w0[k] == w1[k]).all() for k in w0)
    assert preset_dir("tiny-b", tmp_path, 0) != preset_dir("tiny-b", tmp_path, 1)


def test_init_model_copies_the_cached_preset_and_refuses_to_overwrite(tiny_b, cache_dir, tmp_path):
    r = run_sapo("init-model", "--preset", "tiny-b", "--cache-dir", str(cache_dir), "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert "tiny-b" in r.stdout and (tmp_path / "m" / "model.safetensors").exists()
    assert ", copied from the cache in " in r.stdout and "; built earlier in " in r.stdout  # not the build's time as its own
    again = run_sapo("init-model", "--preset", "tiny-b", "--cache-dir", str(cache_dir), "--out", str(tmp_path / "m"))
    assert again.returncode == 2 and "not empty" in again.stderr
    bad = run_sapo("init-model", "--preset", "huge", "--cache-dir", str(cache_dir))
    assert bad.returncode == 2 and "unknown preset 'huge'" in bad.stderr


@pytest.mark.parametrize("name, says", [("{tmp}/no-such-model", "no such folder: "),
                                        ("no-such-org/no-such-model", "is not a preset or a folder, and the model hub is unreachable")])
def test_a_model_that_cannot_load_is_a_clear_error(name, says, tmp_path):
    r = run_sapo("run", "--model", name.format(tmp=tmp_path), "--out", str(tmp_path / "out"),
                 env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr and "sapo: config error: model.name: " in r.stderr
    assert not (tmp_path / "out").exists()  # refused before it created anything


def test_truncated_model_weights_are_a_clear_error(tiny_a, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_a, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    r = run_sapo("run", "--model", str(model), "--out", str(tmp_path / "out"))
    assert r.returncode == 2
    assert f"cannot load model '{model}'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.untimed  # one node that waits on no peer: its only limit is a generous timeout
def test_an_unreadable_checkpoint_stops_the_node_without_touching_it(tiny_a, cache_dir, tmp_path):
    assert run_sapo(*small_run(cache_dir, tmp_path, 2)).returncode == 0
    ckpt = checkpoint.complete(tmp_path / "checkpoints")[-1]
    (ckpt / "trainer.pt").write_bytes(b"garbage")
    r = run_sapo(*small_run(cache_dir, tmp_path, 4))
    assert r.returncode == 1 and ckpt.name in r.stderr and "Traceback" not in r.stderr
    assert (ckpt / "trainer.pt").read_bytes() == b"garbage"


@pytest.mark.untimed  # one node that waits on no peer: its only limit is a generous timeout
def test_resuming_with_another_model_is_refused(tiny_a, tiny_b, cache_dir, tmp_path):
    assert run_sapo(*small_run(cache_dir, tmp_path, 1)).returncode == 0
    r = run_sapo(*small_run(cache_dir, tmp_path, 2, "--model", "tiny-b"))
    assert r.returncode == 1 and "continues model 'tiny-a', not 'tiny-b'" in r.stderr


def test_a_checkpoint_whose_weights_are_cut_short_is_named_with_the_way_out(tiny_a, cache_dir, tmp_path):
    """It read as a bad model.name ('config error: model.name: cannot load model .../checkpoints/...')."""
    assert run_sapo(*small_run(cache_dir, tmp_path, 2)).returncode == 0
    weights = tmp_path / "checkpoints" / "round-000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    r = run_sapo(*small_run(cache_dir, tmp_path, 3))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"sapo: checkpoint {tmp_path / 'checkpoints' / 'round-000002'} is unreadable (cannot load model ")
    assert last.endswith("move it aside to resume from an older one") and weights.stat().st_size == 1000


def test_a_resume_with_no_rounds_left_says_so_and_joins_nothing(tiny_a, cache_dir, tmp_path):
    """It exited 0 at once, saying only 'done: round 2'. And it opened its listener on the way out, so that `sapo
    swarm` run again on a finished swarm could catch its bootstrap node listening and start the rest (seen once
    on a loaded machine) instead of saying the swarm had run its rounds."""
    assert run_sapo(*small_run(cache_dir, tmp_path, 2)).returncode == 0
    r = run_sapo(*small_run(cache_dir, tmp_path, 1, "--p2p.enabled", "true"))
    assert r.returncode == 0
    assert "run.rounds is 1 and this run folder has run 2: nothing left to run (raise --rounds to go on)" in r.stderr
    assert "listening on" not in r.stderr and "status: dashboard" not in r.stderr


def test_a_start_with_no_checkpoint_sets_an_earlier_starts_metrics_aside(tiny_a, cache_dir, tmp_path):
    """A node that stopped before its first checkpoint (or whose checkpoints were removed) starts at round 0
    again: it appended rounds 0, 1, 2 after the earlier 0, 1, 2, and a summary read both."""
    quick = ["--tasks.eval_size", "4", "--run.checkpoint_every", "1000"]
    assert run_sapo(*small_run(cache_dir, tmp_path, 2, *quick), "--p2p.enabled", "false").returncode == 0
    earlier = (tmp_path / "metrics.jsonl").read_text()
    shutil.rmtree(tmp_path / "checkpoints")
    r = run_sapo(*small_run(cache_dir, tmp_path, 2, *quick), "--p2p.enabled", "false")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [m["round"] for m in metrics(tmp_path)] == [0, 1, 2]
    assert (tmp_path / "metrics.rolled-back.jsonl").read_text() == earlier  # set aside, not lost
    assert "moved 3 metrics lines of an earlier start that left no checkpoint to metrics.rolled-back.jsonl" in r.stderr


def test_a_node_rotates_its_metrics_and_resumes_across_the_archives(tiny_a, cache_dir, tmp_path):
    from node.metrics import MetricsLog

    rotate = ("--run.metrics_rotate_mb", "0.002", "--p2p.enabled", "false", "--tasks.eval_size", "4")  # about 2 rounds
    for rounds in (2, 5):
        r = run_sapo(*small_run(cache_dir, tmp_path, rounds, *rotate))
        assert r.returncode == 0, r.stderr[-2000:]
    log = MetricsLog(tmp_path / "metrics.jsonl")
    assert len(log.archives()) >= 2
    assert [m["round"] for m in log.rows()] == [0, 1, 2, 3, 4, 5]
    assert log.start_row()["eval_accuracy"] == log.rows()[0]["eval_accuracy"] is not None


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed here: CI's second stage (scripts/test_vllm.sh) runs this")
def test_a_node_on_vllm_trains_pushes_every_step_and_resumes_exactly(tiny_a, cache_dir, tmp_path):
    vllm = ("--generation.backend", "vllm", "--generation.vllm.enforce_eager", "true",
            "--generation.vllm.cpu_kv_cache_gib", "0.25", "--p2p.enabled", "false")
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out, rounds in [(straight, 4), (split, 2), (split, 4)]:
        r = run_sapo(*small_run(cache_dir, out, rounds, *vllm))
        assert r.returncode == 0, r.stderr
        assert "generation backend: vllm" in r.stderr
    a, b = metrics(straight), metrics(split)
    assert [m["round"] for m in b] == [0, 1, 2, 3, 4]
    for key in ("reward_mean", "tokens_generated", "eval_accuracy", "weight_version"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    trained = [m for m in b[1:] if m["loss"] is not None]
    assert trained and b[-1]["weight_version"] == len(trained)  # one push per trained round


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_asking_for_vllm_without_it_is_one_line_naming_the_install(tiny_a, cache_dir, tmp_path):
    r = run_sapo(*small_run(cache_dir, tmp_path, 1, "--generation.backend", "vllm", "--p2p.enabled", "false"))
    assert r.returncode != 0
    assert "generation.backend" in r.stderr and "pip install -e '.[vllm]'" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_round_that_cannot_fit_in_memory_is_refused_before_it_starts_and_auto_fits_it(tiny_a, cache_dir, tmp_path):
    # tiny-a with room for 2,000 new tokens (its rotary positions run past its config's 256, which the planner holds to)
    long = shutil.copytree(tiny_a, tmp_path / "tiny-a-long")
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    tight = ["--model", str(long), "--run.memory_gb", "1.2", "--generation.max_new_tokens", "2000"]
    full = ["--model.lora.enabled", "false", "--model.gradient_checkpointing", "false"]
    r = run_sapo(*small_run(cache_dir, tmp_path / "fixed", 1, *tight, *full, "--grpo.micro_batch", "12"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "grpo.micro_batch 12 needs about" in r.stderr and "set grpo.micro_batch to" in r.stderr
    assert not (tmp_path / "fixed" / "metrics.jsonl").exists()
    r = run_sapo(*small_run(cache_dir, tmp_path / "auto", 1, *tight, *full), env={"COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    ran = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert 1 <= ran["grpo"]["micro_batch"] < 12  # 3 groups x 4 completions per step: the whole step does not fit
    assert re.search(rf"micro-batch {ran['grpo']['micro_batch']}(, [a-z0-9 ]+)*; expected peak", r.stderr)


def stopped_during_evaluation(cache_dir, out: Path, rounds: int, extra: list[str], round_: int, log_path: Path) -> float:
    """Run a node until it logs that it evaluates the weights of `round_`, send SIGINT inside that evaluation, and
    return the seconds it took to exit."""
    with open(log_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "node.cli", *small_run(cache_dir, out, rounds, *extra)],
                                cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and f"evaluating the weights of round {round_}" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.1)
            time.sleep(0.5)  # inside the evaluation
            asked = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
            took = time.monotonic() - asked
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert proc.returncode == 0 and "Traceback" not in text, text
    return took


@pytest.mark.slow
def test_a_stop_signal_during_an_evaluation_exits_within_seconds_and_the_resume_evaluates_it_once(tiny_a, cache_dir, tmp_path):
    """A stop that lands in an evaluation (minutes on a real model) is heard within a decoding step: the node exits 0 with
    a checkpoint that records the evaluation as pending, and the resume evaluates those weights once: mid-run, and
    at the final evaluation (a run that would otherwise resume as finished)."""
    out, heavy = tmp_path / "out", ["--tasks.eval_size", "1500", "--tasks.eval_samples", "16"]
    for stopped_at, log_name in ((2, "first.err"), (4, "resumed.err")):
        took = stopped_during_evaluation(cache_dir, out, 4, heavy, stopped_at, tmp_path / log_name)
        assert took < 10, f"the stop during round {stopped_at}'s evaluation took {took:.1f} s"
        saved = checkpoint.load_latest(out / "checkpoints")
        assert saved.round == stopped_at and saved.state["pending_row"]["round"] == stopped_at
        assert [m["round"] for m in metrics(out)] == list(range(stopped_at))  # the round's line waits for its evaluation
    assert (tmp_path / "resumed.err").read_text().count("evaluating the weights of round 2") == 1
    r = run_sapo(*small_run(cache_dir, out, 4, *heavy))
    assert r.returncode == 0, r.stderr
    lines = metrics(out)
    assert [m["round"] for m in lines] == [0, 1, 2, 3, 4]
    assert all(lines[k]["eval_accuracy"] is not None and lines[k]["eval_expected"] is not None for k in (2, 4))
    assert r.stderr.count("evaluating the weights of round 4") == 1 and "weights of round 2" not in r.stderr
