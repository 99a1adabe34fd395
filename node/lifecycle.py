"""Graceful stop on SIGINT/SIGTERM: the first signal asks the round loop to stop at the next safe
point (it then checkpoints and exits 0); a second one interrupts at once, leaving the last
complete checkpoint as it was.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)


class StopSignal:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds; True as soon as a stop is requested."""
        return self._event.wait(timeout)

    def request(self, reason: str = "requested") -> None:
        if not self._event.is_set():
            log.warning("stop %s: finishing the current step, then checkpointing (repeat to abort)", reason)
        self._event.set()

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
