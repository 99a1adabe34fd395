"""Which addresses a node dials, by what it knows of its own reachability (p2p/reach.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from p2p.config import P2PConfig
from p2p.reach import Reach, Reachability, _private_net, is_circuit

HOME = [Multiaddr("/ip4/192.168.3.2/tcp/7420")]
CIRCUIT = "/ip4/198.18.1.2/tcp/7420/p2p/12D3KooWEm5ckQy2MGzaxaFwYEHBSaiLKHJSGfcot2iSVfqKr2r6/p2p-circuit"


def reach(state: Reachability) -> Reach:
    r = Reach(P2PConfig(), new_host(key_pair=create_new_key_pair()), Counter())
    r.state = state
    return r


def peer(after: Reach | None = None, before: Reach | None = None) -> ID:
    """A fresh peer id sorting after (or before) the given node's."""
    while True:
        pid = ID.from_pubkey(create_new_key_pair().public_key)
        me = (after or before).host.get_id().to_bytes()
        if (pid.to_bytes() > me) == (after is not None):
            return pid


@pytest.mark.parametrize("addr, net", [
    ("/ip4/127.0.0.1/tcp/1", "loopback"), ("/ip6/::1/tcp/1", "loopback"),
    ("/ip4/192.168.2.7/tcp/1", "192.168.2.0/24"), ("/ip4/10.1.2.3/tcp/1", "10.1.2.0/24"),
    ("/ip4/172.18.0.5/tcp/1", "172.18.0.0/24"), ("/ip4/100.64.9.9/tcp/1", "100.64.9.0/24"),
    ("/ip4/198.18.1.2/tcp/1", None), ("/ip4/8.8.8.8/tcp/1", None), ("/dns4/example.org/tcp/1", None),
])
def test_private_addresses_are_told_apart_by_their_local_network(addr, net):
    found = _private_net(Multiaddr(addr))
    assert (None if found is None else str(found)) == net


def test_a_private_hint_address_is_dialed_only_from_its_own_network():
    node = reach(Reachability.PUBLIC)
    hint = PeerInfo(peer(after=node), [Multiaddr(a) for a in (
        "/ip4/192.168.2.2/tcp/7420", "/ip4/192.168.3.9/tcp/7420", "/ip4/198.18.5.2/tcp/7420", "/ip4/127.0.0.1/tcp/7420")])
    assert [str(a) for a in node.dialable(hint, HOME)] == ["/ip4/192.168.3.9/tcp/7420", "/ip4/198.18.5.2/tcp/7420"]
    on_loopback = [Multiaddr("/ip4/127.0.0.1/tcp/7421")]
    assert [str(a) for a in node.dialable(hint, on_loopback)] == ["/ip4/198.18.5.2/tcp/7420", "/ip4/127.0.0.1/tcp/7420"]


@pytest.mark.parametrize("state, sorts_first, dialed", [
    (Reachability.PUBLIC, True, False),  # a dialable node waits for the private one to dial out
    (Reachability.UNKNOWN, True, False),
    (Reachability.PRIVATE, True, True),  # two private nodes: the lower peer id dials, through the relay
    (Reachability.PRIVATE, False, False),
])
def test_a_peer_behind_nat_is_dialed_through_its_relay_by_one_side_only(state, sorts_first, dialed):
    node = reach(state)
    other = peer(after=node) if sorts_first else peer(before=node)
    hint = PeerInfo(other, [Multiaddr(CIRCUIT), Multiaddr("/ip4/192.168.3.5/tcp/7420")])  # its leaked private address
    got = node.dialable(hint, HOME)
    assert got == ([Multiaddr(CIRCUIT)] if dialed else [])
    assert all(is_circuit(a) for a in got)


def test_a_private_node_advertises_only_its_relayed_addresses():
    node = reach(Reachability.UNKNOWN)
    assert node.advertised(HOME) == HOME
    node.state = Reachability.PRIVATE
    assert node.advertised(HOME) == []  # no relay yet: nothing anyone could dial
    relay = peer(after=node)
    node.reserved[relay] = Multiaddr(CIRCUIT)
    assert node.advertised(HOME) == [Multiaddr(CIRCUIT)]
