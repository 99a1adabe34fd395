"""The seconds Python's cyclic garbage collector runs, for each round's metrics (`seconds_gc`).

A loaded node holds torch, transformers and libp2p: over 400,000 objects the collector tracks, and a full collection
walks every one of them (0.1-0.3 s on 2 cores, as long as a tiny model's whole round). Whether that ever sets a
node's pace is a measurement, not a guess: the clock counts every collection in the process, whichever thread set
it off (docs/bench/speed.md: in the demo it came to 0.2-0.3 ms a round, with or without freezing the loaded objects
out of the walk, so the node leaves the collector as Python sets it).
"""

from __future__ import annotations

import gc
import time


class _Clock:
    """The collector's seconds in this process, through `gc.callbacks` (a collection's start and stop come under
    the GIL, so two never interleave): one per process, since the collector is."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total += time.perf_counter() - self._started
            self._started = None


_clock = _Clock()
gc.callbacks.append(_clock)


def seconds() -> float:
    """The seconds the collector has run in this process since the node's modules were imported."""
    return _clock.total
