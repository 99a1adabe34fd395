"""Rollout topic shards (protocols 2 and 3): a node's gossip cost is bounded by the authors of its shard,
not by the size of the swarm.

A peer's shard at level L is the first L bits of its shard key, sha256 of the epoch number and its peer
id. The keys are redrawn every epoch (the network's `shard_epoch_s`, 30 minutes by default), so a node
hears a different set of peers each epoch and, over a day, a wide sample of the swarm. An author
publishes each payload under its shard's topics at levels L-1, L and L+1, as one GossipSub message per
topic (protocol 2 put the three topic ids in one message, which only py-libp2p can sign and verify:
the pubsub message of go-, rust- and js-libp2p has a single topic); a receiver subscribes to its shard
at its own level L. Neighbouring shards
whose nodes sit one level apart therefore still hear each other, and no one needs to agree on a level:
each node picks its own from the authors it hears (`ShardLevel`). Level 0 is one topic for the whole
swarm, which is how protocol 1 disseminated.

Which topics a message may name is a function of its signer's peer id and the epoch, so no author can
publish into a shard that is not its own (short of grinding a peer id for each epoch, which buys it
nothing the pool's unproven-peer quota does not already cap).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

MAX_LEVEL = 24  # 16 million shards: far beyond any swarm this protocol expects
MAX_PROBES = 2  # hinted levels listened to at once, beside our own
PROBE_AGAIN_WINDOWS = 5  # a level probed in vain is not probed again for this many windows
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
    """`/sapo/<network>/rollouts/<protocol>/s<bits>`: `s` alone is level 0."""
    return f"{base}/s{prefix(key, level)}"


def publish_topics(base: str, key: bytes, level: int) -> list[str]:
    """The topics an author at `level` publishes each payload under, one GossipSub message each."""
    return [shard_topic(base, key, lv) for lv in (level - 1, level, level + 1) if 0 <= lv <= MAX_LEVEL]


def topic_level(base: str, topic: str) -> int | None:
    """The level of a shard topic of this network and protocol, else None."""
    head, _, bits = topic.rpartition("/s")
    if head != base or len(bits) > MAX_LEVEL or bits.strip("01"):
        return None
    return len(bits)


def topics_problem(base: str, topics: Sequence[str], author: bytes, epochs: Iterable[int]) -> str | None:
    """Why a message may not carry these topic ids, or None: exactly one, a shard of its author (peer id
    bytes) at some level, in one of `epochs`."""
    if len(topics) != 1:
        return f"names {len(topics)} topics (one is due)"
    level = topic_level(base, topics[0])
    if level is None:
        return f"names {topics[0]!r}, not a rollout shard of this network"
    if not any(topics[0] == shard_topic(base, shard_key(author, e), level) for e in epochs):
        return f"names shard {topics[0]}, not its author's in this epoch"
    return None


@dataclass
class ShardLevel:
    """The level a node listens at, chosen only from authors it has heard with valid rollouts, never
    from what peers say about themselves (a subscription costs nothing to fake).

    An author counts at a level when its shard there is ours and it was heard within `window_s` on our
    topic at that level or one level away (it publishes at L-1, L and L+1); the node itself counts. The node
    moves deeper while its shard holds `split_authors` and the child shard `min_authors` (at most one
    level beyond where it heard its authors, so a deeper move waits for them to follow), and one level
    shallower after a full window with fewer than `min_authors`. The shards its connected peers
    subscribe to that contain its key, two or more levels away, are only hints of where to look: it
    *probes* up to `MAX_PROBES` of them (listens there for one window, each level at most once every
    `PROBE_AGAIN_WINDOWS`). While its own shard holds fewer than `min_authors` it takes at once a probed
    level whose shard holds that many, and after a full window the probed level that holds the most
    authors, if more than its own. That is how a newcomer finds a deep swarm, how a node rejoins
    neighbours that moved out of its earshot, and how a move made on authors who then fall silent is
    undone within about one window. A lie costs the liar nothing and the node one subscription for one
    window. With `useful` (a training node's: whether this node's own selection has proven the author) only
    authors whose groups it used count, itself included: six ids ground into a node's level-8 shard (about
    2^L key generations each, per epoch), each publishing one valid message every few seconds, pulled a
    3-node swarm's node to level 8 in 9 s and held it there, its honest groups cut from 4 a round to 0.1. A
    bootstrap-only node, which uses nothing, counts every author with valid rollouts. Authors count by the
    network group of the connection that vouches for them (`hear`): the author's own when it is connected to
    us, else the one its message came over. While an author that was not connected counted alone, twelve ids
    ground into a node's level-8 shard, whose messages all came over one connection of a thirteenth id, took
    it to level 8 in 27 s and held it. An honest shard's authors are connected to each other (a node dials
    the peers nearest its shard key first) or reach it through neighbours that are shard authors themselves,
    so their count is unchanged (`scripts/bench/simulate_swarm.py` models it). `pinned`
    fixes the level (0 floods every rollout to every node, as protocol 1 did). A new epoch moves the
    node to its new shard at the same level and starts its hearing over."""

    peer: bytes  # this node's peer id
    epoch_s: float
    epoch: int
    min_authors: int
    split_authors: int
    window_s: float
    pinned: int | None = None
    level: int = 0
    since: float | None = None  # when this level was taken: a full window is heard before it widens
    heard: dict[tuple[bytes, int], float] = field(default_factory=dict)  # (author, level heard at) -> last heard
    groups: dict[bytes, Hashable] = field(default_factory=dict)  # author -> the network group that vouched for it last
    probes: dict[int, float] = field(default_factory=dict)  # level probed -> when the probe started
    probed: dict[int, float] = field(default_factory=dict)  # level -> when its last probe started
    useful: Callable[[bytes], bool] | None = field(default=None, repr=False)  # which authors count; None: all

    def __post_init__(self) -> None:
        if self.pinned is not None:
            self.level = self.pinned

    @property
    def key(self) -> bytes:
        return shard_key(self.peer, self.epoch)

    def key_of(self, peer: bytes) -> bytes:
        return shard_key(peer, self.epoch)

    def hear(self, author: bytes, now: float, level: int, group: Hashable | None = None) -> None:
        """A valid message of `author`, heard on our shard's topic at `level` (it publishes within one
        level of it). `group`: the network group of the connection that vouches for it, the author's own when
        it is connected to us, else the one its message arrived over; authors of one group count once
        (GossipSub v1.1's IP colocation, P6), since peer ids are free and forwarding is too. None: no
        connection known, the author counts as itself."""
        self.heard[author, level] = now
        if group is not None:
            self.groups[author] = group
        else:
            self.groups.pop(author, None)

    def authors(self, now: float, level: int) -> int:
        """Authors (self included) heard within the window that the topic of our shard at `level` hears, those
        of one network group counted once."""
        mine = prefix(self.key, level)
        return 1 + len({self.groups.get(p, p) for (p, lv), t in self.heard.items()
                        if t >= now - self.window_s and abs(lv - level) <= 1
                        and (level == 0 or prefix(self.key_of(p), level) == mine)
                        and (self.useful is None or self.useful(p))})

    def update(self, now: float, hinted: Iterable[int] = ()) -> bool:
        """Re-decide the epoch, the level and the probes; True when the shard changed. `hinted`: the
        levels at which connected peers subscribe to a shard of ours (unverified)."""
        self._forget(now)
        if epoch_of(now, self.epoch_s) != self.epoch:
            self.epoch, self.since = epoch_of(now, self.epoch_s), now
            self.heard.clear()  # heard in the old shard: they count nowhere now
            self.groups.clear()
            self.probes.clear()
            self.probed.clear()  # the new shards are other peers' too: any level may be probed again
            return True
        if self.pinned is not None:
            return False
        if self.since is None:
            self.since = now
        self._probe(now, hinted)
        here = self.authors(now, self.level)
        heard_there = [lv for lv, t in self.probed.items() if now - t < 2 * self.window_s]  # a window of probing
        louder = sorted((self.authors(now, lv), lv) for lv in heard_there if self.authors(now, lv) > here)
        if here >= self.split_authors:
            target = self._deepest_split(now)
        elif here < self.min_authors and louder and louder[-1][0] >= self.min_authors:
            target = louder[-1][1]  # at once: a probe found a shard that holds enough authors
        elif here < self.min_authors and now - self.since >= self.window_s:
            target = louder[-1][1] if louder else max(0, self.level - 1)  # the best we heard, else wider
        else:
            return False
        if target == self.level:
            return False
        self.probes.pop(target, None)
        self.level, self.since = target, now
        return True

    def _forget(self, now: float) -> None:
        """Authors not heard within the window, and their groups."""
        for k in [k for k, t in self.heard.items() if t < now - self.window_s]:
            del self.heard[k]
        for author in set(self.groups) - {p for p, _ in self.heard}:
            del self.groups[author]

    def _probe(self, now: float, hinted: Iterable[int]) -> None:
        """End probes that listened a full window; start probes of hinted levels out of earshot."""
        for p in [p for p, t in self.probes.items() if now - t >= self.window_s]:
            del self.probes[p]
        counts = Counter(lv for lv in hinted if abs(lv - self.level) >= 2 and lv not in self.probes
                         and now - self.probed.get(lv, -math.inf) >= PROBE_AGAIN_WINDOWS * self.window_s)
        for lv, _ in counts.most_common(MAX_PROBES - len(self.probes)):
            self.probes[lv] = self.probed[lv] = now

    def _deepest_split(self, now: float) -> int:
        """Split as many levels at once as the heard authors allow; an author counts only within one
        level of the topic it was heard on, so this goes at most one level beyond the deepest of those."""
        level = self.level
        while level < MAX_LEVEL and self.authors(now, level) >= self.split_authors \
                and self.authors(now, level + 1) >= self.min_authors:
            level += 1
        return level
