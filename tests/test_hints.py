"""Which peer-exchange hints a node dials (p2p/hints.py): failures held against address, host and giver."""

from __future__ import annotations

from p2p.hints import HOST_FAILURES, SOURCE_FAILURES, HintBudget, Recent, host_of


def test_hosts_group_every_port_and_a_circuit_is_its_own():
    assert host_of("/ip4/198.18.0.7/tcp/7420") == host_of("/ip4/198.18.0.7/tcp/1") == "/ip4/198.18.0.7"
    assert host_of("/ip6/::1/tcp/9") == "/ip6/::1"
    circuit = "/ip4/198.18.0.7/tcp/7420/p2p/12D3KooWRelay/p2p-circuit/p2p/12D3KooWPeer"
    assert host_of(circuit) == circuit


def test_a_host_is_left_alone_after_its_failures_and_again_dialable_after_the_window():
    budget = HintBudget(window_s=60)
    for port in range(HOST_FAILURES):
        assert budget.may_dial(f"/ip4/198.18.0.7/tcp/{port}", 0.0)
        budget.failed([f"/ip4/198.18.0.7/tcp/{port}"], source=f"liar{port}", now=float(port))
    assert not budget.may_dial("/ip4/198.18.0.7/tcp/9999", 10.0)  # a fresh port of the same host
    assert budget.may_dial("/ip4/198.18.0.8/tcp/9999", 10.0)  # another host
    assert budget.may_dial("/ip4/198.18.0.7/tcp/9999", 61.0) and not budget.may_dial("/ip4/198.18.0.7/tcp/3", 62.0)
    assert budget.may_dial("/ip4/198.18.0.7/tcp/3", 64.0)


def test_a_peer_whose_hints_keep_failing_is_not_asked_again_within_the_window():
    budget = HintBudget(window_s=60)
    for k in range(SOURCE_FAILURES):
        assert budget.may_ask("liar", float(k))
        budget.failed([f"/ip4/198.18.0.{k}/tcp/1"], source="liar", now=float(k))
    assert not budget.may_ask("liar", 10.0) and budget.may_ask("honest", 10.0)
    assert budget.may_ask("liar", 61.0)


def test_recent_counts_forget_the_oldest_keys_past_the_cap():
    recent = Recent(window_s=10, max_keys=3)
    for key in "abcd":
        recent.add(key, 0.0)
    assert [recent.count(k, 1.0) for k in "abcd"] == [0, 1, 1, 1]
