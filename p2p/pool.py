"""The bounded pool of rollout groups received from other peers.

Bounded three ways: total size, each peer's share (a chatty or hostile peer cannot crowd out the
others), and age (old groups come from policies long gone). Every group that leaves without being
taken is counted under a reason. Which groups a node takes is its own policy (`node.selection`).

Peer ids cost nothing, so a share per peer id alone lets six fresh identities crowd out an honest peer.
The node therefore tells the pool which peers are *proven* (their groups have carried learning signal
here recently; `node.selection` keeps that statistic): unproven peers, however many, hold at most
`unproven_share` of the pool together (fairly among themselves: the one holding most gives way), and a
full pool makes room at the expense of unproven peers before it evicts any proven peer's group.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from p2p.config import PoolConfig
from p2p.seen import SeenKeys
from p2p.wire import WireGroup, WireMessage

DROP_REASONS = ("duplicate", "stale", "peer_quota", "unproven_quota", "overflow")


@dataclass(frozen=True)
class PooledGroup:
    peer: str
    model: str
    round: int
    created: float
    group: WireGroup
    key: str


class RolloutPool:
    def __init__(self, cfg: PoolConfig, proven: Callable[[str], bool] = lambda peer: True):
        self.cfg = cfg
        self.proven = proven  # called on the gossip thread: must be cheap and thread-safe
        self.received = 0
        self.accepted = 0
        self.sampled = 0
        self.dropped: Counter[str] = Counter()
        self._by_peer: dict[str, deque[PooledGroup]] = {}
        self._size = 0
        self._seen = SeenKeys(ttl=cfg.max_age_s)  # group keys, remembered after the group leaves the pool
        self._lock = threading.Lock()

    @property
    def peer_quota(self) -> int:
        return max(1, int(self.cfg.size * self.cfg.max_peer_share))

    @property
    def unproven_quota(self) -> int:
        return max(1, int(self.cfg.size * self.cfg.unproven_share))

    def __len__(self) -> int:
        return self._size

    def add(self, msg: WireMessage, now: float | None = None) -> int:
        """Offer a message's groups; returns how many were accepted."""
        now = time.time() if now is None else now
        added = 0
        with self._lock:
            self._expire(now)
            queue = self._by_peer.setdefault(msg.peer, deque())
            proven = {peer: self.proven(peer) for peer in self._by_peer}
            unproven = [q for p, q in self._by_peer.items() if not proven[p]]
            for g in msg.groups:
                self.received += 1
                key = g.key()
                if key in self._seen:
                    self.dropped["duplicate"] += 1
                    continue
                if msg.created < now - self.cfg.max_age_s:
                    self.dropped["stale"] += 1
                    continue
                self._seen.add(key, now)
                held = sum(map(len, unproven))
                if len(queue) >= self.peer_quota:
                    self._pop(queue, "peer_quota")
                elif not proven[msg.peer] and held >= self.unproven_quota:
                    self._pop(max(unproven, key=len), "unproven_quota")
                elif self._size >= self.cfg.size:
                    victim = max(unproven, key=len) if held else min((q for q in self._by_peer.values() if q),
                                                                      key=lambda q: q[0].created)
                    self._pop(victim, "overflow")
                queue.append(PooledGroup(msg.peer, msg.model, msg.round, float(msg.created), g, key))
                self._size += 1
                self.accepted += 1
                added += 1
        return added

    def groups(self, now: float | None = None) -> list[PooledGroup]:
        """What the pool holds now, stale groups expired first."""
        now = time.time() if now is None else now
        with self._lock:
            self._expire(now)
            return [g for q in self._by_peer.values() for g in q]

    def take(self, group: PooledGroup) -> bool:
        """Remove `group` for use; False if it left the pool since `groups()` listed it."""
        with self._lock:
            queue = self._by_peer.get(group.peer, ())
            at = next((i for i, g in enumerate(queue) if g.key == group.key), None)
            if at is None:
                return False
            del queue[at]
            self._size -= 1
            self.sampled += 1
            return True

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"size": self._size, "peers": sum(1 for q in self._by_peer.values() if q), "received": self.received,
                    "accepted": self.accepted, "sampled": self.sampled, "dropped": dict(self.dropped), "seen": len(self._seen)}

    def _pop(self, queue: deque[PooledGroup], reason: str) -> None:
        queue.popleft()
        self._size -= 1
        self.dropped[reason] += 1

    def _expire(self, now: float) -> None:
        self._seen.forget_expired(now)
        horizon = now - self.cfg.max_age_s
        for peer, queue in list(self._by_peer.items()):
            while queue and queue[0].created < horizon:
                self._pop(queue, "stale")
            if not queue:
                del self._by_peer[peer]
