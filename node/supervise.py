"""Retry a failing component with backoff; after too many failures, stop the node cleanly.

A node runs for days on hardware that has bad moments (a CUDA error, a full disk for a second, a
peer that crashes the p2p stack): a transient failure must not end the run, a persistent one must
end it with a clear message and a checkpoint, not a traceback halfway through a round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from node.lifecycle import StopSignal
from trainer.generation import Cancelled

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BACKOFF_S = 60.0


class ComponentFailed(RuntimeError):
    """A component failed for good. `resumable`: the node's state is a round boundary, safe to checkpoint."""

    def __init__(self, message: str, resumable: bool):
        super().__init__(message)
        self.resumable = resumable


def describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def retrying(what: str, fn: Callable[[], T], retries: int, backoff_s: float, stop: StopSignal) -> T | None:
    """`fn()`, retried on any exception with exponential backoff; None if a stop arrives while waiting, or `fn`
    gives up (`Cancelled`) because one arrived."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Cancelled:
            return None
        except Exception as e:  # noqa: BLE001 - any failure of the component is handled the same way
            if attempt == retries:
                raise ComponentFailed(f"{what} failed {retries + 1} time(s); last error: {describe(e)}", resumable=True) from e
            delay = min(MAX_BACKOFF_S, backoff_s * 2**attempt)
            log.warning("%s failed (%s); retry %d of %d in %.0f s", what, describe(e), attempt + 1, retries, delay,
                        exc_info=log.isEnabledFor(logging.DEBUG))
            if stop.wait(delay):
                return None
    raise AssertionError("unreachable")
