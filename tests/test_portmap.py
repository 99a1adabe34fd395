"""Asking the LAN's router for the node's port (p2p/portmap.py), against a stand-in for miniupnpc's gateway and a
NAT-PMP router on 127.0.0.1; the network lab runs it against a real one (miniupnpd, tests/test_netlab.py)."""

from __future__ import annotations

import socket
import struct
import threading
from types import SimpleNamespace

import pytest
from multiaddr import Multiaddr

import p2p.portmap
from p2p.portmap import PortMap, private_port


def test_the_port_to_map_is_the_first_private_ipv4_listening_address():
    addrs = [Multiaddr(a) for a in ("/ip4/127.0.0.1/tcp/7420", "/ip4/11.18.1.2/tcp/7420", "/ip4/169.254.1.1/tcp/1",
                                    "/ip6/fd00::1/tcp/7420", "/ip4/198.18.1.2/tcp/7420", "/ip4/192.168.1.20/tcp/7421")]
    assert private_port(addrs) == ("192.168.1.20", 7421)
    # loopback, public, link-local, IPv6, the lab's internet (public to the node, private to Python): nothing to forward
    assert private_port(addrs[:5]) is None


class Gateway:
    """miniupnpc.UPnP as a home router answers it."""

    def __init__(self, devices: int = 1, refuse: str | None = None):
        self.devices, self.refuse, self.mapped, self.discoverdelay = devices, refuse, {}, 0
        self.lanaddr = "192.168.1.20"  # the address the router was reached from

    def discover(self) -> int:
        return self.devices

    def selectigd(self) -> str:
        return "http://192.168.1.1:5000/ctl/IPConn"

    def externalipaddress(self) -> str:
        return "198.51.100.7"

    def addportmapping(self, eport, proto, host, iport, desc, remote, lease) -> bool:
        if self.refuse:
            raise Exception(self.refuse)
        self.mapped[eport, proto] = (host, iport, desc, lease)
        return True

    def deleteportmapping(self, eport, proto) -> bool:
        del self.mapped[eport, proto]
        return True


@pytest.mark.parametrize("gateway, mapped, why", [
    (Gateway(), "/ip4/198.51.100.7/tcp/7420", "mapped 198.51.100.7:7420 -> 192.168.1.20:7420 (UPnP)"),
    (Gateway(devices=0), None, "no UPnP router answered and no default gateway to ask with NAT-PMP"),
    (Gateway(refuse="ConflictInMappingEntry"), None, "the router refused: ConflictInMappingEntry")])
def test_a_mapping_is_asked_for_and_removed_and_a_failure_says_why(gateway, mapped, why, monkeypatch):
    monkeypatch.setattr(p2p.portmap, "miniupnpc", SimpleNamespace(UPnP=lambda: gateway))
    monkeypatch.setattr(p2p.portmap, "default_gateway", lambda: None)  # never this machine's real router
    portmap = PortMap("172.17.0.1", 7420)  # the first private address found: docker0's, not the LAN's
    got = portmap.open()
    assert (str(got) if got else None) == mapped and portmap.why.startswith(why)
    if mapped:
        assert gateway.mapped == {(7420, "TCP"): ("192.168.1.20", 7420, "sapo-node", 3600)}
        portmap.close()
        assert gateway.mapped == {} and portmap.why == "removed"
    portmap.close()  # nothing mapped: nothing to remove


class NatPmpRouter:
    """A NAT-PMP router (RFC 6886) on 127.0.0.1: its external address and the mappings it grants, each at the
    internal port or, with `offer`, at that port instead; `silent` answers nothing."""

    def __init__(self, offer: int | None = None, silent: bool = False):
        self.offer, self.silent, self.mapped, self.requests = offer, silent, {}, []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, sender = self.sock.recvfrom(64)
            except OSError:
                return
            self.requests.append(data)
            if self.silent:
                continue
            if data[1] == 0:
                self.sock.sendto(struct.pack("!BBHI4s", 0, 128, 0, 1, socket.inet_aton("198.51.100.9")), sender)
            elif data[1] == 2:
                _, _, _, inner, outer, lease = struct.unpack("!BBHHHI", data)
                outer = 0 if not lease else self.offer or outer
                self.mapped.pop(inner, None) if not lease else self.mapped.update({inner: outer})
                self.sock.sendto(struct.pack("!BBHIHHI", 0, 130, 0, 1, inner, outer, lease), sender)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("offer, silent, mapped, why", [
    (None, False, "/ip4/198.51.100.9/tcp/7420", "mapped 198.51.100.9:7420 -> 127.0.0.1:7420 (NAT-PMP)"),
    (7999, False, None, "the router refused (NAT-PMP result 0, port 7999 offered)"),
    (None, True, None, "no UPnP or NAT-PMP router answered on the LAN")])
def test_a_router_without_upnp_is_asked_with_nat_pmp(offer, silent, mapped, why, monkeypatch):
    router = NatPmpRouter(offer, silent)
    monkeypatch.setattr(p2p.portmap, "miniupnpc", SimpleNamespace(UPnP=lambda: Gateway(devices=0)))
    monkeypatch.setattr(p2p.portmap, "default_gateway", lambda: "127.0.0.1")
    monkeypatch.setattr(p2p.portmap, "NATPMP_PORT", router.port)
    try:
        portmap = PortMap("192.168.1.20", 7420)
        got = portmap.open()
        assert (str(got) if got else None) == mapped and portmap.why == why
        assert router.mapped == ({7420: 7420} if mapped else {})  # a port offered in place of ours is given back
        if mapped:
            portmap.close()
            assert router.mapped == {} and portmap.why == "removed"
        else:
            assert len(router.requests) == (p2p.portmap.NATPMP_TRIES if silent else 4)  # 4: asked, then given back
    finally:
        router.close()


def test_the_default_gateway_is_read_from_the_kernels_route_table(tmp_path, monkeypatch):
    table = tmp_path / "route"
    table.write_text("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n"
                     "eth0\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
                     "eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(table if path == "/proc/net/route" else path, *a, **k))
    assert p2p.portmap.default_gateway() == "192.168.1.1"
