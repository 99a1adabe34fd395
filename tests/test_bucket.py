"""Token buckets (p2p/bucket.py): pacing that goes into debt, refusal that does not, and a bounded table."""

from __future__ import annotations

from p2p.bucket import Bucket, Buckets


def test_take_goes_into_debt_and_says_how_long_to_wait_while_take_if_room_refuses_without_spending():
    paced = Bucket(rate=100, capacity=200)
    assert paced.take(150, now=0.0) == 0.0
    assert paced.take(150, now=0.0) == 1.0  # 100 units short at 100 a second
    assert paced.take(0, now=1.0) == 0.0  # the debt is paid off by then
    capped = Bucket(rate=100, capacity=200)
    assert capped.take_if_room(150, now=0.0) and not capped.take_if_room(150, now=0.0)
    assert capped.take_if_room(150, now=1.0)  # 50 left, 100 refilled: the refusal spent nothing
    assert capped.take_if_room(200, now=100.0) and not capped.take_if_room(1, now=100.0)  # refills stop at the capacity


def test_buckets_keep_one_bucket_per_key_for_the_most_recent_keys_only():
    buckets = Buckets(rate=10, capacity=10, max_keys=2)
    assert buckets["a"].take_if_room(10, now=0.0) and not buckets["a"].take_if_room(1, now=0.0)
    for key in ("b", "c"):  # "a" is now the least recent: forgotten
        buckets[key].take(1, now=0.0)
    assert len(buckets) == 2
    assert buckets["a"].take_if_room(10, now=0.0)  # a forgotten key starts full again
