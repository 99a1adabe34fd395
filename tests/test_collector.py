"""The seconds Python's collector runs, counted for the round's metrics (node/collector.py)."""

from __future__ import annotations

import gc

from node import collector


def test_the_clock_counts_the_seconds_of_every_collection():
    before = collector.seconds()
    for _ in range(3):
        gc.collect()
    assert collector.seconds() > before

