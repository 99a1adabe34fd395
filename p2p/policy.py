"""What a node accepts from the wire, kept apart from sockets: the gossip validator calls `check`.

A rejected message is not forwarded by GossipSub either, so bad traffic dies at the first honest hop.
Whether a group can teach anyone is the node's verifier's to say: the policy is handed that check
(`signal`) and parses no answer itself.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from typing import Callable

from p2p.config import Limits
from libp2p.peer.id import ID

from p2p.bucket import Buckets
from p2p.seen import SeenKeys
from p2p.shards import EPOCH_S, epoch_of, topics_problem
from p2p.wire import Rejected, WireGroup, WireMessage, decode


MAX_AUTHORS = 4096  # authors whose byte budget is remembered (a forgotten one starts with a full budget)


class MessagePolicy:
    def __init__(self, limits: Limits, topic_base: str, epoch_s: float = EPOCH_S, *,
                 signal: Callable[[WireGroup], bool]):
        self.limits = limits
        self.signal = signal  # whether a group's completions score differently (docs/PROTOCOL.md section 4)
        self.topic_base = topic_base
        self.epoch_s = epoch_s
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self._seen = SeenKeys(ttl=self.remember_s)  # sha256 of topic and message bytes
        self._charged = SeenKeys(ttl=self.remember_s)  # sha256 of message bytes: one charge for an author's copies
        rate = limits.max_author_kib_per_s * 1024  # a burst of two of the largest messages, or a second's worth
        self._budgets = Buckets(rate, max(rate, 2 * limits.max_message_bytes), MAX_AUTHORS)
        self._lock = threading.Lock()

    @property
    def remember_s(self) -> float:
        """Long enough that a replay is either remembered or already too old."""
        return self.limits.max_message_age_s + self.limits.max_clock_skew_s

    def check(self, data: bytes, author: str, topics: list[str], now: float | None = None) -> WireMessage:
        """Accept or raise `Rejected`; either way the outcome is counted. `author` is the libp2p signer,
        `topics` the topic ids the message was published under."""
        now = time.time() if now is None else now
        try:
            skew = self.limits.max_clock_skew_s  # the author's clock may sit in a neighbouring epoch
            epochs = sorted({epoch_of(now - skew, self.epoch_s), epoch_of(now + skew, self.epoch_s)})
            if problem := topics_problem(self.topic_base, topics, ID.from_base58(author).to_bytes(), epochs):
                raise Rejected("wrong_shard", problem)
            msg = self._check(data, author, topics[0], now)
        except Rejected as r:
            with self._lock:
                self.rejected[r.reason] += 1
            raise
        with self._lock:
            self.accepted += 1
        return msg

    def _check(self, data: bytes, author: str, topic: str, now: float) -> WireMessage:
        msg = decode(data, self.limits)
        if msg.peer != author:
            raise Rejected("sender_mismatch", f"payload names {msg.peer[:16]}…, signed by {author[:16]}…")
        if msg.created > now + self.limits.max_clock_skew_s:
            raise Rejected("from_future", f"created {msg.created - now:.0f} s ahead of this clock")
        if msg.created < now - self.limits.max_message_age_s:
            raise Rejected("too_old", f"created {now - msg.created:.0f} s ago")
        payload = hashlib.sha256(data).digest()
        digest = hashlib.sha256(topic.encode() + b"\0" + payload).digest()  # an author sends one copy per level
        with self._lock:
            self._seen.forget_expired(now)
            if digest in self._seen:
                raise Rejected("duplicate", "same bytes under the same topic seen before")
            self._seen.add(digest, now)
            self._charge(author, payload, len(data), now)
        if not any(map(self.signal, msg.groups)):
            # A group whose completions all score alike is worth nothing to any receiver; a message of
            # only such groups is not forwarded, so well-formed junk stops at the first honest hop instead
            # of costing every neighbour its decoding and re-scoring.
            raise Rejected("no_signal", f"none of its {len(msg.groups)} group(s) has completions that score "
                           "differently")
        return msg

    def _charge(self, author: str, payload: bytes, size: int, now: float) -> None:
        """Count the bytes against the author's budget, once per payload. Valid messages are forwarded to
        every mesh peer, so an author of long valid groups (the length flood: right answers padded to the
        limits) cost each node on its path CPU for every byte; past its budget it stops at the first hop."""
        self._charged.forget_expired(now)
        if payload in self._charged:
            return
        if not self._budgets[author].take_if_room(size, now):
            raise Rejected("over_budget", f"{size} bytes past the author's {self.limits.max_author_kib_per_s} KiB/s")
        self._charged.add(payload, now)

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"accepted": self.accepted, "rejected": dict(self.rejected)}

    def remembered(self) -> int:
        """Message hashes held for duplicate detection and single charging: bounded by time and count (the
        soak watches it)."""
        with self._lock:
            return len(self._seen) + len(self._charged)
