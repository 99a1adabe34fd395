"""`DecayedRates`: hits over trials per key, decayed each round: what the selection learns about peers and
task families, bounded in keys and saved in checkpoints as plain lists."""

from __future__ import annotations


class DecayedRates:
    """Hits over trials per key, both decayed each round, for a bounded number of keys."""

    def __init__(self, max_keys: int):
        self.max_keys = max_keys
        self.counts: dict[str, list[float]] = {}  # key -> [hits, trials, last round seen]

    def beta(self, key: str) -> tuple[float, float]:
        """A Beta(1, 1) prior updated with the decayed counts."""
        hits, trials, _ = self.counts.get(key, (0.0, 0.0, 0))
        return 1 + hits, 1 + trials - hits

    def add(self, key: str, hits: float, trials: float, round_: int) -> None:
        entry = self.counts.setdefault(key, [0.0, 0.0, round_])
        entry[0] += hits
        entry[1] += trials
        entry[2] = round_
        if len(self.counts) > self.max_keys:
            del self.counts[min(self.counts, key=lambda k: self.counts[k][2])]

    def decay(self, factor: float) -> None:
        for entry in self.counts.values():
            entry[0] *= factor
            entry[1] *= factor
