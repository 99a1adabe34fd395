"""Hole punching (DCUtR) for peers reached only through a relay, and GossipSub moved onto the punched connection.

py-libp2p 0.8.1's DCUtR (`libp2p.relay.circuit_v2.dcutr`, started here) punches on its own: every 2 s it picks the
peers it holds a relayed connection to, first dials the peer's non-circuit peerstore addresses plainly (spec step
0), then exchanges CONNECT (addresses) and SYNC over the relayed connection and dials the peer's addresses from its
TCP listen port (SO_REUSEPORT), in up to 3 rounds of 5 s, 3 attempts a peer. What it leaves undone is the move:
GossipSub's outbound stream to the peer (`Pubsub.peers[peer]`) stays on the relayed connection it was opened on, the
relayed connection stays open for 60 s after a punch (and for good after a plain dial, or until a relay's circuit
limit), and when it closes, Pubsub learns nothing: its read loop ends quietly on the stream's EOF, and its
disconnect handler skips a peer that still has another (the direct) connection. The dead stream stays in `peers`
until a write into it fails; that message is lost, and the failure makes Pubsub forget the peer's subscriptions,
learned again only when the peer's own dead stream fails a write: a side with nothing to send is sent nothing more,
with no error (tests/test_punch.py). `GuardedPubsub` reopens both ends' streams when a connection under them closes;
`Punch` runs DCUtR and closes a peer's relayed connections as soon as a direct one is open, not 60 s later.

What a punch dials is the peer's word, so it is a hint (`p2p.hints`): the library took every CONNECT address (up to 20,
over any connection) into the address book for 10 minutes, dialed them with every address the book held for the peer
in 3 rounds, and began with a plain dial of the book's addresses (spec step 0). Here a CONNECT is read only over a
relayed connection, a punch dials `ADDRS_PER_PEER` of its addresses that we could reach and nothing else, only
within the hint budget, and a failed punch charges them to the budget and to the peer, as one failed hint: a peer
whose punches keep failing is not punched again within the window (`SOURCE_FAILURES`), and all strangers' punches
and hints together fail at most `TOTAL_FAILURES` addresses a window. Step 0 dials nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections import Counter
from collections.abc import Callable

import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2p.hints import ADDRS_PER_PEER, REMEMBERED, HintBudget
from p2p.reach import is_circuit, is_open
from p2p.seen import SeenKeys

log = logging.getLogger(__name__)

MOVE_CHECK_S = 0.5  # how often connections are checked for a relayed one beside a direct one
SEEN_KEPT = 2  # external addresses of our listen port remembered (the latest): the first addresses a CONNECT sends


def relayed(conn: INetConn) -> bool:
    """Whether a connection runs through a relay (py-libp2p tags both ends' circuit connections with the circuit
    address)."""
    with contextlib.suppress(Exception):
        return any(map(is_circuit, conn.get_transport_addresses()))
    return False


class ListenPortSeen:
    """What the peers we dialed from our listen port see of it (identify's observed address on those connections).
    py-libp2p's DCUtR tells a peer our external IP with our listen port, which is right only where the router keeps
    the port (masquerade); a router that maps endpoint-independently to another port (carrier-grade NAT's way) is
    seen at that other port, by any peer, once a connection leaves from the listen port. The host's observed-address
    manager mixes connections from every local port, so the ones dialed here are told apart by the connection."""

    def __init__(self, host: IHost):
        self.host = host
        self.conns: weakref.WeakSet[INetConn] = weakref.WeakSet()
        self.seen: dict[str, Multiaddr] = {}  # the latest first
        manager = getattr(host, "_observed_addr_manager", None)
        if manager is not None:
            record = manager.record_observation

            def observed(conn: INetConn, addr: Multiaddr, local: list[Multiaddr]) -> None:
                if conn in self.conns and "/tcp/" in str(addr):
                    latest = {str(addr): addr, **{k: v for k, v in self.seen.items() if k != str(addr)}}
                    self.seen = dict(list(latest.items())[:SEEN_KEPT])
                record(conn, addr, local)

            manager.record_observation = observed

    def source(self) -> tuple[str, int] | None:
        """Our first TCP listen address, as (ip, port); None when we listen on none."""
        for addr in self.host.get_transport_addrs():
            with contextlib.suppress(Exception):
                return addr.value_for_protocol("ip4") or addr.value_for_protocol("ip6"), int(addr.value_for_protocol("tcp"))
        return None

    async def connect(self, info: PeerInfo) -> None:
        """Connect to `info` from our listen port where we can (a peer that dials nobody: a DHT server, a relay), so
        its identify tells us how our listen port is mapped; from any port where that fails."""
        source, network = self.source(), self.host.get_network()
        if source is not None and not network.get_connections(info.peer_id):
            for addr in info.addrs:
                with contextlib.suppress(Exception):
                    self.conns.add(await network.dial_addr(addr, info.peer_id, source))
                    self.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 600)
                    return
        await self.host.connect(info)

    def addrs(self) -> list[Multiaddr]:
        return list(self.seen.values())


class GuardedDCUtR(DCUtRProtocol):
    """py-libp2p's DCUtR with what a punch dials held to the hint budget (the module's docstring says why), and each
    punch counted (`punches`, `punches_failed`, `punches_refused`: no address the budget allowed, or a CONNECT over a
    direct connection). Both roles punch through `_perform_hole_punch` (the initiator after SYNC, dialing as the
    security responder; the peer that got SYNC at once, as the dialer)."""

    def __init__(self, host: IHost, counts: Counter[str], hints: HintBudget,
                 dialable: Callable[[PeerInfo], list[Multiaddr]], seen: ListenPortSeen | None = None):
        super().__init__(host)
        self.counts, self.hints, self.dialable = counts, hints, dialable
        self.seen = seen or ListenPortSeen(host)
        self.allowed: dict[ID, set[str]] = {}  # the addresses of each punch under way, the only ones `_dial_peer` dials
        self.punched: set[ID] = set()  # peers first reached through a relay, now over a direct connection
        self.told = SeenKeys(math.inf, REMEMBERED)  # peers whose failed punch was logged (once each)

    async def _handle_dcutr_stream(self, stream: INetStream) -> None:
        if stream.swarm_conn is None or not relayed(stream.swarm_conn):  # DCUtR runs over the relayed connection
            self.counts["punches_refused"] += 1
            with contextlib.suppress(Exception):
                await stream.reset()
            return
        await super()._handle_dcutr_stream(stream)

    async def _get_observed_addrs(self) -> list[bytes]:
        """Where peers saw our listen port (`ListenPortSeen`) first, then the library's guess: our external IP with
        our listen port."""
        return list(dict.fromkeys([a.to_bytes() for a in self.seen.addrs()] + await super()._get_observed_addrs()))

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        return super()._decode_observed_addrs(addr_bytes[:4 * ADDRS_PER_PEER])

    async def _perform_hole_punch(self, peer_id: ID, addrs: list[Multiaddr], as_responder: bool = False) -> bool:
        now, source = trio.current_time(), ("punch", peer_id)
        reachable = [a for a in self.dialable(PeerInfo(peer_id, addrs)) if not is_circuit(a)]
        # no backoff per address: DCUtR tries the same addresses again (3 attempts a peer), each bounded as a whole
        keys = list(dict.fromkeys(map(str, reachable)))[:self.hints.allowance(now, False)]
        if not keys or not self.hints.may_ask(source, now):
            self.counts["punches_refused"] += 1
            return False
        self.allowed[peer_id] = set(keys)
        try:
            with self.hints.dialing(len(keys), proven=False):
                ok = await super()._perform_hole_punch(peer_id, [Multiaddr(k) for k in keys], as_responder)
                if not ok:
                    self.hints.failed(keys, source, trio.current_time())
        finally:
            self.allowed.pop(peer_id, None)
        self.counts["punches" if ok else "punches_failed"] += 1
        if ok:
            self.punched.add(peer_id)
        elif peer_id not in self.told:
            self.told.add(peer_id, 0.0)
            log.info("hole punch to %s failed (a router on the way gives each connection its own port, or drops what "
                     "it did not ask for): it stays reached through the relay, whose limits may cut the circuit; "
                     "it is punched again when next dialed", peer_id)
        return ok

    async def _dial_peer(self, peer_id: ID, addr: Multiaddr, source: tuple[str, int] | None = None,
                         as_responder: bool = False) -> None:
        """Only the punch's own addresses: not the ones the library adds from the address book, nor step 0's."""
        if str(addr) in self.allowed.get(peer_id, ()):
            await super()._dial_peer(peer_id, addr, source, as_responder)


class Punch:
    """DCUtR for every relayed peer, and the relayed connection retired as soon as a direct one to the peer is open:
    closed at once rather than after py-libp2p's 60 s (or never, after a plain dial), so that nothing rides the relay
    once it is not needed; `GuardedPubsub` then reopens the peer's gossip stream on the direct connection."""

    def __init__(self, host: IHost, counts: Counter[str], hints: HintBudget,
                 dialable: Callable[[PeerInfo], list[Multiaddr]]):
        self.host, self.counts = host, counts
        self.seen = ListenPortSeen(host)
        self.dcutr = GuardedDCUtR(host, counts, hints, dialable, self.seen)
        self.punched = self.dcutr.punched

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.dcutr):
            task_status.started()
            while True:
                await self.move_to_direct()
                await trio.sleep(MOVE_CHECK_S)

    async def move_to_direct(self) -> None:
        """Close the relayed connections of every peer that also has an open direct one, and move its stream."""
        for peer, conns in list(self.host.get_network().connections.items()):
            live = [c for c in conns if is_open(c)]
            circuits = [c for c in live if relayed(c)]
            if not circuits or len(circuits) == len(live):
                continue
            for conn in circuits:
                with contextlib.suppress(Exception):
                    await conn.close()
            self.counts["relayed_closed_direct"] += len(circuits)
            self.punched.add(peer)
            log.info("peer %s reached directly: its relayed connection is closed", peer)
        self.punched.intersection_update(self.host.get_network().connections)

    def how_reached(self, peer: ID) -> str | None:
        """'punched', 'relayed' or 'direct' for a connected peer (status and /metrics), None when not connected."""
        live = [c for c in self.host.get_network().get_connections(peer) if is_open(c)]
        if not live:
            return None
        if all(map(relayed, live)):
            return "relayed"
        return "punched" if peer in self.punched else "direct"
