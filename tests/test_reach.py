"""Which addresses a node dials, by what it knows of its own reachability (p2p/reach.py)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import msgpack
import pytest
import trio
from trio.testing import MockClock
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from p2p.config import P2PConfig
from p2p.reach import AskAgain, SLOTS_PER_IP, SLOTS_PER_SUBNET, UNREACHABLE_S, Reach, Reachability, _private_net, is_circuit

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


@pytest.mark.parametrize("state, sorts_first, dialed", [
    (Reachability.PUBLIC, True, False),  # a dialable node waits for the private one to dial out
    (Reachability.UNKNOWN, True, False),
    (Reachability.PRIVATE, True, True),  # two private nodes: the lower peer id dials, through the relay
    (Reachability.PRIVATE, False, False),
])
def test_a_peer_behind_nat_is_dialed_through_its_relay_by_one_side_only(state, sorts_first, dialed):
    node = reach(state)
    other = peer(after=node) if sorts_first else peer(before=node)
    hint = PeerInfo(other, [Multiaddr(CIRCUIT), Multiaddr("/ip4/192.168.3.5/tcp/7420")])  # its leaked private address
    got = node.dialable(hint, HOME)
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


class FakeStream:
    """A dial-back stream from `asker` over a connection whose transport address is `addr`."""

    def __init__(self, node: Reach, asker: ID, addr: str, ports: list[int]):
        self.muxed_conn = SimpleNamespace(peer_id=asker)
        conn = SimpleNamespace(muxed_conn=self.muxed_conn, get_transport_addresses=lambda: [Multiaddr(addr)])
        node.host.get_network().connections[asker] = [conn]
        self.request, self.written = msgpack.packb({"ports": ports}), []

    def get_remote_address(self) -> tuple[str, int]:
        return ("198.18.1.2", 40000)  # over a relay: the relay's host

    async def read(self, n: int) -> bytes:
        return self.request

    async def write(self, data: bytes) -> None:
        self.written.append(msgpack.unpackb(data))

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("relayed, open_ports", [(True, True), (False, True), (False, False)])
def test_dial_back_is_served_only_over_a_direct_connection(relayed, open_ports, monkeypatch):
    node = reach(Reachability.PUBLIC)
    asker = peer(after=node)
    dialed = []

    async def open_tcp_stream(ip: str, port: int):
        dialed.append((ip, port))
        if not open_ports:
            raise OSError("refused")
        return SimpleNamespace(aclose=lambda: trio.sleep(0))

    monkeypatch.setattr(trio, "open_tcp_stream", open_tcp_stream)
    stream = FakeStream(node, asker, f"{CIRCUIT}/p2p/{asker}" if relayed else "/ip4/198.18.1.2/tcp/40000", [22, 80, 7420])
    trio.run(node._serve_dialback, stream)
    if relayed:  # dialing would scan the relay's host for the asker
        assert stream.written == [{"relayed": True}] and dialed == [] and node.counts["dialback_relayed"] == 1
    else:
        assert stream.written == [{"reached": [22, 80, 7420] if open_ports else []}]
        assert dialed == [("198.18.1.2", p) for p in (22, 80, 7420)]
    assert (asker in node.slots.unreachable) == (not relayed and not open_ports)  # only then may it reserve a slot


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
