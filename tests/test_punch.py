"""Hole punching that GossipSub survives (p2p/punch.py): py-libp2p hosts in one trio run on 127.0.0.1, two of them
connected only through a third that serves circuit relay v2, as p2p/reach.py sets it up."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter

import pytest
import trio
import trio.testing
from libp2p import NOISE_PROTOCOL_ID, YAMUX_PROTOCOL_ID, ConnectionConfig, NoiseTransport, Yamux, new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
from libp2p.host.basic_host import BasicHost
from libp2p.network.config import RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.pubsub import Pubsub
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP, CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2p.config import P2PConfig
from p2p.hints import ADDRS_PER_PEER, SOURCE_FAILURES, TOTAL_FAILURES, HintBudget
from p2p.pubsub import GuardedPubsub, gossipsub_router
from p2p.punch import GuardedDCUtR, Punch, relayed
from p2p.reach import Reachability, is_open
from tests.test_hints import gossip_host

TOPIC = "t"
LIMITS = RelayLimits(duration=600, data=64 << 20, max_circuit_conns=8, max_reservations=8)  # p2p.relay_circuit_*


def host():
    """A host as GossipHost makes one: Noise, yamux, one connection per peer, no dial retries."""
    kp = create_new_key_pair()
    h = new_host(key_pair=kp, sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(kp, noise_privkey=new_x25519().private_key)},
                 muxer_opt={YAMUX_PROTOCOL_ID: Yamux}, connection_config=ConnectionConfig(max_connections_per_peer=1))
    h.get_network().retry_config = RetryConfig(max_retries=0)
    return h


class Node:
    def __init__(self, guarded: bool):
        self.host = host()
        self.counts: Counter[str] = Counter()
        self.router = gossipsub_router(self.counts, P2PConfig())
        self.pubsub = (GuardedPubsub(self.host, self.router, strict_signing=True, counts=self.counts) if guarded
                       else Pubsub(self.host, self.router, strict_signing=True))
        self.relay = CircuitV2Protocol(self.host, LIMITS)
        self.transport = CircuitV2Transport(self.host, self.relay, RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT))
        self.got: list[bytes] = []

    def conns(self, other: Node) -> list:
        return [c for c in self.host.get_network().get_connections(other.host.get_id()) if is_open(c)]

    def stream_conn(self, other: Node):
        """The connection our gossip stream to `other` rides, open or not (None without a stream)."""
        stream = self.pubsub.peers.get(other.host.get_id())
        return None if stream is None else stream.muxed_conn


@contextlib.asynccontextmanager
async def relayed_pair(guarded: bool):
    """Nodes a and b, each with a reservation on relay r, subscribed to TOPIC and connected only through r."""
    r, a, b = host(), Node(guarded), Node(guarded)
    hop = CircuitV2Protocol(r, LIMITS, allow_hop=True)
    listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
    async with contextlib.AsyncExitStack() as stack:
        for h in (r, a.host, b.host):
            await stack.enter_async_context(h.run(listen))
        for service in (hop, a.relay, b.relay, a.pubsub, a.router, b.pubsub, b.router):
            await stack.enter_async_context(background_trio_service(service))
        nursery = await stack.enter_async_context(trio.open_nursery())
        relay_addr = r.get_addrs()[0]
        for n in (a, b):
            await n.host.connect(info_from_p2p_addr(relay_addr))
            assert await n.transport.reserve(await n.host.new_stream(r.get_id(), [HOP]), r.get_id(), nursery)

            async def read(n=n, sub=await n.pubsub.subscribe(TOPIC)) -> None:
                while True:
                    n.got.append((await sub.get()).data)

            nursery.start_soon(read)
        await a.transport.dial(Multiaddr(f"{relay_addr}/p2p-circuit/p2p/{b.host.get_id()}"))
        for x, y in ((a, b), (b, a)):
            await x.pubsub.wait_for_mesh(y.host.get_id(), TOPIC, timeout=10)
            assert [relayed(c) for c in x.conns(y)] == [True] and x.stream_conn(y) is x.conns(y)[0].muxed_conn
        yield nursery, a, b
        nursery.cancel_scope.cancel()


async def arrives(node: Node, data: bytes, within: float) -> bool:
    with trio.move_on_after(within):
        while data not in node.got:
            await trio.sleep(0.05)
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [False, True], ids=["py-libp2p", "GuardedPubsub"])
def test_a_gossip_stream_left_on_a_closed_relayed_connection_stops_gossip_unless_moved(guarded):
    """What a punch does to GossipSub, without the punch's timing: a direct connection opens beside the relayed one,
    then the relayed one closes (as DCUtR closes it 60 s after a punch, py-libp2p's per-peer limit trims it, or a
    relay ends the circuit). py-libp2p's Pubsub keeps its stream to the peer on the closed connection, with no error
    (its disconnect handler skips a peer that still has a connection, its read loop ends quietly). The next message
    written into it fails and is lost; the failure makes a forget b's subscriptions, and b, with nothing to write
    into its own dead stream, never reopens it to tell them again: a sends b nothing more, with no error.
    GuardedPubsub reopens both ends' streams on the direct connection when the relayed one closes."""
    async def scenario() -> None:
        async with relayed_pair(guarded) as (_, a, b):
            circuit = a.conns(b)[0]
            direct = await a.host.get_network().dial_addr(b.host.get_addrs()[0], b.host.get_id())
            assert not relayed(direct)
            await circuit.close()
            await trio.sleep(1.5)  # nothing is published meanwhile
            assert [relayed(c) for c in a.conns(b)] == [False]
            moved = a.stream_conn(b) is direct.muxed_conn
            await a.pubsub.publish(TOPIC, b"first after the move")
            first = await arrives(b, b"first after the move", 3.0)
            await a.pubsub.publish(TOPIC, b"second")
            second = await arrives(b, b"second", 5.0)
            knows = b.host.get_id() in a.pubsub.peer_topics.get(TOPIC, set())  # that b reads TOPIC
            assert (moved, first, second, knows) == (guarded,) * 4
            assert a.counts["gossip_streams_moved"] == int(guarded)

    trio.run(scenario)


@pytest.mark.slow
def test_after_a_punch_gossip_flows_both_ways_over_the_direct_connection():
    """DCUtR (through `Punch`) upgrades a relayed pair; the relayed connection is closed within a second of the
    direct one (py-libp2p closed it 60 s later, under the streams) and both gossip streams ride the direct
    connection. Both sides publish once a second for 20 s: every message arrives."""
    async def scenario() -> None:
        async with relayed_pair(True) as (nursery, a, b):
            punches = [Punch(n.host, n.counts, HintBudget(60.0), lambda info: info.addrs) for n in (a, b)]
            for p in punches:
                await nursery.start(p.run)
            with trio.fail_after(20):
                while not (a.conns(b) and b.conns(a) and not any(map(relayed, a.conns(b) + b.conns(a)))):
                    await trio.sleep(0.1)
            await trio.sleep(1.0)
            for x, y in ((a, b), (b, a)):
                assert x.stream_conn(y) in {c.muxed_conn for c in x.conns(y)}  # ... which are direct: see above
                assert punches[0].how_reached(b.host.get_id()) == "punched"
            sent = []
            for i in range(20):
                for n, name in ((a, b"a"), (b, b"b")):
                    sent.append((n, name + str(i).encode()))
                    await n.pubsub.publish(TOPIC, sent[-1][1])
                await trio.sleep(1.0)
            await trio.sleep(2.0)
            lost = [data for n, data in sent if data not in (b if n is a else a).got]
            assert lost == []
            for x, y in ((a, b), (b, a)):
                assert not any(map(relayed, x.conns(y))) and x.stream_conn(y) in {c.muxed_conn for c in x.conns(y)}
            assert a.counts["relayed_closed_direct"] + b.counts["relayed_closed_direct"] >= 1

    trio.run(scenario)


def test_a_stranger_makes_a_punch_dial_only_what_the_hint_budget_allows(monkeypatch, caplog):
    """A punch dials the addresses the peer sent in CONNECT: a stranger's word. py-libp2p dialed all 20 it read, and
    every address its book held for the peer, in 3 rounds a punch and 3 punches a peer (and a plain dial of the book's
    addresses first). Here each punch dials at most `ADDRS_PER_PEER` of them, never the book's, all punches together
    within `TOTAL_FAILURES` addresses a window, and a peer's punches stop after `SOURCE_FAILURES` failures."""
    dialed: list[str] = []

    async def record(self, peer_id: ID, addr: Multiaddr, source=None, as_responder: bool = False) -> None:
        dialed.append(str(addr))  # a dial that reaches nothing

    monkeypatch.setattr(DCUtRProtocol, "_dial_peer", record)
    counts: Counter[str] = Counter()
    dcutr = GuardedDCUtR(host(), counts, HintBudget(3600.0), lambda info: info.addrs)  # a failed punch takes 21 s
    strangers = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(2)]
    dcutr.host.get_peerstore().add_addrs(strangers[0], [Multiaddr("/ip4/127.0.0.9/tcp/1")], 600)

    made_up = [Multiaddr(f"/ip4/198.18.7.{i}/tcp/4001") for i in range(20)]

    async def scenario() -> None:
        for _ in range(SOURCE_FAILURES + 1):
            assert not await dcutr._perform_hole_punch(strangers[0], made_up)
        assert not await dcutr._try_unilateral_upgrade(strangers[0])  # step 0 dials nothing
        assert not await dcutr._perform_hole_punch(strangers[1], made_up[10:])

    with caplog.at_level(logging.INFO, logger="p2p.punch"):
        trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    assert set(dialed) == {str(a) for a in made_up[:ADDRS_PER_PEER]}  # never the book's, nor step 0's
    assert SOURCE_FAILURES * ADDRS_PER_PEER <= TOTAL_FAILURES  # so the budget's end is reached here
    assert counts["punches_failed"] == SOURCE_FAILURES  # then the stranger is not punched again...
    assert counts["punches_refused"] == 2  # ... nor the next one, the window's budget spent
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hole punch to")]
    assert len(told) == 1 and str(strangers[0]) in told[0] and "stays reached through the relay" in told[0]


def test_a_connect_over_a_direct_connection_is_refused():
    """DCUtR runs over the relayed connection; a CONNECT over a direct one is a stranger asking to be dialed."""
    class Direct:
        def get_transport_addresses(self) -> list[Multiaddr]:
            return [Multiaddr("/ip4/198.18.7.1/tcp/4001")]

    class Stream:
        swarm_conn, was_reset = Direct(), False

        async def reset(self) -> None:
            self.was_reset = True

    counts: Counter[str] = Counter()
    dcutr, stream = GuardedDCUtR(host(), counts, HintBudget(60.0), lambda info: info.addrs), Stream()
    trio.run(dcutr._handle_dcutr_stream, stream)
    assert stream.was_reset and counts["punches_refused"] == 1


def test_a_circuit_address_is_told_whole_where_py_libp2p_cut_it_at_the_relays_id():
    """Identify and our provider record tell peers `host.get_addrs()`. py-libp2p's strips the first /p2p/ of each
    address before appending ours, so a circuit address became the relay's own address under our id: in the lab, two
    homes behind NAT found each other's provider records through a stock relay and dialed the relay."""
    node = gossip_host()
    relay = ID.from_pubkey(create_new_key_pair().public_key)
    node.reach.state = Reachability.PRIVATE
    node.reach.reserved[relay] = Multiaddr(f"/ip4/198.18.1.2/tcp/4001/p2p/{relay}/p2p-circuit")
    assert [str(a) for a in node.host.get_addrs()] == [f"/ip4/198.18.1.2/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{node.me}"]
    assert [str(a) for a in BasicHost.get_addrs(node.host)] == [f"/ip4/198.18.1.2/tcp/4001/p2p/{node.me}"]
