"""How many CPU threads the node's torch uses, chosen from the cores other work leaves it, round after round.

torch's intra-op threads meet at a barrier after each operation: when one is descheduled because another program
wants the core, the rest wait for it. On 2 cores beside two busy loops a SmolLM2 round with 2 threads ran 6.9 times
slower than on idle cores, where a fair share would cost about 2x. So after each round the node measures the cores the
rest of the machine used meanwhile (the machine's busy CPU time, less its own, over the round's wall time) and takes
what is left, at least one thread and at most the cores it may run on. A user's `run.torch_threads` is kept as set.
Linux only (it reads /proc/stat); elsewhere torch's own choice stands.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MARGIN = 0.25  # cores of other work tolerated before a thread is given up (a shell, the gossip thread, the kernel)


def machine_cpu_s() -> tuple[float, float] | None:
    """CPU seconds the whole machine has spent so far busy (user, nice, system, irq, softirq) and stolen by the
    hypervisor; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS


def machine_busy_s() -> float | None:
    """CPU seconds the machine's cores have not been free to this node: busy, and stolen by the hypervisor."""
    cpu = machine_cpu_s()
    return None if cpu is None else sum(cpu)


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class ThreadGovernor:
    """Sets torch's thread count after each round from the cores other programs used during it."""

    set_threads: Callable[[int], None]
    cores: int = field(default_factory=usable_cores)
    machine: Callable[[], float | None] = machine_busy_s
    own: Callable[[], float] = own_cpu_s
    clock: Callable[[], float] = time.monotonic
    threads: int = 0
    _last: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        self.threads = self.threads or self.cores

    def settle(self, seconds: float = 0.25) -> int:
        """Before the first round: the cores other work uses while this node sleeps for `seconds`, so that a node
        started beside busy programs does not spend its first round finding out."""
        before = self.machine()
        if before is None:
            return self.threads
        time.sleep(seconds)
        return self._choose(max(0.0, (self.machine() or before) - before) / seconds)

    def _choose(self, others: float) -> int:
        wanted = max(1, min(self.cores, int(self.cores - others + MARGIN)))
        if wanted != self.threads:
            log.info("other work uses %.1f of %d cores: torch goes on with %d thread(s) (was %d)", others, self.cores,
                     wanted, self.threads)
            self.threads = wanted
            self.set_threads(wanted)
        return self.threads

    def start(self) -> None:
        """Begin the first window (the loading and the first evaluation are not a round's)."""
        busy = self.machine()
        self._last = None if busy is None else (busy, self.own(), self.clock())

    def after_round(self) -> int:
        """The thread count for the next round: the cores the rest of the machine left free during this one."""
        busy = self.machine()
        if busy is None or self._last is None:
            return self.threads
        own, now = self.own(), self.clock()
        last_busy, last_own, last_t = self._last
        self._last = (busy, own, now)
        wall = now - last_t
        if wall <= 0:
            return self.threads
        return self._choose(max(0.0, (busy - last_busy) - (own - last_own)) / wall)
