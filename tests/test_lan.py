"""mDNS on the LAN (p2p/lan.py): which service a network announces under, and on which addresses."""

from __future__ import annotations

from multiaddr import Multiaddr

from p2p.config import P2PConfig
from p2p.lan import lan_addresses, service_type


def test_each_network_and_protocol_has_its_own_mdns_service_type_within_dns_sds_15_characters():
    local, testnet = (service_type(P2PConfig(network=n).rollout_topic_base()) for n in ("local", "testnet"))
    assert local != testnet and local != service_type("/sapo/local/rollouts/2")
    for t in (local, testnet):
        label = t.split(".")[0]
        assert t.endswith("._udp.local.") and label.startswith("_sapo-") and len(label) <= 15


def test_only_addresses_a_lan_neighbour_could_dial_are_announced():
    addrs = [Multiaddr(a) for a in ("/ip4/127.0.0.1/tcp/7420", "/ip4/192.168.1.20/tcp/7420", "/ip6/::1/tcp/7420",
                                    "/ip6/fe80::1/tcp/7420",
                                    "/ip4/198.51.100.7/tcp/4001/p2p/12D3KooWNm6CjiRDYcvCyd7yRpUp8zBmJhJWAsQ6aDiezxFwCM8o/p2p-circuit")]
    assert [str(a) for a in lan_addresses(addrs)] == ["/ip4/192.168.1.20/tcp/7420", "/ip6/fe80::1/tcp/7420"]
