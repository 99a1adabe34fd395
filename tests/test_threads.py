"""The node's torch threads follow the cores other work leaves free, round after round."""

from __future__ import annotations

from node.threads import ThreadGovernor, machine_busy_s


class Machine:
    """A 2-core machine whose other work uses `others` cores while the node uses `own`."""

    def __init__(self):
        self.t, self.busy, self.mine = 0.0, 0.0, 0.0

    def run(self, seconds: float, others: float, own: float) -> None:
        self.t += seconds
        self.busy += (others + own) * seconds
        self.mine += own * seconds


def governor(m: Machine, set_to: list[int]) -> ThreadGovernor:
    return ThreadGovernor(set_to.append, cores=2, machine=lambda: m.busy, own=lambda: m.mine, clock=lambda: m.t)


def test_busy_neighbours_take_a_thread_and_give_it_back_when_they_stop():
    m, set_to = Machine(), []
    g = governor(m, set_to)
    g.start()
    m.run(10, others=0.0, own=2.0)
    assert g.after_round() == 2 and set_to == []  # idle cores: torch's own count stands
    m.run(10, others=1.0, own=1.0)  # two busy loops beside the node's two threads: a core's worth each
    assert g.after_round() == 1 and set_to == [1]
    m.run(10, others=1.33, own=0.67)
    assert g.after_round() == 1 and set_to == [1]  # still busy: no change, nothing said
    m.run(10, others=0.1, own=1.0)  # the neighbours stopped: a shell's worth of other work
    assert g.after_round() == 2 and set_to == [1, 2]


def test_one_neighbour_on_two_cores_leaves_one_thread_and_never_none():
    m, set_to = Machine(), []
    g = governor(m, set_to)
    g.start()
    m.run(5, others=0.67, own=1.33)
    assert g.after_round() == 1
    m.run(5, others=2.0, own=0.0)  # a machine taken whole: one thread still
    assert g.after_round() == 1 and set_to == [1]


def test_no_window_no_change():
    set_to = []
    g = ThreadGovernor(set_to.append, cores=4, machine=lambda: None)  # not Linux: torch's own choice stands
    g.start()
    assert g.after_round() == 4 and set_to == []
    m = Machine()
    g = governor(m, set_to)
    assert g.after_round() == 2  # before start(): nothing measured yet


def test_the_machine_counter_reads_this_linux_machine():
    first = machine_busy_s()
    assert first is not None and first > 0


def test_a_node_started_beside_busy_programs_settles_before_its_first_round(monkeypatch):
    import node.threads as threads

    m, set_to = Machine(), []
    g = governor(m, set_to)
    monkeypatch.setattr(threads.time, "sleep", lambda s: m.run(s, others=1.8, own=0.0))
    assert g.settle() == 1 and set_to == [1]


def test_the_contention_bench_gives_each_checkout_its_share_of_its_own_idle_pace():
    import bench_contention

    runs = [{"code": c, "busy": b, "rounds_per_minute": rpm, "generated_tokens_per_s": 10 * rpm}
            for c, b, rpm in (("old", 0, 24.0), ("old", 2, 3.5), ("new", 0, 25.0), ("new", 2, 11.0), ("new", 2, 9.0))]
    rows = {(r["code"], r["busy"]): r for r in bench_contention.summary(runs)}
    assert rows["old", 2]["share_of_idle"] == 3.5 / 24.0 and rows["old", 0]["share_of_idle"] == 1.0
    assert rows["new", 2]["rounds_per_minute"] == 10.0 and rows["new", 2]["share_of_idle"] == 0.4 and rows["new", 2]["n"] == 2
    partial = bench_contention.summary(runs[:3])  # written after every measurement: a checkout not yet measured busy
    assert [(r["code"], r["busy"]) for r in partial] == [("old", 0), ("old", 2), ("new", 0)]
