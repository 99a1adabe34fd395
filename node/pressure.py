"""A node's look at its own memory after each round. The plan is an estimate: a round that went past
it lowers the micro-batch for the next one, so that a node which finds itself short shrinks its step
instead of growing until the kernel's out-of-memory killer ends it (and a whole experiment with it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from trainer.memory import GB, peak_rss_bytes

log = logging.getLogger(__name__)


def round_peak_reader(device: str) -> Callable[[], float | None]:
    """How to read a round's peak on `device`, starting a new window each time: what torch reserved on a
    CUDA card, the process's peak resident size elsewhere (a host's memory, Apple's unified memory)."""
    if device != "cuda":
        return peak_rss_bytes

    def cuda_peak() -> float:
        import torch

        peak = float(torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        return peak

    return cuda_peak


REPORT_AFTER = 5  # rounds after which a node says how its peak compares with the plan, once


@dataclass
class MemoryWatch:
    planned_bytes: float  # the plan's expected peak
    read: Callable[[], float | None]
    rounds: int = 0
    highest: float = 0.0

    def start(self) -> None:
        """Begin the first window once the model is loaded: loading is not part of a round's plan."""
        self.read()

    def after_round(self, micro_batch: int) -> tuple[float | None, int]:
        """The round's measured peak, and the micro-batch for the next round: half of this one when the
        peak went past the plan."""
        peak = self.read()
        self.rounds += 1
        self.highest = max(self.highest, peak or 0.0)
        if self.rounds == REPORT_AFTER and self.highest:
            log.info("memory: the first %d rounds peaked at %.2f GB, %.0f%% of the plan's %.2f GB (the plan is for "
                     "the worst round: every completion at generation.max_new_tokens)", REPORT_AFTER,
                     self.highest / GB, 100 * self.highest / self.planned_bytes, self.planned_bytes / GB)
        if peak is None or peak <= self.planned_bytes:
            return peak, micro_batch
        lower = max(1, micro_batch // 2)
        if lower < micro_batch:
            log.warning("memory: this round peaked at %.2f GB, past the plan's %.2f GB; the next rounds train in "
                        "micro-batches of %d (was %d)", peak / GB, self.planned_bytes / GB, lower, micro_batch)
        else:
            log.warning("memory: this round peaked at %.2f GB, past the plan's %.2f GB, at micro-batch 1 already: "
                        "give the node more memory (run.memory_gb) or lower generation.batch_size or "
                        "generation.max_new_tokens", peak / GB, self.planned_bytes / GB)
        return peak, lower
