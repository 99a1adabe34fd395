"""Finding the swarm with no server of our own: a rendezvous key on a Kademlia DHT.

Every node of a network provides one key, derived from the network's namespace and wire protocol, on the DHT
(`/ipfs/kad/1.0.0`, the public one that kubo, go-, rust- and js-libp2p serve), and looks the key up to learn the
others: go-libp2p's "chat with rendezvous" example. A node is a DHT *client*: it asks and provides, and serves no
records (a home node behind NAT could not). The lookups are our own (`p2p.kad`: disjoint paths, dials within a budget,
the whole region around the key asked and told), since py-libp2p's let three servers near the key choose what the node
dials and which providers it sees. The providers it finds are hints like any other (`p2p.hints`): the host dials a few
from each answering server within the budget of peer exchange, a provider counts as found once it completes our gossip
handshake, and a DHT server it talked to is disconnected again after the lookup, so DHT traffic never takes a swarm
peer's place.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from p2p.hints import HintBudget
from p2p.kad import DIRECT_TCP, PROTOCOL as KAD_PROTOCOL, DialBudget, KadClient, key_bytes

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 30.0  # one provide or one lookup, over however many DHT hops
RETRY_S = 10.0  # the first wait before the next lookup while the node has no swarm peer, doubling up to REFRESH_S
REFRESH_S = 600.0  # the next lookup (and a fresh provider record), once it has some
RESOLVE_TIMEOUT_S = 10.0  # one /dnsaddr name's DNS TXT lookups
NAMED = 4096  # providers remembered as named by the DHT, until they are checked against gossip peers


async def resolve_dns(addr: Multiaddr) -> list[Multiaddr]:
    """py-multiaddr's DNS resolver: /dnsaddr through its TXT records, recursively."""
    return await addr.resolve()


def rendezvous_key(namespace: str, protocol: int) -> str:
    """The DHT key a network's nodes provide: a sha2-256 multihash (hex), as a CID's would be, of the network's
    rollout topic base (docs/PROTOCOL.md)."""
    return "1220" + hashlib.sha256(f"/sapo/{namespace}/rollouts/{protocol}".encode()).hexdigest()


class Rendezvous:
    """A DHT client that provides `key` and looks it up, from the DHT peers at `bootstrap` (full multiaddrs).
    `dialable`: which of a DHT server's addresses this node should dial (`Reach.dialable`)."""

    def __init__(self, host: IHost, key: str, bootstrap: list[str], counts: Counter[str], hints: HintBudget,
                 dialable: Callable[[PeerInfo], list[Multiaddr]],
                 resolve: Callable[[Multiaddr], Awaitable[list[Multiaddr]]] = resolve_dns,
                 connect: Callable[[PeerInfo], Awaitable[None]] | None = None):
        self.host, self.key, self.counts, self.resolve = host, key_bytes(key), counts, resolve
        self.connect = connect or host.connect  # to a bootstrap DHT peer: the node's from its listen port
        self.bootstrap = [info_from_p2p_addr(Multiaddr(a)) for a in bootstrap]
        self.kad = KadClient(host, DialBudget(host, hints), dialable)
        self.named: set[ID] = set()  # providers the DHT named (at most `NAMED`): claims
        self.providers: set[ID] = set()  # ... of which completed our gossip handshake: found, for stats

    async def run(self, found: Callable[[list[tuple[ID, PeerInfo]]], Awaitable[None]],
                  gossip_peers: Callable[[], set[ID]], keep: Callable[[ID], bool] = lambda peer: False) -> None:
        """Look up and provide, then hand `found` the providers as (server that named it, provider) picks; again in
        `RETRY_S`, doubling, while no peer speaks our gossip (a node alone on a network nobody else has joined asks
        less and less often), else in `REFRESH_S`, or in `RETRY_S` once the node is alone again (its peers left, or
        a limited relay ended the circuits it was reached through: it was cut off for the rest of `REFRESH_S`).
        Every `RETRY_S` the connections DHT servers hold to us are closed (a server may dial its table's peers,
        clients included), but those to servers `keep` names (our relays)."""
        due, wait = 0.0, RETRY_S
        while True:
            if trio.current_time() >= due:
                if await self._join():
                    picks = await self._lookup()
                    if len(self.named) > NAMED:
                        self.named.clear()
                    self.named.update(info.peer_id for _, info in picks)
                    await found(picks)
                    self.counts["dht_lookups"] += 1
                if gossip_peers():
                    due, wait = trio.current_time() + REFRESH_S, RETRY_S
                else:
                    due, wait = trio.current_time() + wait, min(2 * wait, REFRESH_S)
            elif not gossip_peers() and due > trio.current_time() + wait:
                due = trio.current_time() + wait  # alone again
            await self._leave_dht_servers(keep)
            self.proven(gossip_peers())
            await trio.sleep(RETRY_S)

    def proven(self, gossip_peers: set[ID]) -> set[ID]:
        """The providers found so far: those the DHT named that have spoken our gossip (now, or before)."""
        self.providers |= self.named & gossip_peers
        return self.providers

    async def _join(self) -> bool:
        """Connect to the DHT bootstrap peers not connected yet; whether any is connected."""
        connected = set(self.host.get_connected_peers())
        for info in self.bootstrap:
            if info.peer_id not in connected:
                addrs = await self._addresses(info)
                with trio.move_on_after(LOOKUP_TIMEOUT_S):
                    try:
                        await self.connect(PeerInfo(info.peer_id, addrs))
                    except Exception as e:  # an unreachable DHT peer is one of several
                        log.debug("DHT bootstrap peer %s unreachable: %s", info.peer_id, e)
                        continue
        connected = set(self.host.get_connected_peers())
        if any(i.peer_id in connected for i in self.bootstrap):
            return True
        self.counts["dht_unreachable"] += 1
        return False

    async def _addresses(self, info: PeerInfo) -> list[Multiaddr]:
        """A DHT peer's TCP addresses; a /dnsaddr one resolved through DNS (kubo's bootstrap list is written so), its
        records for other peers, and addresses of other transports (QUIC, websockets), left out."""
        out: list[Multiaddr] = []
        for addr in info.addrs:
            names = [p.name for p in addr.protocols()]
            if names[:1] != ["dnsaddr"]:
                out.append(addr)
                continue
            with trio.move_on_after(RESOLVE_TIMEOUT_S):
                try:
                    out += [r for r in await self.resolve(addr.encapsulate(Multiaddr(f"/p2p/{info.peer_id}")))
                            if {p.name for p in r.protocols()} <= DIRECT_TCP and _peer_of(r) in (None, info.peer_id)]
                except Exception as e:  # no DNS (offline, a lab namespace): one DHT peer fewer
                    self.counts["dht_resolve_failed"] += 1
                    log.debug("resolving %s failed: %s", addr, e)
        return [_without_peer(a) for a in out]

    async def _lookup(self) -> list[tuple[ID, PeerInfo]]:
        """One walk to the key's region, our provider record at each of its servers, and the providers they named,
        as picks (`Region.picks`)."""
        connected = set(self.host.get_connected_peers())
        known = [i for i in self.bootstrap if i.peer_id in connected]
        with trio.move_on_after(LOOKUP_TIMEOUT_S) as scope:
            region = await self.kad.lookup(self.key, known)
        if scope.cancelled_caught:
            self.counts["dht_lookup_timeouts"] += 1
            return []
        self.counts["dht_servers_dialed"] += region.dialed
        self.counts["dht_servers_failed"] += region.failed
        with trio.move_on_after(LOOKUP_TIMEOUT_S):
            if not await self.kad.provide(self.key, region.servers):
                self.counts["dht_provide_failed"] += 1
        return region.picks({self.host.get_id()})

    async def _leave_dht_servers(self, keep: Callable[[ID], bool]) -> None:
        """Close connections to peers that serve the DHT and not our gossip, but those `keep` names: they are not
        swarm peers. Those the operator did not name leave the address book too."""
        store = self.host.get_peerstore()
        named = {i.peer_id for i in self.bootstrap}
        for peer in self.host.get_connected_peers():
            try:
                protocols = set(store.get_protocols(peer))
            except Exception:  # not identified yet: not known to be a DHT server
                continue
            if KAD_PROTOCOL in protocols and not any(p.startswith("/meshsub/") for p in protocols) and not keep(peer):
                await self.host.disconnect(peer)
                if peer not in named:
                    store.clear_addrs(peer)


def _peer_of(addr: Multiaddr) -> ID | None:
    text = str(addr)
    return ID.from_base58(text.rsplit("/p2p/", 1)[1]) if "/p2p/" in text and "/p2p-circuit" not in text else None


def _without_peer(addr: Multiaddr) -> Multiaddr:
    """A provider's address as the host dials it: without the trailing /p2p/<id> py-libp2p's DHT appends."""
    text = str(addr)
    return Multiaddr(text.rsplit("/p2p/", 1)[0]) if "/p2p-circuit" not in text and "/p2p/" in text else addr
