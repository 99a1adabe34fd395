"""Python's cyclic garbage collector, kept from setting the node's pace.

A loaded node holds torch, transformers and libp2p: over 400,000 objects the collector tracks, and a full collection
walks every one of them (0.1-0.3 s on 2 cores, as long as a tiny model's whole round). How often a full collection
comes depends on how many new objects survive, which the swarm's pool and the round's work move from hour to hour.
Freezing what the node holds once it has loaded (CPython's `gc.freeze`) takes those objects out of every later walk;
what the node allocates afterwards is collected as before. The collector's seconds are counted for each round's
metrics (`seconds_gc`), whichever thread set it off.
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


def freeze_loaded() -> int:
    """Collect what loading left behind, then move every surviving object out of later collections; the number
    frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
