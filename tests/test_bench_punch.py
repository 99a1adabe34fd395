"""scripts/bench/bench_punch.py's bookkeeping: the share of attempts that punched, its interval, and the verdict of one
attempt from what its two probes reported. The attempts themselves run in the network lab (docs/bench/network.md)."""

from __future__ import annotations

import bench_punch as punch


def run(case: str, ok: bool, failed: int | None = None, seconds: float | None = 3.0) -> dict:
    return {"case": case, "ok": ok, "contact_to_direct_rollout_s": seconds if ok else None,
            "home0_punches_failed": failed, "home1_punches_failed": None}


def test_the_interval_of_a_share_holds_at_none_and_at_all_of_twenty():
    assert punch.wilson(0, 20) == (0.0, 0.161) and punch.wilson(20, 20) == (0.839, 1.0)
    low, high = punch.wilson(14, 20)
    assert low < 0.7 < high  # the field's 70% sits inside 14 of 20


def test_the_summary_counts_punched_attempts_those_at_the_first_punch_and_their_times():
    runs = [run("eim", True), run("eim", True, failed=2, seconds=27.0), run("eim", False), run("symmetric", False)]
    summary = punch.summary(runs)
    assert summary["eim"] | {"share_95ci": None} == {
        "attempts": 3, "direct": 2, "share": 0.667, "share_95ci": None, "direct_at_first_punch": 1,
        "contact_to_direct_rollout_s_median": 15.0, "contact_to_direct_rollout_s_max": 27.0}
    assert summary["symmetric"]["direct"] == 0 and summary["symmetric"]["contact_to_direct_rollout_s_median"] is None


def test_an_attempt_is_direct_once_a_peer_is_punched_and_none_is_relayed_and_given_up_after_three_failures():
    assert punch.is_direct({"punched_peers": 1, "relayed_peers": 0})
    assert not punch.is_direct({"punched_peers": 1, "relayed_peers": 1}) and not punch.is_direct({})
    assert punch.gave_up({"punches_failed": 2, "punches_refused": 1}) and not punch.gave_up({"punches_failed": 2})
    assert not punch.gave_up({"punches_failed": 3, "punches": 1})
