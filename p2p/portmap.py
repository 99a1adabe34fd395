"""Asking the home router to forward the node's port (UPnP IGD, else NAT-PMP), so that peers can dial it without a
relay.

UPnP through miniupnpc, the library py-libp2p's own `UpnpManager` wraps. That manager is not used as it is: it refuses
a router whose external address is private (a double NAT: the mapping cannot help, but costs nothing either), and
logs a missing router, the common case, with a traceback at ERROR. A router that answers no UPnP search is asked
with NAT-PMP (RFC 6886: two UDP requests to the default gateway, which py-libp2p does not speak; Apple's routers and
many others do). The mapping is asked for whenever the node listens on a private address, and whether it made the
node reachable is for the dial-back check to say (`p2p.reach`): a node is *mapped* when the router granted the port,
*public* when peers then reached it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct

import miniupnpc
from multiaddr import Multiaddr

from p2p.reach import is_private

log = logging.getLogger(__name__)

DISCOVER_MS = 2000  # how long the SSDP search for a router waits for answers
LEASE_S = 3600  # the mapping's lease: renewed by the next start, gone by itself if the node dies
DESCRIPTION = "sapo-node"
NATPMP_PORT = 5351
NO_UPNP = "no UPnP router answered on the LAN"
NATPMP_TRIES = 3  # waits of 0.25, 0.5 and 1 s: RFC 6886 allows 9 for a first contact, a home router answers the first


def private_port(addrs: list[Multiaddr]) -> tuple[str, int] | None:
    """The first listening (IPv4, TCP) address on a private network a router could forward to: (ip, port)."""
    for a in addrs:
        parts = str(a).split("/")
        if len(parts) > 4 and parts[1] == "ip4" and parts[3] == "tcp":
            if is_private(parts[2]) and not ipaddress.ip_address(parts[2]).is_link_local:
                return parts[2], int(parts[4])
    return None


def default_gateway() -> str | None:
    """The IPv4 default route's gateway (Linux's /proc/net/route), where a NAT-PMP router listens."""
    try:
        with open("/proc/net/route") as f:
            routes = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return None
    for fields in routes:
        if len(fields) > 3 and fields[1] == "00000000" and int(fields[3], 16) & 2:  # the default route, RTF_GATEWAY
            return socket.inet_ntoa(struct.pack("<L", int(fields[2], 16)))
    return None


def natpmp(sock: socket.socket, request: bytes, size: int) -> bytes | None:
    """One NAT-PMP request on a socket connected to the router and its answer of at least `size` bytes, retried;
    None when the router says nothing."""
    wait = 0.25
    for _ in range(NATPMP_TRIES):
        sock.settimeout(wait)
        sock.send(request)
        try:
            while True:
                data = sock.recv(64)
                if len(data) >= size and data[0] == 0 and data[1] == request[1] + 128:  # version 0, our opcode's answer
                    return data
        except OSError:  # timed out, or the router's ICMP "port unreachable": no NAT-PMP there
            wait *= 2
    return None


class PortMap:
    """One TCP port mapped on the LAN's router for as long as the node runs. Blocking calls: run them in a thread."""

    def __init__(self, ip: str, port: int):
        self.ip, self.port = ip, port
        self.external: str | None = None  # the router's external address, once the port is mapped
        self.protocol: str | None = None  # which the router spoke: "UPnP" or "NAT-PMP"
        self.why = "not tried"  # what happened, for stats and doctor

    def open(self) -> Multiaddr | None:
        """The external address peers reach the node at, or None (`why` says why)."""
        external = self._upnp()
        if external is None and self.why == NO_UPNP:
            external = self._natpmp()
        if external is None:
            return None
        self.external = external
        self.why = f"mapped {external}:{self.port} -> {self.ip}:{self.port} ({self.protocol})"
        if is_private(external):
            self.why += " (the router's own address is private: another NAT lies beyond it)"
        log.info("%s: the router forwards %s:%d to this node", self.protocol, external, self.port)
        return Multiaddr(f"/ip4/{external}/tcp/{self.port}")

    def _upnp(self) -> str | None:
        gateway = miniupnpc.UPnP()
        gateway.discoverdelay = DISCOVER_MS
        try:
            if not gateway.discover():
                self.why = NO_UPNP
                return None
            gateway.selectigd()
            external = gateway.externalipaddress()
            # our address on the router's own network (a machine with several, docker0's among them, has one there)
            self.ip = gateway.lanaddr or self.ip
            gateway.addportmapping(self.port, "TCP", self.ip, self.port, DESCRIPTION, "", LEASE_S)
        except Exception as e:  # miniupnpc raises Exception with the router's error text, "Success" included
            self.why = f"the router refused: {e}" if str(e) != "Success" else NO_UPNP
            return None
        self._gateway, self.protocol = gateway, "UPnP"
        return external

    def _natpmp(self, lease_s: int = LEASE_S) -> str | None:
        """Ask the default gateway for its external address and a mapping of our port (`lease_s` 0 removes it)."""
        if (gateway := default_gateway()) is None:
            self.why = "no UPnP router answered and no default gateway to ask with NAT-PMP"
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((gateway, NATPMP_PORT))
            address = natpmp(sock, struct.pack("!BB", 0, 0), 12)  # a silent router is asked nothing more
            mapped = address and natpmp(sock, struct.pack("!BBHHHI", 0, 2, 0, self.port, self.port if lease_s else 0,
                                                          lease_s), 16)
            self.ip = sock.getsockname()[0]  # our address on the router's network: the one it maps to
        if address is None or mapped is None:
            self.why = "no UPnP or NAT-PMP router answered on the LAN"
            return None
        result, external_port = struct.unpack("!H", mapped[2:4])[0], struct.unpack("!H", mapped[10:12])[0]
        if result or struct.unpack("!H", address[2:4])[0] or (lease_s and external_port != self.port):
            if lease_s and not result and external_port:  # another port was granted (peers dial ours): give it back
                self._natpmp(0)
            self.why = f"the router refused (NAT-PMP result {result}, port {external_port} offered)"
            return None
        self.protocol = "NAT-PMP"
        return socket.inet_ntoa(address[8:12])

    def close(self) -> None:
        """Remove the mapping (a router that forgets it anyway lets the lease run out)."""
        if self.external is None:
            return
        try:
            if self.protocol == "UPnP":
                self._gateway.deleteportmapping(self.port, "TCP")
            elif self._natpmp(0) is None:
                raise OSError(self.why)
            log.info("%s: removed the mapping of port %d", self.protocol, self.port)
        except Exception as e:
            log.warning("%s: removing the mapping of port %d failed (%s); it lapses in %d s", self.protocol, self.port, e,
                        LEASE_S)
        self.external = None
        self.why = "removed"
