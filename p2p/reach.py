"""Reachability behind home routers: whether peers can dial us, and circuit relay v2 when they cannot.

A node learns whether it can be dialed by asking a few peers to dial it back (`/sapo/<ns>/dialback`), as
libp2p's AutoNAT v2 does: the asker sends a fresh nonce, and the peer dials the address it sees us at, on our
listen ports, on a connection of its own, and hands the nonce over it; only a nonce that arrives proves the dial.
py-libp2p 0.8.1's AutoNAT cannot answer this (its dial-back reuses the connection already open, so every node
looks public: measured), hence this small protocol of our own. A verdict needs the agreement of peers in two
network groups (`verdict`), so one peer that lies cannot move it either way. A node nobody can dial reserves a
slot on `relays` public peers (circuit relay v2: py-libp2p's client, and any relay v2 server, a sapo node's or a stock
js-libp2p or kubo one) and is then reached through them at `<relay addr>/p2p/<relay>/p2p-circuit/p2p/<us>`; it renews
each slot at half its lifetime itself; its outbound connections are direct as always. Public nodes
serve as relays (`relay_slots` reservations each) and tell askers of their peer list how to reach the peers that
reserved with them. A relayed pair then punches a direct connection (`p2p.punch`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import random
import secrets
import time
from collections import Counter
from enum import Enum

import msgpack
import trio
from libp2p.abc import IHost, IRawConnection, ISecureConn, ISecureTransport
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import IOException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.multiselect_client import MultiselectClient
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL, CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits, RelayResourceManager
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.security.exceptions import HandshakeFailure
from libp2p.tools.anyio_service import background_trio_service
from libp2p.transport.tcp.tcp import TCP
from multiaddr import Multiaddr

from p2p.bucket import Bucket, Buckets
from p2p.config import P2PConfig
from p2p.seen import SeenKeys

log = logging.getLogger(__name__)

DIALBACK_TIMEOUT_S = 5.0  # per port dialed back
DIALBACK_MAX_PORTS = 4
DIALBACK_ASK = 3  # peers asked per check, each of another network group while there are others
DIALBACK_QUORUM = 2  # network groups that must agree on a verdict (all there are, when a node is connected to fewer)
NONCE_BYTES = 16  # the dial-back's proof: only a connection that really reached us can hand it back
EARLY_RECHECK_S = 75.0  # after a change of verdict or a check that settled nothing (past a server's one dial-back a minute)
RELAY_RETRY_S = 4.0  # a first refusal is mostly a peer that has not yet learned it is public (a second after us, seen)
RELAY_RETRY_MAX_S = 60.0  # ... later ones a relay waiting for us to have taken part long enough (p2p.relay_after_s)
RENEW_MIN_S = 10.0  # a reservation is renewed at half the lifetime its relay granted, but no sooner than this
RENEW_MAX_S = 1800.0  # ... and no later (half of kubo's and js-libp2p's hour; a relay's clock may be off)
RECHECK_S = 600.0  # addresses change (a new lease, a new router): check again this often
UNREACHABLE_S = 2 * RECHECK_S  # a peer our dial-back could not reach may reserve a relay slot this long after
CIRCUIT = "p2p-circuit"
RELAY_PEER_SHARE = 0.25  # of the relay's paced budget, for the bytes sent through it from one IP address
METERED_PEERS = 1024  # addresses whose send rate the relay remembers (the least recent go first)
SLOTS_PER_IP = 2  # relay reservations held from one IP address (go-libp2p's relay limits them per peer, IP and ASN)
SLOTS_PER_SUBNET = 4  # ... and from one /24 (IPv4) or /48 (IPv6): addresses come cheaper than networks


def remote_ip(host: IHost, peer: ID) -> str | None:
    """The IP address `peer` is connected to us from (None when not connected)."""
    for conn in host.get_network().get_connections(peer):
        with contextlib.suppress(Exception):
            if remote := conn.muxed_conn.get_remote_address():
                return remote[0]
    return None


def subnet_of(ip: str) -> str:
    """The /24 of an IPv4 address, the /48 of an IPv6 one: what one owner's addresses mostly share."""
    return str(ipaddress.ip_network(f"{ip}/{24 if ipaddress.ip_address(ip).version == 4 else 48}", strict=False))


class Participants:
    """Peers whose signed messages our validator accepted within `ttl`, each with when its current run of
    participation began: one computable group costs nothing, so a relay slot also asks for time."""

    def __init__(self, ttl: float, max_keys: int):
        self.last = SeenKeys(ttl, max_keys)
        self.since: dict[ID, float] = {}  # peer -> its first accepted message since it last fell silent for `ttl`

    def __contains__(self, peer: ID) -> bool:
        return peer in self.last

    def add(self, peer: ID, now: float) -> None:
        self.last.forget_expired(now)  # a peer silent past `ttl` starts over
        if peer not in self.last:
            self.since[peer] = now
        self.last.add(peer, now)
        if len(self.since) > 2 * self.last.max_keys:
            self.forget_expired(now)

    def forget_expired(self, now: float) -> None:
        self.last.forget_expired(now)
        for peer in [p for p in self.since if p not in self.last]:
            del self.since[peer]

    def age(self, peer: ID, now: float) -> float | None:
        """Seconds this peer has taken part without a silence of `ttl`, or None when it does not now."""
        return now - self.since[peer] if peer in self.last and peer in self.since else None


class AskAgain:
    """When this node may ask each relay for a slot again: `RELAY_RETRY_S` after its first refusal, doubling up to
    `RELAY_RETRY_MAX_S` (a newcomer waits `p2p.relay_after_s` for its slot: asking every 4 s was 150 asks a relay)."""

    def __init__(self, max_keys: int = 4096):
        self.max_keys = max_keys
        self._next: dict[ID, tuple[float, float]] = {}  # relay -> (when it may be asked again, the last wait)

    def may_ask(self, relay: ID, now: float) -> bool:
        return now >= self._next.get(relay, (now, 0.0))[0]

    def refused(self, relay: ID, now: float) -> None:
        wait = min(2 * self._next.pop(relay, (now, RELAY_RETRY_S / 2))[1], RELAY_RETRY_MAX_S)
        self._next[relay] = (now + wait, wait)
        if len(self._next) > self.max_keys:
            del self._next[next(iter(self._next))]  # the least recently refused

    def granted(self, relay: ID) -> None:
        self._next.pop(relay, None)


class ParticipantSlots(RelayResourceManager):
    """Relay slots for participants only. A peer may reserve when, within `UNREACHABLE_S`, this node dialed
    it back over a direct connection and reached none of its ports (it needs a relay), its signed messages have
    been accepted here for `min_age_s` with no silence of `UNREACHABLE_S` (strangers who each published one
    computable group got 32 of 34 slots: anyone can solve a public generator's task, but no one can buy time),
    and while fewer than `SLOTS_PER_IP` slots are held from its IP address and `SLOTS_PER_SUBNET` from its
    subnet (peer ids are free). A slot is freed when its holder disconnects. Every refusal is counted, a full
    relay's included (relayed bytes by `RelayMeter`)."""

    def __init__(self, limits: RelayLimits, host: IHost, counts: Counter[str], min_age_s: float):
        super().__init__(limits, host)
        self.counts, self.min_age_s = counts, min_age_s
        self.unreachable = SeenKeys(UNREACHABLE_S, 4096)  # peers our dial-back could not reach
        self.participants = Participants(UNREACHABLE_S, 4096)  # authors of messages our validator accepted

    def can_accept_reservation(self, peer_id: ID) -> bool:
        now = trio.current_time()
        self.unreachable.forget_expired(now)
        self.participants.forget_expired(now)
        if peer_id not in self.unreachable or peer_id not in self.participants or not super().can_accept_reservation(peer_id):
            self.counts["relay_refused"] += 1
            return False
        if self.participants.age(peer_id, now) < self.min_age_s:
            self.counts["relay_refused"] += 1
            self.counts["relay_refused_new"] += 1
            return False
        if self._crowded(peer_id):
            self.counts["relay_refused"] += 1
            self.counts["relay_refused_address"] += 1
            return False
        return True

    def _crowded(self, peer_id: ID) -> bool:
        """Whether the slots held from `peer_id`'s address, or from its subnet, are at their limit."""
        ip = remote_ip(self.host, peer_id)
        if ip is None:
            return True
        held = [a for a in (remote_ip(self.host, p) for p in self._reservations if p != peer_id) if a]
        return held.count(ip) >= SLOTS_PER_IP or [subnet_of(a) for a in held].count(subnet_of(ip)) >= SLOTS_PER_SUBNET

    def _clean_expired(self) -> None:
        super()._clean_expired()
        for peer in [p for p in self._reservations if not self._is_peer_connected(p)]:
            del self._reservations[peer]


class RelayMeter:
    """Every byte this node relays, counted, and paced to `bytes_per_s` over all circuits together and to
    `RELAY_PEER_SHARE` of it for the bytes sent from any one IP address: relaying costs a pure-Python node CPU it
    needs for its rounds, one pair of peers took the whole budget that NAT'd peers share, and four peer ids from one
    address took it again when the share was per peer id. One meter serves the trio thread's circuits, which never
    run at once."""

    def __init__(self, bytes_per_s: int, counts: Counter[str]):
        self.rate, self.counts = bytes_per_s, counts
        self.all = Bucket(bytes_per_s)
        self.peers = Buckets(bytes_per_s * RELAY_PEER_SHARE, max_keys=METERED_PEERS)

    async def take(self, n: int, sender: object) -> None:
        now = trio.current_time()
        wait = max(self.all.take(n, now), self.peers[sender].take(n, now))
        self.counts["relayed_bytes"] += n
        if wait:
            self.counts["relay_paced_s"] += wait
            await trio.sleep(wait)


class MeteredStream:
    """A relayed stream whose reads pass through the meter, charged to the peer that sent them; all else is
    the stream's own."""

    def __init__(self, stream, meter: RelayMeter, sender: object):
        self._stream, self._meter, self._sender = stream, meter, sender

    async def read(self, n: int | None = None) -> bytes:
        data = await self._stream.read(n)
        await self._meter.take(len(data), self._sender)
        return data

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class MeteredRelay(CircuitV2Protocol):
    """py-libp2p's relay with every relayed byte counted and paced (`RelayMeter`); its own per-circuit
    caps stay: py-libp2p counts nothing once a circuit has a data cap."""

    def __init__(self, host: IHost, limits: RelayLimits, meter: RelayMeter):
        super().__init__(host, limits=limits, allow_hop=False)  # hop: once we know we are public
        self.meter = meter

    async def _relay_data(self, src_stream, dst_stream, peer_id, deadline=None, circuit_data_limit=None) -> None:
        """py-libp2p runs this once per direction with `peer_id` the peer whose stream `src_stream` is; its bytes are
        charged to the address it is connected from."""
        sender = remote_ip(self.host, peer_id) or peer_id
        await super()._relay_data(MeteredStream(src_stream, self.meter, sender), dst_stream, peer_id, deadline,
                                  circuit_data_limit)


class Reachability(Enum):
    UNKNOWN = "unknown"
    PUBLIC = "public"
    PRIVATE = "private"


def is_circuit(addr: Multiaddr) -> bool:
    return CIRCUIT in str(addr)


def is_open(conn) -> bool:
    """Whether a swarm connection is still up (py-libp2p keeps a closed one in its table for a while)."""
    return not getattr(conn.muxed_conn, "is_closed", False)


PRIVATE_NETS = [ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "fc00::/7", "fe80::/10")]


def is_private(ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Private as the node counts it (`PRIVATE_NETS`: a home network, CGNAT), not as Python's `is_private`, which
    also counts documentation and benchmarking ranges (the network lab's internet) and not CGNAT."""
    return any(ipaddress.ip_address(ip) in net for net in PRIVATE_NETS)


def _private_net(addr: Multiaddr) -> ipaddress.IPv4Network | ipaddress.IPv6Network | str | None:
    """The local network a private address belongs to (its /24, or /64), 'loopback', or None for a
    public address or a name."""
    for proto in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(addr.value_for_protocol(proto))
        except Exception:
            continue
        if ip.is_loopback:
            return "loopback"
        if is_private(ip):
            return ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False)
    return None


def tcp_ports(addrs: list[Multiaddr]) -> list[int]:
    return sorted({int(a.value_for_protocol("tcp")) for a in addrs if "tcp" in [p.name for p in a.protocols()]})


def verdict(answers: list[tuple[str, bool]], groups: int) -> tuple[Reachability | None, int]:
    """What one check's answers settle, and how many network groups back it. Each answer is the answering peer's
    group and whether it reached us (our nonce came back); a group counts once on each side it answered for. A side
    wins with `DIALBACK_QUORUM` groups, or all `groups` the node is connected to when there are fewer, and more
    groups than the other side; else nothing is settled. A "reached" cannot be forged, and one liar's "not reached"
    (free to send) is one group: it neither makes a verdict alone nor outweighs two honest groups."""
    reached, unreached = ({g for g, ok in answers if ok is side} for side in (True, False))
    need = max(1, min(DIALBACK_QUORUM, groups))
    for side, other, state in ((reached, unreached, Reachability.PUBLIC), (unreached, reached, Reachability.PRIVATE)):
        if len(side) >= need and len(side) > len(other):
            return state, len(side)
    return None, 0


class NonceTaker(ISecureTransport):
    """Where a dial-back's nonce comes in (`Reach.nonce_protocol`): negotiated on a new inbound TCP connection in
    place of a security protocol, so that the connection never becomes one to a peer. It is read, checked and
    closed here, and the swarm drops it as a failed handshake (a dial-back over a secured, multiplexed connection
    from a throwaway identity showed that identity as a connected peer for 0.1 s: identify, GossipSub and peer
    exchange turned to it). It secures nothing."""

    def __init__(self, reach: Reach):
        self.reach = reach

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        await self.reach._take_nonce(conn)
        raise HandshakeFailure("a dial-back's nonce, not a security protocol")

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        raise HandshakeFailure("a dial-back's nonce, not a security protocol")


class Reach:
    """Our reachability, our relay reservations when not known public, and our relay service when public."""

    def __init__(self, cfg: P2PConfig, host: IHost, counts: Counter[str]):
        self.cfg = cfg
        self.host = host
        self.counts = counts
        self.state = {"auto": Reachability.UNKNOWN, "public": Reachability.PUBLIC,
                      "private": Reachability.PRIVATE}[cfg.reachability]
        limits = RelayLimits(duration=cfg.relay_circuit_s, data=cfg.relay_circuit_mib << 20, max_circuit_conns=8,
                             max_reservations=cfg.relay_slots)
        self.protocol = MeteredRelay(host, limits, RelayMeter(cfg.relay_kib_per_s << 10, counts))
        self.slots = self.protocol.resource_manager = ParticipantSlots(limits, host, counts, cfg.relay_after_s)
        # without RelayRole.CLIENT: py-libp2p's client would reserve a slot on every relay it dials a circuit through
        self.transport = CircuitV2Transport(host, self.protocol, RelayConfig(roles=RelayRole.STOP))
        self.dialback_protocol = TProtocol(f"/sapo/{cfg.profile().namespace}/dialback/2.0.0")
        self.nonce_protocol = TProtocol(f"/sapo/{cfg.profile().namespace}/dialback-nonce/2.0.0")
        self.reserved: dict[ID, Multiaddr] = {}  # relay -> our address through it (without /p2p/<us>)
        self._renew_at: dict[ID, float] = {}  # relay -> when to renew our reservation there (trio time)
        self.ask = AskAgain()  # relays that refused a reservation are not asked again for a while
        self._served = SeenKeys(60.0, 4096)  # askers answered in the last minute: one dial-back each
        self._asked: dict[bytes, bool] = {}  # nonce of a dial-back waiting for its answer -> whether it came in
        self.reached = False  # whether the last check with answers had one that proved a peer reached us
        self._hop = False

    # -- what others should dial ---------------------------------------------------------------

    def advertised(self, direct: list[Multiaddr]) -> list[Multiaddr]:
        """Our direct addresses, or, when nobody can dial them, our addresses through our relays; both while we do
        not know (a relay grants a slot only to a peer its own dial-back could not reach)."""
        if self.state is Reachability.PUBLIC:
            return direct
        relayed = list(self.reserved.values())
        return relayed if self.state is Reachability.PRIVATE else direct + relayed

    def relayed_entries(self) -> dict[ID, list[str]]:
        """As a relay: how to reach each peer that holds a reservation with us."""
        if not self._hop:
            return {}
        mine = [str(a).split("/p2p/")[0] for a in self.host.get_addrs() if not is_circuit(a)]
        return {peer: [f"{a}/p2p/{self.host.get_id()}/{CIRCUIT}" for a in mine]
                for peer in list(self.slots._reservations) if self.slots.has_reservation(peer)}

    def dialable(self, info: PeerInfo, own: list[Multiaddr], alone: bool = False) -> list[Multiaddr]:
        """Which of a peer-exchange hint's addresses we should dial, given our own addresses.

        A private address (a home network's, loopback) only from inside that network: another home's
        192.168.2.2 is not that peer, and a dial to it hangs until the timeout (measured: 10 s per hint).
        A peer that lists circuits cannot be dialed directly; we dial it through its relays only when
        we cannot be dialed either and our peer id sorts first: a dialable node waits for the private
        one to dial out to it, and two circuits between one pair (both dialing at once) broke both
        nodes' connections to the relay (measured). A node with no swarm peer (`alone`) dials whatever the order: the
        peer that sorts first may have peers of its own and look nobody up for the rendezvous' refresh, and a node
        behind a symmetric NAT, reached only through limited relays, was cut off when their circuits ended."""
        relayed = [a for a in info.addrs if is_circuit(a)]
        if not relayed:
            local = {n for n in map(_private_net, own) if n is not None}
            return [a for a in info.addrs if _private_net(a) in local | {None}]
        if self.behind_nat() and (alone or self.host.get_id().to_bytes() < info.peer_id.to_bytes()):
            return relayed
        return []

    async def dial(self, addr: Multiaddr, peer: ID) -> None:
        """Connect to `peer` through the relay named in `addr` (`.../p2p/<relay>/p2p-circuit`)."""
        await self.transport.dial(Multiaddr(f"{addr}/p2p/{peer}"))

    # -- background tasks ------------------------------------------------------------------------

    def set_handlers(self) -> None:
        """Serve dial-backs, and take the nonces of our own (after the security protocols: this node never
        proposes it first when it dials)."""
        self.host.set_stream_handler(self.dialback_protocol, self._serve_dialback)
        self.host.get_network().upgrader.security_multistream.add_transport(self.nonce_protocol, NonceTaker(self))

    async def run(self, connected, nursery: trio.Nursery) -> None:
        """Keep our reachability known, and our relay reservations or relay service up to date.
        `connected()` gives the peers we hold direct connections to. While the answers settle nothing and none
        proved that a peer reached us, we keep relay slots as a fallback too (a node that one peer did reach
        would only be refused: a relay grants a slot to a peer its own dial-back could not reach)."""
        self.set_handlers()
        await nursery.start(self._run_protocol)
        ask = self.ask
        due = 0.0
        while True:
            now = trio.current_time()
            peers = [p for p in connected() if p in self.direct_peers()]
            if self.cfg.reachability == "auto" and peers and now >= due:
                due = now + await self._recheck(peers)
            if self.state is Reachability.PUBLIC and self.cfg.relay_slots and not self._hop:
                self._serve_relay()
            if self.state is Reachability.PRIVATE or (self.state is Reachability.UNKNOWN and not self.reached):
                await self._keep_reservations(peers, ask)
            await trio.sleep(2.0)

    async def _keep_reservations(self, peers: list[ID], ask: AskAgain) -> None:
        """Forget relays we lost and those that do not renew our reservation when it is due; ask connected peers for
        slots until we hold `relays` (each refusal backs off)."""
        for relay in [r for r in self.reserved if r not in peers]:
            self._forget(relay)
            log.info("lost relay %s", relay)
        now = trio.current_time()
        for relay in [r for r, due in self._renew_at.items() if due <= now]:
            if not await self._reserve(relay):
                self._forget(relay)
                ask.refused(relay, now)
                log.info("relay %s did not renew our reservation", relay)
        for relay in [p for p in peers if p not in self.reserved and ask.may_ask(p, now)][:self.cfg.relays - len(self.reserved)]:
            if await self._reserve(relay):
                ask.granted(relay)
            else:
                ask.refused(relay, now)

    def _forget(self, relay: ID) -> None:
        del self.reserved[relay]
        del self._renew_at[relay]

    def _serve_relay(self) -> None:
        self._hop = True
        self.host.set_stream_handler(HOP_PROTOCOL, self.protocol._handle_hop_stream)
        where = ("by peers on this machine (it listens on loopback only)"
                 if all(_private_net(a) == "loopback" for a in self.host.get_addrs()) else "from outside")
        log.info("reachable %s: serving as a relay for up to %d peers behind NAT", where, self.cfg.relay_slots)

    async def _run_protocol(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.protocol):
            task_status.started()
            await trio.sleep_forever()

    def _set(self, found: Reachability) -> None:
        if found is not self.state:
            log.info("reachability: %s%s", found.value, "" if found is Reachability.PUBLIC else
                     f" (no peer could dial us back); reserving slots on {self.cfg.relays} relays")
            self.state = found
            self.counts["reachability_changes"] += 1

    def keeps(self, peer: ID) -> bool:
        """Whether a peer that is not a swarm peer (a DHT server) stays connected: a relay we hold a slot on, or,
        while we are not known to be dialable and hold fewer than `relays` slots, one that serves circuit relay v2
        and has not just refused us. With no dialable sapo node in the swarm, the public DHT servers a home node
        meets through the rendezvous are the relays it has (kubo's and js-libp2p's serve limited circuits), enough
        to coordinate a hole punch."""
        if peer in self.reserved:
            return True
        if self.state is Reachability.PUBLIC or len(self.reserved) >= self.cfg.relays:
            return False
        with contextlib.suppress(Exception):
            return HOP_PROTOCOL in self.host.get_peerstore().get_protocols(peer) \
                and self.ask.may_ask(peer, trio.current_time())
        return False

    def behind_nat(self) -> bool:
        """Private, or not known either way while relays hold a slot for us (a relay grants one only to a peer its own
        dial-back could not reach; a stock relay asks nothing, and no peer may have answered ours)."""
        return self.state is Reachability.PRIVATE or (self.state is Reachability.UNKNOWN and bool(self.reserved))

    def direct_peers(self) -> set[ID]:
        """Peers we hold a connection to that does not go through a relay."""
        return {peer for peer, conns in self.host.get_network().connections.items()
                if any(not any(map(is_circuit, c.get_transport_addresses())) for c in conns)}

    async def _reserve(self, relay: ID) -> bool:
        """Reserve a slot on `relay`, or renew ours. Ask it to dial us back first: a sapo relay serves only peers it
        found it could not reach (another relay answers that it does not speak the protocol).

        The renewal is ours, not py-libp2p's (`CircuitV2Transport.reserve` starts a refresher): that one retries a
        failed renewal with no pause until the reservation expires, so a relay lost or refusing in its last 30 s
        spun a core (measured: 63,041 ERROR records in 6 s after the relay stopped)."""
        await self._ask(relay, self._ports())
        with trio.move_on_after(DIALBACK_TIMEOUT_S * 2):
            try:
                stream = await self.host.new_stream(relay, [HOP_PROTOCOL])
                try:
                    if not await self.transport._make_reservation(stream, relay):
                        return False
                    remote = stream.get_remote_address()
                finally:
                    await stream.close()
                lifetime = self.transport._reservations[relay] - time.time()  # the relay's expiry, in unix seconds
                self._renew_at[relay] = trio.current_time() + min(max(lifetime / 2, RENEW_MIN_S), RENEW_MAX_S)
                if relay not in self.reserved:
                    self.counts["relay_reservations"] += 1
                    log.info("reachable through relay %s", relay)
                self.reserved[relay] = Multiaddr(f"/ip4/{remote[0]}/tcp/{remote[1]}/p2p/{relay}/{CIRCUIT}")
                return True
            except Exception as e:
                log.debug("relay %s refused a reservation: %s", relay, e)
        return False

    # -- dial-back -------------------------------------------------------------------------------

    def _ports(self) -> list[int]:
        return tcp_ports(self.host.get_transport_addrs())[:DIALBACK_MAX_PORTS]

    def group_of(self, peer: ID) -> str | None:
        """The network group a peer counts in: the /24 or /48 its connection comes from (`subnet_of`). Loopback
        groups like any address, so a swarm of processes on 127.0.0.1 is one group, and its nodes settle on
        one answer (a verdict asks at most as many groups as a node is connected to)."""
        ip = remote_ip(self.host, peer)
        return subnet_of(ip) if ip else None

    async def _recheck(self, peers: list[ID]) -> float:
        """Check and act on the verdict; return when to check again. A check nobody answered is repeated at
        the next turn; one that confirmed what we believed with `DIALBACK_QUORUM` groups, after `RECHECK_S`; any other
        (a change, a verdict from the one group we are connected to, answers that settle nothing) after
        `EARLY_RECHECK_S`, when the peers asked may answer again."""
        groups = {p: g for p in peers if (g := self.group_of(p)) is not None}
        answers = await self._check(groups)
        if not answers:
            return 0.0
        found, support = verdict(answers, len(set(groups.values())))
        self.reached = any(ok for _, ok in answers)
        settled = found is self.state and support >= DIALBACK_QUORUM
        if found is not None:
            self._set(found)
        if self.state is not Reachability.UNKNOWN:
            self.counts["dialback_disagreeing"] += sum(ok is not (self.state is Reachability.PUBLIC) for _, ok in answers)
        return RECHECK_S if settled else EARLY_RECHECK_S

    async def _check(self, groups: dict[ID, str]) -> list[tuple[str, bool]]:
        """Ask up to DIALBACK_ASK peers at once, one per network group first, to dial us back; the answers,
        each with its peer's group (`verdict`)."""
        by_group: dict[str, list[ID]] = {}
        for peer, group in groups.items():
            by_group.setdefault(group, []).append(peer)
        firsts = [random.choice(peers) for peers in by_group.values()]
        rest = [p for p in groups if p not in firsts]
        random.shuffle(firsts)
        random.shuffle(rest)
        ports, answers = self._ports(), []

        async def ask(peer: ID) -> None:
            if (reached := await self._ask(peer, ports)) is not None:
                answers.append((groups[peer], reached))

        async with trio.open_nursery() as nursery:
            for peer in (firsts + rest)[:DIALBACK_ASK]:
                nursery.start_soon(ask, peer)
        return answers

    async def _ask(self, peer: ID, ports: list[int]) -> bool | None:
        """One dial-back: True when `peer` handed our nonce over a new direct connection, False when it
        answered without (whatever it says: one that claims it reached us is counted, `dialback_unproven`),
        None when it did not answer (refused, timed out, over a relay, asked again within the minute)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._asked[nonce] = False
        reply = None
        try:
            with trio.move_on_after(DIALBACK_TIMEOUT_S * (len(ports) + 1)):
                stream = await self.host.new_stream(peer, [self.dialback_protocol])
                try:
                    await stream.write(msgpack.packb({"ports": ports, "nonce": nonce}))
                    reply = msgpack.unpackb(await stream.read(1024))
                finally:
                    await stream.close()
        except Exception as e:
            log.debug("dial-back by %s failed: %s", peer, e)
        finally:
            reached = self._asked.pop(nonce)
        if reached:
            self.counts["dialback_proven"] += 1
            return True
        if not isinstance(reply, dict) or "reached" not in reply:
            return None
        self.counts["dialback_unproven" if reply["reached"] else "dialback_unreached"] += 1
        return False

    async def _take_nonce(self, conn: IRawConnection) -> None:
        """A dial-back's nonce, on a connection dialed to us (`NonceTaker`). It proves the dial when it is one we
        are waiting for and the connection came directly (through a relay it would only prove the relay
        reachable); anything else is counted (`dialback_nonce_refused`)."""
        try:
            nonce = b""
            with trio.move_on_after(DIALBACK_TIMEOUT_S):
                while len(nonce) < NONCE_BYTES and (data := await conn.read(NONCE_BYTES - len(nonce))):
                    nonce += data
            if nonce in self._asked and not conn.is_initiator and conn.get_connection_type() is ConnectionType.DIRECT:
                self._asked[nonce] = True
            else:
                self.counts["dialback_nonce_refused"] += 1
        except Exception as e:
            self.counts["dialback_nonce_refused"] += 1
            log.debug("taking a dial-back nonce failed: %s", e)
        finally:
            with trio.CancelScope(shield=True):
                await conn.close()  # the server waits for this: we have read its nonce

    def _relayed(self, stream) -> bool:
        """Whether a stream runs over a relayed connection (or one no longer known): the address it
        comes from is then the relay's, not the asker's."""
        conns = self.host.get_network().connections.get(stream.muxed_conn.peer_id, [])
        conn = next((c for c in conns if c.muxed_conn is stream.muxed_conn), None)
        return conn is None or any(map(is_circuit, conn.get_transport_addresses()))

    async def _serve_dialback(self, stream) -> None:
        """Dial the asker back at the IP its direct connection comes from, on at most 4 of its ports in
        turn until its nonce is handed over (`_deliver`), once a minute per asker: nobody can point us at a
        third party. Over a relay that IP is the relay's, so the answer is that we cannot tell (dialing would
        scan the relay's host). A request that is not one (no nonce, not a map, not sent in time, a stream that
        breaks) is counted, `dialback_malformed`, and left unanswered."""
        try:
            asker = stream.muxed_conn.peer_id
            remote = stream.get_remote_address()
            request = None
            with trio.move_on_after(DIALBACK_TIMEOUT_S):
                request = msgpack.unpackb(await stream.read(1024))
            if self._relayed(stream):
                self.counts["dialback_relayed"] += 1
                await stream.write(msgpack.packb({"relayed": True}))
                return
            nonce = request.get("nonce") if isinstance(request, dict) else None
            ports = request.get("ports") if isinstance(request, dict) else None
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES or not isinstance(ports, list):
                self.counts["dialback_malformed"] += 1
                return
            ports = [p for p in ports if isinstance(p, int) and 0 < p < 65536][:DIALBACK_MAX_PORTS]
            now = trio.current_time()
            self._served.forget_expired(now)
            if not remote or asker in self._served:
                self.counts["dialback_limited"] += 1
                await stream.write(msgpack.packb({"limited": True}))
                return
            self._served.add(asker, now)
            reached = []
            for port in ports:
                if await self._deliver(remote[0], port, nonce):
                    reached.append(port)
                    break
            if ports and not reached:  # it needs a relay: it may reserve a slot with us
                self.slots.unreachable.add(asker, trio.current_time())
            self.counts["dialbacks_served"] += 1
            await stream.write(msgpack.packb({"reached": reached}))
        except Exception as e:
            self.counts["dialback_malformed"] += 1
            log.debug("serving a dial-back failed: %s", e)
        finally:
            await stream.close()

    async def _deliver(self, ip: str, port: int, nonce: bytes) -> bool:
        """Dial ip:port on a new TCP connection, negotiate `nonce_protocol` there (multistream-select, where a
        security protocol goes: `NonceTaker`), write the nonce and wait for the asker to close; True once it has.

        Not through our host: py-libp2p keeps one connection per peer (`max_connections_per_peer=1`), so a dial
        from it reuses the one the request came over and proves nothing (why py-libp2p's AutoNAT calls every peer
        public). Measured on loopback: about 3 ms a dial-back, both ends' CPU included (a Noise and Yamux connection
        from a throwaway identity took 0.12 s and 15 ms, and showed the asker a peer for 0.1 s)."""
        raw = None
        with trio.move_on_after(DIALBACK_TIMEOUT_S):
            try:
                raw = await TCP().dial(Multiaddr(f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}"))
                await MultiselectClient().select_one_of([self.nonce_protocol], MultiselectCommunicator(raw))
                await raw.write(nonce)
                with contextlib.suppress(IOException):
                    await raw.read(1)  # the asker closes the connection once it has the nonce
                return True
            except Exception as e:
                log.debug("dial-back to %s:%d failed: %s", ip, port, e)
            finally:
                if raw is not None:
                    with trio.CancelScope(shield=True):
                        await raw.close()
        return False
