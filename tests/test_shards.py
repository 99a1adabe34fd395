"""Rollout topic shards: topic names, which topics an author may use, and how a node picks its level."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from p2p.config import P2PConfig, ShardConfig
from p2p.shards import MAX_LEVEL, prefix, publish_topics, shard_topic, topic_level, topics_problem

BASE = "/sapo/local/rollouts/2"


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def keys_with_prefix(bits: str, n: int, skip: int = 0) -> list[bytes]:
    found = (k for k in map(key, range(skip, 10**6)) if prefix(k, len(bits)) == bits)
    return [next(found) for _ in range(n)]


def test_topics_name_the_key_prefix_and_publishing_names_three_levels():
    k = keys_with_prefix("101", 1)[0]
    assert shard_topic(BASE, k, 0) == f"{BASE}/s"
    assert shard_topic(BASE, k, 3) == f"{BASE}/s101"
    assert publish_topics(BASE, k, 0) == [f"{BASE}/s", f"{BASE}/s1"]
    assert publish_topics(BASE, k, 2) == [f"{BASE}/s1", f"{BASE}/s10", f"{BASE}/s101"]
    assert len(publish_topics(BASE, k, MAX_LEVEL)) == 2
    assert [topic_level(BASE, t) for t in publish_topics(BASE, k, 2)] == [1, 2, 3]


@pytest.mark.parametrize("topic", [f"{BASE}/s2", f"{BASE}/x1", "/sapo/local/rollouts/1", f"{BASE}/s" + "0" * 25,
                                   "/sapo/testnet/rollouts/2/s", f"{BASE}/s/s1"])
def test_anything_else_is_not_a_shard_topic(topic):
    assert topic_level(BASE, topic) is None


def test_an_author_may_only_name_its_own_shards_and_at_most_three():
    k = keys_with_prefix("01", 1)[0]
    assert topics_problem(BASE, publish_topics(BASE, k, 1), k) is None
    assert topics_problem(BASE, [f"{BASE}/s", f"{BASE}/s01101"[:len(BASE) + 4]], k) is None
    assert "not its author's" in topics_problem(BASE, [f"{BASE}/s", f"{BASE}/s1"], k)
    assert "at most 3" in topics_problem(BASE, [shard_topic(BASE, k, lv) for lv in range(4)], k)
    assert "not a rollout shard" in topics_problem(BASE, ["/sapo/local/rollouts/1"], k)


def level(**knobs):
    cfg = ShardConfig(**{"min_authors": 3, "split_authors": 6, "window_s": 10, **knobs})
    return cfg.level_of(keys_with_prefix("00", 1)[0])


def test_a_shard_splits_only_when_the_child_shard_would_hold_enough_authors():
    shard = level()
    assert not shard.update(0.0, [])
    lopsided = keys_with_prefix("0", 1, skip=1) + keys_with_prefix("1", 6)  # my child shard "0": me + 1
    for k in lopsided:
        shard.hear(k, 5.0)
    assert shard.authors(5.0, 0) == 8 and shard.authors(5.0, 1) == 2
    assert not shard.update(10.0, [])  # 8 authors >= 6, but the child shard would hold 2 < 3
    for k in keys_with_prefix("0", 2, skip=10**4):
        shard.hear(k, 11.0)
    assert shard.update(11.0, []) and shard.level == 1


def test_a_node_moves_up_when_its_shard_is_too_small_and_not_below_zero():
    shard = level(level="auto")
    shard.level = 2
    shard.update(0.0, [])
    assert not shard.update(9.0, [])  # not a full window at this level yet
    assert shard.update(10.0, []) and shard.level == 1  # alone: 1 author < 3
    assert shard.update(20.0, []) and shard.level == 0
    assert not shard.update(40.0, [])


def test_authors_count_only_within_the_window():
    shard = level()
    for k in keys_with_prefix("0", 5):
        shard.hear(k, 0.0)
    assert shard.authors(5.0, 0) == 6
    assert shard.authors(10.5, 0) == 1
    shard.update(10.5, [])
    assert not shard.heard  # forgotten, not kept forever


def test_a_newcomer_takes_the_median_level_of_its_neighbours_then_follows_what_it_hears():
    shard = level()
    assert shard.update(1.0, [3, 4, 3, 9]) and shard.level == 3
    assert not shard.update(2.0, [3, 4, 3, 9])
    assert shard.update(5.0, [5, 5, 5]) and shard.level == 5  # still joining: follows its neighbours
    assert not shard.update(12.0, [7, 7, 7])  # joined: now only its own hearing moves it ...
    assert shard.update(15.0, [7, 7, 7]) and shard.level == 4  # ... and it hears nobody at level 5


def test_a_pinned_level_never_moves():
    shard = level(level=0)
    for k in keys_with_prefix("0", 20):
        shard.hear(k, 0.0)
    assert not shard.update(0.0, [5]) and not shard.update(100.0, [5]) and shard.level == 0


def test_shard_knobs_are_checked():
    with pytest.raises(ValidationError, match="must be at least twice min_authors"):
        ShardConfig(min_authors=6, split_authors=8)
    with pytest.raises(ValidationError, match="level"):
        P2PConfig(shards={"level": MAX_LEVEL + 1})
    assert P2PConfig(shards={"level": "auto"}).shards.level == "auto"
