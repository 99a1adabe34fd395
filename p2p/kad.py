"""Kademlia lookups of our own for the rendezvous: no few servers can steer, starve or fool them.

py-libp2p 0.8.1's lookups (`kad_dht.peer_routing`) write every `closerPeers` entry into the host's address book and dial
up to 10 of them a step for up to 20 steps, and its `find_providers` stops at the first 32 providers, closest servers
first. Three servers with ids ground near the rendezvous key made two nodes open 114 connections to 91 hosts of their
choosing in one lookup each, and 32 made-up providers in every answer kept two honest nodes apart for 240 s
(tests/test_kad.py shows the library's behaviour). This client speaks `/ipfs/kad/1.0.0` itself:

- **Disjoint paths** (S/Kademlia): the known servers are dealt into `PATHS` paths, and a server that one path learns of
  is queried by that path alone, so servers near the key sit on some paths, not on all.
- **Bounded dials**: one answer adds at most `CLOSER_PER_ANSWER` servers, a lookup dials at most `LOOKUP_DIALS` that
  it did not know, and `DialBudget` allows `FAILURES_PER_MINUTE` failed dials a minute over all lookups; each failed
  address is charged to the node's hint budget (`p2p.hints`) and its answering server. An address from an answer is
  dialed once, and forgotten with the lookup: it never enters the host's address book.
- **The region** (the 2025 follow-up to the IPFS censorship work, against kubo's early termination): once the walk
  ends, every server among the `REGION` closest that answered is asked for providers and told ours, and providers are
  kept by the server that named them, so that callers take a few from each (`Region.picks`) and no server answers for
  the others. A provider found here is a hint; it counts as found once it completes our gossip handshake.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
import varint
from libp2p.abc import IHost
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.custom_types import TProtocol
from libp2p.utils.varint import read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from p2p.hints import HintBudget, Recent

log = logging.getLogger(__name__)

PROTOCOL = TProtocol("/ipfs/kad/1.0.0")
PATHS = 3  # disjoint lookup paths
REGION = 20  # servers around the key asked for providers and told ours (Kademlia's k)
CLOSER_PER_ANSWER = 3  # new servers one answer may add to its path
PATH_QUERIES = 8  # servers one path asks before it stops
LOOKUP_DIALS = 12  # servers a lookup dials that it did not know (bootstrap DHT peers and connected ones it knows)
FAILURES_PER_MINUTE = 4  # failed server dials a minute, over all lookups: a liar's made-up servers cost this many
ADDRS_TRIED = 2  # addresses of one server tried, one connection attempt each
QUERY_TIMEOUT_S = 10.0
MAX_ANSWER_BYTES = 256 * 1024
MAX_ENTRIES = 32  # closer peers and providers read from one answer
MAX_ADDRS = 4  # addresses kept per entry
RAW_ADDRS = 16  # ... of the first this many it lists
DIRECT_TCP = {"ip4", "ip6", "dns4", "dns6", "tcp", "p2p"}  # what an address may be made of for the host to dial it


def key_bytes(key: str) -> bytes:
    """The DHT key of a hex multihash (as `rendezvous_key` gives it)."""
    return bytes.fromhex(key)


def distance(target: bytes, peer: ID) -> int:
    """Kademlia's XOR distance between sha256 of the key and of the peer id, as every libp2p DHT measures it."""
    return int.from_bytes(hashlib.sha256(target).digest(), "big") ^ int.from_bytes(
        hashlib.sha256(peer.to_bytes()).digest(), "big")


def tcp_addrs(raw: list[bytes]) -> list[Multiaddr]:
    """The dialable TCP addresses among an answer's raw ones, without a trailing /p2p; malformed ones skipped. A
    circuit through a relay at a TCP address counts too, as `<relay addr>/p2p/<relay>/p2p-circuit` (a home node's
    provider record lists them, and js-libp2p's servers add the address they saw the provider at, first)."""
    out: list[Multiaddr] = []
    for data in raw[:RAW_ADDRS]:
        with contextlib.suppress(Exception):  # noqa: BLE001 - untrusted bytes
            relay, circuit, _ = str(Multiaddr(data)).partition("/p2p-circuit")
            names = [p.name for p in Multiaddr(relay).protocols()]
            if set(names) <= DIRECT_TCP and "tcp" in names and (not circuit or names[-1] == "p2p"):
                out.append(Multiaddr(f"{relay}/p2p-circuit" if circuit else relay.split("/p2p/")[0]))
    return list({str(a): a for a in out}.values())[:MAX_ADDRS]


def entries(peers) -> list[PeerInfo]:
    """An answer's peer entries (closer peers or providers) as peer infos; malformed ones skipped."""
    out: list[PeerInfo] = []
    for peer in list(peers)[:MAX_ENTRIES]:
        try:
            pid = ID(peer.id)
            pid.to_base58()
        except Exception:  # noqa: BLE001 - untrusted bytes
            continue
        out.append(PeerInfo(pid, tcp_addrs(list(peer.addrs))))
    return out


@dataclass
class Server:
    """A DHT server one lookup knows of: on which path, who named it (None: the node knew it), how it went."""
    info: PeerInfo
    path: int
    named_by: ID | None
    state: str = "new"  # new, asked (it answered), failed (no connection or no answer), skipped (no dial budget)


@dataclass
class Region:
    """What one lookup found: the servers that answered, closest first, and the providers each named."""
    servers: list[ID]
    providers: dict[ID, list[PeerInfo]] = field(default_factory=dict)
    dialed: int = 0  # servers the lookup dialed that it did not know
    failed: int = 0  # ... of which the dial failed

    def picks(self, exclude: set[ID], rng: random.Random | None = None) -> list[tuple[ID, PeerInfo]]:
        """Every provider once, taken round-robin over the servers that named them, in random order: the first few
        picks come from as many servers as there are picks, so servers that name only made-up providers hold back
        the others' by one turn each, however many they name."""
        rng = rng or random.Random()
        lists = {s: rng.sample(ps, len(ps)) for s, ps in self.providers.items()}
        order = rng.sample(list(lists), len(lists))
        out, seen = [], set(exclude)
        while any(lists.values()):
            for server in order:
                while lists[server]:
                    info = lists[server].pop()
                    if info.peer_id not in seen and info.addrs:
                        seen.add(info.peer_id)
                        out.append((server, info))
                        break
        return out


class DialBudget:
    """What DHT lookups may dial: addresses the hint budget allows, `ADDRS_TRIED` a server, one at a time, and
    `FAILURES_PER_MINUTE` failures a minute over all lookups. A failure is charged to its address, its host and the
    server that named it (`HintBudget.failed`); not to the budget unproven hints share, which is the providers'.
    An attempt in flight counts as a failure until it succeeds: the paths dial at once, and each would otherwise see
    the same room left and overdraw it."""

    def __init__(self, host: IHost, hints: HintBudget):
        self.host, self.hints = host, hints
        self.failures = Recent(60.0)
        self.in_flight = 0

    def exhausted(self, now: float) -> bool:
        return self.failures.count(None, now) + self.in_flight >= FAILURES_PER_MINUTE

    async def dial(self, server: Server) -> bool:
        for addr in [a for a in server.info.addrs if self.hints.may_dial(str(a), trio.current_time())][:ADDRS_TRIED]:
            if self.exhausted(trio.current_time()):
                return False
            self.in_flight += 1
            try:
                with trio.move_on_after(QUERY_TIMEOUT_S):
                    try:
                        await self.host.connect(PeerInfo(server.info.peer_id, [addr]))
                        return True
                    except Exception as e:  # noqa: BLE001 - a made-up server: one failed attempt
                        log.debug("DHT server %s at %s: %s", server.info.peer_id, addr, e)
            finally:
                self.in_flight -= 1
            now = trio.current_time()
            self.failures.add(None, now)
            self.hints.failed([str(addr)], server.named_by, now, proven=True)
        self.host.get_peerstore().clear_addrs(server.info.peer_id)
        return False


class KadClient:
    """One node's lookups on a Kademlia DHT, as a client (it serves no records)."""

    def __init__(self, host: IHost, budget: DialBudget, dialable: Callable[[PeerInfo], list[Multiaddr]]):
        self.host, self.budget, self.dialable = host, budget, dialable
        self.me = host.get_id()

    async def lookup(self, key: bytes, known: list[PeerInfo]) -> Region:
        """Walk `PATHS` disjoint paths from the `known` servers towards `key`, then ask the whole region."""
        servers: dict[ID, Server] = {}
        for i, info in enumerate(sorted(known, key=lambda s: distance(key, s.peer_id))):
            servers.setdefault(info.peer_id, Server(info, i % PATHS, None))
        region = Region([])
        async with trio.open_nursery() as nursery:
            for path in range(PATHS):
                nursery.start_soon(self._walk, key, path, servers, region)
        answered = sorted((s for s in servers.values() if s.state == "asked"), key=lambda s: distance(key, s.info.peer_id))
        near = sorted((s for s in servers.values() if s.state == "new"), key=lambda s: distance(key, s.info.peer_id))
        for server in near:  # the servers no path reached, closest first, while the region has room
            if len(answered) >= REGION:
                break
            await self._ask(key, server, servers, region, grow=False)
            if server.state == "asked":
                answered = sorted([*answered, server], key=lambda s: distance(key, s.info.peer_id))
        region.servers = [s.info.peer_id for s in answered[:REGION]]
        self._forget([s for s in servers.values() if s.named_by is not None])
        return region

    async def provide(self, key: bytes, servers: list[ID]) -> int:
        """Tell each server that we provide `key` (fire and forget, as kubo does); how many were told."""
        message = Message(type=Message.MessageType.ADD_PROVIDER, key=key)
        provider = message.providerPeers.add()
        provider.id = self.me.to_bytes()
        provider.addrs.extend(a.to_bytes() for a in self.host.get_addrs())
        told = 0
        for server in servers:
            with trio.move_on_after(QUERY_TIMEOUT_S):
                try:
                    stream = await self.host.new_stream(server, [PROTOCOL])
                    try:
                        await _write(stream, message)
                        told += 1
                    finally:
                        await stream.close()
                except Exception as e:  # noqa: BLE001 - one server fewer holds our record
                    log.debug("ADD_PROVIDER to %s failed: %s", server, e)
        return told

    async def _walk(self, key: bytes, path: int, servers: dict[ID, Server], region: Region) -> None:
        """Ask this path's closest unasked server until none is left closer than its `REGION` closest answers, or
        it asked `PATH_QUERIES`."""
        for _ in range(PATH_QUERIES):
            mine = [s for s in servers.values() if s.path == path]
            todo = sorted((s for s in mine if s.state == "new"), key=lambda s: distance(key, s.info.peer_id))
            done = sorted(distance(key, s.info.peer_id) for s in mine if s.state == "asked")
            if not todo or (len(done) >= REGION and distance(key, todo[0].info.peer_id) > done[REGION - 1]):
                return
            await self._ask(key, todo[0], servers, region, grow=True)

    async def _ask(self, key: bytes, server: Server, servers: dict[ID, Server], region: Region, grow: bool) -> None:
        """GET_PROVIDERS at one server (dialing it first if we are not connected): its providers go to the region,
        and with `grow` the closest `CLOSER_PER_ANSWER` servers it names that no path knows join this server's path."""
        server.state = "failed"
        peer = server.info.peer_id
        if peer == self.me:
            return
        if not self.host.get_network().get_connections(peer):
            if region.dialed >= LOOKUP_DIALS or self.budget.exhausted(trio.current_time()):
                server.state = "skipped"  # the budget said no, not the server
                return
            region.dialed += 1
            if not await self.budget.dial(server):
                region.failed += 1
                return
        answer = await self._query(peer, Message(type=Message.MessageType.GET_PROVIDERS, key=key))
        if answer is None:
            return
        server.state = "asked"
        if providers := [p for p in entries(answer.providerPeers) if p.peer_id != self.me]:
            region.providers[peer] = providers
        if grow:
            new = [c for c in entries(answer.closerPeers) if c.peer_id not in servers and c.peer_id != self.me]
            new = [PeerInfo(c.peer_id, addrs) for c in new
                   if (addrs := [a for a in self.dialable(c) if "/p2p-circuit" not in str(a)])]  # a server is dialed
            for info in sorted(new, key=lambda c: distance(key, c.peer_id))[:CLOSER_PER_ANSWER]:
                servers[info.peer_id] = Server(info, server.path, peer)

    async def _query(self, peer: ID, message: Message) -> Message | None:
        """One request and its answer, or None (no stream, a timeout, bytes that do not parse)."""
        with trio.move_on_after(QUERY_TIMEOUT_S):
            try:
                stream = await self.host.new_stream(peer, [PROTOCOL])
                try:
                    await _write(stream, message)
                    answer = Message()
                    answer.ParseFromString(await read_varint_prefixed_bytes_limited(stream, MAX_ANSWER_BYTES))
                    return answer if answer.type == message.type else None
                finally:
                    await stream.close()
            except Exception as e:  # noqa: BLE001 - a server that does not answer is one of several
                log.debug("DHT query to %s failed: %s", peer, e)
        return None

    def _forget(self, named: list[Server]) -> None:
        """Servers learned from answers and not connected leave the address book with the lookup (connected ones
        when `Rendezvous` closes their connections): nothing redials them."""
        store = self.host.get_peerstore()
        for server in named:
            if not self.host.get_network().get_connections(server.info.peer_id):
                store.clear_addrs(server.info.peer_id)


async def _write(stream, message: Message) -> None:
    data = message.SerializeToString()
    await stream.write(varint.encode(len(data)) + data)
