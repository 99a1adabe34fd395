"""Which peer-exchange hints a node dials (p2p/hints.py): failures held against address, host and giver."""

from __future__ import annotations

from p2p.hints import HOST_FAILURES, SOURCE_FAILURES, TOTAL_FAILURES, HintBudget, Recent, host_of


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


def test_failed_hints_of_unproven_sources_are_bounded_all_together_but_a_bootstrap_peers_are_not():
    """30 fresh liar ids, each naming other hosts, passed every per-address, per-host and per-source budget: 3 nodes
    opened 421 connections to 56 hosts in 62 s. All unproven sources together now get `TOTAL_FAILURES` addresses."""
    budget = HintBudget(window_s=60)
    assert budget.allowance(0.0, proven=False) == TOTAL_FAILURES
    budget.failed(["/ip4/198.18.1.1/tcp/1", "/ip4/198.18.1.2/tcp/1"], source="liar0", now=0.0)  # one hint, two addresses
    for k in range(1, TOTAL_FAILURES - 2):
        budget.failed([f"/ip4/198.18.0.{k}/tcp/1"], source=f"liar{k}", now=float(k))
    assert budget.allowance(10.0, proven=False) == 1 and budget.may_ask("liar99", 10.0)
    budget.failed(["/ip4/198.18.0.99/tcp/1"], source="liar99", now=10.0)
    assert budget.allowance(11.0, proven=False) == 0  # no hint of any unproven source is dialed now
    assert budget.allowance(11.0, proven=True) > 8  # the operator's bootstrap peers still introduce peers
    budget.failed(["/ip4/198.18.2.1/tcp/1"], source="bootstrap", now=11.0, proven=True)
    assert budget.allowance(60.5, proven=False) == 2  # the first hint's two left the window; the bootstrap's never counted


def test_a_hinted_address_that_fails_is_one_connection_attempt():
    """py-libp2p retried each failed dial 3 times: a failed hint was 4 connections to a host it may not know."""
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

    from p2p.config import P2PConfig
    from p2p.host import GossipHost
    from p2p.policy import MessagePolicy
    from rewards.scoring import group_carries_signal

    accepted: list[int] = []

    async def hang_up(stream: trio.SocketStream) -> None:  # a port that answers, and is no libp2p peer
        accepted.append(1)
        await stream.aclose()

    async def main() -> bool:
        cfg = P2PConfig(network="local", listen=["/ip4/127.0.0.1/tcp/0"])
        host = GossipHost(cfg, create_new_key_pair(), MessagePolicy(cfg.limits, cfg.rollout_topic_base(),
                                                                    signal=group_carries_signal), on_message=lambda m: None)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, hang_up, listeners)
            async with host.host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                stranger = ID.from_pubkey(create_new_key_pair().public_key)
                reached = await host._dial(PeerInfo(stranger, [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")]))
                await trio.sleep(0.5)  # a retry would come within this
            nursery.cancel_scope.cancel()
        return reached

    assert trio.run(main) is False
    assert len(accepted) == 1
