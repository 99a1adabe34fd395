"""A peer's signed address records, as a node's peer store keeps them (p2p/peerstore.py)."""

from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.peer.envelope import seal_record
from libp2p.peer.id import ID
from libp2p.peer.peer_record import PeerRecord
from libp2p.peer.peerstore import PeerStore
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.utils import maybe_consume_signed_record
from multiaddr import Multiaddr

from p2p.config import P2PConfig
from p2p.host import GossipHost
from p2p.peerstore import OrderedPeerStore
from p2p.policy import MessagePolicy
from rewards.scoring import group_carries_signal

KEYS = create_new_key_pair(b"\x01" * 32)
PEER = ID.from_pubkey(KEYS.public_key)


def record(seq: int, port: int, keys=KEYS):
    return seal_record(PeerRecord(PEER, [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")], seq), keys.private_key)


def rpc_with(envelope) -> rpc_pb2.RPC:
    return rpc_pb2.RPC(senderRecord=envelope.marshal_envelope())


def test_an_older_record_that_arrives_late_is_ignored_and_the_newer_addresses_kept():
    store = OrderedPeerStore()
    assert store.consume_peer_record(record(2, 4002), 7200)
    assert store.consume_peer_record(record(1, 4001), 7200)
    assert store.peer_record_map[PEER].seq == 2
    assert store.addrs(PEER) == [Multiaddr("/ip4/127.0.0.1/tcp/4002")]
    assert store.consume_peer_record(record(3, 4003), 7200)
    assert store.addrs(PEER) == [Multiaddr("/ip4/127.0.0.1/tcp/4003")]


def test_a_record_signed_by_another_key_is_refused_older_or_newer():
    store = OrderedPeerStore()
    assert store.consume_peer_record(record(2, 4002), 7200)
    forger = create_new_key_pair(b"\x02" * 32)
    assert not store.consume_peer_record(record(1, 9, forger), 7200)
    assert not store.consume_peer_record(record(3, 9, forger), 7200)
    assert store.addrs(PEER) == [Multiaddr("/ip4/127.0.0.1/tcp/4002")]


def test_a_gossip_rpc_carrying_an_older_record_is_read_by_a_node_not_dropped():
    """py-libp2p's pubsub drops every RPC whose sender record the peer store refuses; its own store refused a
    late older record, so a node lost the rollouts in that RPC. The node's store is ours."""
    cfg = P2PConfig(network="local")
    node = GossipHost(cfg, create_new_key_pair(), MessagePolicy(cfg.limits, cfg.rollout_topic_base(),
                                                                 signal=group_carries_signal), on_message=lambda m: None)
    assert isinstance(node.host.get_peerstore(), OrderedPeerStore)
    assert maybe_consume_signed_record(rpc_with(record(2, 4002)), node.host, PEER)
    assert maybe_consume_signed_record(rpc_with(record(1, 4001)), node.host, PEER)
    assert not maybe_consume_signed_record(rpc_with(record(1, 9, create_new_key_pair(b"\x02" * 32))), node.host, PEER)

    class Host:  # py-libp2p's own store, as 0.8.1 builds it: the fault this store mends
        store = PeerStore()

        def get_peerstore(self):
            return self.store

    bare = Host()
    assert maybe_consume_signed_record(rpc_with(record(2, 4002)), bare, PEER)
    assert not maybe_consume_signed_record(rpc_with(record(1, 4001)), bare, PEER)
