"""Python's collector kept from setting the node's pace (node/collector.py)."""

from __future__ import annotations

import gc
import weakref

from node import collector


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_clock_counts_the_seconds_of_every_collection():
    before = collector.seconds()
    for _ in range(3):
        gc.collect()
    assert collector.seconds() > before


def test_a_frozen_object_is_walked_by_no_later_collection_and_a_new_one_still_is():
    loaded = Cycle()
    held = weakref.ref(loaded)
    try:
        assert collector.freeze_loaded() > 0
        del loaded  # garbage only the collector could free: frozen, nothing walks it now
        fresh = Cycle()
        gone = weakref.ref(fresh)
        del fresh
        gc.collect()
        assert held() is not None and gone() is None
    finally:
        gc.unfreeze()
    gc.collect()
    assert held() is None
