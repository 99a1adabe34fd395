"""A home node's circuit relay v2 client (p2p/reach.py over py-libp2p's) against a relay that is no sapo node: a stock
js-libp2p node serving the DHT and a limited relay with kubo's limits (tests/interop/dht.mjs --relay, `JsRelay`), the
public peer a swarm of home nodes has when none of its members is dialable. All on 127.0.0.x, one address a role.

What a limited relay does to a circuit is what a home node must live with: js-libp2p resets both halves of the relayed
stream at the data limit (counted over both directions together) or the time limit, and py-libp2p then drops the
relayed connection on both ends; the reservation and the connections to the relay stay."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from multiaddr import Multiaddr
from trio.testing import MockClock

from lab.dht import JsRelay
from p2p.reach import CIRCUIT, RELAY_RETRY_S, AskAgain, Reach, Reachability, is_circuit
from tests.test_interop import js_peer  # noqa: F401 - a fixture
from tests.test_reach import listening, peer

RELAY_IP, HOME_IP, DIALER_IP, CROWD_IP = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
ECHO = TProtocol("/sapo-test/echo/1.0.0")
SINK = TProtocol("/sapo-test/sink/1.0.0")
KIB = 1 << 10
DATA_LIMIT = 128 * KIB  # kubo's and dht.mjs's per circuit (js-libp2p: both directions together)
PER_IP = 8  # reservations a relay with kubo's limits grants to one IP address
INBOUND_PER_S = 4  # connections a second from one IP address (js-libp2p refuses past 5: inboundConnectionThreshold)
GONE_S = 2.0  # for both ends to drop a circuit the relay cut (measured: 0.2 s)


def home_node() -> Reach:
    """A node that found it cannot be dialed (it reserves relay slots and checks nothing more)."""
    node = listening()
    node.cfg.reachability, node.state = "private", Reachability.PRIVATE
    return node


@contextlib.asynccontextmanager
async def running(*nodes: tuple[Reach, str]) -> AsyncIterator[trio.Nursery]:
    """Each node's host listening on its address with its relay handlers (STOP) up, until the block ends."""
    async with contextlib.AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        for node, ip in nodes:
            await stack.enter_async_context(node.host.run(listen_addrs=[Multiaddr(f"/ip4/{ip}/tcp/0")]))
            node.set_handlers()
            await nursery.start(node._run_protocol)
        yield nursery
        nursery.cancel_scope.cancel()


async def connect(node: Reach, relay: JsRelay) -> None:
    await node.host.connect(PeerInfo(relay.peer_id, [Multiaddr(relay.addr.split("/p2p/")[0])]))


async def echo(stream) -> None:
    with contextlib.suppress(Exception):
        while data := await stream.read(64 * KIB):
            await stream.write(data)
    await stream.close()


async def exchange(node: Reach, peer: ID, payload: bytes) -> bytes:
    """`payload` sent to `peer`'s echo on a new stream; what came back."""
    stream = await node.host.new_stream(peer, [ECHO])
    await stream.write(payload)
    back = b""
    with trio.fail_after(10):
        while len(back) < len(payload):
            back += await stream.read(len(payload) - len(back))
    await stream.close()
    return back


def relayed(node: Reach, peer: ID) -> bool:
    """Whether `node` holds a connection to `peer` through a relay."""
    return any(any(map(is_circuit, c.get_transport_addresses()))
               for c in node.host.get_network().connections.get(peer, []))


async def until_gone(a: Reach, b: Reach, limit: float) -> float:
    """Seconds until neither `a` nor `b` holds a connection to the other (at most `limit`)."""
    start = trio.current_time()
    with trio.move_on_after(limit):
        while b.host.get_id() in a.host.get_connected_peers() or a.host.get_id() in b.host.get_connected_peers():
            await trio.sleep(0.05)
    return trio.current_time() - start


@pytest.mark.slow
def test_a_home_node_reserves_on_a_stock_relay_is_dialed_through_it_both_ways_and_renews_its_slot(js_peer, tmp_path):
    """The home node reserves a slot with its own client and advertises `<relay>/p2p-circuit`; another node dials
    it there and streams run both ways; the dialer takes no slot of its own (py-libp2p's client reserved one on
    every relay it dialed through); and the home renews before the relay's TTL (16 s here), so a node dialing after
    that TTL still gets through and the first circuit, which a lapsed reservation would cut, stays up."""
    relay = JsRelay(js_peer[0], [], tmp_path / "relay.log", listen=f"/ip4/{RELAY_IP}/tcp/0", reservation_s=16)
    home, dialer, late = home_node(), listening(), listening()
    home.host.set_stream_handler(ECHO, echo)
    dialer.host.set_stream_handler(ECHO, echo)

    async def scenario() -> None:
        async with running((home, HOME_IP), (dialer, DIALER_IP), (late, DIALER_IP)) as nursery:
            await connect(home, relay)
            nursery.start_soon(home.run, lambda: set(home.host.get_connected_peers()), nursery)
            with trio.fail_after(15):
                while relay.peer_id not in home.reserved:
                    await trio.sleep(0.1)
            reserved_at, circuit = trio.current_time(), home.reserved[relay.peer_id]
            assert circuit == Multiaddr(f"{relay.addr}/{CIRCUIT}")
            assert home.advertised([]) == [circuit]

            with trio.fail_after(10):
                await dialer.dial(circuit, home.host.get_id())
            assert relayed(dialer, home.host.get_id()) and relayed(home, dialer.host.get_id())
            assert await exchange(dialer, home.host.get_id(), b"d" * 16 * KIB) == b"d" * 16 * KIB
            assert await exchange(home, dialer.host.get_id(), b"h" * 16 * KIB) == b"h" * 16 * KIB
            assert dialer.transport._reservations == {}

            await trio.sleep_until(reserved_at + 18)  # past the relay's TTL
            assert relayed(dialer, home.host.get_id()), "the first circuit was cut: the reservation lapsed"
            with trio.fail_after(10):
                await late.dial(circuit, home.host.get_id())
            assert await exchange(late, home.host.get_id(), b"l" * KIB) == b"l" * KIB
            assert home.reserved == {relay.peer_id: circuit} and home.counts["relay_reservations"] == 1

    try:
        trio.run(scenario)
    finally:
        relay.close()


@pytest.mark.slow
def test_a_limited_circuit_is_cut_at_its_data_and_time_limits_and_both_ends_drop_it(js_peer, tmp_path):
    """kubo's 128 KiB: the writer's stream is reset and the reader sees its end after less than 128 KiB of payload
    (what the relay had counted but not yet forwarded, the circuit's own handshakes and framing, and what the reader
    had not read when the reset came are lost), and both ends drop the connection within GONE_S; the relay's time
    limit (3 s here) cuts an idle circuit the same way. The home keeps its slot: a new circuit comes up at once."""
    relay = JsRelay(js_peer[0], [], tmp_path / "relay.log", listen=f"/ip4/{RELAY_IP}/tcp/0", circuit_s=3)
    home, dialer = home_node(), listening()
    received: list[int] = []

    async def sink(stream) -> None:
        received.append(0)
        with contextlib.suppress(Exception):
            while data := await stream.read(64 * KIB):
                received[-1] += len(data)

    home.host.set_stream_handler(SINK, sink)

    async def scenario() -> None:
        async with running((home, HOME_IP), (dialer, DIALER_IP)):
            await connect(home, relay)
            assert await home._reserve(relay.peer_id)
            circuit = home.reserved[relay.peer_id]
            await dialer.dial(circuit, home.host.get_id())
            stream, sent = await dialer.host.new_stream(home.host.get_id(), [SINK]), 0
            with pytest.raises(StreamError), trio.fail_after(10):  # the reset: StreamReset or StreamError, both seen
                while True:
                    await stream.write(b"x" * KIB)
                    sent += KIB
                    await trio.sleep(0)
            assert DATA_LIMIT // 4 <= received[0] < DATA_LIMIT and received[0] <= sent  # measured: 90-122 KiB
            assert await until_gone(home, dialer, 2 * GONE_S) < GONE_S
            assert {relay.peer_id} <= set(home.host.get_connected_peers()) & set(dialer.host.get_connected_peers())

            start = trio.current_time()  # the relay's clock for this circuit starts after this
            await dialer.dial(circuit, home.host.get_id())
            assert relayed(dialer, home.host.get_id())
            await until_gone(home, dialer, 10)
            assert 3 <= trio.current_time() - start < 3 + 2 * GONE_S

    try:
        trio.run(scenario)
    finally:
        relay.close()


@pytest.mark.slow
def test_the_stock_relay_refuses_a_ninth_slot_from_one_address_and_a_circuit_to_a_peer_without_one(js_peer, tmp_path,
                                                                                                  monkeypatch):
    """What the relay refuses our client, and the status it says: a reservation from a ninth peer at one IP address,
    PERMISSION_DENIED (kubo's per-IP limit), while a peer at another address still gets one; and a circuit to a peer
    that holds no slot, NO_RESERVATION, at once rather than at the dial's timeout. The crowd's connections all come
    from 127.0.0.1 (the kernel's source address on loopback, whatever address a host listens on); the home's comes
    from its own address because the relay dials it."""
    # the refusal's status is read from py-libp2p's record, caught on its own logger: a node run earlier in this
    # process (p2p.service.quiet_libp2p_logs) left filters and levels there that keep it from the root's handlers
    logger, seen = logging.getLogger("libp2p.relay.circuit_v2.transport"), []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(logger, "handlers", [handler])
    level, logger.disabled = logger.level, False
    logger.setLevel(logging.WARNING)
    crowd, home, dialer = [home_node() for _ in range(PER_IP + 1)], home_node(), listening()

    async def scenario() -> None:
        async with running(*((n, CROWD_IP) for n in crowd), (home, HOME_IP), (dialer, DIALER_IP)):
            relay = await trio.to_thread.run_sync(lambda: JsRelay(
                js_peer[0], [str(home.host.get_addrs()[0])], tmp_path / "relay.log", listen=f"/ip4/{RELAY_IP}/tcp/0"))
            try:
                for node in crowd:
                    await connect(node, relay)
                    await trio.sleep(1 / INBOUND_PER_S)
                assert [await node._reserve(relay.peer_id) for node in crowd] == [True] * PER_IP + [False]
                assert await home._reserve(relay.peer_id)
                start = trio.current_time()
                with pytest.raises(ConnectionError, match=f"status {StatusCode.NO_RESERVATION.value}"):
                    await dialer.dial(Multiaddr(f"{relay.addr}/{CIRCUIT}"), crowd[-1].host.get_id())
                assert trio.current_time() - start < 2
            finally:
                relay.close()

    try:
        trio.run(scenario)
    finally:
        logger.setLevel(level)
    refusals = [r.args[1] for r in seen if r.msg.startswith("Reservation failed")]
    assert refusals == [StatusCode.PERMISSION_DENIED]


def test_a_relay_that_does_not_renew_a_slot_is_forgotten_and_asked_again_only_after_a_backoff():
    """A renewal the relay refuses (it restarted full, it no longer serves us) ends the address we advertise through
    it at once, and the relay is asked again like any that refused; a slot not yet due is not renewed."""
    node = home_node()
    relay, later = peer(after=node), peer(after=node)
    asked: list[ID] = []

    async def refuse(relay: ID) -> bool:
        asked.append(relay)
        return False

    node._reserve = refuse
    for r in (relay, later):
        node.reserved[r] = Multiaddr(f"/ip4/{RELAY_IP}/tcp/1/p2p/{r}/{CIRCUIT}")
    node._renew_at = {relay: 0.0, later: float("inf")}
    ask = AskAgain()
    trio.run(node._keep_reservations, [relay, later], ask, clock=MockClock())  # at time 0
    assert asked == [relay] and list(node.reserved) == [later]
    assert not ask.may_ask(relay, RELAY_RETRY_S - 1) and ask.may_ask(relay, RELAY_RETRY_S)
