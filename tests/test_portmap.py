"""Asking the LAN's router for the node's port (p2p/portmap.py), against a stand-in for miniupnpc's gateway; the
network lab runs it against a real UPnP IGD (tests/test_netlab.py)."""

from __future__ import annotations

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
    (Gateway(), "/ip4/198.51.100.7/tcp/7420", "mapped 198.51.100.7:7420 -> 192.168.1.20:7420"),
    (Gateway(devices=0), None, "no UPnP router answered on the LAN"),
    (Gateway(refuse="ConflictInMappingEntry"), None, "the router refused: ConflictInMappingEntry")])
def test_a_mapping_is_asked_for_and_removed_and_a_failure_says_why(gateway, mapped, why, monkeypatch):
    monkeypatch.setattr(p2p.portmap, "miniupnpc", SimpleNamespace(UPnP=lambda: gateway))
    portmap = PortMap("172.17.0.1", 7420)  # the first private address found: docker0's, not the LAN's
    got = portmap.open()
    assert (str(got) if got else None) == mapped and portmap.why.startswith(why)
    if mapped:
        assert gateway.mapped == {(7420, "TCP"): ("192.168.1.20", 7420, "sapo-node", 3600)}
        portmap.close()
        assert gateway.mapped == {} and portmap.why == "removed"
    portmap.close()  # nothing mapped: nothing to remove
