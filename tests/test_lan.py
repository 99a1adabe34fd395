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


def test_a_lan_without_multicast_costs_one_warning_and_the_node_runs_on(tmp_path, monkeypatch, caplog):
    """zeroconf raises where multicast cannot be used (a container, a firewall): the node carries on without mDNS."""
    import logging
    import time

    from p2p.lan import LanDiscovery
    from p2p.service import Gossip
    from rewards.scoring import group_carries_signal

    def no_multicast(self) -> None:
        raise OSError("[Errno 19] No such device")

    monkeypatch.setattr(LanDiscovery, "start", no_multicast)
    with caplog.at_level(logging.WARNING, logger="p2p.host"), \
            Gossip(P2PConfig(listen=["/ip4/127.0.0.1/tcp/0"]), tmp_path / "n.key", on_message=lambda msg: None,
                   signal=group_carries_signal) as node:
        deadline = time.time() + 10
        while not any("mDNS unavailable" in r.getMessage() for r in caplog.records) and time.time() < deadline:
            time.sleep(0.1)
        stats = node.stats()
    assert [r.getMessage() for r in caplog.records if "mDNS" in r.getMessage()] == \
        ["mDNS unavailable ([Errno 19] No such device): peers on the LAN are found through bootstrap peers and the DHT only"]
    assert stats["mdns"] is False and "shard_level" in stats  # the p2p layer still runs
