"""Keys remembered for a fixed time and up to a fixed count: the duplicate memory of the message
policy (hashes of message bytes) and of the pool (group keys), and the discovery loop's backoff and
logged-once tables. Not locked: its one owner serialises access (a lock, or a single trio task)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

MAX_KEYS = 200_000


class SeenKeys:
    def __init__(self, ttl: float, max_keys: int = MAX_KEYS):
        self.ttl = ttl
        self.max_keys = max_keys
        self._expiry: OrderedDict[Hashable, float] = OrderedDict()  # insertion order is expiry order: fixed TTL

    def __contains__(self, key: Hashable) -> bool:
        return key in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)

    def forget_expired(self, now: float) -> None:
        while self._expiry and next(iter(self._expiry.values())) < now:
            self._expiry.popitem(last=False)

    def add(self, key: Hashable, now: float) -> None:
        """Remember `key` for `ttl` from `now`; a key seen again is kept from its latest sighting."""
        self._expiry.pop(key, None)  # to the end: a re-added key left in place would break the expiry order
        while len(self._expiry) >= self.max_keys:  # past the cap, the oldest go first
            self._expiry.popitem(last=False)
        self._expiry[key] = now + self.ttl
