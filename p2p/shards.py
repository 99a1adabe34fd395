"""Rollout topic shards (protocol 2): a node's gossip cost is bounded by the authors of its shard, not
by the size of the swarm.

A peer's shard at level L is the first L bits of its Kademlia key, sha256(peer id bytes), so the peers
of a shard are exactly the XOR-closest peers that a DHT lookup of one's own key finds. An author
publishes each message once, under its shard's topics at levels L-1, L and L+1 (one GossipSub message
carrying three topic ids); a receiver subscribes to its shard at its own level L. Neighbouring shards
whose nodes sit one level apart therefore still hear each other, and no one needs to agree on a level:
each node picks its own from the authors it hears (`ShardLevel`). Level 0 is one topic for the whole
swarm, which is how protocol 1 disseminated.

Which topics a message may name is a function of its signer's peer id, so no author can publish into a
shard that is not its own (short of grinding peer ids, which buys it nothing the pool's unproven-peer
quota does not already cap).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_LEVEL = 24  # 16 million shards: far beyond any swarm this protocol expects
MAX_TOPICS = 3  # levels L-1, L, L+1


def peer_key(peer_id: bytes) -> bytes:
    """The peer's Kademlia key (as py-libp2p's routing table computes it)."""
    return hashlib.sha256(peer_id).digest()


def prefix(key: bytes, level: int) -> str:
    return format(int.from_bytes(key[:4], "big"), "032b")[:level]


def shared_bits(a: bytes, b: bytes) -> int:
    """How many leading key bits two peers share: the deepest level at which they are in one shard."""
    return 32 - (int.from_bytes(a[:4], "big") ^ int.from_bytes(b[:4], "big")).bit_length()


def shard_topic(base: str, key: bytes, level: int) -> str:
    """`/sapo/<network>/rollouts/2/s<bits>`: `s` alone is level 0."""
    return f"{base}/s{prefix(key, level)}"


def publish_topics(base: str, key: bytes, level: int) -> list[str]:
    return [shard_topic(base, key, lv) for lv in (level - 1, level, level + 1) if 0 <= lv <= MAX_LEVEL]


def topic_level(base: str, topic: str) -> int | None:
    """The level of a shard topic of this network and protocol, else None."""
    head, _, bits = topic.rpartition("/s")
    if head != base or len(bits) > MAX_LEVEL or bits.strip("01"):
        return None
    return len(bits)


def topics_problem(base: str, topics: Iterable[str], author_key: bytes) -> str | None:
    """Why a message may not carry these topic ids, or None: each must be a shard of its author."""
    topics = list(topics)
    if len(topics) > MAX_TOPICS:
        return f"names {len(topics)} topics (at most {MAX_TOPICS})"
    for t in topics:
        level = topic_level(base, t)
        if level is None:
            return f"names {t!r}, not a rollout shard of this network"
        if t != shard_topic(base, author_key, level):
            return f"names shard {t!r}, which is not its author's"
    return None


@dataclass
class ShardLevel:
    """The level a node listens at, chosen from what it hears: deeper while its shard holds
    `split_authors` or more authors and the child shard it would move to holds at least `min_authors`,
    shallower when fewer than `min_authors` are heard. Authors count when heard within `window_s`
    (longer than the slowest peer's round); the node itself counts. A node that has not yet listened
    a full window takes the median level of its neighbours, so a newcomer to a large swarm starts where
    the swarm is instead of climbing one window per level. `pinned` fixes the level (0 floods every
    rollout to every node, as protocol 1 did)."""

    key: bytes
    min_authors: int
    split_authors: int
    window_s: float
    pinned: int | None = None
    level: int = 0
    started: float | None = None  # the first update
    since: float = 0.0  # when this level was taken: a full window is heard before the counts move it
    heard: dict[bytes, float] = field(default_factory=dict)  # author key -> last heard on our shard

    def __post_init__(self) -> None:
        if self.pinned is not None:
            self.level = self.pinned

    def hear(self, author_key: bytes, now: float) -> None:
        self.heard[author_key] = now

    def authors(self, now: float, level: int) -> int:
        """Authors (self included) heard within the window whose key lies in our shard at `level`."""
        mine = prefix(self.key, level)
        return 1 + sum(1 for k, t in self.heard.items() if t >= now - self.window_s and prefix(k, level) == mine)

    def update(self, now: float, neighbour_levels: list[int]) -> bool:
        """Re-decide the level; True when it changed."""
        for k in [k for k, t in self.heard.items() if t < now - self.window_s]:
            del self.heard[k]
        if self.pinned is not None:
            return False
        if self.started is None:
            self.started = self.since = now
        if now - self.started < self.window_s:
            if not neighbour_levels:
                return False
            target = min(MAX_LEVEL, int(statistics.median_low(neighbour_levels)))
        elif now - self.since < self.window_s:
            return False
        elif self.authors(now, self.level) >= self.split_authors and self.level < MAX_LEVEL \
                and self.authors(now, self.level + 1) >= self.min_authors:
            target = self.level + 1
        elif self.authors(now, self.level) < self.min_authors and self.level > 0:
            target = self.level - 1
        else:
            return False
        if target == self.level:
            return False
        self.level, self.since = target, now
        return True
