"""py-libp2p's Pubsub and GossipSub with what 0.8.1 gets wrong for us fixed in subclasses, each fault
measured in this project before it was fixed here."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter

import trio
from google.protobuf.message import DecodeError
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.score import ScoreParams, TopicScoreParams

from p2p.config import P2PConfig
from p2p.reach import is_open

log = logging.getLogger(__name__)

SCORE_HALF_LIFE_S = 120.0  # how long a neighbour's record of deliveries lasts
SCORE_CAP = 100.0  # deliveries (or rejections) counted at most, so that a long past does not outweigh the present
# How long a pruned neighbour stays out of the mesh (GossipSub's default is 60 s). A neighbour pruned by mistake,
# say while strangers crowded the mesh, is grafted back within this when the mesh is short; a pruned stranger
# that grafts again is pruned again by score once the mesh is over D_hi.
PRUNE_BACKOFF_S = 10


def gossipsub_router(counts: Counter[str], cfg: P2PConfig) -> CountingGossipSub:
    """GossipSub with the parameters PROTOCOL.md section 1 recommends, the degree and heartbeat from `cfg`."""
    return CountingGossipSub(
        counts, protocols=[PROTOCOL_ID_V11], degree=cfg.mesh_degree, degree_low=cfg.mesh_low(),
        degree_high=2 * cfg.mesh_degree, heartbeat_interval=cfg.heartbeat_s, adaptive_gossip_enabled=False,
        max_messages_per_topic_per_second=cfg.max_messages_per_s, score_params=delivery_scores(cfg.heartbeat_s),
        prune_back_off=PRUNE_BACKOFF_S)


def delivery_scores(heartbeat_s: float) -> ScoreParams:
    """GossipSub peer scores from what each neighbour delivers: +1 for each valid message it was first to bring
    us, -1 for each it sent that our validator refused, both decaying with a half-life of SCORE_HALF_LIFE_S.

    py-libp2p always scores its neighbours, and when a topic's mesh holds more than 2D peers prunes the lowest
    scores first; with its default weights every score is 0 and the order is arbitrary. Subscribe-only
    strangers joining the mesh could then prune the honest neighbours, which the backoff after a PRUNE (60 s
    by default) kept out of the mesh after the strangers left. Here the neighbours that bring valid rollouts
    outrank those that bring nothing or junk. No threshold uses these scores: they order pruning and
    refuse nobody."""
    decay = 0.5 ** (heartbeat_s / SCORE_HALF_LIFE_S)
    return ScoreParams(p2_first_message_deliveries=TopicScoreParams(weight=1.0, cap=SCORE_CAP, decay=decay),
                       p4_invalid_messages=TopicScoreParams(weight=1.0, cap=SCORE_CAP, decay=decay))


class CountingGossipSub(GossipSub):
    """GossipSub whose spam limit (`p2p.max_messages_per_s` per neighbour) counts the messages it
    refuses to forward; py-libp2p only logs them."""

    def __init__(self, counts: Counter[str], **kwargs):
        super().__init__(**kwargs)
        self.counts = counts

    def _check_spam_protection(self, peer_id: ID, msg) -> bool:
        if super()._check_spam_protection(peer_id, msg):
            return True
        self.counts["dropped_rate_limit"] += 1
        return False

    async def _maintain_mesh_quality(self, topic: str) -> None:
        """No swapping of mesh peers by score. py-libp2p swaps its worst mesh peer for a better-scored outsider
        at every heartbeat, PRUNE and backoff included: with delivery scores that churns a healthy
        mesh (each neighbour's first deliveries rise and fall with who happened to forward first), and its
        undo path indexes `mesh[topic]` after an await, when a shard move may have left the topic. Pruning
        an oversubscribed mesh by score is what keeps the neighbours that deliver."""

    def add_peer(self, peer_id: ID, protocol_id) -> None:
        """A peer connecting anew (a restarted node, same id) starts with no GRAFT backoff: the backoff left from its
        previous life refused every GRAFT of the restarted node, and each refusal extended it, so a node rejoining
        through its address book stayed connected and unfed for over a minute (tests/test_addrbook.py). A peer
        that drops and redials to shed a backoff pays a connection and a handshake each time."""
        for peers in self.back_off.values():
            peers.pop(peer_id, None)
        super().add_peer(peer_id, protocol_id)

    async def _do_px(self, px_peers: list[rpc_pb2.PeerInfo]) -> None:
        """Peers named in a PRUNE are not dialed: py-libp2p dials up to 16 of them per PRUNE whatever the
        sender's score, outside the node's hint budget (`p2p.hints`), so any neighbour could aim the node's
        dials at any host. The node's own peer exchange is where it learns peers; these are counted."""
        self.counts["px_ignored"] += len(px_peers)


class GuardedPubsub(Pubsub):
    """Pubsub that writes one RPC at a time per stream, survives a peer's garbage and counts what it drops
    unread.

    py-libp2p lets several tasks (forwarding, heartbeat control) write to a peer's stream at once, and
    yamux sends a message larger than a frame or than the send window in several frames, so two RPCs
    interleave and the peer reads garbage (measured: 3 of 24 nodes hit it within seconds of joining).
    An RPC that does not parse then escaped the read loop and stopped the reader's whole host, so one
    bad peer, careless or hostile, took a node off the swarm; it now costs that peer its stream."""

    def __init__(self, *args, counts: Counter[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.counts = counts
        self._write_locks: weakref.WeakKeyDictionary[INetStream, trio.Lock] = weakref.WeakKeyDictionary()
        self.host.get_network().register_notifee(MoveOnDisconnect(self))

    def _is_subscribed_to_msg(self, msg: rpc_pb2.Message) -> bool:
        """py-libp2p drops a message on a topic we do not read before any validator sees it; count it."""
        if super()._is_subscribed_to_msg(msg):
            return True
        self.counts["dropped_unsubscribed"] += 1
        return False

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        async with self._write_locks.setdefault(stream, trio.Lock()):
            return await super().write_msg(stream, rpc_msg)

    def drop_stale_stream(self, peer: ID) -> None:
        """Reopen our gossip stream to `peer` when the connection it rode is gone while another is open: after a
        hole punch, or when a relay ends its circuit. py-libp2p skips a disconnect while the peer has another
        connection, and its read loop ends quietly on the dead connection, so the dead stream stayed in `peers` until
        a write into it failed. That message was lost, and the failure made py-libp2p forget the peer's
        subscriptions, which it learns again only when the peer reopens its own stream, which the peer does only
        when a write into its own dead stream fails: a peer with nothing to send us was sent nothing again, with no
        error (tests/test_punch.py). Here both ends reopen at once, each telling its subscriptions anew."""
        stream = self.peers.get(peer)
        live = {c.muxed_conn for c in self.host.get_network().get_connections(peer) if is_open(c)}
        if stream is None or not live or stream.muxed_conn in live:
            return  # no stream, no other connection (the disconnect handler's case), or it rides a live one
        self.counts["gossip_streams_moved"] += 1
        self._handle_dead_peer(peer)  # py-libp2p reopens it on a connection still open, with our subscriptions

    async def continuously_read_stream(self, stream: INetStream) -> None:
        try:
            await super().continuously_read_stream(stream)
        except DecodeError:
            peer = stream.muxed_conn.peer_id
            self.counts["dropped_bad_rpc"] += 1
            log.warning("peer %s sent a gossip RPC that does not parse; its stream is closed", peer)
            with contextlib.suppress(Exception):
                await stream.reset()
            self._handle_dead_peer(peer)


class MoveOnDisconnect(INotifee):
    """Tells `GuardedPubsub` of every closed connection (py-libp2p's own notifee ignores one while another is open)."""

    def __init__(self, pubsub: GuardedPubsub):
        self.pubsub = pubsub

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self.pubsub.drop_stale_stream(conn.muxed_conn.peer_id)

    async def connected(self, network: INetwork, conn: INetConn) -> None: ...
    async def opened_stream(self, network: INetwork, stream: INetStream) -> None: ...
    async def closed_stream(self, network: INetwork, stream: INetStream) -> None: ...
    async def listen(self, network: INetwork, multiaddr) -> None: ...
    async def listen_close(self, network: INetwork, multiaddr) -> None: ...
