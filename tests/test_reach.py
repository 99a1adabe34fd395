"""Which addresses a node dials, by what it knows of its own reachability (p2p/reach.py)."""

from __future__ import annotations

import contextlib
import socket
from collections import Counter
from types import SimpleNamespace

import msgpack
import pytest
import trio
from trio.testing import MockClock
from libp2p import NOISE_PROTOCOL_ID, YAMUX_PROTOCOL_ID, ConnectionConfig, NoiseTransport, Yamux, new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.connection_types import ConnectionType
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.exceptions import HandshakeFailure
from multiaddr import Multiaddr

from p2p.config import P2PConfig
from p2p.reach import (EARLY_RECHECK_S, NONCE_BYTES, RECHECK_S, SLOTS_PER_IP, SLOTS_PER_SUBNET, UNREACHABLE_S, AskAgain,
                       NonceTaker, Reach, Reachability, _private_net, is_circuit, verdict)

HOME = [Multiaddr("/ip4/192.168.3.2/tcp/7420")]
CIRCUIT = "/ip4/198.18.1.2/tcp/7420/p2p/12D3KooWEm5ckQy2MGzaxaFwYEHBSaiLKHJSGfcot2iSVfqKr2r6/p2p-circuit"


def reach(state: Reachability, **cfg) -> Reach:
    r = Reach(P2PConfig(**cfg), new_host(key_pair=create_new_key_pair()), Counter())
    r.state = state
    return r


def peer(after: Reach | None = None, before: Reach | None = None) -> ID:
    """A fresh peer id sorting after (or before) the given node's."""
    while True:
        pid = ID.from_pubkey(create_new_key_pair().public_key)
        me = (after or before).host.get_id().to_bytes()
        if (pid.to_bytes() > me) == (after is not None):
            return pid


@pytest.mark.parametrize("addr, net", [
    ("/ip4/127.0.0.1/tcp/1", "loopback"), ("/ip6/::1/tcp/1", "loopback"),
    ("/ip4/192.168.2.7/tcp/1", "192.168.2.0/24"), ("/ip4/10.1.2.3/tcp/1", "10.1.2.0/24"),
    ("/ip4/172.18.0.5/tcp/1", "172.18.0.0/24"), ("/ip4/100.64.9.9/tcp/1", "100.64.9.0/24"),
    ("/ip4/198.18.1.2/tcp/1", None), ("/ip4/8.8.8.8/tcp/1", None), ("/dns4/example.org/tcp/1", None),
])
def test_private_addresses_are_told_apart_by_their_local_network(addr, net):
    found = _private_net(Multiaddr(addr))
    assert (None if found is None else str(found)) == net


def test_a_private_hint_address_is_dialed_only_from_its_own_network():
    node = reach(Reachability.PUBLIC)
    hint = PeerInfo(peer(after=node), [Multiaddr(a) for a in (
        "/ip4/192.168.2.2/tcp/7420", "/ip4/192.168.3.9/tcp/7420", "/ip4/198.18.5.2/tcp/7420", "/ip4/127.0.0.1/tcp/7420")])
    assert [str(a) for a in node.dialable(hint, HOME)] == ["/ip4/192.168.3.9/tcp/7420", "/ip4/198.18.5.2/tcp/7420"]
    on_loopback = [Multiaddr("/ip4/127.0.0.1/tcp/7421")]
    assert [str(a) for a in node.dialable(hint, on_loopback)] == ["/ip4/198.18.5.2/tcp/7420", "/ip4/127.0.0.1/tcp/7420"]


@pytest.mark.parametrize("state, sorts_first, alone, reserved, dialed", [
    (Reachability.PUBLIC, True, False, False, False),  # a dialable node waits for the private one to dial out
    (Reachability.UNKNOWN, True, False, False, False),
    (Reachability.UNKNOWN, True, False, True, True),  # a relay holds a slot for it: behind NAT, as far as it can tell
    (Reachability.PRIVATE, True, False, False, True),  # two private nodes: the lower peer id dials, through the relay
    (Reachability.PRIVATE, False, False, False, False),
    (Reachability.PRIVATE, False, True, False, True),  # ... or one with no swarm peer: the other may not look it up
    (Reachability.PUBLIC, False, True, False, False),
])
def test_a_peer_behind_nat_is_dialed_through_its_relay_by_one_side_only(state, sorts_first, alone, reserved, dialed):
    node = reach(state)
    if reserved:
        node.reserved[peer(after=node)] = Multiaddr(CIRCUIT)
    other = peer(after=node) if sorts_first else peer(before=node)
    hint = PeerInfo(other, [Multiaddr(CIRCUIT), Multiaddr("/ip4/192.168.3.5/tcp/7420")])  # its leaked private address
    got = node.dialable(hint, HOME, alone)
    assert got == ([Multiaddr(CIRCUIT)] if dialed else [])
    assert all(is_circuit(a) for a in got)


def test_a_private_node_advertises_only_its_relayed_addresses():
    node = reach(Reachability.UNKNOWN)
    assert node.advertised(HOME) == HOME
    node.state = Reachability.PRIVATE
    assert node.advertised(HOME) == []  # no relay yet: nothing anyone could dial
    relay = peer(after=node)
    node.reserved[relay] = Multiaddr(CIRCUIT)
    assert node.advertised(HOME) == [Multiaddr(CIRCUIT)]


NONCE = b"n" * NONCE_BYTES


class FakeStream:
    """A dial-back stream from `asker` over a connection whose transport address is `addr`."""

    def __init__(self, node: Reach, asker: ID, addr: str, ports: list[int], **request):
        self.muxed_conn = SimpleNamespace(peer_id=asker)
        conn = SimpleNamespace(muxed_conn=self.muxed_conn, get_transport_addresses=lambda: [Multiaddr(addr)])
        node.host.get_network().connections[asker] = [conn]
        self.request, self.written = msgpack.packb({"ports": ports, "nonce": NONCE, **request}), []

    def get_remote_address(self) -> tuple[str, int]:
        return ("198.18.1.2", 40000)  # over a relay: the relay's host

    async def read(self, n: int) -> bytes:
        return self.request

    async def write(self, data: bytes) -> None:
        self.written.append(msgpack.unpackb(data))

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("relayed, open_port", [(True, 80), (False, 80), (False, None)])
def test_dial_back_is_served_only_over_a_direct_connection(relayed, open_port):
    """The nonce goes only to the IP the asker's direct connection comes from (`_deliver`: a connection of its
    own), on its ports in turn until one takes it."""
    node = reach(Reachability.PUBLIC)
    asker = peer(after=node)
    dialed = []

    async def deliver(ip: str, port: int, nonce: bytes) -> bool:
        dialed.append((ip, port, nonce))
        return port == open_port

    node._deliver = deliver
    stream = FakeStream(node, asker, f"{CIRCUIT}/p2p/{asker}" if relayed else "/ip4/198.18.1.2/tcp/40000", [22, 80, 7420])
    trio.run(node._serve_dialback, stream)
    if relayed:  # dialing would scan the relay's host for the asker
        assert stream.written == [{"relayed": True}] and dialed == [] and node.counts["dialback_relayed"] == 1
    else:
        assert stream.written == [{"reached": [80] if open_port else []}]
        assert dialed == [("198.18.1.2", p, NONCE) for p in ((22, 80) if open_port else (22, 80, 7420))]
    assert (asker in node.slots.unreachable) == (not relayed and not open_port)  # only then may it reserve a slot


def test_a_dial_back_request_without_its_nonce_or_within_the_minute_is_not_dialed():
    node = reach(Reachability.PUBLIC)
    dialed = []

    async def deliver(*args) -> bool:
        dialed.append(args)
        return False

    node._deliver = deliver
    addr = "/ip4/198.18.1.2/tcp/40000"
    asker = peer(after=node)
    malformed = [FakeStream(node, peer(after=node), addr, [22], nonce=b"short"),
                 FakeStream(node, peer(after=node), addr, [22], nonce=None), FakeStream(node, peer(after=node), addr, "22")]
    first, again = FakeStream(node, asker, addr, [22]), FakeStream(node, asker, addr, [22])
    first.muxed_conn = again.muxed_conn  # one connection (the last registered), two requests

    async def scenario() -> None:
        for stream in [*malformed, first, again]:
            await node._serve_dialback(stream)

    trio.run(scenario, clock=MockClock(autojump_threshold=0))
    assert [s.written for s in malformed] == [[]] * 3 and node.counts["dialback_malformed"] == 3
    assert first.written == [{"reached": []}] and again.written == [{"limited": True}]
    assert len(dialed) == 1 and node.counts["dialback_limited"] == 1


class RawConn:
    """A connection as it reaches `NonceTaker`: before any security protocol, `data` to read."""

    def __init__(self, data: bytes, kind: ConnectionType = ConnectionType.DIRECT, dialed_by_us: bool = False):
        self.data, self.kind, self.is_initiator, self.closed = data, kind, dialed_by_us, False

    async def read(self, n: int) -> bytes:
        data, self.data = self.data[:min(n, 5)], self.data[min(n, 5):]  # in pieces, as TCP may hand it over
        return data

    def get_connection_type(self) -> ConnectionType:
        return self.kind

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("conn, proves", [
    (RawConn(NONCE), True), (RawConn(NONCE, kind=ConnectionType.RELAYED), False),
    (RawConn(NONCE, dialed_by_us=True), False), (RawConn(b"m" * NONCE_BYTES), False), (RawConn(NONCE[:5]), False),
])
def test_a_nonce_proves_a_dial_back_only_on_a_connection_dialed_to_us_directly(conn, proves):
    """It comes only where a security protocol is negotiated (`NonceTaker`): on a new connection, never on one a
    request went over; through a relay it would prove only the relay reachable."""
    node = reach(Reachability.UNKNOWN)
    node._asked[NONCE] = False
    with pytest.raises(HandshakeFailure):  # the swarm drops the connection
        trio.run(NonceTaker(node).secure_inbound, conn)
    assert node._asked[NONCE] is proves and node.counts["dialback_nonce_refused"] == (not proves) and conn.closed


@pytest.mark.parametrize("answers, groups, found", [
    ([("a", True), ("b", True), ("c", False)], 3, Reachability.PUBLIC),  # one liar's "not reached" is outweighed
    ([("a", False), ("b", True)], 2, None),  # one group a side: nothing settled, the belief stays
    ([("a", False)], 2, None),  # one liar alone is one group: no verdict
    ([("a", False), ("b", False)], 3, Reachability.PRIVATE),
    ([("a", False), ("a", False)], 2, None),  # two ids of one /24 count once
    ([("a", True)], 1, Reachability.PUBLIC),  # connected to one group only (a swarm on 127.0.0.1): it decides
    ([("a", True), ("a", False)], 1, None),
])
def test_a_verdict_needs_two_network_groups_that_agree_more_than_they_disagree(answers, groups, found):
    assert verdict(answers, groups)[0] is found


def listening() -> Reach:
    """A node whose host is set up like `GossipHost`'s (Noise, Yamux, one connection per peer)."""
    kp = create_new_key_pair()
    return Reach(P2PConfig(), new_host(key_pair=kp, sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(
        kp, noise_privkey=new_x25519_key_pair().private_key)}, muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        connection_config=ConnectionConfig(max_connections_per_peer=1)), Counter())


def serve_lies(server: Reach, answer: dict | None, hand_back: bool = False) -> None:
    """`server` answers dial-backs with `answer` (None: not at all) and dials nobody; with `hand_back`, it
    returns the nonce over the connection the request came on."""
    async def lie(stream) -> None:
        request = msgpack.unpackb(await stream.read(1024))
        if hand_back:  # refused: the nonce is no stream protocol
            with contextlib.suppress(Exception):
                back = await server.host.new_stream(stream.muxed_conn.peer_id, [server.nonce_protocol])
                await back.write(request["nonce"])
                await back.close()
        if answer is not None:
            await stream.write(msgpack.packb(answer))
        await stream.close()

    server.host.set_stream_handler(server.dialback_protocol, lie)


def check_with(servers: int, rig, state: Reachability = Reachability.UNKNOWN) -> tuple[Reach, list[Reach]]:
    """One reachability check of a node on 127.0.0.1 that asks `servers` nodes, each counted in a network group of
    its own (on loopback every connection comes from 127.0.0.1); `rig(node, servers)` sets them up first."""
    node, others = listening(), [listening() for _ in range(servers)]
    node.state = state

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            for n in (node, *others):
                await stack.enter_async_context(n.host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]))
                n.set_handlers()
            rig(node, others)
            groups = {o.host.get_id(): f"198.18.{k}.0/24" for k, o in enumerate(others)}
            node.group_of = groups.get
            for o in others:
                await node.host.connect(PeerInfo(o.host.get_id(), o.host.get_addrs()))
            await node._recheck(list(groups))
            with trio.move_on_after(5):  # the dial-backs' own connections close
                while set(node.host.get_connected_peers()) != set(groups):
                    await trio.sleep(0.05)
            assert set(node.host.get_connected_peers()) == set(groups)

    trio.run(scenario)
    return node, others


def test_a_dial_back_liar_answering_reached_is_not_believed():
    """One peer answering "reached" without dialing made a node behind a router that maps without forwarding call
    itself public; another that hands the nonce back over the connection it was asked on proves nothing either (the
    node here is reachable: only a dial proves it)."""
    node, _ = check_with(2, lambda node, liars: (serve_lies(liars[0], {"reached": node._ports()}),
                                                    serve_lies(liars[1], {"reached": node._ports()}, hand_back=True)))
    assert node.state is Reachability.PRIVATE  # two groups answered and neither dialed
    assert node.counts["dialback_unproven"] == 2
    assert node.counts["dialback_proven"] == 0 and node.counts["reachability_changes"] == 1


@pytest.mark.parametrize("honest, silent", [(2, 0), (0, 1)])
def test_one_dial_back_liar_answering_not_reached_does_not_make_a_node_private(honest, silent):
    """Among honest peers that reach it, or as the only answer (the other peer speaks no dial-back, as a
    js-libp2p peer), one "not reached" leaves a public node public, and an unknown one unknown or public."""
    def rig(node: Reach, servers: list[Reach]) -> None:
        serve_lies(servers[0], {"reached": []})
        for s in servers[1:1 + silent]:
            serve_lies(s, None)

    for state in (Reachability.UNKNOWN, Reachability.PUBLIC):
        node, servers = check_with(1 + honest + silent, rig, state)
        assert node.state is (Reachability.PUBLIC if honest else state)
        assert node.counts["dialback_proven"] == honest and node.counts["dialback_unreached"] == 1
        assert node.counts["dialback_disagreeing"] == (1 if node.state is Reachability.PUBLIC else 0)
        assert all(s.counts["dialbacks_served"] == 1 for s in servers[1:1 + honest])


def test_two_honest_peers_in_different_groups_that_cannot_reach_a_node_make_it_private():
    """... with a liar claiming it reached the node beside them: a claim without the nonce counts as not reached."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there once closed

    def rig(node: Reach, servers: list[Reach]) -> None:
        node._ports = lambda: [port]
        serve_lies(servers[0], {"reached": [port]})

    node, servers = check_with(3, rig, Reachability.PUBLIC)
    assert node.state is Reachability.PRIVATE and node.counts["reachability_changes"] == 1
    assert node.counts["dialback_unreached"] == 2 and node.counts["dialback_unproven"] == 1
    for s in servers[1:]:  # each dialed and found it needs a relay
        assert node.host.get_id() in s.slots.unreachable and s.counts["dialbacks_served"] == 1


def run_checks(node: Reach, answer, seconds: float) -> tuple[list[float], list[Reachability], list[float]]:
    """`node.run` for `seconds` of mock time, connected to three peers in three groups that answer each check with
    `answer(now)` (True: reached); when it checked, the states it went through, and when it asked for a relay slot."""
    peers = {peer(after=node): f"198.18.{k}.0/24" for k in range(3)}
    checks, states, reserved = [], [], []

    async def check(groups: dict[ID, str]) -> list[tuple[str, bool]]:
        checks.append(trio.current_time())
        return [(g, ok) for g, ok in zip(groups.values(), answer(trio.current_time())) if ok is not None]

    async def no_relay_service(task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def reserve(relay: ID) -> bool:
        reserved.append(trio.current_time())
        return False

    node._check, node.group_of, node.direct_peers = check, peers.get, lambda: set(peers)
    node._run_protocol, node._reserve, node.cfg.relay_slots = no_relay_service, reserve, 0

    async def scenario() -> None:
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(node.run, lambda: set(peers), nursery)
                while True:
                    await trio.sleep(1)
                    if not states or states[-1] is not node.state:
                        states.append(node.state)

    trio.run(scenario, clock=MockClock(autojump_threshold=0))
    return checks, states, reserved


def test_a_change_of_verdict_is_checked_again_early():
    """A verdict confirmed by two groups stands RECHECK_S; a new one is checked again after EARLY_RECHECK_S, not
    10 minutes later (one that a transient or a lie brought about does not stand long)."""
    def behind_a_new_router(now: float) -> list[bool]:  # reachable, then not
        return [now < RECHECK_S] * 3

    node = reach(Reachability.UNKNOWN)
    checks, states, _ = run_checks(node, behind_a_new_router, 2 * RECHECK_S)
    start = EARLY_RECHECK_S + RECHECK_S  # confirmed public at EARLY_RECHECK_S: the next check finds it private
    assert checks == pytest.approx([0, EARLY_RECHECK_S, start, start + EARLY_RECHECK_S], abs=2.1)
    assert states == [Reachability.PUBLIC, Reachability.PRIVATE] and node.counts["reachability_changes"] == 2


@pytest.mark.parametrize("answers, reserves", [((False, None, None), True), ((True, False, None), False)])
def test_a_node_whose_answers_settle_nothing_keeps_relay_slots_unless_one_proved_it_reachable(answers, reserves):
    """One "not reached" (a home behind NAT whose other peers do not answer) leaves it unknown: it reserves slots as
    a fallback and advertises them after its direct addresses; a proven reach (a public node beside a liar) does not."""
    node = reach(Reachability.UNKNOWN)
    checks, states, reserved = run_checks(node, lambda now: answers, 60)
    assert states == [Reachability.UNKNOWN] and checks == [0] and bool(reserved) is reserves
    node.reserved[peer(after=node)] = Multiaddr(CIRCUIT)
    assert node.advertised(HOME) == [*HOME, Multiaddr(CIRCUIT)]


def test_relay_slots_go_only_to_participants_our_dial_back_could_not_reach_and_free_when_they_leave():
    """A stranger that asked for a dial-back on a closed port got a slot (32 of 34 did, and one pair used the
    relay's whole budget): a slot needs a signed, useful message of its own as well. A full relay's refusals
    were not counted."""
    node = reach(Reachability.PUBLIC, relay_slots=1, relay_after_s=0)
    stranger, member, late = peer(after=node), peer(after=node), peer(after=node)
    slots, connections = node.slots, node.host.get_network().connections

    async def scenario() -> None:
        assert not slots.can_accept_reservation(stranger) and node.counts["relay_refused"] == 1
        slots.unreachable.add(stranger, trio.current_time())  # it asked for a dial-back on a closed port
        assert not slots.can_accept_reservation(stranger) and node.counts["relay_refused"] == 2
        for p in (member, late):
            slots.unreachable.add(p, trio.current_time())  # what serving its dial-back found
            slots.participants.add(p, trio.current_time())  # what our validator accepted from it
            connections[p] = [conn_from(f"198.18.0.{len(connections) + 1}")]
        assert slots.can_accept_reservation(member)
        slots.reserve(member)
        assert slots.has_reservation(member) and list(slots._reservations) == [member]
        assert not slots.can_accept_reservation(late) and node.counts["relay_refused"] == 3  # full: counted too
        del connections[member]  # it left: its slot is free at once, not in an hour
        assert slots.can_accept_reservation(late) and not slots._reservations
        await trio.sleep(UNREACHABLE_S + 1)  # its dial-back and its messages are too old now
        assert not slots.can_accept_reservation(late)

    trio.run(scenario, clock=MockClock(autojump_threshold=0))


def conn_from(ip: str) -> SimpleNamespace:
    """A live connection as py-libp2p's swarm holds it, from `ip`."""
    return SimpleNamespace(muxed_conn=SimpleNamespace(get_remote_address=lambda: (ip, 40000)))


def test_relay_slots_are_limited_per_ip_address_and_per_subnet():
    """Peer ids are free: 32 of 34 strangers on one host got slots once each had published one computable group."""
    node = reach(Reachability.PUBLIC, relay_slots=16, relay_after_s=0)
    slots, connections = node.slots, node.host.get_network().connections

    def asks(ip: str | None) -> bool:
        p = peer(after=node)
        slots.unreachable.add(p, trio.current_time())
        slots.participants.add(p, trio.current_time())
        if ip:
            connections[p] = [conn_from(ip)]
        if ok := slots.can_accept_reservation(p):
            slots.reserve(p)
        return ok

    async def scenario() -> None:
        assert [asks("198.18.0.1") for _ in range(SLOTS_PER_IP + 2)] == [True] * SLOTS_PER_IP + [False, False]
        assert [asks(f"198.18.0.{k}") for k in range(2, 2 + SLOTS_PER_SUBNET)] == \
            [True] * (SLOTS_PER_SUBNET - SLOTS_PER_IP) + [False] * SLOTS_PER_IP  # the /24 is full
        assert asks("198.19.0.1") and asks("2001:db8:1::1") and not asks(None)  # another /24; IPv6; not connected
        assert node.counts["relay_refused_address"] == 2 + SLOTS_PER_IP + 1 == node.counts["relay_refused"]

    trio.run(scenario, clock=MockClock(autojump_threshold=0))


def test_relay_slots_wait_until_a_peer_has_taken_part_for_relay_after_s_without_falling_silent():
    """One computable group (right answers to a public generator's task) proved a stranger a participant: 32 of
    34 strangers got slots. Time is what a free identity cannot buy."""
    node = reach(Reachability.PUBLIC, relay_slots=4)
    assert node.slots.min_age_s == P2PConfig().relay_after_s == 600
    slots, connections = node.slots, node.host.get_network().connections
    newcomer, quiet = peer(after=node), peer(after=node)
    for i, p in enumerate((newcomer, quiet)):
        connections[p] = [conn_from(f"198.18.{i}.1")]

    async def takes_part(p: ID, seconds: float, every: float = 60) -> None:
        for _ in range(int(seconds // every)):
            slots.participants.add(p, trio.current_time())
            slots.unreachable.add(p, trio.current_time())
            await trio.sleep(every)

    async def scenario() -> None:
        await takes_part(newcomer, 60)
        assert not slots.can_accept_reservation(newcomer) and node.counts["relay_refused_new"] == 1
        await takes_part(newcomer, 540)
        assert slots.can_accept_reservation(newcomer)  # 10 minutes of messages
        await takes_part(quiet, 600)
        await trio.sleep(UNREACHABLE_S + 1)  # silent past the window: its time starts over
        await takes_part(quiet, 120)
        assert not slots.can_accept_reservation(quiet) and node.counts["relay_refused_new"] == 2
        assert node.counts["relay_refused"] == 2

    trio.run(scenario, clock=MockClock(autojump_threshold=0))


def test_participants_forget_the_silent_and_stay_bounded():
    slots = reach(Reachability.PUBLIC).slots
    many = [ID(b"peer%d" % i) for i in range(3 * 4096)]

    async def scenario() -> None:
        for p in many:
            slots.participants.add(p, trio.current_time())
        assert len(slots.participants.since) <= 2 * 4096 + 1 and many[-1] in slots.participants
        assert slots.participants.age(many[-1], trio.current_time()) == 0
        await trio.sleep(UNREACHABLE_S + 1)
        slots.participants.forget_expired(trio.current_time())
        assert not slots.participants.since and slots.participants.age(many[-1], trio.current_time()) is None

    trio.run(scenario, clock=MockClock(autojump_threshold=0))


class Pipe:
    """One side of a relayed circuit: `chunks` to read, then end of stream; what is written is kept."""

    def __init__(self, chunks: list[bytes] = ()):
        self.chunks, self.written, self.reset_called = list(chunks), [], False

    async def read(self, n: int | None = None) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    async def reset(self) -> None:
        self.reset_called = True

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("circuit_kib, relayed_kib", [(1024, 100), (50, 50)])
def test_relayed_bytes_are_counted_and_paced_and_a_circuit_stops_at_its_cap(circuit_kib, relayed_kib):
    # py-libp2p counts nothing once a circuit has a data cap; the meter counts every byte and paces all
    # circuits together to relay_kib_per_s, while the circuit's own cap still ends it
    cfg = P2PConfig(relay_kib_per_s=20, relay_circuit_mib=1)
    node = Reach(cfg, new_host(key_pair=create_new_key_pair()), Counter())
    src, dst = Pipe([b"x" * 10240] * 10), Pipe()

    async def relay() -> float:
        start = trio.current_time()
        await node.protocol._relay_data(src, dst, peer(after=node), None, [circuit_kib << 10])
        return trio.current_time() - start

    took = trio.run(relay, clock=MockClock(autojump_threshold=0))
    assert sum(map(len, dst.written)) == relayed_kib << 10
    assert src.reset_called == (relayed_kib < 100)
    counted = node.counts["relayed_bytes"]
    assert counted in (relayed_kib << 10, (relayed_kib + 10) << 10)  # the chunk past the cap was read, not sent
    assert took == pytest.approx((counted / 1024 - 5) / 5)  # one sender: its second's worth at once, then 5 KiB/s
    assert node.counts["relay_paced_s"] == pytest.approx(took)


def test_one_address_sends_through_a_relay_at_most_a_quarter_of_its_budget_and_four_share_all_of_it():
    """A stranger pair used the relay's whole paced budget (256 KiB/s), which genuinely NAT'd peers share; then four
    sender ids from one address took it again while the quarter was per sender id."""
    cfg = P2PConfig(relay_kib_per_s=20, relay_circuit_mib=1)

    def seconds_to_relay(senders: int, addresses: int | None = None) -> float:
        node = Reach(cfg, new_host(key_pair=create_new_key_pair()), Counter())
        ids = [peer(after=node) for _ in range(senders)]
        for k, p in enumerate(ids if addresses else ()):
            node.host.get_network().connections[p] = [conn_from(f"198.18.{k % addresses}.1")]

        async def relay() -> float:
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for p in ids:  # 100 KiB each, after the first second's worth of the budget
                    nursery.start_soon(node.protocol._relay_data, Pipe([b"x" * 1024] * 100), Pipe(), p, None, [1 << 20])
            return trio.current_time() - start

        return trio.run(relay, clock=MockClock(autojump_threshold=0))

    assert seconds_to_relay(1) == pytest.approx(95 / 5, abs=0.5)  # a quarter of 20 KiB/s
    assert seconds_to_relay(4) == pytest.approx((400 - 20) / 20, abs=0.5)  # four senders fill the whole budget
    assert seconds_to_relay(4, addresses=4) == pytest.approx((400 - 20) / 20, abs=0.5)  # from four addresses too
    assert seconds_to_relay(4, addresses=1) == pytest.approx((400 - 5) / 5, abs=0.5)  # from one: its quarter


def test_relay_caps_come_from_the_config():
    node = Reach(P2PConfig(relay_circuit_s=30, relay_circuit_mib=2, relay_slots=3),
                 new_host(key_pair=create_new_key_pair()), Counter())
    limits = node.protocol.limits
    assert (limits.duration, limits.data, limits.max_reservations) == (30, 2 << 20, 3)


def test_a_refusing_relay_is_asked_again_after_4_s_doubling_to_a_minute_and_at_once_after_a_grant():
    """A newcomer waits p2p.relay_after_s (10 minutes) for its slot: asking every 4 s was 150 asks of one relay."""
    ask, relay, other = AskAgain(max_keys=2), ID(b"relay"), ID(b"other")
    now, asked = 0.0, []
    while now < 600:
        if ask.may_ask(relay, now):
            asked.append(now)
            ask.refused(relay, now)
        now += 1.0
    assert asked[:6] == [0, 4, 12, 28, 60, 120] and len(asked) == 13  # then every 60 s
    assert ask.may_ask(other, now)  # another relay is asked at once
    ask.granted(relay)
    assert ask.may_ask(relay, now)
    for k in range(3):
        ask.refused(ID(b"r%d" % k), now)
    assert len(ask._next) == 2  # bounded: the least recently refused go first
