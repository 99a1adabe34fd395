"""Finding the swarm on a Kademlia DHT with no bootstrap peer of its own (p2p/rendezvous.py)."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
import trio.testing
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2p.config import P2PConfig
from p2p.hints import SOURCE_FAILURES, HintBudget
from p2p.rendezvous import Rendezvous, rendezvous_key
from lab.dht import DHTServers, JsDHTServer
from lab.listeners import ConnectionCounter
from tests.test_gossip import log_lines, made_up_peer, spawn, wait_heard  # noqa: F401 - spawn is a fixture
from tests.test_interop import js_peer  # noqa: F401 - a fixture


def test_a_networks_rendezvous_key_is_a_sha256_multihash_of_its_topic_base_and_differs_by_network_and_protocol():
    key = rendezvous_key("testnet", 3)
    assert key == rendezvous_key("testnet", 3) and key.startswith("1220") and len(key) == 4 + 64
    assert len({key, rendezvous_key("testnet", 4), rendezvous_key("local", 3)}) == 3


def test_the_dht_is_off_with_one_flag_and_a_given_list_replaces_the_profiles():
    addr = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWNm6CjiRDYcvCyd7yRpUp8zBmJhJWAsQ6aDiezxFwCM8o"
    assert P2PConfig(dht_bootstrap=[addr]).dht_peers() == [addr]
    assert P2PConfig(dht_bootstrap=[addr], dht=False).dht_peers() == []
    with pytest.raises(ValueError, match="/p2p/<peer id>"):
        P2PConfig(dht_bootstrap=["/ip4/127.0.0.1/tcp/4001"])
    with pytest.raises(ValueError, match="a /dnsaddr name is resolved to one peer's addresses"):
        P2PConfig(dht_bootstrap=["/dnsaddr/bootstrap.libp2p.io"])


def test_a_dnsaddr_dht_peer_is_dialed_at_the_tcp_addresses_its_dns_records_give_for_it():
    """kubo's bootstrap list is written as /dnsaddr names, resolved through DNS TXT records (here a stand-in)."""
    boot = "/dnsaddr/bootstrap.libp2p.io/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
    peer, other = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN", "QmQCU2EcMqAqQPR2i9bChDtGNJchTbq5TbXJJ16u19uLTa"
    asked = []

    async def records(addr: Multiaddr) -> list[Multiaddr]:
        asked.append(str(addr))
        return [Multiaddr(a) for a in (f"/ip4/198.51.100.7/tcp/4001/p2p/{peer}", f"/ip4/198.51.100.7/udp/4001/quic-v1/p2p/{peer}",
                                       f"/dns4/sv15.bootstrap.libp2p.io/tcp/443/wss/p2p/{peer}",
                                       f"/ip4/198.51.100.8/tcp/4001/p2p/{other}")]

    async def offline(addr: Multiaddr) -> list[Multiaddr]:
        raise OSError("no DNS")

    def addresses(resolve) -> tuple[list[str], Counter]:
        counts: Counter[str] = Counter()
        r = Rendezvous(new_host(key_pair=create_new_key_pair()), rendezvous_key("testnet", 3), [boot], counts,
                       HintBudget(60.0), lambda info: info.addrs, resolve)
        return [str(a) for a in trio.run(r._addresses, r.bootstrap[0])], counts

    assert addresses(records)[0] == ["/ip4/198.51.100.7/tcp/4001"] and asked == [boot]  # its TCP address only
    assert addresses(offline) == ([], Counter(dht_resolve_failed=1))
    assert P2PConfig(network="testnet").dht_peers() and P2PConfig(dht_bootstrap=[boot]).dht_peers() == [boot]


def test_a_node_alone_again_looks_up_within_the_retry_not_at_the_refresh(monkeypatch):
    """A node with swarm peers looks up every `REFRESH_S`; one whose peers all left (or whose relayed peers a limited
    relay cut off) looks up again within `RETRY_S`, where it waited out the refresh, alone."""
    from p2p import rendezvous as rdv

    lookups: list[float] = []
    peers = {ID.from_pubkey(create_new_key_pair().public_key)}
    r = Rendezvous(new_host(key_pair=create_new_key_pair()), rendezvous_key("testnet", 3), [], Counter(), HintBudget(60.0),
                   lambda info: info.addrs)

    async def joined() -> bool:
        return True

    async def looked_up() -> list:
        lookups.append(trio.current_time())
        return []

    async def left(keep) -> None:
        pass

    monkeypatch.setattr(r, "_join", joined)
    monkeypatch.setattr(r, "_lookup", looked_up)
    monkeypatch.setattr(r, "_leave_dht_servers", left)

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(r.run, lambda picks: trio.sleep(0), lambda: set(peers))
            await trio.sleep(100.0)
            peers.clear()  # everyone left at 100 s
            await trio.sleep(100.0)
            nursery.cancel_scope.cancel()

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    assert lookups[0] == 0.0 and 100.0 < lookups[1] <= 100.0 + 2 * rdv.RETRY_S < rdv.REFRESH_S


@pytest.mark.slow
def test_nodes_that_know_only_different_dht_servers_of_two_implementations_find_each_other(spawn, js_peer, tmp_path):  # noqa: F811
    """The public DHT's stand-in: a py-libp2p server and a js-libp2p one (@libp2p/kad-dht) that knows it. Nodes that
    know only the js server and a node that knows only the py one find each other: provider records cross
    implementations both ways.

    The joins are ordered because a node with a swarm peer looks up again only after `REFRESH_S`: `a` has provided
    before `b` looks, and `c` looks after both have provided."""
    py = DHTServers(1)
    js = JsDHTServer(js_peer[0], py.addrs, tmp_path / "js-dht.log")
    try:
        a = spawn("a", "--rate", "2", "--dht-bootstrap", js.addr)
        a.wait_for(lambda: a.stats().get("dht_lookups", 0) >= 1, 60, "a's first provide and lookup")
        b = spawn("b", "--rate", "2", "--dht-bootstrap", py.addrs[0])
        b.wait_for(lambda: (b.stats().get("dht_providers") or 0) >= 1, 60, "a found from the py server")
        since = time.time()
        wait_heard(a, [b], since, timeout=90)
        wait_heard(b, [a], since, timeout=30)
        for node in (a, b):
            node.wait_for(lambda n=node: n.stats()["peers"] == 1, 30, "the DHT servers' connections closed")
        c = spawn("c", "--rate", "2", "--dht-bootstrap", js.addr)
        c.wait_for(lambda: (c.stats().get("dht_providers") or 0) >= 2, 60, "a and b found from the js server")
        for node in (a, b, c):
            assert log_lines(node, " ERROR ") == [], log_lines(node, " ERROR ")
    finally:
        js.close()
        py.close()


@pytest.mark.slow
@pytest.mark.untimed  # a minute asleep, watching that nothing is dialed
def test_a_flood_of_fake_providers_costs_a_few_connection_attempts_and_none_once_it_is_gone(spawn, tmp_path):  # noqa: F811
    """Provider records cost nothing to write: 32 fake providers of the network's key, each at another host, are
    hints from one source (the DHT) under the peer-exchange budget."""
    servers = DHTServers(1)
    counter = ConnectionCounter([f"127.0.0.{k}" for k in range(2, 34)])
    key = rendezvous_key("local", 3)
    try:
        servers.add_providers(key, [PeerInfo(ID.from_base58(made_up_peer()), [Multiaddr(a)]) for a in counter.addrs])
        node = spawn("node", "--dht-bootstrap", servers.addrs[0])
        node.wait_for(lambda: (node.stats().get("dht_lookups") or 0) >= 3, 60, "three lookups")
        during = counter.count
        assert 1 <= during <= SOURCE_FAILURES  # then the DHT is not asked again within the window
        servers.remove_providers(key)
        time.sleep(60)  # past py-libp2p's 60 s ban of a failed peer: nothing redials the fake providers
        assert counter.count == during, f"{counter.count - during} connections to fake providers after they left"
        assert node.stats()["dht_lookups"] >= 4 and log_lines(node, " ERROR ") == []  # at 0, 10, 30, 70 s: backing off
    finally:
        counter.close()
        servers.close()
