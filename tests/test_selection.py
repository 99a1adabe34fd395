"""Swarm sampling rules: what takes the J external slots and the I local ones, and what the adaptive
rule learns (and saves) about peers and tasks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from node.selection import SelectionConfig, Selector, SupportGate, fair_order, informative
from p2p.config import PoolConfig
from p2p.pool import RolloutPool
from p2p.wire import VERSION, WireGroup, WireMessage
from rewards import TaskRef, regenerate
from rewards.config import TasksConfig
from trainer.groups import scored_group

NOW = 1_800_000_000.0


def test_the_nodes_policy_and_a_bootstrap_node_load_no_torch():
    """What to sample, accept and relay is policy, not training: a bootstrap-only node and the swarm simulator
    use it without loading torch (a bootstrap node measured 412 MB with it, 106 MB without)."""
    code = ("import sys, node.selection, node.bootstrap; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]


def group(index: int, signal: bool, dataset: str = "arith", wrap: str = "") -> WireGroup:
    """Four completions of a task: half right (after `wrap`) when `signal`, else all wrong (equal rewards)."""
    ref = TaskRef(dataset, {}, seed=3, index=index)
    right, wrong = f"{wrap}<answer>{regenerate(ref).answer}</answer>", "<answer>wrong</answer>"
    texts = [right, wrong, right, wrong] if signal else [wrong] * 4
    return WireGroup(dataset=ref.dataset, config={}, seed=ref.seed, index=ref.index, completions=texts)


def offer(pool: RolloutPool, peer: str, groups: list[WireGroup], created: float = NOW) -> None:
    pool.add(WireMessage(v=VERSION, peer=peer, model="m", round=1, created=created, groups=groups), now=created)


OWN_LOGPROB = -0.5  # the mean token log-prob of this node's own writing, in these tests


FLOOR = -5.0  # grpo.external_min_logprob: the trainer masks external rows below it


def logprobs(groups) -> list[list[float]]:
    """A stand-in policy: text opening with 'z' is off this node's own writing (below its support gate, above the
    trainer's floor, as a one-letter prefix scores under SmolLM2), with 'zzzzzz' far off (below the floor), the
    rest like it."""
    def lp(i: int, text: str) -> float:
        return -8.0 if text.startswith("zzzzzz") else -3.0 if text.startswith("z") else OWN_LOGPROB + 0.1 * (i % 2)
    return [[lp(i, text) for i, text in enumerate(g.completions)] for g in groups]


def selector(**cfg) -> Selector:
    """A selector whose support gate has seen a window of this node's own completions."""
    sel = Selector(SelectionConfig(**cfg), TasksConfig(), logprobs=logprobs, floor=FLOOR)
    sel.observe_own([OWN_LOGPROB + 0.01 * i for i in range(-32, 32)])
    return sel


def pick(sel: Selector, pool: RolloutPool, round_: int = 1, seed: int = 0):
    return sel.external(pool, random.Random(seed), round_)


@pytest.mark.parametrize("rule", ["signal", "guarded", "adaptive"])
def test_a_group_with_uniform_rewards_never_takes_a_slot(rule):
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "a", [group(i, signal=i % 3 == 0) for i in range(12)])  # 4 informative of 12
    offer(pool, "b", [group(100 + i, signal=False) for i in range(6)])
    p = pick(selector(rule=rule, external_groups=3), pool)
    assert len(p.groups) == 3 and all(informative(g) for g in p.groups)
    assert p.informative == 3 and p.inspected == 3 + p.dropped["uniform_rewards"]
    p = pick(selector(rule=rule, external_groups=8), pool)  # more slots than informative groups left
    assert [informative(g) for g in p.groups] == [True] and len(pool) == 0
    assert p.dropped == {"uniform_rewards": p.inspected - 1}


def test_the_uniform_rule_takes_groups_whatever_their_rewards():
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "a", [group(i, signal=False) for i in range(4)])
    p = pick(selector(rule="uniform", external_groups=3), pool)
    assert (len(p.groups), p.inspected, p.informative, dict(p.dropped)) == (3, 3, 0, {})


def test_signal_re_scores_at_most_max_inspect_groups_a_round():
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "a", [group(i, signal=False) for i in range(20)] + [group(99, signal=True)])
    p = pick(selector(rule="signal", external_groups=2, max_inspect=5), pool)
    assert (p.groups, p.inspected, len(pool)) == ([], 5, 16)


def test_the_adaptive_rule_comes_to_prefer_a_peer_whose_groups_carry_signal_and_still_explores():
    sel = selector(rule="adaptive", external_groups=1, max_inspect=1, explore=0.1)
    inspected = Counter()
    for r in range(1, 301):
        pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
        offer(pool, "never", [group(2 * r, signal=False)])
        offer(pool, "useful", [group(2 * r + 1, signal=True)])
        p = pick(sel, pool, round_=r, seed=r)
        taken = {g.source for g in p.groups}
        inspected["useful" if taken or p.dropped["uniform_rewards"] == 0 else "never"] += 1
        if r == 50:
            early = inspected.copy()
    late = inspected - early
    assert late["useful"] > 0.85 * sum(late.values())
    assert late["never"] > 0  # the exploration floor keeps looking at the other peer
    assert sel.peers.beta("useful")[1] < 0.1 * sel.peers.beta("useful")[0] and sel.peers.counts["never"][:2] == [0.0, pytest.approx(sel.peers.counts["never"][1])]
    assert 0 < sel.peers.counts["never"][1] < sel.peers.counts["useful"][1]


def test_the_adaptive_rule_spreads_the_slots_over_peers_that_are_equally_useful():
    sel = selector(rule="adaptive", external_groups=4, explore=0.0)
    distinct = []
    for r in range(1, 61):
        pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
        for k, peer in enumerate("abcd"):
            offer(pool, peer, [group(1000 * r + 10 * k + i, signal=True) for i in range(4)])
        p = pick(sel, pool, round_=r, seed=r)
        assert len(p.groups) == 4
        distinct.append(len({g.source for g in p.groups}))
    assert sum(distinct[30:]) / 30 >= 3.5  # once their usefulness is known, about one group per peer


def test_adaptive_state_survives_a_checkpoint_and_a_resumed_selector_chooses_exactly_the_same():
    def pools(r: int) -> RolloutPool:
        pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
        for k, peer in enumerate("abcd"):
            offer(pool, peer, [group(100 * r + 10 * k + i, signal=(i + k + r) % (k + 2) == 0) for i in range(3)])
        return pool

    def run(sel: Selector, rounds: range) -> list:
        return [[(g.source, g.task.ref.index) for g in pick(sel, pools(r), round_=r, seed=r).groups] for r in rounds]

    straight = selector(rule="adaptive", external_groups=2, max_inspect=3)
    first = run(straight, range(1, 21))
    resumed = selector(rule="adaptive", external_groups=2, max_inspect=3)
    resumed.load_state_dict(json.loads(json.dumps(straight.state_dict())))  # as the checkpoint stores it
    assert run(resumed, range(21, 41)) == run(straight, range(21, 41))
    assert len({tuple(map(tuple, x)) for x in first}) > 1  # the choices do depend on the round


def test_statistics_stay_bounded_and_forget_the_least_recently_seen():
    sel = selector(rule="adaptive", external_groups=1, max_tracked=3)
    for r, peer in enumerate("abcde", start=1):
        pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
        offer(pool, peer, [group(r, signal=True)])
        pick(sel, pool, round_=r)
    assert sorted(sel.peers.counts) == ["c", "d", "e"]


def test_local_groups_fill_their_slots_informative_first_when_over_drawn():
    sel = selector(local_overdraw=2.0)
    assert sel.local_tasks(4) == 8 and selector(local_overdraw=1.5).local_tasks(3) == 5
    tasks = [regenerate(TaskRef("arith", {}, 0, i)) for i in range(6)]
    groups = [scored_group(t, [f"<answer>{t.answer}</answer>", "x"] if i in (2, 4) else ["x", "x"], 0.0)
              for i, t in enumerate(tasks)]
    kept = sel.local(groups, slots=3)
    assert [g.task.ref.index for g in kept] == [2, 4, 0]
    assert sel.local(groups[:2], slots=3) == groups[:2]


def test_fair_order_spreads_over_peers_before_a_second_group_from_any_newest_first():
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    for peer, n in (("a", 10), ("b", 1), ("c", 3), ("d", 2)):
        for i in range(n):
            offer(pool, peer, [group(100 * ord(peer) + i, signal=True)], created=NOW + i)
    order = fair_order(pool.groups(now=NOW), random.Random(1))
    assert sorted(g.peer for g in order[:4]) == ["a", "b", "c", "d"]
    assert Counter(g.peer for g in order[4:9]) == {"a": 2, "c": 2, "d": 1}
    assert [g.created for g in order if g.peer == "a"] == [NOW + i for i in reversed(range(10))]


def test_the_selection_config_rejects_bad_values_naming_the_field():
    from node.config import ConfigError, load_config

    for bad, field in (({"rule": "best"}, "selection.rule"), ({"local_overdraw": 0.5}, "selection.local_overdraw"),
                       ({"explore": 2}, "selection.explore")):
        with pytest.raises(ConfigError, match=f"^{field}: "):
            load_config(None, {"selection": bad})


def test_proven_peers_are_inspected_first_and_fresh_identities_get_the_explore_share():
    sel = selector(rule="signal", external_groups=2, explore=0.1)
    pool = RolloutPool(PoolConfig(size=1000, max_peer_share=1.0, unproven_share=1.0, max_age_s=1e9), proven=sel.proven)
    offer(pool, "honest", [group(0, signal=True)])
    assert [g.source for g in pick(sel, pool).groups] == ["honest"]
    assert sel.proven("honest") and not sel.proven("sybil0")  # a group of its carried signal here
    used, junk_inspected = 0, 0
    for r in range(2, 22):
        offer(pool, "honest", [group(10 * r + i, signal=True) for i in range(2)], created=NOW + r)
        for h in range(6):
            offer(pool, f"sybil{h}", [group(1000 * r + 10 * h + i, signal=False) for i in range(10)], created=NOW + r)
        p = pick(sel, pool, r, seed=r)
        used += sum(g.source == "honest" for g in p.groups)
        junk_inspected += p.dropped["uniform_rewards"]
    assert used == 40  # every honest group, every round
    assert junk_inspected < 20  # about the explore share (10%) of ~2 inspections a round; fair order would spend ~12
    assert not any(sel.proven(f"sybil{h}") for h in range(6))


def test_a_newcomer_is_still_inspected_and_taken_when_it_carries_signal():
    sel = selector(rule="signal", external_groups=2, explore=0.1)
    pool = RolloutPool(PoolConfig(size=1000, max_peer_share=1.0, max_age_s=1e9), proven=sel.proven)
    offer(pool, "old", [group(0, signal=True)])
    pick(sel, pool)
    offer(pool, "old", [group(i, signal=False) for i in range(1, 5)])
    offer(pool, "newcomer", [group(50, signal=True)])
    p = pick(sel, pool, round_=2)
    assert [g.source for g in p.groups] == ["newcomer"] and sel.proven("newcomer")


def test_the_support_gate_cuts_at_a_quantile_of_the_nodes_own_recent_writing_once_it_has_enough():
    gate = SupportGate(quantile=0.1, window=80)
    gate.observe([-1.0] * 15)
    assert gate.cutoff() is None  # fewer than MIN_OWN_ROWS: no reference yet
    gate.observe([-0.01 * i for i in range(100)])  # the window keeps the last 80: -0.20 .. -0.99
    assert len(gate.own) == 80 and gate.cutoff() == pytest.approx(-0.91)  # 8 of 80 lie below
    gate.observe([-0.1] * 80)  # the node sharpened: the cut-off follows it
    assert gate.cutoff() == pytest.approx(-0.1)


def test_informative_counts_only_rows_to_push_up_that_are_left_in_the_loss():
    task = regenerate(TaskRef("arith", {}, 0, 1))
    g = scored_group(task, [f"<answer>{task.answer}</answer>", "x", f"<answer>{task.answer}</answer>", "x"], 0.0)
    assert informative(g)
    g.used = [False, True, True, True]
    assert informative(g)
    g.used = [False, True, False, True]  # only the wrong rows remain: nothing to push up
    assert not informative(g)


def test_guarded_uses_a_peer_that_writes_like_this_node_and_drops_one_whose_right_answers_it_would_not_write():
    sel = selector(rule="guarded", external_groups=4, explore=0.0)
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9), proven=sel.proven)
    offer(pool, "strong", [group(i, signal=True) for i in range(3)])
    offer(pool, "weak", [group(100 + i, signal=True, wrap="z") for i in range(3)])
    p = pick(sel, pool)
    assert sorted(g.source for g in p.groups) == ["strong"] * 3
    assert p.dropped["off_support"] == 3 and p.gated == 6 and p.informative == 6 and p.gate_s > 0
    assert sel.proven("strong") and not sel.proven("weak")
    for g in p.groups:
        assert g.used == [True] * 4
    signal_rule = selector(rule="signal", external_groups=4)  # today's rule: the weak peer's groups take slots
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "weak", [group(200 + i, signal=True, wrap="z") for i in range(3)])
    assert len(pick(signal_rule, pool).groups) == 3


def test_guarded_keeps_a_groups_usable_rows_and_leaves_out_the_rest():
    sel = selector(rule="guarded", external_groups=1)
    ref = TaskRef("arith", {}, seed=3, index=7)
    right = f"<answer>{regenerate(ref).answer}</answer>"
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "mixed", [WireGroup(dataset="arith", config={}, seed=3, index=7,
                                    completions=[right, "z" + right, "<answer>no</answer>", right])])
    p = pick(sel, pool)
    assert p.groups[0].used == [True, False, True, True] and p.gated == 1


def test_masked_sybil_groups_stop_taking_slots_under_guarded():
    """Six fresh identities flood groups whose right rows this node would never write: under `signal`
    they pass as informative, prove their senders and take the honest peer's slots; under `guarded`
    they are dropped before a slot and their senders stay unproven."""
    def attack(rule: str) -> tuple[int, bool]:
        sel = selector(rule=rule, external_groups=2, explore=0.1)
        pool = RolloutPool(PoolConfig(size=1000, max_peer_share=1.0, unproven_share=1.0, max_age_s=1e9),
                           proven=sel.proven)
        used = 0
        for r in range(1, 21):
            offer(pool, "honest", [group(10 * r + i, signal=True) for i in range(2)], created=NOW + r)
            for h in range(6):
                offer(pool, f"sybil{h}", [group(1000 * r + 10 * h + i, signal=True, wrap="zzzzzz") for i in range(10)],
                      created=NOW + r)
            used += sum(g.source == "honest" for g in pick(sel, pool, r, seed=r).groups)
        return used, any(sel.proven(f"sybil{h}") for h in range(6))

    assert attack("guarded") == (40, False)  # every honest group, every round
    used, proven = attack("signal")
    assert used < 30 and proven


def test_once_a_peer_is_proven_a_flood_gets_at_most_the_explore_share_of_max_inspect_a_round():
    """The honest peer offers fewer groups than J: the rest of the round may look at unproven groups,
    but only explore x max_inspect of them, not every Sybil group up to max_inspect."""
    sel = selector(rule="guarded", external_groups=4, explore=0.1, max_inspect=64, budget_s=60)
    pool = RolloutPool(PoolConfig(size=1000, max_peer_share=1.0, unproven_share=1.0, max_age_s=1e9), proven=sel.proven)

    def flood(r: int) -> None:
        for h in range(6):
            offer(pool, f"sybil{h}", [group(1000 * r + 10 * h + i, signal=True, wrap="zzzzzz") for i in range(10)],
                  created=NOW + r)

    flood(0)
    assert pick(sel, pool).inspected == 60  # nobody proven yet: the whole pool is looked at
    offer(pool, "honest", [group(1, signal=True)], created=NOW + 1)
    pick(sel, pool, 2)
    assert sel.proven("honest")
    for r in range(3, 8):
        offer(pool, "honest", [group(10 * r, signal=True)], created=NOW + r)
        flood(r)
        p = pick(sel, pool, r, seed=r)
        assert [g.source for g in p.groups] == ["honest"] and p.inspected == 1 + 7  # ceil(0.1 x 64) unproven


def test_a_peer_tried_and_never_useful_gets_the_explore_share_behind_newcomers_and_can_still_prove_itself():
    """No peer is proven: a weak peer whose every group the gate drops is looked at in full once, then only
    explore x max_inspect a round, after any peer not yet tried; once it writes usable groups it is proven."""
    sel = selector(rule="guarded", external_groups=4, explore=0.1, max_inspect=64, budget_s=60)
    pool = RolloutPool(PoolConfig(size=1000, max_peer_share=1.0, unproven_share=1.0, max_age_s=1e9), proven=sel.proven)
    offer(pool, "weak", [group(i, signal=True, wrap="z") for i in range(30)])
    first = pick(sel, pool)
    assert first.inspected == 30 and first.groups == [] and sel.tried("weak") and not sel.proven("weak")
    assert first.held_back == 0  # not tried when the round began
    offer(pool, "weak", [group(100 + i, signal=True, wrap="z") for i in range(30)], created=NOW + 2)
    offer(pool, "newcomer", [group(200 + i, signal=True, wrap="z") for i in range(10)], created=NOW + 2)
    second = pick(sel, pool, 2)
    assert second.inspected == 10 + 7 and second.groups == []  # the newcomer in full, then ceil(0.1 x 64)
    assert second.held_back == 30 - 7 and len(pool) == 30 - 7  # counted, and kept in the pool
    assert sel.tried("newcomer")
    offer(pool, "weak", [group(300 + i, signal=True) for i in range(5)], created=NOW + 3)
    third = pick(sel, pool, 3, seed=3)
    assert [g.source for g in third.groups] == ["weak"] * 4 and sel.proven("weak") and not sel.tried("weak")


def test_the_guarded_rule_takes_nothing_before_it_knows_the_nodes_own_writing():
    sel = Selector(SelectionConfig(rule="guarded", external_groups=2), TasksConfig(), logprobs=logprobs)
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "a", [group(i, signal=True) for i in range(2)])
    assert (pick(sel, pool).groups, len(pool)) == ([], 2)  # left in the pool for later rounds
    sel.observe_own([OWN_LOGPROB] * 64)
    assert len(pick(sel, pool).groups) == 2
    with pytest.raises(ValueError, match="log-probs"):
        Selector(SelectionConfig(rule="guarded"), TasksConfig())


def test_the_support_gates_reference_survives_a_checkpoint():
    sel = selector(rule="guarded")
    sel.observe_own([-0.3] * 10)
    resumed = Selector(SelectionConfig(rule="guarded"), TasksConfig(), logprobs=logprobs)
    resumed.load_state_dict(json.loads(json.dumps(sel.state_dict())))  # as the checkpoint stores it
    assert list(resumed.support.own) == list(sel.support.own) and resumed.support.cutoff() == sel.support.cutoff()
    resumed.load_state_dict({"peers": {}})  # a checkpoint from before the guarded rule
    assert resumed.support.cutoff() is None


def test_a_peer_whose_right_answers_are_padded_far_past_ours_keeps_to_the_explore_share():
    """The length attack: groups that carry signal, padded with plausible text up to the wire's limits, would
    prove their sender and take the honest slots; measured family by family against this node's own writing."""
    sel = selector(rule="signal", external_groups=2, explore=0.1, max_inspect=64, budget_s=60)
    own = scored_group(regenerate(TaskRef("arith", {}, seed=3, index=0)), ["<answer>1</answer>"] * 4, 0.0)
    sel.observe_own([], [own])
    pool = RolloutPool(PoolConfig(size=1000, max_peer_share=1.0, unproven_share=1.0, max_age_s=1e9), proven=sel.proven)
    pad = "Let me check that once more, step by step. " * 40

    def padded(index: int) -> WireGroup:
        g = group(index, signal=True)
        return WireGroup(dataset=g.dataset, config=g.config, seed=g.seed, index=g.index,
                         completions=[pad + c for c in g.completions])

    for r in range(1, 6):
        offer(pool, "honest", [group(100 * r, signal=True)], created=NOW + r)
        offer(pool, "verbose", [padded(100 * r + i) for i in range(1, 4)], created=NOW + r)
        pick(sel, pool, r, seed=r)
    assert sel.proven("honest") and not sel.proven("verbose")
    assert sel.peers.counts["verbose"][0] >= sel.peers.counts["honest"][0]  # its groups did carry signal
    assert sel.lengths.verbose("verbose") and not sel.lengths.verbose("honest")
    offer(pool, "honest", [group(900, signal=True)], created=NOW + 9)
    offer(pool, "verbose", [padded(900 + i) for i in range(1, 30)], created=NOW + 9)
    p = pick(sel, pool, 9, seed=9)
    assert [g.source for g in p.groups][:1] == ["honest"] and p.inspected <= 1 + 7  # ceil(0.1 x 64) of the padded
    restored = selector(rule="signal")
    restored.load_state_dict(json.loads(json.dumps(sel.state_dict())))  # a checkpoint keeps the measure
    assert restored.lengths.verbose("verbose") and restored.proven("honest") and not restored.proven("verbose")


@pytest.mark.parametrize("rule", ["signal", "guarded"])
def test_a_group_whose_right_rows_run_past_the_completion_budget_takes_no_slot(rule):
    """Rows past max_new_tokens are masked from the loss: a padded group would take a slot and give nothing."""
    sel = Selector(SelectionConfig(rule=rule, external_groups=2, budget_s=60), TasksConfig(), logprobs=logprobs,
                   fits=lambda texts: [len(t) <= 40 for t in texts])
    sel.observe_own([OWN_LOGPROB + 0.01 * i for i in range(-32, 32)])
    pool = RolloutPool(PoolConfig(size=1000, max_peer_share=1.0, unproven_share=1.0, max_age_s=1e9), proven=sel.proven)
    long = group(2, signal=True)
    long = WireGroup(dataset=long.dataset, config=long.config, seed=long.seed, index=long.index,
                     completions=["x" * 60 + c if "wrong" not in c else c for c in long.completions])
    offer(pool, "padder", [long])
    offer(pool, "honest", [group(1, signal=True)])
    p = pick(sel, pool)
    assert [g.source for g in p.groups] == ["honest"] and p.informative == 2  # both differ in reward
    assert p.dropped == Counter({"too_long": 1}) and not sel.proven("padder")


def own_groups(dataset: str, right: int, of: int = 8) -> list:
    """This node's own sampled group of a task of `dataset` with `right` of `of` completions right."""
    task = regenerate(TaskRef(dataset, {}, seed=5, index=0))
    return [scored_group(task, [f"<answer>{task.answer}</answer>"] * right + ["<answer>no</answer>"] * (of - right), 0.0)]


def test_scoped_trains_a_stronger_peers_right_rows_below_the_gate_on_that_family_and_gates_them_on_another():
    """A peer of another family writes text this node would not ('z...', below the support gate). On arith, where
    this node passes 1 in 8 and the peer, re-scored here, 1 in 2, its right rows are kept with the shaped weight;
    on reverse, where this node passes 8 in 8, they stay gated and the groups are dropped as under `guarded`."""
    offers = [group(i, signal=True, wrap="z") for i in range(4)] + \
             [group(100 + i, signal=True, dataset="reverse", wrap="z") for i in range(4)]
    picks = {}
    for rule in ("scoped", "guarded"):
        sel = selector(rule=rule, external_groups=8, explore=0.0, max_inspect=64, budget_s=60)
        for r in range(3):
            sel.observe_own([], own_groups("arith", 1) + own_groups("reverse", 8), round_=r)
        pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
        offer(pool, "gemma", offers)
        picks[rule] = sel, pick(sel, pool, 3)
    sel, p = picks["scoped"]
    assert sel.strength.stronger("gemma", "arith") and not sel.strength.stronger("gemma", "reverse")
    assert sorted(g.task.ref.dataset for g in p.groups) == ["arith"] * 4
    for g in p.groups:
        assert g.shaped == [True, False, True, False] and g.used is None  # the right rows, shaped; every row used
    assert p.shaped == 8 and p.gated == 8 and p.dropped["off_support"] == 4
    _, guarded = picks["guarded"]
    assert guarded.groups == [] and guarded.dropped["off_support"] == 8 and guarded.shaped == 0


def test_scoped_counts_no_row_the_trainer_masks_so_a_masked_sybil_stronger_on_paper_takes_no_slot():
    """Right answers behind 'zzzzzz' (below the trainer's floor): the peer is stronger on arith by re-scoring, but
    its right rows would be masked in the loss. Shaped, they made its groups take every slot and add no gradient
    (the masked flood under `scoped`: honest groups used fell to 17%); gated, they are dropped and prove nothing."""
    sel = selector(rule="scoped", external_groups=4, explore=0.0, max_inspect=64, budget_s=60)
    for r in range(3):
        sel.observe_own([], own_groups("arith", 1), round_=r)
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    offer(pool, "sybil", [group(i, signal=True, wrap="zzzzzz") for i in range(6)])
    offer(pool, "honest", [group(100 + i, signal=True) for i in range(2)])
    p = pick(sel, pool, 3)
    assert sel.strength.stronger("sybil", "arith")
    assert [g.source for g in p.groups] == ["honest", "honest"] and p.shaped == 0
    assert p.dropped["off_support"] == 6 and p.gated == 12 and not sel.proven("sybil")


def test_a_peer_cannot_claim_strength_with_answers_the_node_scores_wrong():
    """Rewards are re-scored: a peer whose arith answers are plausible but wrong here (another task's) measures a
    pass rate of 0, is never stronger, and its off-support groups stay gated under `scoped`."""
    sel = selector(rule="scoped", external_groups=4, explore=0.0, max_inspect=64, budget_s=60)
    sel.observe_own([], own_groups("arith", 1), round_=0)
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=1e9))
    forged = [WireGroup(dataset="arith", config={}, seed=3, index=i, completions=[
        f"z<answer>{regenerate(TaskRef('arith', {}, seed=3, index=i + 1)).answer}</answer>"] * 4) for i in range(8)]
    offer(pool, "liar", forged)
    p = pick(sel, pool)
    assert p.groups == [] and p.shaped == 0 and not sel.strength.stronger("liar", "arith")
    assert sel.strength.peers.counts["liar arith"][0] == 0  # none of its 32 completions right here


def test_family_strength_needs_enough_rows_decays_and_survives_a_checkpoint():
    sel = selector(rule="scoped")
    strength = sel.strength
    for r in range(2):
        strength.observe_own(own_groups("arith", 2), r)
    strength.observe("peer", own_groups("arith", 8)[0], 1)  # 8 of 8, but only 8 rows: too few to judge
    assert not strength.stronger("peer", "arith")
    strength.observe("peer", own_groups("arith", 8)[0], 2)
    assert strength.stronger("peer", "arith") and not strength.stronger("other", "arith")
    restored = selector(rule="scoped")
    restored.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert restored.strength.stronger("peer", "arith")
    strength.decay(0.5)  # forgotten evidence counts for less: below MIN_ROWS again
    assert not strength.stronger("peer", "arith")
