"""Asking the home router to forward the node's port (UPnP IGD), so that peers can dial it without a relay.

Through miniupnpc, the library py-libp2p's own `UpnpManager` wraps. That manager is not used as it is: it refuses a
router whose external address is private (a double NAT: the mapping cannot help, but costs nothing either), and
logs a missing router, the common case, with a traceback at ERROR. Here the mapping is asked for whenever the node
listens on a private address, and whether it made the node reachable is for the dial-back check to say
(`p2p.reach`): a node is *mapped* when the router granted the port, *public* when peers then reached it.
"""

from __future__ import annotations

import ipaddress
import logging

import miniupnpc
from multiaddr import Multiaddr

from p2p.reach import PRIVATE_NETS

log = logging.getLogger(__name__)

DISCOVER_MS = 2000  # how long the SSDP search for a router waits for answers
LEASE_S = 3600  # the mapping's lease: renewed by the next start, gone by itself if the node dies
DESCRIPTION = "sapo-node"


def is_private(ip: str) -> bool:
    """Private as the rest of the node counts it (`p2p.reach.PRIVATE_NETS`: a home network, CGNAT), not as Python's
    `is_private`, which also counts documentation and benchmarking ranges (the network lab's internet)."""
    return any(ipaddress.ip_address(ip) in net for net in PRIVATE_NETS)


def private_port(addrs: list[Multiaddr]) -> tuple[str, int] | None:
    """The first listening (IPv4, TCP) address on a private network a router could forward to: (ip, port)."""
    for a in addrs:
        parts = str(a).split("/")
        if len(parts) > 4 and parts[1] == "ip4" and parts[3] == "tcp":
            if is_private(parts[2]) and not ipaddress.ip_address(parts[2]).is_link_local:
                return parts[2], int(parts[4])
    return None


class PortMap:
    """One TCP port mapped on the LAN's router for as long as the node runs. Blocking calls: run them in a thread."""

    def __init__(self, ip: str, port: int):
        self.ip, self.port = ip, port
        self.external: str | None = None  # the router's external address, once the port is mapped
        self.why = "not tried"  # what happened, for stats and doctor

    def open(self) -> Multiaddr | None:
        """The external address peers reach the node at, or None (`why` says why)."""
        gateway = miniupnpc.UPnP()
        gateway.discoverdelay = DISCOVER_MS
        try:
            if not gateway.discover():
                self.why = "no UPnP router answered on the LAN"
                return None
            gateway.selectigd()
            external = gateway.externalipaddress()
            # our address on the router's own network (a machine with several, docker0's among them, has one there)
            self.ip = gateway.lanaddr or self.ip
            gateway.addportmapping(self.port, "TCP", self.ip, self.port, DESCRIPTION, "", LEASE_S)
        except Exception as e:  # miniupnpc raises Exception with the router's error text, "Success" included
            self.why = f"the router refused: {e}" if str(e) != "Success" else "no UPnP router answered on the LAN"
            return None
        self._gateway, self.external = gateway, external
        self.why = f"mapped {external}:{self.port} -> {self.ip}:{self.port}"
        if is_private(external):
            self.why += " (the router's own address is private: another NAT lies beyond it)"
        log.info("UPnP: the router forwards %s:%d to this node", external, self.port)
        return Multiaddr(f"/ip4/{external}/tcp/{self.port}")

    def close(self) -> None:
        """Remove the mapping (a router that forgets it anyway lets the lease run out)."""
        if self.external is None:
            return
        try:
            self._gateway.deleteportmapping(self.port, "TCP")
            log.info("UPnP: removed the mapping of port %d", self.port)
        except Exception as e:
            log.warning("UPnP: removing the mapping of port %d failed (%s); it lapses in %d s", self.port, e, LEASE_S)
        self.external = None
        self.why = "removed"
