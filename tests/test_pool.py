"""The rollout pool: bounded by size, per-peer share and age; deduplicated; groups taken once."""

from __future__ import annotations

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
    for g in pool.groups(now=NOW):
        assert pool.take(g)
    assert pool.add(message("a", range(3)), now=NOW + 1) == 0
    s = pool.stats()
    assert (s["received"], s["accepted"], s["sampled"], s["dropped"], s["seen"]) == (9, 3, 3, {"duplicate": 6}, 3)


def test_one_peer_cannot_hold_more_than_its_share_and_its_oldest_go_first():
    pool = RolloutPool(PoolConfig(size=20, max_peer_share=0.25))  # quota 5
    pool.add(message("spammer", range(12)), now=NOW)
    pool.add(message("honest", range(3)), now=NOW)
    assert len(pool) == 8
    assert pool.stats()["dropped"] == {"peer_quota": 7}
    assert sorted(g.group.index for g in pool.groups(now=NOW) if g.peer == "spammer") == [7, 8, 9, 10, 11]


def test_a_full_pool_evicts_its_oldest_group():
    pool = RolloutPool(PoolConfig(size=4, max_peer_share=1.0))
    for i, peer in enumerate("abcde"):
        pool.add(message(peer, [i], created=NOW + i), now=NOW + 5)
    assert len(pool) == 4
    assert pool.stats()["dropped"] == {"overflow": 1}
    assert {g.peer for g in pool.groups(now=NOW + 5)} == set("bcde")


def test_groups_older_than_the_max_age_are_dropped_on_arrival_and_while_waiting():
    pool = RolloutPool(PoolConfig(size=10, max_age_s=60))
    assert pool.add(message("a", [0], created=NOW - 61), now=NOW) == 0
    pool.add(message("b", [1], created=NOW), now=NOW)
    assert pool.groups(now=NOW + 61) == []
    assert pool.stats()["dropped"] == {"stale": 2}


def test_a_group_is_taken_once_and_not_after_it_was_evicted():
    pool = RolloutPool(PoolConfig(size=100, max_peer_share=1.0, max_age_s=60))
    pool.add(message("a", [0, 1], created=NOW), now=NOW)
    first, second = pool.groups(now=NOW)
    assert pool.take(first) and not pool.take(first)
    pool.groups(now=NOW + 61)  # expires the second
    assert not pool.take(second)
    assert (len(pool), pool.stats()["sampled"], pool.stats()["dropped"]) == (0, 1, {"stale": 1})


def test_an_empty_pool_lists_nothing():
    assert RolloutPool(PoolConfig()).groups() == []


def test_seen_keys_are_forgotten_after_their_ttl_and_stay_under_their_cap():
    seen = SeenKeys(ttl=10, max_keys=3)
    for k in range(5):
        seen.add(k, now=k)
    assert [k for k in range(5) if k in seen] == [2, 3, 4]  # capped at 3: the oldest went first
    seen.forget_expired(now=13.5)  # 2 and 3 expired at 12 and 13
    assert [k for k in range(5) if k in seen] == [4]


def flood(pool: RolloutPool, identities: int, per_identity: int, created: float) -> None:
    for h in range(identities):
        pool.add(message(f"sybil{h}", range(per_identity), created=created), now=created)


def test_fresh_identities_share_one_quota_and_cannot_evict_a_proven_peers_groups():
    pool = RolloutPool(PoolConfig(size=64, max_peer_share=0.25, unproven_share=0.25), proven=lambda p: p == "honest")
    pool.add(message("honest", range(10), created=NOW), now=NOW)
    flood(pool, identities=6, per_identity=16, created=NOW + 1)  # 96 newer groups from free identities
    held = [g.peer for g in pool.groups(now=NOW + 1)]
    assert held.count("honest") == 10  # nothing of the proven peer left
    assert len(held) - 10 == pool.unproven_quota == 16  # six identities hold one share between them
    assert max(held.count(f"sybil{h}") for h in range(6)) <= 4  # the one holding most gives way
    assert pool.stats()["dropped"] == {"unproven_quota": 96 - 16}


def test_without_the_split_the_same_flood_evicts_the_honest_peer():
    pool = RolloutPool(PoolConfig(size=64, max_peer_share=0.25))  # every peer counts as proven: per-id shares only
    pool.add(message("honest", range(10), created=NOW), now=NOW)
    flood(pool, identities=6, per_identity=16, created=NOW + 1)
    assert [g.peer for g in pool.groups(now=NOW + 1)].count("honest") == 0
    assert pool.stats()["dropped"] == {"overflow": 106 - 64}


def test_a_full_pool_makes_room_at_the_expense_of_unproven_peers_first():
    proven = {"a", "b"}
    pool = RolloutPool(PoolConfig(size=8, max_peer_share=1.0, unproven_share=1.0), proven=lambda p: p in proven)
    pool.add(message("a", range(3), created=NOW), now=NOW)
    pool.add(message("new", range(3), created=NOW + 1), now=NOW + 1)
    pool.add(message("b", range(4), created=NOW + 2), now=NOW + 2)  # full: the newcomer gives way, not the oldest
    held = [g.peer for g in pool.groups(now=NOW + 2)]
    assert (held.count("a"), held.count("new"), held.count("b")) == (3, 1, 4)
    assert pool.stats()["dropped"] == {"overflow": 2}
