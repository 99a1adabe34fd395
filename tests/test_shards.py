"""Rollout topic shards: topic names, which topics an author may use, how a node picks its level, and
how shards are redrawn each epoch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from p2p.config import P2PConfig, ShardConfig
from p2p.shards import (MAX_LEVEL, PROBE_AGAIN_WINDOWS, epoch_of, prefix, publish_topics, shard_key, shard_topic,
                        topic_level, topics_problem)
from tests.conftest import ROOT

BASE = "/sapo/local/rollouts/3"
EPOCH_S = 1000.0  # the tests' clock runs from 0 to 999 within epoch 0, unless they move it on


def peers_with_prefix(bits: str, n: int, skip: int = 0, epoch: int = 0) -> list[bytes]:
    """Peer ids (stand-ins) whose shard key this epoch starts with `bits`."""
    found = (p for p in (str(i).encode() for i in range(skip, 10**6)) if prefix(shard_key(p, epoch), len(bits)) == bits)
    return [next(found) for _ in range(n)]


def keys_with_prefix(bits: str, n: int) -> list[bytes]:
    return [shard_key(p, 0) for p in peers_with_prefix(bits, n)]


def test_topics_name_the_key_prefix_and_an_author_publishes_at_three_levels():
    k = keys_with_prefix("101", 1)[0]
    assert shard_topic(BASE, k, 0) == f"{BASE}/s"
    assert shard_topic(BASE, k, 3) == f"{BASE}/s101"
    assert publish_topics(BASE, k, 0) == [f"{BASE}/s", f"{BASE}/s1"]
    assert publish_topics(BASE, k, 2) == [f"{BASE}/s1", f"{BASE}/s10", f"{BASE}/s101"]
    assert len(publish_topics(BASE, k, MAX_LEVEL)) == 2
    assert [topic_level(BASE, t) for t in publish_topics(BASE, k, 2)] == [1, 2, 3]


@pytest.mark.parametrize("topic", [f"{BASE}/s2", f"{BASE}/x1", "/sapo/local/rollouts/1", f"{BASE}/s" + "0" * 25,
                                   "/sapo/testnet/rollouts/3/s", "/sapo/local/rollouts/2/s", f"{BASE}/s/s1"])
def test_anything_else_is_not_a_shard_topic(topic):
    assert topic_level(BASE, topic) is None


def test_a_message_names_one_topic_a_shard_of_its_author_at_any_level():
    # protocol 3: one GossipSub message per topic, as stock libp2p pubsub (one `topic` field) can sign
    peer = peers_with_prefix("01", 1)[0]
    k = shard_key(peer, 0)
    assert all(topics_problem(BASE, [shard_topic(BASE, k, lv)], peer, [0]) is None for lv in range(MAX_LEVEL + 1))
    assert "not its author's" in topics_problem(BASE, [f"{BASE}/s1"], peer, [0])
    assert "not its author's" in topics_problem(BASE, [f"{BASE}/s00"], peer, [0])
    assert "names 2 topics (one is due)" in topics_problem(BASE, publish_topics(BASE, k, 0), peer, [0])
    assert "names 3 topics" in topics_problem(BASE, publish_topics(BASE, k, 1), peer, [0])
    assert "names 0 topics" in topics_problem(BASE, [], peer, [0])
    assert "not a rollout shard" in topics_problem(BASE, ["/sapo/local/rollouts/1"], peer, [0])
    assert "not a rollout shard" in topics_problem(BASE, ["/sapo/local/rollouts/2/s"], peer, [0])  # protocol 2


def test_an_author_may_name_its_shard_of_any_accepted_epoch():
    peer = next(p for p in (str(i).encode() for i in range(10**6))
                if prefix(shard_key(p, 0), 2) == "00" and prefix(shard_key(p, 1), 2) == "11")
    old, new = (shard_topic(BASE, shard_key(peer, e), 2) for e in (0, 1))
    assert topics_problem(BASE, [old], peer, [0, 1]) is None and topics_problem(BASE, [new], peer, [0, 1]) is None
    assert "not its author's" in topics_problem(BASE, [old], peer, [1, 2])  # an epoch no longer accepted


def level(**knobs):
    cfg = ShardConfig(**{"min_authors": 3, "split_authors": 6, "window_s": 10, **knobs})
    return cfg.level_of(peers_with_prefix("00", 1)[0], EPOCH_S, 0.0)


def hear_all(shard, peers, now, at_level):
    for p in peers:
        shard.hear(p, now, at_level)


def test_a_shard_splits_only_when_the_child_shard_would_hold_enough_authors():
    shard = level()
    assert not shard.update(0.0, [])
    lopsided = peers_with_prefix("0", 1, skip=1) + peers_with_prefix("1", 6)  # my child shard "0": me + 1
    hear_all(shard, lopsided, 5.0, 0)
    assert shard.authors(5.0, 0) == 8 and shard.authors(5.0, 1) == 2
    assert not shard.update(10.0, [])  # 8 authors >= 6, but the child shard would hold 2 < 3
    hear_all(shard, peers_with_prefix("0", 2, skip=10**4), 11.0, 0)
    assert shard.update(11.0, []) and shard.level == 1


def test_a_node_moves_up_when_its_shard_is_too_small_and_not_below_zero():
    shard = level(level="auto")
    shard.level = 2
    shard.update(0.0, [])
    assert not shard.update(9.0, [])  # not a full window at this level yet
    assert shard.update(10.0, []) and shard.level == 1  # alone: 1 author < 3
    assert shard.update(20.0, []) and shard.level == 0
    assert not shard.update(40.0, [])


def test_authors_count_only_within_the_window_and_within_one_level_of_the_topic_they_were_heard_on():
    shard = level()
    hear_all(shard, peers_with_prefix("0", 5), 0.0, 0)
    assert shard.authors(5.0, 0) == 6
    assert shard.authors(10.5, 0) == 1
    shard.update(10.5, [])
    assert not shard.heard  # forgotten, not kept forever
    hear_all(shard, peers_with_prefix(prefix(shard.key, 5), 4), 11.0, 3)  # heard on our level-3 topic
    assert [shard.authors(11.0, lv) for lv in range(6)] == [1, 1, 5, 5, 5, 1]
    hear_all(shard, peers_with_prefix(prefix(shard.key, 5), 4), 11.0, 4)  # the same authors' copies at level 4
    assert [shard.authors(11.0, lv) for lv in range(6)] == [1, 1, 5, 5, 5, 5]  # each counts once


def test_a_split_goes_at_most_one_level_beyond_the_topics_its_authors_were_heard_on():
    shard = level()
    shard.update(0.0, [])
    authors = peers_with_prefix("000", 4, skip=10**4) + peers_with_prefix("001", 4, skip=10**4) \
        + peers_with_prefix("01", 6) + peers_with_prefix("1", 12)
    hear_all(shard, authors, 5.0, 0)
    # mine is "00...": 27 authors at level 0 and 15 at level 1; at level 2 none of them would be heard
    assert [shard.authors(10.0, lv) for lv in range(3)] == [27, 15, 1]
    assert shard.update(10.0, []) and shard.level == 1
    hear_all(shard, authors, 12.0, 1)  # they split too: heard on our level-1 topic
    assert [shard.authors(12.0, lv) for lv in range(4)] == [27, 15, 9, 1]
    assert shard.update(12.0, []) and shard.level == 2  # not 3: none of them was heard within a level of it


def test_subscriptions_alone_never_move_a_level_and_probes_are_bounded():
    shard = level()
    shard.update(0.0, [])
    lies = [MAX_LEVEL] * 30 + [5] * 30 + [9] * 3  # 63 subscriptions to our own shards, and no rollout
    for t in range(0, 200, 2):
        assert not shard.update(float(t), lies) and shard.level == 0
        assert len(shard.probes) <= 2
    assert set(shard.probed) == {MAX_LEVEL, 5, 9}  # each probed, none again within PROBE_AGAIN_WINDOWS windows
    assert min(shard.probed.values()) >= 200 - 2 - PROBE_AGAIN_WINDOWS * 10 * 2


def test_a_newcomer_finds_a_deep_swarm_by_probing_where_its_neighbours_listen():
    shard = level()
    assert not shard.update(0.0, [6, 6, 6, 1]) and set(shard.probes) == {6}  # level 1 is within earshot already
    hear_all(shard, peers_with_prefix(prefix(shard.key, 6), 1), 1.0, 6)
    assert not shard.update(1.0, [6, 6, 6])  # 2 authors at 6 (itself included): fewer than min_authors
    hear_all(shard, peers_with_prefix(prefix(shard.key, 6), 3), 2.0, 7)
    assert shard.update(2.0, [6, 6, 6]) and shard.level == 6 and not shard.probes


def test_a_move_made_on_authors_who_fall_silent_is_undone_within_about_one_window():
    shard = level()
    shard.update(0.0, [12])
    hear_all(shard, peers_with_prefix(prefix(shard.key, 12), 3), 1.0, 12)  # ground ids with valid rollouts
    assert shard.update(1.0, [12]) and shard.level == 12
    honest = peers_with_prefix("1", 2)  # a 3-node swarm at level 0
    for t in range(2, 40, 2):  # the sybils fall silent; the honest pair keeps publishing at 0
        if shard.level == 0:
            break
        hear_all(shard, honest, float(t), 0)
        shard.update(float(t), [0, 0])
    assert shard.level == 0 and t <= 2 * 10 + 2


def test_a_pinned_level_never_moves_nor_probes():
    shard = level(level=0)
    hear_all(shard, peers_with_prefix("0", 20), 0.0, 0)
    assert not shard.update(0.0, [5]) and not shard.update(100.0, [5]) and shard.level == 0 and not shard.probes


def test_shard_knobs_are_checked():
    with pytest.raises(ValidationError, match="must be at least twice min_authors"):
        ShardConfig(min_authors=6, split_authors=8)
    with pytest.raises(ValidationError, match="level"):
        P2PConfig(shards={"level": MAX_LEVEL + 1})
    assert P2PConfig(shards={"level": "auto"}).shards.level == "auto"


def test_a_new_epoch_moves_the_node_to_its_new_shard_at_the_same_level_and_starts_hearing_over():
    shard = level()
    shard.level = 2
    shard.update(0.0, [])
    hear_all(shard, peers_with_prefix("00", 3, skip=10**4), 990.0, 2)
    before = shard.key
    assert shard.update(1001.0, []) and shard.epoch == 1 and shard.level == 2 and shard.key != before
    assert shard.key == shard_key(shard.peer, epoch_of(1001.0, EPOCH_S)) and not shard.heard
    assert not shard.update(1005.0, [])  # alone in its new shard, but not a full window yet: no merge
    shard.probed[5] = 1000.0
    assert shard.update(2001.0, [5]) and not shard.probes and not shard.probed  # epoch 2: nothing carried over
    assert not shard.update(2002.0, [5]) and set(shard.probes) == {5}


def test_over_many_epochs_a_node_shares_its_shard_with_many_different_peers():
    me, others = b"me", [str(i).encode() for i in range(256)]
    mates = [{p for p in others if prefix(shard_key(p, e), 3) == prefix(shard_key(me, e), 3)} for e in range(24)]
    per_epoch = sum(map(len, mates)) / len(mates)
    assert 20 <= per_epoch <= 44  # 256 / 8 on average
    assert len(set().union(*mates)) > 6 * per_epoch  # a day of 1-hour epochs: most of the swarm


@pytest.mark.slow
def test_the_simulated_swarm_keeps_a_nodes_cost_flat_with_shards_and_not_with_one_topic(tmp_path):
    # the real ShardLevel, topic binding and pool in scripts/bench/simulate_swarm.py, at 8 and 100 nodes
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, "scripts/bench/simulate_swarm.py", "--nodes", "8", "100", "--measure-s", "120",
                        "--pool-nodes", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {(x["nodes"], x["scheme"]): x for x in json.loads(out.read_text())["results"]}
    small = rows[(8, "shards")]["cpu_ms_per_round_mean"]
    assert rows[(100, "shards")]["cpu_ms_per_round_mean"] < 2 * small
    assert rows[(100, "one-topic")]["cpu_ms_per_round_mean"] > 5 * small
    assert min(int(level) for level in rows[(100, "shards")]["levels"]) > 0  # the 100-node swarm split
    for row in rows.values():
        assert row["delivery_ratio"] == 1 and row["j_filled_ratio"] == 1


def test_authors_a_training_node_never_used_do_not_set_its_level_and_its_useful_ones_do_at_once():
    """Six ids ground into a node's level-8 shard, each publishing a valid message every few seconds, pulled a
    3-node swarm's node there in 9 s and held it: its honest groups fell from 4 a round to 0.1 for 8 minutes."""
    honest = peers_with_prefix("1", 2)  # a 3-node swarm at level 0, whose groups this node uses
    shard = level(min_authors=3, split_authors=6)
    shard.useful = lambda author: author in honest
    shard.update(0.0, [8])
    assert set(shard.probes) == {8}  # the strangers' subscriptions are hints: it listens there for a window
    ground = peers_with_prefix(prefix(shard.key, 8), 6)
    for t in range(1, 40):
        hear_all(shard, ground, float(t), 8)
        hear_all(shard, honest, float(t), 0)
        shard.update(float(t), [8] * 6)
        assert shard.level == 0  # at level 8 it would hear 7 authors, none it ever used
    assert shard.authors(39.0, 8) == 1 and shard.authors(39.0, 0) == 3
    shard.level, shard.since = 8, 40.0  # a node already pulled there (by authors it used to count)
    shard.probes.pop(8, None)  # as a move there ends its probe
    hear_all(shard, ground, 41.0, 8)
    # its old neighbours' subscriptions start a probe of level 0, which hears its useful authors: back at once
    assert shard.update(41.0, [0, 0]) and shard.level == 0 and shard.probed[0] == 41.0


def test_authors_of_one_network_group_count_once_and_others_one_each():
    """Six ground ids on one host, each publishing groups anyone can compute, moved a node to level 8: ids are free,
    addresses are not (GossipSub v1.1's IP colocation)."""
    shard = level()
    sybils, honest = peers_with_prefix("0", 6), peers_with_prefix("0", 3, skip=10**4)
    for p in sybils:
        shard.hear(p, 5.0, 0, group="198.51.100.0/24")
    assert shard.authors(5.0, 0) == 2 and not shard.update(6.0, [])  # me and one subnet: no split
    for k, p in enumerate(honest):  # each vouched for by a subnet of its own
        shard.hear(p, 6.0, 0, group=f"203.0.{k}.0/24")
    assert shard.authors(6.0, 0) == 5
    shard.hear(sybils[0], 7.0, 0, group="203.0.0.0/24")  # a sybil's message forwarded by an honest author adds no one
    assert shard.authors(7.0, 0) == 5
    shard.hear(sybils[1], 7.0, 0)  # no connection known (the simulation): counted as itself
    assert shard.authors(7.0, 0) == 6
    shard.update(30.0, [])  # all out of the window: their groups are forgotten with them
    assert shard.groups == {} and shard.authors(30.0, 0) == 1


def test_twelve_ground_ids_whose_messages_arrive_over_one_connection_move_no_level():
    """Twelve ids ground into a node's level-8 shard, whose signed messages all came over one connection of a
    thirteenth id, took the node to level 8 in 27 s and held it: an author that was not connected counted alone.
    Here through the host's validator, which is told the neighbour that brought each message (not connected in
    this test: the forwarder's own id stands for its connection)."""
    import time

    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.pubsub.pb import rpc_pb2

    from p2p.host import GossipHost
    from p2p.policy import MessagePolicy
    from rewards.scoring import group_carries_signal
    from tests.test_wire import pack, raw_message

    cfg = P2PConfig(network="local")
    host = GossipHost(cfg, create_new_key_pair(), MessagePolicy(cfg.limits, cfg.rollout_topic_base(),
                                                                signal=group_carries_signal), on_message=lambda m: None)
    shard, base, now = host.shard, cfg.rollout_topic_base(), time.time()
    mine = prefix(shard.key, 8)
    ground = []
    while len(ground) < 12:  # about 2^8 key generations each
        pid = ID.from_pubkey(create_new_key_pair().public_key)
        if prefix(shard.key_of(pid.to_bytes()), 8) == mine:
            ground.append(pid)
    forwarder = ID.from_pubkey(create_new_key_pair().public_key)
    shard.update(now, [8])
    assert set(shard.probes) == {8}  # the forwarder's subscriptions point there: the node listens for a window
    topic = shard_topic(base, shard.key, 8)
    host.pubsub.set_topic_validator(topic, host._validate, False)
    for k, author in enumerate(ground):
        msg = rpc_pb2.Message(from_id=author.to_bytes(), data=pack(raw_message(peer=author.to_base58(), created=now)),
                              seqno=k.to_bytes(8, "big"), topicIDs=[topic])
        trio.run(host.pubsub.validate_msg, forwarder, msg)  # as GossipSub does, then hands it to the reader
        host._deliver(msg)
    assert host.policy.stats() == {"accepted": 12, "rejected": {}}
    assert shard.authors(now, 8) == 2  # itself and the one connection (13 when each counted alone)
    for t in range(0, 60, 2):
        shard.update(now + t, [8])
        assert shard.level == 0
