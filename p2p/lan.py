"""Peers on the same LAN, found with mDNS and no flag: py-libp2p's mDNS broadcaster and listener (on zeroconf).

Every node announces its addresses under a service type of its network (`service_type`: libp2p mDNS's own
`_p2p._udp.local` would find every IPFS node in the house) and listens for the others'. mDNS runs only on the
interfaces the node listens on: a node on 127.0.0.1 (every test, `sapo swarm`) multicasts nothing, since nothing on
a LAN could dial it. What a listener hears is a hint like any other (`p2p.hints`): the host dials it within the same
budget as peer exchange, except that a failed answer bars only its peer id at that address (`p2p.host._addr_key`):
anyone on the LAN can announce any id at any address, and py-libp2p reports a service only when it first appears, so
a barred address would lose the real peer's announcement for the whole window. zeroconf calls back on a thread of
its own; the hints cross to the trio thread by a bounded channel, and a full channel drops them (the next
announcement brings them again).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import secrets
from collections import Counter

import trio
from libp2p.abc import IHost
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.discovery.mdns.broadcaster import PeerBroadcaster
from libp2p.discovery.mdns.listener import PeerListener
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr
from zeroconf import Zeroconf

log = logging.getLogger(__name__)

TTL_S = 120  # how long a heard announcement is kept (py-libp2p's default)
QUEUED = 64  # hints waiting for the trio thread; past it the newest are dropped


def service_type(topic_base: str) -> str:
    """The mDNS service type of a network: `_sapo-<8 hex digits>._udp.local.` (DNS-SD allows 15 characters), from
    its rollout topic base, so that nodes of one network and protocol hear only each other."""
    return f"_sapo-{hashlib.sha256(topic_base.encode()).hexdigest()[:8]}._udp.local."


def lan_addresses(addrs: list[Multiaddr]) -> list[Multiaddr]:
    """The TCP addresses a LAN neighbour could dial: IPv4 or IPv6, not loopback, not a relay circuit."""
    out = []
    for a in addrs:
        parts = str(a).split("/")
        if len(parts) > 4 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and "/p2p-circuit" not in str(a):
            if not ipaddress.ip_address(parts[2]).is_loopback:
                out.append(a)
    return out


class LanDiscovery:
    """mDNS on the interfaces of `addrs` (the node's concrete listen addresses); `hints` receives each peer heard."""

    def __init__(self, host: IHost, topic_base: str, addrs: list[Multiaddr], hints: trio.MemorySendChannel,
                 counts: Counter[str]):
        self.host, self.hints, self.counts = host, hints, counts
        self.addrs = lan_addresses(addrs)
        self.service_type = service_type(topic_base)
        self._token = trio.lowlevel.current_trio_token()
        self._zeroconf: Zeroconf | None = None
        self._broadcaster: PeerBroadcaster | None = None
        self._listener: PeerListener | None = None

    @property
    def active(self) -> bool:
        return self._zeroconf is not None

    def start(self) -> None:
        """Announce and listen, unless the node listens on no LAN address. Blocks briefly (zeroconf's registration):
        call it from a worker thread."""
        if not self.addrs:
            return
        ips = sorted({str(a).split("/")[2] for a in self.addrs})
        self._zeroconf = Zeroconf(interfaces=ips)
        name = f"{secrets.token_hex(16)}.{self.service_type}"
        me = str(self.host.get_id())
        port = int(str(self.addrs[0]).split("/")[4])
        self._broadcaster = PeerBroadcaster(zeroconf=self._zeroconf, service_type=self.service_type, service_name=name,
                                            peer_id=me, port=port, listen_addrs=[str(a) for a in self.addrs])
        peerDiscovery.register_peer_discovered_handler(self._heard)
        self._listener = PeerListener(peerstore=self.host.get_peerstore(), zeroconf=self._zeroconf,
                                      service_type=self.service_type, service_name=name, ttl=TTL_S)
        self._broadcaster.register()
        log.info("mDNS: announcing %s on %s", ", ".join(map(str, self.addrs)), ", ".join(ips))

    def stop(self) -> None:
        """Withdraw the announcement and close zeroconf (its threads with it)."""
        peerDiscovery.unregister_peer_discovered_handler(self._heard)
        if self._zeroconf is None:
            return
        for close in (self._broadcaster.unregister, self._listener.stop, self._zeroconf.close):
            try:
                close()
            except Exception as e:  # a half-closed zeroconf: nothing left to withdraw
                log.debug("closing mDNS: %s", e)
        self._zeroconf = None

    def _heard(self, info: PeerInfo) -> None:
        """zeroconf's thread: hand the peer to the trio thread. The handler list is process-wide (py-libp2p's
        `peerDiscovery`), so another service type's or another node's announcements may pass through here too:
        only this node's own service type is browsed, and the host dials nothing twice."""
        if info.peer_id == self.host.get_id():
            return
        try:
            self._token.run_sync_soon(self._queue, info)
        except trio.RunFinishedError:
            pass

    def _queue(self, info: PeerInfo) -> None:
        self.counts["mdns_heard"] += 1
        try:
            self.hints.send_nowait(info)
        except (trio.WouldBlock, trio.ClosedResourceError):
            self.counts["mdns_dropped"] += 1
