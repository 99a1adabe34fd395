"""Graceful stop on SIGINT/SIGTERM: the first signal asks the round loop to stop at the next safe
point (it then checkpoints and exits 0); a second one interrupts at once, leaving the last
complete checkpoint as it was. If the safe point never comes (a hung GPU call), the process exits
by itself after `deadline_s`: a supervisor's stop (docker's grace period) always takes bounded time,
and checkpoints are written atomically, so an exit at any moment leaves the last one intact.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

log = logging.getLogger(__name__)


EXIT_STOP_TIMEOUT = 3
CHECKPOINTING = "finishing the current step, then checkpointing"


class StopSignal:
    def __init__(self, deadline_s: float | None = None, then: str = CHECKPOINTING) -> None:
        """`then`: what the process does on a stop, as its log says (a bootstrap-only node has nothing to save)."""
        self._then = then
        self._event = threading.Event()
        self._previous: dict[int, object] = {}
        self._deadline_s = deadline_s

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds; True as soon as a stop is requested."""
        return self._event.wait(timeout)

    def request(self, reason: str = "requested") -> None:
        if not self._event.is_set():
            log.warning("stop %s: %s (repeat to abort)", reason, self._then)
            if self._deadline_s is not None:
                timer = threading.Timer(self._deadline_s, self._give_up)
                timer.daemon = True
                timer.start()
        self._event.set()

    def _give_up(self) -> None:
        print(f"sapo: did not reach a safe point within {self._deadline_s:.0f} s of the stop request; exiting "
              "without a new checkpoint (the last complete one is kept)", file=sys.stderr, flush=True)
        os._exit(EXIT_STOP_TIMEOUT)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._event.is_set():
            raise KeyboardInterrupt
        self.request(f"on {signal.Signals(signum).name}")

    def __enter__(self) -> "StopSignal":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def exit_on_stop_signals() -> None:
    """SIGTERM and Ctrl-C (SIGINT) exit with status 143 and 130 through `finally` blocks (SystemExit, which prints
    no traceback), so a harness stops the processes it started instead of leaving them running; a repeated signal
    during that cleanup is ignored (its waits are bounded)."""

    def handle(signum: int, frame: FrameType | None) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
