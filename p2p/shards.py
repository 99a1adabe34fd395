"""Rollout topic shards (protocol 2): a node's gossip cost is bounded by the authors of its shard, not
by the size of the swarm.

A peer's shard at level L is the first L bits of its shard key, sha256 of the epoch number and its peer
id. The keys are redrawn every epoch (the network's `shard_epoch_s`, 30 minutes by default), so a node
hears a different set of peers each epoch and, over a day, a wide sample of the swarm. An author
publishes each message once, under its shard's topics at levels L-1, L and L+1 (one GossipSub message
carrying three topic ids); a receiver subscribes to its shard at its own level L. Neighbouring shards
whose nodes sit one level apart therefore still hear each other, and no one needs to agree on a level:
each node picks its own from the authors it hears (`ShardLevel`). Level 0 is one topic for the whole
swarm, which is how protocol 1 disseminated.

Which topics a message may name is a function of its signer's peer id and the epoch, so no author can
publish into a shard that is not its own (short of grinding a peer id for each epoch, which buys it
nothing the pool's unproven-peer quota does not already cap).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_LEVEL = 24  # 16 million shards: far beyond any swarm this protocol expects
MAX_TOPICS = 3  # levels L-1, L, L+1
EPOCH_S = 1800  # the default shard epoch of a network profile


def epoch_of(t: float, epoch_s: float) -> int:
    return int(t // epoch_s)


def shard_key(peer_id: bytes, epoch: int) -> bytes:
    """The peer's position among the shards during `epoch`."""
    return hashlib.sha256(b"sapo-shard/%d/" % epoch + peer_id).digest()


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


def topics_problem(base: str, topics: Iterable[str], author: bytes, epochs: Iterable[int]) -> str | None:
    """Why a message may not carry these topic ids, or None: each must be a shard of its author (peer id
    bytes) in one of `epochs`, the same for all."""
    topics = list(topics)
    if len(topics) > MAX_TOPICS:
        return f"names {len(topics)} topics (at most {MAX_TOPICS})"
    levels = [topic_level(base, t) for t in topics]
    if None in levels:
        return f"names {topics[levels.index(None)]!r}, not a rollout shard of this network"
    keys = [shard_key(author, e) for e in epochs]
    if not any(all(t == shard_topic(base, k, lv) for t, lv in zip(topics, levels)) for k in keys):
        return f"names shards {', '.join(topics)}, not all its author's in this epoch"
    return None


@dataclass
class ShardLevel:
    """The level a node listens at, chosen from what it hears: deeper while its shard holds
    `split_authors` or more authors and the child shard it would move to holds at least `min_authors`
    (as soon as it hears them, several levels at once when the heard authors allow), shallower when
    fewer than `min_authors` were heard for a full window, unless its neighbours listen two or more
    levels deeper, out of its earshot, where it then rejoins them. Authors count when heard within
    `window_s` (longer than the slowest peer's round); the node itself counts. A node that has not yet
    listened a full window takes the median level of its neighbours, so a newcomer to a large swarm
    starts where the swarm is. `pinned` fixes the level (0 floods every rollout to every node, as
    protocol 1 did). A new epoch moves the node to its new shard at the same level and starts its
    hearing over."""

    peer: bytes  # this node's peer id
    epoch_s: float
    epoch: int
    min_authors: int
    split_authors: int
    window_s: float
    pinned: int | None = None
    level: int = 0
    started: float | None = None  # the first update
    since: float = 0.0  # when this level was taken: a full window is heard before the counts move it
    heard: dict[bytes, float] = field(default_factory=dict)  # author peer id -> last heard on our shard

    def __post_init__(self) -> None:
        if self.pinned is not None:
            self.level = self.pinned

    @property
    def key(self) -> bytes:
        return shard_key(self.peer, self.epoch)

    def key_of(self, peer: bytes) -> bytes:
        return shard_key(peer, self.epoch)

    def hear(self, author: bytes, now: float) -> None:
        self.heard[author] = now

    def authors(self, now: float, level: int) -> int:
        """Authors (self included) heard within the window whose key lies in our shard at `level`."""
        mine = prefix(self.key, level)
        return 1 + sum(1 for p, t in self.heard.items()
                       if t >= now - self.window_s and (level == 0 or prefix(self.key_of(p), level) == mine))

    def update(self, now: float, neighbour_levels: list[int]) -> bool:
        """Re-decide the epoch and the level; True when the shard changed."""
        for k in [k for k, t in self.heard.items() if t < now - self.window_s]:
            del self.heard[k]
        if epoch_of(now, self.epoch_s) != self.epoch:
            self.epoch, self.since = epoch_of(now, self.epoch_s), now
            self.heard.clear()  # heard in the old shard: they count nowhere now
            return True
        if self.pinned is not None:
            return False
        if self.started is None:
            self.started = self.since = now
        median = min(MAX_LEVEL, int(statistics.median_low(neighbour_levels))) if neighbour_levels else None
        joining = now - self.started < self.window_s
        if joining and median is not None and median != self.level:
            target = median
        elif self.authors(now, self.level) >= self.split_authors:
            target = self._deepest_split(now)  # at once: counts only grow within a window
        elif not joining and now - self.since >= self.window_s and self.authors(now, self.level) < self.min_authors:
            # Starved for a full window: rejoin the neighbours if they listen out of its earshot, two or
            # more levels deeper (it missed their move), else widen the shard by one level.
            target = median if median is not None and median > self.level + 1 else max(0, self.level - 1)
        else:
            return False
        if target == self.level:
            return False
        self.level, self.since = target, now
        return True

    def _deepest_split(self, now: float) -> int:
        """Split as many levels at once as the heard authors allow (every author of a deeper shard is
        heard at this one), so a swarm that starts at level 0 reaches its depth within a round."""
        level = self.level
        while level < MAX_LEVEL and self.authors(now, level) >= self.split_authors \
                and self.authors(now, level + 1) >= self.min_authors:
            level += 1
        return level
