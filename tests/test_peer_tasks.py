"""`selection.when_short = peer_tasks`: the tasks of peers' groups that carried signal here but whose text the
node could not use fill its empty external slots, sampled with its own model."""

from __future__ import annotations

import json

import pytest

from lab.probe import ProbeProcess
from node.selection import SelectionConfig, Selector
from p2p.config import PoolConfig
from p2p.pool import RolloutPool
from rewards.config import TasksConfig
from tests.conftest import node_beside
from tests.test_selection import group, logprobs, offer, pick, OWN_LOGPROB


def selector(**cfg) -> Selector:
    sel = Selector(SelectionConfig(rule="guarded", explore=0.0, max_inspect=64, budget_s=60, **cfg), TasksConfig(),
                   logprobs=logprobs)
    sel.observe_own([OWN_LOGPROB + 0.01 * i for i in range(-32, 32)])
    return sel


def test_tasks_of_gated_groups_are_remembered_newest_first_taken_once_and_kept_in_checkpoints():
    sel = selector(when_short="peer_tasks", external_groups=4)
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "other-model", [group(i, signal=True, wrap="z") for i in range(3)] + [group(50, signal=False, wrap="z")])
    p = pick(sel, pool)
    assert p.groups == [] and p.dropped["off_support"] == 3 and p.dropped["uniform_rewards"] == 1
    tasks = sel.peer_tasks(2)
    assert len(tasks) == 2 and {t.ref.index for t in tasks} < {0, 1, 2}  # never the group without signal
    restored = selector(when_short="peer_tasks", external_groups=4)
    restored.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert [t.ref for t in restored.peer_tasks(3)] == [t.ref for t in sel.peer_tasks(3)]
    assert restored.peer_tasks(3)[0].answer == sel.peer_tasks(3)[0].answer
    assert sel.took_peer_tasks(tasks) == 2 and len(sel.peer_tasks(3)) == 1
    plain = selector(external_groups=4)  # fill_local: nothing remembered
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "other-model", [group(i, signal=True, wrap="z") for i in range(3)])
    pick(plain, pool)
    assert plain.peer_tasks(3) == []


@pytest.mark.slow
def test_a_node_samples_the_tasks_of_a_peers_unusable_groups_in_its_empty_external_slots(tiny_a, cache_dir, tmp_path):
    """A peer whose right answers come wrapped in text tiny-a would never write (its groups fail the support gate,
    or run past its completion budget): under `peer_tasks` their tasks, not their text, fill the node's empty
    external slots."""
    peer = ProbeProcess(tmp_path, "peer", "--rate", "2", "--groups", "4", "--completions", "4", "--chars", "40",
                        "--wrap", "Sponsored: visit our site for more answers! ")
    code, err, rows = node_beside(
        peer, tmp_path / "node", ["--model.cache_dir", str(cache_dir), "--rounds", "100000", "--tasks", "arith",
                                  "--selection.when_short", "peer_tasks", "--tasks.eval_size", "10", "--run.eval_every",
                                  "1000", "--run.checkpoint_every", "1000", "--status.listen", "127.0.0.1:0"],
        lambda rows: any(r.get("n_peer_tasks") for r in rows), 240, "a round with peer tasks")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    used = [r for r in rows if r["n_peer_tasks"]]
    assert all(r["n_peer_tasks"] <= 4 - r["n_external"] and r["n_local"] == 8 - r["n_external"] for r in used), used
    unusable = sum((r.get("external_dropped") or {}).get(why, 0) for r in rows for why in ("off_support", "too_long"))
    assert unusable >= sum(r["n_peer_tasks"] for r in used) > 0
