"""SAPO end to end: external groups are re-scored here, enter training across tokenizers, cannot be
forged into reward, and J = 0 is the silo loop."""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest

from node.selection import SelectionConfig, Selector
from p2p.config import PoolConfig
from p2p.pool import RolloutPool
from p2p.wire import VERSION, WireGroup, WireMessage
from rewards import TaskRef, regenerate
from rewards.config import TasksConfig
from tests.conftest import run_sapo
from trainer.config import GRPOConfig, ModelConfig
from trainer.grpo import GRPOTrainer
from trainer.presets import load

PEER = "12D3KooWForgerForgerForgerForgerForgerForgerForgerFo"
REF = TaskRef("arith", {}, seed=5, index=11)
TASK = regenerate(REF)


def pool_with(*groups: WireGroup, peer: str = PEER) -> RolloutPool:
    pool = RolloutPool(PoolConfig())
    pool.add(WireMessage(v=VERSION, peer=peer, model="m", round=1, created=time.time(), groups=list(groups)))
    return pool


def take_external(pool: RolloutPool, j: int, tasks: TasksConfig = TasksConfig(), **selection):
    """The uniform rule's pick: every usable group, whatever its rewards. The selector is closed after, as the
    node closes it: its untrusted-task worker is a process of its own. The round's budget is a minute: the
    worker's start-up counts against it, and on a loaded machine it took longer than the default 5 s (the pick
    then leaves the groups in the pool for the next round, which these tests do not look at)."""
    selector = Selector(SelectionConfig(external_groups=j, rule="uniform", **{"budget_s": 60.0, **selection}), tasks)
    try:
        pick = selector.external(pool, random.Random(0), 1)
    finally:
        selector.close()
    return pick.groups, pick.dropped


def wire(completions: list[str], ref: TaskRef = REF, **extra) -> WireGroup:
    return WireGroup.model_validate({"dataset": ref.dataset, "config": dict(ref.config), "seed": ref.seed,
                                     "index": ref.index, "completions": completions, **extra})


def test_a_forged_group_earns_nothing_for_a_claimed_answer_or_reward():
    wrong = str(int(TASK.answer) + 1)
    forged = wire([f"<answer>{wrong}</answer>"] * 4, reward=[1, 1, 1, 1], answer=wrong, correct=True)
    groups, dropped = take_external(pool_with(forged), 4)
    assert len(groups) == 1 and not dropped
    assert groups[0].rewards == [0.0] * 4 and groups[0].source == PEER
    assert groups[0].task.answer == TASK.answer  # the node's own regeneration, not the sender's claim


def test_an_honest_external_group_is_scored_by_this_nodes_verifier():
    honest = wire([f"<answer>{TASK.answer}</answer>", "<answer>nope</answer>"])
    groups, _ = take_external(pool_with(honest), 4)
    assert groups[0].rewards == [1.0, 0.0] and groups[0].correct == [True, False]


def test_unaccepted_and_unregenerable_tasks_are_dropped_and_counted_and_the_pool_is_drained_for_usable_ones():
    tasks = TasksConfig(datasets="arith,reverse")
    other_config = wire(["x"], TaskRef("arith", {"max_operand": 99}, 0, 1))
    not_ours = wire(["x"], TaskRef("count", {}, 0, 2))
    unknown = wire(["x"], TaskRef("no_such_dataset", {}, 0, 3))
    good = [wire([f"<answer>{i}</answer>"], TaskRef("reverse", {}, 0, i)) for i in range(3)]
    pool = RolloutPool(PoolConfig(max_peer_share=1.0))
    for k, g in enumerate([other_config, not_ours, unknown, *good]):
        pool.add(WireMessage(v=VERSION, peer=f"peer{k}", model="m", round=1, created=time.time(), groups=[g]))
    groups, dropped = take_external(pool, 3, tasks)
    assert len(groups) == 3 and {g.task.ref.dataset for g in groups} == {"reverse"}
    assert dropped == {"not_accepted": 3}  # the pool is drained past them until J usable groups are found
    pool = pool_with(unknown, not_ours)
    groups, dropped = take_external(pool, 2, tasks, accept="any")
    assert dropped == {"unknown_task": 1} and [g.task.ref.dataset for g in groups] == ["count"]


def test_a_node_with_another_tokenizer_trains_on_text_from_a_tiny_a_node(tiny_a, tiny_b, cache_dir):
    author = load(ModelConfig(name="tiny-a", cache_dir=cache_dir))
    learner = load(ModelConfig(name="tiny-b", cache_dir=cache_dir))
    texts = [f"<answer>{TASK.answer}</answer>", "<answer>0</answer>", f"<answer>{TASK.answer}</answer>", "<answer>x</answer>"]
    probe = "<answer>1234</answer>"
    assert author.tokenizer(probe)["input_ids"] != learner.tokenizer(probe)["input_ids"]  # digit runs merge in tiny-b
    assert author.tokenizer.get_vocab() != learner.tokenizer.get_vocab()
    groups, _ = take_external(pool_with(wire(texts)), 1)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    stats = GRPOTrainer(learner, GRPOConfig(external_min_logprob=None), 16, 10).step(groups)
    assert stats.external_groups_used == 1 and stats.optimizer_steps == 1
    assert any(not (before[k] == v).all() for k, v in learner.model.state_dict().items())


@pytest.mark.slow
def test_a_three_node_mixed_swarm_trains_on_each_others_groups(tiny_a, tiny_b, cache_dir, tmp_path):
    # Tiny-model rounds take ~0.1 s and the nodes' start-up evaluations differ by ~1 s, so the first node can run
    # a dozen rounds before a peer has published: 30 rounds (measured: first external use by round 8-10 under load)
    r = run_sapo("swarm", "--nodes", "3", "--rounds", "30", "--local", "2", "--external", "2", "--presets", "tiny-a,tiny-b",
                 "--task-mixes", "arith,reverse; reverse,count", "--out", str(tmp_path), "--cache-dir", str(cache_dir),
                 "--node-args", "--tasks.eval_size 20 --generation.completions_per_group 4", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [n["model"] for n in summary["per_node"]] == ["tiny-a", "tiny-b", "tiny-a"]
    assert (tmp_path / "summary.png").stat().st_size > 10_000
    for k, mix in enumerate((["arith", "reverse"], ["reverse", "count"], ["arith", "reverse"])):
        config = json.loads((tmp_path / f"node{k}" / "config.json").read_text())
        assert [d["name"] for d in config["tasks"]["datasets"]] == mix
        rows = [json.loads(line) for line in (tmp_path / f"node{k}" / "metrics.jsonl").read_text().splitlines()][1:]
        assert len(rows) == 30
        assert sum(m["n_external_used"] for m in rows) > 0, f"node{k} never trained on a peer's group"
        assert max(m["external_peers"] for m in rows) >= 1 and max(m["peers"] for m in rows) == 2
        assert all(m["n_local"] + m["n_external"] == 4 for m in rows)  # I + J, short pools filled locally


@pytest.mark.slow
def test_a_swarm_with_a_baseline_runs_the_same_nodes_alone_and_reports_the_difference(tiny_a, cache_dir, tmp_path):
    command = ["swarm", "--nodes", "2", "--rounds", "3", "--local", "2", "--external", "2", "--presets", "tiny-a",
               "--baseline", "--out", str(tmp_path), "--cache-dir", str(cache_dir),
               "--node-args", "--tasks.eval_size 10 --generation.completions_per_group 4"]
    r = run_sapo(*command, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    alone = summary["baseline"]["per_node"]
    assert [n["name"] for n in alone] == ["silo0", "silo1"] and summary["baseline"]["local"] == 4
    assert summary["vs_baseline"] == pytest.approx(summary["cumulative_reward_mean"] / summary["baseline"]["cumulative_reward_mean"] - 1)
    for k in range(2):
        rows = [json.loads(line) for line in (tmp_path / "silo" / f"node{k}" / "metrics.jsonl").read_text().splitlines()][1:]
        assert [(m["n_local"], m["n_external"], m["p2p"]) for m in rows] == [(4, 0, None)] * 3
        config = json.loads((tmp_path / "silo" / f"node{k}" / "config.json").read_text())
        assert config["run"]["seed"] == k and config["model"]["name"] == "tiny-a"  # the same node, alone
    assert f"the same nodes alone ({summary['cumulative_reward_mean']:.2f} vs " in r.stdout
    # piped output (as in CI logs): plain progress lines from the start, and the final table at full width
    assert "] node0 (tiny-a) round 0/3" in r.stderr and "] silo1 (tiny-a) round " in r.stderr
    header = next(line for line in r.stderr.splitlines() if line.split()[:3] == ["node", "model", "round"])
    assert header.split()[-3:] == ["ext", "local", "state"]
    final = r.stderr.split(header)[-1]
    assert "exit 0" in final and "Dashboards: node0 http://127.0.0.1:" in " ".join(final.split())

    # the same command again: its nodes have run their rounds, which is said as such (not as a failed start)
    again = run_sapo(*command, timeout=600)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        f"sapo: {tmp_path} holds a swarm that has run its 3 rounds (node0 resumed from its last checkpoint and "
        "stopped): raise --rounds to go on, or pass another --out")
    assert json.loads((tmp_path / "summary.json").read_text()) == summary  # the first run's results are kept


def test_the_live_table_reads_whole_at_80_columns(tmp_path):
    """At 80 columns the table used to cut every cell to three characters."""
    import subprocess
    import sys

    from rich.console import Console

    from node.swarm import Child, table

    row = {"round": 120, "reward_mean": 0.53125, "eval_accuracy": 0.41, "peers": 12, "p2p": {"published": 1200},
           "n_external_received": 4800, "external_inspected": 9000, "external_informative": 4700, "n_external_used": 4550,
           "local_informative": 3000, "n_local": 4800}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        children = [Child(f"node{k}", preset, tmp_path, proc, f"http://127.0.0.1:{8080 + k}/", 300, rows=[row])
                    for k, preset in enumerate(["tiny-a", "smollm2-135m", "tiny-b"])]
        console = Console(width=80, record=True)
        console.print(table(children))
    finally:
        proc.kill()
        proc.wait()
    text = console.export_text()
    assert "…" not in text and "smollm2-135m 120/300 0.53 0.41 12 1200 4800 4550/9000 62% running" in " ".join(text.split())
    assert "node2 http://127.0.0.1:8082/" in " ".join(text.split())


@pytest.mark.slow
@pytest.mark.untimed  # nodes that wait on no peer: their only limit is a generous timeout
def test_a_lonely_node_fills_j_with_local_groups_exactly_like_a_silo_of_i_plus_j(tiny_a, cache_dir, tmp_path):
    common = ["run", "--model.cache_dir", str(cache_dir), "--rounds", "3", "--tasks.eval_size", "20",
              "--generation.completions_per_group", "4", "--p2p.enabled", "false"]
    silo = run_sapo(*common, "--out", str(tmp_path / "silo"), "--local", "6", "--external", "0")
    lonely = run_sapo(*common, "--out", str(tmp_path / "lonely"), "--local", "2", "--external", "4")
    assert silo.returncode == 0 and lonely.returncode == 0, silo.stderr + lonely.stderr

    def rows(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    a, b = rows("silo"), rows("lonely")
    for key in ("reward_mean", "eval_accuracy", "tokens_generated", "n_local", "groups_trained", "weight_version"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert [m["loss"] for m in a[1:]] == pytest.approx([m["loss"] for m in b[1:]], abs=1e-6)
    assert all(m["n_external"] == 0 for m in b)
    fewer = run_sapo(*common, "--out", str(tmp_path / "fewer"), "--local", "2", "--external", "4",
                     "--selection.when_short", "fewer")
    assert fewer.returncode == 0, fewer.stderr
    assert [m["n_local"] for m in rows("fewer")[1:]] == [2, 2, 2]


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "sapo: config error: --nodes: must be at least 1 (got 0)"),
    (["--node-args", "--grpo.lr -1"], 'sapo: config error: grpo.lr: Input should be greater than 0 (got "-1")'),
    (["--node-args", "--bogus 1"], "sapo: config error: --node-args: unrecognized arguments: --bogus 1"),
    # one token that starts with '-' is the value too (argparse alone read it as a flag: 'expected one argument')
    (["--node-args", "--bogus"], "sapo: config error: --node-args: unrecognized arguments: --bogus"),
    (["--task-mixes", "arith;nope:2"], "sapo: config error: --task-mixes: tasks.datasets.0: unknown dataset "
                                       "'nope' (built-in: arith, reverse, count; reasoning-gym: 'rg/<name>')"),
    (["--node-args", '"unclosed'], """sapo: config error: --node-args: No closing quotation (got '"unclosed')"""),
    (["--task-mixes", ";;"], "sapo: config error: --task-mixes: name at least one mix (got ';;')"),  # ran the default
    # what the swarm sets for each node: node1 exited at once, or ran with node0 alone and a false summary
    (["--node-args", "--p2p.enabled false"],
     "sapo: config error: --node-args: p2p.enabled is the swarm's own setting (--external 0 runs every node alone)"),
    (["--node-args", "--tasks.eval_size 4 --out elsewhere"],
     "sapo: config error: --node-args: run.out_dir is the swarm's own setting (node k runs in --out/node<k>)"),
])
def test_bad_swarm_arguments_fail_before_any_node_starts(args, message, tmp_path):
    r = run_sapo("swarm", "--out", str(tmp_path / "s"), *args, cwd=tmp_path)  # a relative --out lands in tmp_path
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [message]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_stops_every_node_of_a_swarm_with_a_checkpoint_and_leaves_no_process(tiny_a, tiny_b, cache_dir, tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import ROOT
    from trainer import checkpoint

    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "swarm", "--nodes", "2", "--rounds", "100000",
                             "--out", str(tmp_path), "--cache-dir", str(cache_dir), "--node-args", "--tasks.eval_size 10"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not all(
                (tmp_path / f"node{k}" / "metrics.jsonl").exists()
                and len((tmp_path / f"node{k}" / "metrics.jsonl").read_text().splitlines()) > 3 for k in range(2)):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "exit 0" in out and "Traceback" not in err and "sapo: stopped before the end: no comparison" in err
    assert "cumulative reward against the same nodes" not in out
    for k in range(2):
        assert checkpoint.load_latest(tmp_path / f"node{k}" / "checkpoints") is not None
    def cmdline(pid_dir: Path) -> str:
        try:
            return (pid_dir / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # the process ended while we looked
            return ""

    assert [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and str(tmp_path) in cmdline(p)] == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["nodes"] == 2 and summary["stopped"] and not summary["complete"]


def test_a_swarm_whose_model_cannot_be_read_says_why_in_one_line_and_starts_nothing(tmp_path, tiny_a):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # with a tokenizer, looks like a model folder until it is read
    (broken / "tokenizer.json").write_bytes((tiny_a / "tokenizer.json").read_bytes())
    r = run_sapo("swarm", "--nodes", "2", "--rounds", "1", "--presets", str(broken), "--out", str(tmp_path / "s"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(f"sapo: model.name: cannot read model '{broken}': ")
    assert "Traceback" not in r.stderr and not (tmp_path / "s").exists()


def test_a_swarm_whose_bootstrap_node_cannot_start_says_why_in_one_line(tmp_path):
    (tmp_path / "s" / "node0" / "checkpoints").parent.mkdir(parents=True)
    (tmp_path / "s" / "node0" / "checkpoints").write_text("")  # found by the node at its start
    r = run_sapo("swarm", "--nodes", "2", "--rounds", "1", "--presets", "tiny-a", "--out", str(tmp_path / "s"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"sapo: the bootstrap node did not start (sapo: config error: run.out_dir: {tmp_path / 's' / 'node0' / 'checkpoints'} "
        "is a file")
    assert "Traceback" not in r.stderr and not (tmp_path / "s" / "node1").exists()


def test_a_swarm_whose_bootstrap_key_is_unreadable_says_so_before_any_node_starts(tmp_path):
    """The swarm reads node0's key for the others' bootstrap address: a corrupt one was its traceback."""
    key = tmp_path / "s" / "node0" / "node.key"
    key.parent.mkdir(parents=True)
    key.write_text("garbage")
    r = run_sapo("swarm", "--nodes", "2", "--rounds", "1", "--presets", "tiny-a", "--out", str(tmp_path / "s"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"sapo: node0: key file {key} is not a libp2p private key")
    assert key.read_text() == "garbage" and not (tmp_path / "s" / "node0" / "node.log").exists()


def test_a_swarm_with_a_model_that_is_not_there_starts_nothing(tmp_path):
    r = run_sapo("swarm", "--nodes", "2", "--rounds", "1", "--presets", f"tiny-a,{tmp_path / 'no-such-model'}",
                 "--out", str(tmp_path / "s"))
    assert r.returncode == 2 and not (tmp_path / "s").exists()
    assert r.stderr.strip().splitlines() == [f"sapo: config error: --presets: no such folder: {tmp_path / 'no-such-model'} "
                                             "(presets: tiny-a, tiny-b, smollm2-135m, gemma3-270m)"]


def test_own_completions_sent_through_the_external_path_train_on_the_tokens_that_were_sampled(tiny_a, cache_dir):
    """The control of the swarm-vs-silo experiment, at the token level: text in, the sampled ids out
    (EOS and truncation included). A text protocol cannot carry the rest: samples that are not valid
    UTF-8 (decoded with U+FFFD) and token sequences the tokenizer never produces for their text."""
    from dataclasses import replace

    from rewards import TaskSource
    from rewards.source import DatasetMix
    from trainer.generation import SamplingParams
    from trainer.generation.hf import TransformersGenerator
    from trainer.rollout import rollout

    policy = load(ModelConfig(name="tiny-a", cache_dir=cache_dir))
    tasks = TaskSource([DatasetMix(n) for n in ("arith", "reverse", "count")], seed=5).draw(32)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=6, stop=("</answer>",), seed=1)
    local = rollout(TransformersGenerator(policy), policy, tasks, params)
    external = [replace(g, completion_ids=None, truncated=[False] * len(g.completions), source=PEER) for g in local]
    trainer = GRPOTrainer(policy, GRPOConfig(), max_new_tokens=6, total_rounds=1, stop=params.stop)

    def rows(groups):
        batch, _, _, truncated, *_ = trainer._tensors(groups)
        lengths = batch.completion_mask.sum(-1).long().tolist()
        return [(batch.input_ids[i, batch.prompt_len: batch.prompt_len + n].tolist(), bool(truncated[i]))
                for i, n in enumerate(lengths)]

    texts = [t for g in local for t in g.completions]
    ended = [ids[-1] == policy.tokenizer.eos_token_id for g in local for ids in g.completion_ids]
    cut = [t for g in local for t in g.truncated]
    assert any(ended) and any(cut) and all(t.endswith("</answer>") or e or c for t, e, c in zip(texts, ended, cut))
    eos = policy.tokenizer.eos_token_id
    canonical = policy.tokenizer(texts, add_special_tokens=False)["input_ids"]
    lossy = [ids != [i for i in sampled if i != eos] for ids, sampled in zip(canonical, (i for g in local for i in g.completion_ids))]
    assert 0 < sum(lossy) < 0.2 * len(texts)
    same = [a == b for a, b, bad in zip(rows(local), rows(external), lossy) if not bad]
    assert all(same), f"{same.count(False)} of {len(same)} completions train on other tokens than were sampled"


def test_a_companion_runs_until_the_others_finish_in_the_swarm_and_in_its_silo(tmp_path):
    from node.swarm import COMPANION_ROUNDS, SwarmSpec

    spec = SwarmSpec(nodes=3, rounds=20, local=2, external=2, presets=["smollm2-135m", "tiny-a"], out=tmp_path,
                     task_mixes=["[]"], companions=[False, True])
    for s in (spec, spec.silo()):
        rounds = [int(args[args.index("--rounds") + 1]) for args in map(s.node_args, range(3))]
        assert rounds == [20, COMPANION_ROUNDS, 20] and [s.preset(k) for k in range(3)] == ["smollm2-135m", "tiny-a", "smollm2-135m"]
    assert spec.silo().local == 4 and spec.silo().external == 0


def test_no_node_of_a_swarm_draws_the_held_out_sets_seed(tmp_path):
    from node.swarm import EVAL_SEED, SwarmSpec

    spec = SwarmSpec(nodes=12, rounds=5, local=2, external=2, presets=["tiny-a"], out=tmp_path)
    seeds = [int(args[args.index("--seed") + 1]) for args in map(spec.node_args, range(12))]
    assert EVAL_SEED not in seeds and len(set(seeds)) == 12 and seeds[:EVAL_SEED] == list(range(EVAL_SEED))


def test_a_node_of_a_faster_model_runs_its_multiple_of_the_rounds_in_the_swarm_and_in_its_silo(tmp_path):
    from types import SimpleNamespace

    from node.swarm import Child, SwarmSpec, failure

    spec = SwarmSpec(nodes=3, rounds=40, local=2, external=2, presets=["gemma3-270m", "smollm2-135m"], out=tmp_path,
                     round_multiples=[1, 2])
    for s in (spec, spec.silo()):
        assert [int(args[args.index("--rounds") + 1]) for args in map(s.node_args, range(3))] == [40, 80, 40]
    done = SimpleNamespace(returncode=0)  # a node that exited 0 counts only once it reached its own rounds
    fast = Child("node1", "smollm2-135m", tmp_path, done, "", spec.node_rounds(1), rows=[{"round": 40}])
    assert failure(fast).startswith("node1 (smollm2-135m) ended at round 40 of 80")
    fast.rows.append({"round": 80})
    assert failure(fast) is None


def test_a_swarm_whose_plans_cannot_fit_is_refused_before_any_node_starts(tiny_a, cache_dir, tmp_path):
    r = run_sapo("swarm", "--nodes", "2", "--rounds", "1", "--baseline", "--out", str(tmp_path / "s"), "--cache-dir",
                 str(cache_dir), "--node-args", "--generation.batch_size 1000000 --tasks.eval_size 1000000")  # a million rows decoded at once
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("sapo: 4 nodes cannot share ") and ": node0 (tiny-a) in its " in line
    # the smallest change depends on the memory free now: fewer rows, or shorter completions when even one is too long
    assert re.search(r"set generation\.(batch_size|max_new_tokens) to \d+", line), line
    assert line.endswith("; not even one fits here")
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_a_swarm_that_loses_a_node_prints_no_gain_names_the_node_and_exits_non_zero(tiny_a, cache_dir, tmp_path):
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "swarm", "--nodes", "2", "--rounds", "150", "--baseline",
                             "--presets", "tiny-a", "--local", "2", "--external", "2", "--out", str(tmp_path),
                             "--cache-dir", str(cache_dir),
                             "--node-args", "--tasks.eval_size 10 --generation.completions_per_group 4"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "node1" / "metrics.jsonl"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) > 3):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        victim = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                      and f"{tmp_path / 'node1'}\0" in (p / "cmdline").read_bytes().decode(errors="replace"))
        os.kill(victim, signal.SIGKILL)  # as the out-of-memory killer would
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert "cumulative reward against the same nodes alone" not in out and "Traceback" not in err
    failed = next(line for line in err.splitlines() if line.startswith("sapo: failed: "))
    assert failed.startswith("sapo: failed: node1 (tiny-a) killed by SIGKILL (as the kernel's out-of-memory killer does); "
                             "its last log line: ")
    assert "sapo: no comparison: 1 node(s) did not finish" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["complete"] and "vs_baseline" not in summary and len(summary["failed"]) == 1
    assert not (tmp_path / "summary.png").exists()


def test_the_summary_figure_draws_each_arm_and_model_as_one_mean_with_a_band_at_any_number_of_nodes(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from node import figure

    def node(name: str, preset: str, level: float, companion: bool = False) -> SimpleNamespace:
        rows = [{"round": r, "reward_mean": None if r == 0 else level, "eval_accuracy": level if r % 5 == 0 else None}
                for r in range(11)]
        return SimpleNamespace(name=name, preset=preset, rows=rows, companion=companion)

    arms = {"swarm": [node(f"node{k}", ("tiny-a", "tiny-b")[k % 2], 0.5 + k / 100) for k in range(8)],
            "alone": [node(f"silo{k}", ("tiny-a", "tiny-b")[k % 2], 0.2 + k / 100) for k in range(8)]}
    arms["swarm"].append(node("node8", "tiny-a", 9.0, companion=True))  # ran a length of its own: left out
    drawn = []
    real = figure._band
    monkeypatch.setattr(figure, "_band", lambda ax, curves, label, style: drawn.append((label, curves)) or
                        real(ax, curves, label, style))
    figure.plot(arms, tmp_path / "summary.png", "16 nodes")
    assert [label for label, _ in drawn[::2]] == ["swarm: 4 tiny-a nodes", "swarm: 4 tiny-b nodes",
                                                  "alone: 4 tiny-a nodes", "alone: 4 tiny-b nodes"]
    rewards = drawn[0][1]
    assert len(rewards) == 4 and sorted(c[10] for c in rewards) == pytest.approx([0.5, 0.52, 0.54, 0.56])
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_swarm_watch_reads_a_metrics_file_rewound_on_resume_from_the_start(tmp_path):
    # a resumed node moves the rounds after its checkpoint aside and replaces metrics.jsonl with a shorter
    # file; the watch then seeked into the middle of a line and `sapo swarm` died with a JSONDecodeError
    from node.metrics import MetricsLog
    from node.swarm import Child

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"round": r, "pad": "x" * 50}) + "\n" for r in range(1, 41)))
    child = Child("node0", "tiny-a", tmp_path, proc=None, dashboard="", rounds=40)
    child.refresh()
    assert [r["round"] for r in child.rows] == list(range(1, 41))
    assert MetricsLog(path).rewind(to_round=30) == 10
    with open(path, "a") as f:
        f.write(json.dumps({"round": 31}) + "\n" + '{"round": 3')  # the next round, and a torn line
    child.refresh()
    assert [r["round"] for r in child.rows] == list(range(1, 32))


def test_the_swarm_watch_keeps_every_round_when_a_node_rotates_its_metrics(tmp_path):
    from node.metrics import MetricsLog
    from node.swarm import Child
    from tests.test_metrics import row

    log = MetricsLog(tmp_path / "metrics.jsonl", rotate_bytes=2500)  # an archive every 3 rounds
    child = Child("node0", "tiny-a", tmp_path, proc=None, dashboard="", rounds=40)
    for r in range(10):
        log.append(row(r))
        child.refresh()
    assert len(log.archives()) == 3
    assert [m["round"] for m in child.rows] == list(range(10))


def test_a_second_swarm_on_a_folder_in_use_is_refused_in_one_line_and_starts_nothing(tiny_a, cache_dir, tmp_path):
    from node.preflight import lock_out_dir

    out = tmp_path / "s"
    out.mkdir()
    held = lock_out_dir(out)  # the first swarm's hold on its folder
    try:
        r = run_sapo("swarm", "--nodes", "2", "--rounds", "1", "--presets", "tiny-a", "--out", str(out),
                     "--cache-dir", str(cache_dir))
    finally:
        os.close(held)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"sapo: config error: --out: {out} is in use by another node "
                                                 f"(pid {os.getpid()}): stop that node, or choose another --out")
    assert sorted(p.name for p in out.iterdir()) == [".node.lock"]
