"""The rollout pool: bounded by size, per-peer share and age; deduplicated; fair sampling."""

from __future__ import annotations

import random
from collections import Counter

from p2p.config import PoolConfig
from p2p.pool import RolloutPool
from p2p.seen import SeenKeys
from p2p.wire import VERSION, WireGroup, WireMessage

NOW = 1_800_000_000.0


def message(peer: str, indices: range | list[int], created: float = NOW, tag: str = "") -> WireMessage:
    groups = [WireGroup(dataset="arith", seed=0, index=i, completions=[f"{peer}{tag}-{i}-{k}" for k in range(2)])
              for i in indices]
    return WireMessage(v=VERSION, peer=peer, model="m", round=1, created=created, groups=groups)


def test_duplicates_are_dropped_even_after_the_first_copy_was_sampled():
    pool = RolloutPool(PoolConfig(size=100))
    assert pool.add(message("a", range(3)), now=NOW) == 3
    assert pool.add(message("a", range(3)), now=NOW) == 0
    pool.sample(3, random.Random(0), now=NOW)
    assert pool.add(message("a", range(3)), now=NOW + 1) == 0
    s = pool.stats()
    assert (s["received"], s["accepted"], s["sampled"], s["dropped"]) == (9, 3, 3, {"duplicate": 6})


def test_one_peer_cannot_hold_more_than_its_share_and_its_oldest_go_first():
    pool = RolloutPool(PoolConfig(size=20, max_peer_share=0.25))  # quota 5
    pool.add(message("spammer", range(12)), now=NOW)
    pool.add(message("honest", range(3)), now=NOW)
    assert len(pool) == 8
    assert pool.stats()["dropped"] == {"peer_quota": 7}
    taken = pool.sample(20, random.Random(0), now=NOW)
    assert sorted(g.group.index for g in taken if g.peer == "spammer") == [7, 8, 9, 10, 11]


def test_a_full_pool_evicts_its_oldest_group():
    pool = RolloutPool(PoolConfig(size=4, max_peer_share=1.0))
    for i, peer in enumerate("abcde"):
        pool.add(message(peer, [i], created=NOW + i), now=NOW + 5)
    assert len(pool) == 4
    assert pool.stats()["dropped"] == {"overflow": 1}
    assert {g.peer for g in pool.sample(4, random.Random(0), now=NOW + 5)} == set("bcde")


def test_groups_older_than_the_max_age_are_dropped_on_arrival_and_while_waiting():
    pool = RolloutPool(PoolConfig(size=10, max_age_s=60))
    assert pool.add(message("a", [0], created=NOW - 61), now=NOW) == 0
    pool.add(message("b", [1], created=NOW), now=NOW)
    assert pool.sample(5, random.Random(0), now=NOW + 61) == []
    assert pool.stats()["dropped"] == {"stale": 2}


def test_sampling_spreads_over_peers_before_taking_a_second_group_from_any():
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0))
    for peer, n in (("a", 10), ("b", 1), ("c", 3), ("d", 2)):
        pool.add(message(peer, range(n)), now=NOW)
    first = pool.sample(4, random.Random(1), now=NOW)
    assert sorted(g.peer for g in first) == ["a", "b", "c", "d"]
    second = Counter(g.peer for g in pool.sample(5, random.Random(1), now=NOW))
    assert second == {"a": 2, "c": 2, "d": 1}
    assert len(pool) == 16 - 9
    assert pool.stats()["sampled"] == 9


def test_sampling_prefers_each_peers_newest_groups():
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0))
    pool.add(message("a", [0], created=NOW - 10), now=NOW)
    pool.add(message("a", [1], created=NOW), now=NOW)
    assert [g.group.index for g in pool.sample(1, random.Random(0), now=NOW)] == [1]


def test_sampling_an_empty_pool_returns_nothing():
    assert RolloutPool(PoolConfig()).sample(4, random.Random(0)) == []


def test_seen_keys_are_forgotten_after_their_ttl_and_stay_under_their_cap():
    seen = SeenKeys(ttl=10, max_keys=3)
    for k in range(5):
        seen.add(k, now=k)
    assert [k for k in range(5) if k in seen] == [2, 3, 4]  # capped at 3: the oldest went first
    seen.forget_expired(now=13.5)  # 2 and 3 expired at 12 and 13
    assert [k for k in range(5) if k in seen] == [4]
