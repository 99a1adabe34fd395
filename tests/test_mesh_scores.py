"""Which neighbours an oversubscribed GossipSub mesh keeps: those that bring valid rollouts, not strangers that
only subscribe, nor senders of what the validator refuses (p2p.pubsub.delivery_scores)."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import trio

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.pubsub.score import ScoreParams

from p2p.config import P2PConfig
from p2p.pubsub import PRUNE_BACKOFF_S, SCORE_HALF_LIFE_S, CountingGossipSub, gossipsub_router

TOPIC = "/sapo/local/rollouts/3/s"


def peer() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


def router(params: ScoreParams | None = None) -> CountingGossipSub:
    """The node's own router (one heartbeat a second), or py-libp2p's with `params` for a comparison."""
    if params is None:
        return gossipsub_router(Counter(), P2PConfig())
    return CountingGossipSub(Counter(), protocols=[PROTOCOL_ID_V11], degree=4, degree_low=3, degree_high=8,
                             heartbeat_interval=1, score_params=params)


def crowded_mesh(gossip: CountingGossipSub) -> tuple[list[ID], list[ID], list[ID]]:
    """Two honest neighbours that have delivered rollouts, fifteen strangers that only subscribed and one
    neighbour whose messages the validator refused, all in one topic's mesh."""
    honest, strangers, junk = [peer(), peer()], [peer() for _ in range(15)], [peer()]
    for p in honest:
        for _ in range(20):
            gossip.scorer.on_first_delivery(p, TOPIC)
    for _ in range(5):
        gossip.scorer.on_invalid_message(junk[0], TOPIC)
    gossip.mesh[TOPIC] = set(honest + strangers + junk)
    return honest, strangers, junk


def test_an_oversubscribed_mesh_prunes_junk_and_strangers_before_neighbours_that_deliver():
    gossip = router()
    honest, strangers, junk = crowded_mesh(gossip)
    pruned = gossip._select_peers_for_pruning(TOPIC, len(gossip.mesh[TOPIC]) - gossip.degree)
    assert junk[0] in pruned and not set(honest) & set(pruned)
    assert len(set(strangers) - set(pruned)) == gossip.degree - len(honest)


def test_with_py_libp2ps_default_weights_every_score_is_zero_and_the_order_says_nothing():
    gossip = router(ScoreParams())
    honest, strangers, junk = crowded_mesh(gossip)
    assert {gossip.scorer.score(p, [TOPIC]) for p in honest + strangers + junk} == {0.0}


def test_a_neighbours_record_halves_over_the_half_life_and_is_capped():
    gossip = router()
    p = peer()
    for _ in range(500):
        gossip.scorer.on_first_delivery(p, TOPIC)
    assert gossip.scorer.score(p, [TOPIC]) == 100.0  # SCORE_CAP: a long past does not outweigh the present
    gossip.scorer.first_message_deliveries[p][TOPIC] = 80.0
    for _ in range(int(SCORE_HALF_LIFE_S)):
        gossip.scorer.on_heartbeat()
    assert abs(gossip.scorer.score(p, [TOPIC]) - 40.0) < 0.01


def test_a_full_mesh_is_not_churned_by_swapping_its_worst_peer_for_a_better_scored_outsider():
    gossip = router()
    mesh, outsider = [peer() for _ in range(4)], peer()
    for _ in range(50):
        gossip.scorer.on_first_delivery(outsider, TOPIC)
    gossip.mesh[TOPIC] = set(mesh)
    gossip.peer_protocol.update({p: PROTOCOL_ID_V11 for p in mesh + [outsider]})
    gossip.pubsub = type("Attached", (), {"peer_topics": {TOPIC: set(mesh + [outsider])}})()
    sent = []

    async def control(topic, to, *args):
        sent.append(to)

    gossip.emit_prune = gossip.emit_graft = control  # py-libp2p's own heartbeat would PRUNE one and GRAFT it
    trio.run(gossip._maintain_mesh_quality, TOPIC)
    assert gossip.mesh[TOPIC] == set(mesh) and not sent


def test_a_pruned_neighbour_may_be_grafted_again_after_seconds_not_a_minute(monkeypatch):
    gossip, p = router(), peer()
    gossip._add_back_off(p, TOPIC, False)  # what a PRUNE leaves behind, on either side
    assert gossip._check_back_off(p, TOPIC)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + PRUNE_BACKOFF_S + 1)
    assert PRUNE_BACKOFF_S < 60 and not gossip._check_back_off(p, TOPIC)


def test_peers_named_in_a_prune_are_counted_and_never_dialed():
    """py-libp2p dials up to 16 peers a PRUNE names (GossipSub's peer exchange), whoever sent it: a second way for any
    neighbour to aim the node's dials, outside its hint budget."""
    router, dialed = gossipsub_router(Counter(), P2PConfig()), []

    async def connect(info) -> None:
        dialed.append(info.peer_id)

    named = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(3)]
    store = SimpleNamespace(peer_info=lambda pid: PeerInfo(pid, []))
    router.pubsub = SimpleNamespace(peers={}, host=SimpleNamespace(connect=connect, get_peerstore=lambda: store))
    trio.run(router._do_px, [rpc_pb2.PeerInfo(peerID=p.to_bytes()) for p in named])
    assert dialed == [] and router.counts["px_ignored"] == 3
