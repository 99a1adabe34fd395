"""Token buckets: the relay paces the bytes it forwards with them, the message policy caps the bytes one
author may have accepted, and a node paces its own messages to stay under that cap."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class Bucket:
    """`rate` units a second, holding at most `capacity` (one second's worth unless told); starts full."""

    def __init__(self, rate: float, capacity: float | None = None):
        self.rate = rate
        self.capacity = rate if capacity is None else capacity
        self.tokens, self.at = self.capacity, None

    def _refill(self, now: float) -> None:
        if self.at is not None:
            self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self, n: int, now: float) -> float:
        """Spend `n` units, going into debt if need be; the seconds to wait before using them."""
        self._refill(now)
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)

    def take_if_room(self, n: int, now: float) -> bool:
        """Spend `n` units only if the bucket holds them."""
        self._refill(now)
        if self.tokens < n:
            return False
        self.tokens -= n
        return True


class Buckets:
    """A bucket per key, for the `max_keys` keys used most recently (a forgotten key starts full again).
    Not locked: its one owner serialises access."""

    def __init__(self, rate: float, capacity: float | None = None, max_keys: int = 1024):
        self.rate, self.capacity, self.max_keys = rate, capacity, max_keys
        self._buckets: OrderedDict[Hashable, Bucket] = OrderedDict()  # the most recent last

    def __getitem__(self, key: Hashable) -> Bucket:
        bucket = self._buckets.pop(key, None) or Bucket(self.rate, self.capacity)
        self._buckets[key] = bucket
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return bucket

    def __len__(self) -> int:
        return len(self._buckets)
