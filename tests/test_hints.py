"""Which peer-exchange hints a node dials (p2p/hints.py): failures held against address, host and giver."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2p.config import P2PConfig
from p2p.host import LAN_SOURCE, GossipHost, _addr_key
from p2p.policy import MessagePolicy
from rewards.scoring import group_carries_signal
from p2p.hints import ADDRS_PER_PEER, HOST_FAILURES, SOURCE_FAILURES, TOTAL_FAILURES, HintBudget, Recent, host_of


def test_hosts_group_every_port_and_a_circuit_is_its_own():
    assert host_of("/ip4/198.18.0.7/tcp/7420") == host_of("/ip4/198.18.0.7/tcp/1") == "/ip4/198.18.0.7"
    assert host_of("/ip6/::1/tcp/9") == "/ip6/::1"
    circuit = "/ip4/198.18.0.7/tcp/7420/p2p/12D3KooWRelay/p2p-circuit/p2p/12D3KooWPeer"
    assert host_of(circuit) == circuit
    lan = "/ip4/192.168.1.20/tcp/7420/p2p/12D3KooWPeer"  # a peer at an address, as an mDNS answer is kept
    assert host_of(lan) == lan


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
    assert budget.allowance(0.0, proven=False) == ADDRS_PER_PEER  # one peer's addresses: never the whole budget
    budget.failed(["/ip4/198.18.1.1/tcp/1", "/ip4/198.18.1.2/tcp/1"], source="liar0", now=0.0)  # one hint, two addresses
    for k in range(1, TOTAL_FAILURES - 2):
        budget.failed([f"/ip4/198.18.0.{k}/tcp/1"], source=f"liar{k}", now=float(k))
    assert budget.allowance(10.0, proven=False) == 1 and budget.may_ask("liar99", 10.0)
    budget.missed(["/ip4/198.18.0.99/tcp/1"], now=10.0)  # a peer's dead first address, though its second answered
    assert budget.allowance(11.0, proven=False) == 0  # no hint of any unproven source is dialed now
    assert budget.allowance(11.0, proven=True) == ADDRS_PER_PEER  # the operator's bootstrap peers still introduce peers
    budget.failed(["/ip4/198.18.2.1/tcp/1"], source="bootstrap", now=11.0, proven=True)
    assert budget.allowance(60.5, proven=False) == 2  # the first hint's two left the window; the bootstrap's never counted


def test_addresses_being_dialed_hold_their_share_of_the_allowance_until_the_dial_ends():
    """Peer exchange, the DHT and mDNS dial hints at once: each chose its addresses from the same room left, and
    between them they overdrew `TOTAL_FAILURES`. Chosen addresses are held until their dial ends."""
    budget = HintBudget(window_s=60)
    for k in range(TOTAL_FAILURES - 3):
        budget.failed([f"/ip4/198.18.0.{k}/tcp/1"], source=f"liar{k}", now=0.0)
    with budget.dialing(ADDRS_PER_PEER, proven=False):
        assert budget.allowance(1.0, proven=False) == 1  # 3 left, 2 of them being dialed
        with budget.dialing(1, proven=False):
            assert budget.allowance(1.0, proven=False) == 0
            with budget.dialing(ADDRS_PER_PEER, proven=True):  # a bootstrap peer's hints hold nothing
                assert budget.allowance(1.0, proven=False) == 0 and budget.allowance(1.0, proven=True) == ADDRS_PER_PEER
        budget.failed(["/ip4/198.18.1.1/tcp/1", "/ip4/198.18.1.2/tcp/1"], source="liar", now=2.0)
    assert budget.allowance(2.0, proven=False) == 1  # the two failures replaced what they held, the third came back


def gossip_host() -> GossipHost:
    cfg = P2PConfig(network="local", listen=["/ip4/127.0.0.1/tcp/0"])
    return GossipHost(cfg, create_new_key_pair(), MessagePolicy(cfg.limits, cfg.rollout_topic_base(),
                                                                signal=group_carries_signal), on_message=lambda m: None)


def stranger() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


LOOPBACK = [Multiaddr("/ip4/127.0.0.1/tcp/0")]


@asynccontextmanager
async def running(*hosts: GossipHost) -> AsyncIterator[None]:
    """The hosts listening on loopback with their gossip services (which a new connection waits for), none of the
    node's own tasks."""
    async with AsyncExitStack() as stack:
        for h in hosts:
            await stack.enter_async_context(h.host.run(listen_addrs=LOOPBACK))
            await stack.enter_async_context(background_trio_service(h.pubsub))
            await stack.enter_async_context(background_trio_service(h.gossipsub))
        yield


async def hang_up_on(accepted: list[int], n: int, nursery: trio.Nursery) -> list[Multiaddr]:
    """`n` ports that answer and are no libp2p peer; each connection accepted is appended to `accepted`."""
    addrs = []
    for _ in range(n):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]

        async def hang_up(stream: trio.SocketStream, port: int = port) -> None:
            accepted.append(port)
            await stream.aclose()

        nursery.start_soon(trio.serve_listeners, hang_up, listeners)
        addrs.append(Multiaddr(f"/ip4/127.0.0.1/tcp/{port}"))
    return addrs


def test_a_hinted_address_that_fails_is_one_connection_attempt():
    """py-libp2p retried each failed dial 3 times: a failed hint was 4 connections to a host it may not know."""
    accepted: list[int] = []

    async def main() -> bool:
        host = gossip_host()
        async with trio.open_nursery() as nursery:
            [addr] = await hang_up_on(accepted, 1, nursery)
            async with host.host.run(listen_addrs=LOOPBACK):
                reached = await host._dial(PeerInfo(stranger(), [addr]))
                await trio.sleep(0.5)  # a retry would come within this
            nursery.cancel_scope.cancel()
        return reached

    assert trio.run(main) is False
    assert len(accepted) == 1


def test_a_hinted_peer_whose_first_address_is_dead_is_reached_at_its_second():
    """py-libp2p dials one TCP address of a peer's: the second address of an honest peer was never tried, and its
    failed first charged both."""
    accepted: list[int] = []

    async def main() -> tuple[bool, bool, bool]:
        node, peer = gossip_host(), gossip_host()
        async with trio.open_nursery() as nursery:
            [dead] = await hang_up_on(accepted, 1, nursery)
            async with running(node, peer):
                live = peer.host.get_transport_addrs()[0]
                await node._dial_hints(stranger(), [PeerInfo(peer.me, [dead, live])], set())
                reached = peer.me in node.host.get_connected_peers()
                now = trio.current_time()
                charged = (node.hints.may_dial(_addr_key(dead), now), node.hints.may_dial(_addr_key(live), now))
            nursery.cancel_scope.cancel()
        return reached, *charged

    assert trio.run(main) == (True, False, True)  # connected; the dead address is held back, the live one is not
    assert len(accepted) == 1


def test_a_made_up_peer_with_eight_addresses_costs_the_addresses_dialed_not_the_whole_budget():
    """One made-up provider with 8 addresses spent the whole unproven budget (`TOTAL_FAILURES`) for the window, though
    py-libp2p dialed one of them: no other stranger's hint was dialed in that minute."""
    accepted: list[int] = []

    async def main() -> tuple[list[Multiaddr], list[Multiaddr], GossipHost]:
        node = gossip_host()
        async with trio.open_nursery() as nursery:
            lies, other = await hang_up_on(accepted, 8, nursery), await hang_up_on(accepted, 2, nursery)
            async with running(node):
                await node._dial_hints(stranger(), [PeerInfo(stranger(), lies)], set())
                await node._dial_hints(stranger(), [PeerInfo(stranger(), other)], set())
            nursery.cancel_scope.cancel()
        return lies, other, node

    lies, other, node = trio.run(main)
    ports = [int(str(a).split("/")[-1]) for a in lies]
    assert sorted(accepted[:ADDRS_PER_PEER]) == sorted(ports[:ADDRS_PER_PEER])  # the liar's first two, one attempt each
    assert len(accepted) == 2 * ADDRS_PER_PEER  # and the next stranger's hint was still dialed
    assert node.counts["hints_failed"] == 2


def test_a_spoofed_mdns_record_at_a_real_peers_address_does_not_keep_the_real_peer_away():
    """One spoofed mDNS record (a made-up id at a real peer's address) marked that address unreachable for 60 s, and
    py-libp2p reports an mDNS service only when it is first added: the real announcement of that minute was lost."""
    async def main() -> tuple[bool, int]:
        node, peer = gossip_host(), gossip_host()
        async with running(node, peer):
            addr = peer.host.get_transport_addrs()[0]
            await node._dial_hints(LAN_SOURCE, [PeerInfo(stranger(), [addr])], set())  # the spoof fails there
            failed = node.counts["hints_failed"]
            await node._dial_hints(LAN_SOURCE, [PeerInfo(peer.me, [addr])], node._connected())  # the real one, next
            return peer.me in node.host.get_connected_peers(), failed

    assert trio.run(main) == (True, 1)
