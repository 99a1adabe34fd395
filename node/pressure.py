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
OFF_BY = 0.20  # a peak this far above the plan's figure for such rounds makes that report a warning
LOWERED_BY = 0.05  # a halving that did not lower the next round's peak by this share did not help
# once the micro-batch can shrink no further, a peak past the plan is said again only this share above the highest said:
# a round's peak drifts by a few hundredths of a GB with its completions, which is no news every round
HIGHER_BY = 0.05
MORE_MEMORY = "give the node more memory (run.memory_gb) or lower generation.batch_size or generation.max_new_tokens"


@dataclass
class MemoryWatch:
    planned_bytes: float  # the plan's expected peak: the worst round, every completion at max_new_tokens
    read: Callable[[], float | None]
    # the plan's peak for a round of (rows, positions of its largest micro-batch, longest completion in tokens):
    # the rounds a node runs are far below the worst, so the self-check compares like with like (Plan.peak_at)
    expect: Callable[[int, int, int], float] | None = None
    # the peak is of a host heap that keeps what sampling frees (trainer/allocator.py): giving it back is the first
    # remedy; a card's peak (torch's reserve) is not, and a round past the plan there halves the micro-batch at once
    heap: bool = False
    rounds: int = 0
    highest: float = 0.0
    longest: int = 0  # the longest completion of those rounds, in tokens
    largest: tuple[int, int] = (0, 0)  # (positions, rows) of their largest micro-batch
    _halved_at: float | None = None  # the peak of the last round, when it halved the micro-batch
    _fixed: bool = False  # a halving did not lower the peak: the micro-batch stays where it is
    _warned_peak: float = 0.0  # the highest peak past the plan said since the micro-batch stopped halving
    # past the plan once: from then on the heap's freed memory goes back to the system before each step
    # (trainer/allocator.py), the first remedy, before any halving
    giving_back: bool = False

    def start(self) -> None:
        """Begin the first window at the first round: loading and the first evaluation are not a round's."""
        self.read()

    def after_round(self, micro_batch: int, longest_completion: int = 0,
                    largest_part: tuple[int, int] = (0, 0)) -> tuple[float | None, int]:
        """The round's measured peak, and the micro-batch for the next round. On a heap that keeps what sampling
        frees, the first round past the plan turns `giving_back` on: those pieces, not the step, grew a Gemma 3 270M
        node past its plan. A round past it after that (on a card, any) halves the micro-batch, unless the last halving
        did not lower the peak (what exceeds the plan is then not the micro-batch's, and halving again would only slow
        the node)."""
        peak = self.read()
        self.rounds += 1
        self.highest = max(self.highest, peak or 0.0)
        self.longest, self.largest = max(self.longest, longest_completion), max(self.largest, largest_part)
        if self.rounds == REPORT_AFTER and self.highest:
            self._report()
        halved_at, self._halved_at = self._halved_at, None
        if peak is None or peak <= self.planned_bytes:
            return peak, micro_batch
        past = f"this round peaked at {peak / GB:.2f} GB, past the plan's {self.planned_bytes / GB:.2f} GB"
        if self.heap and not self.giving_back:
            self.giving_back = True
            log.warning("memory: %s; from now on the memory sampling freed goes back to the system before each step "
                        "(kept, it makes sampling faster), and only a round past the plan after that halves the "
                        "micro-batch", past)
        elif halved_at is not None and peak >= halved_at * (1 - LOWERED_BY):
            self._fixed, self._warned_peak = True, peak
            log.warning("memory: %s, no lower than the %.2f GB before the micro-batch was halved to %d: what exceeds "
                        "the plan does not shrink with the micro-batch, so it stays at %d; %s", past, halved_at / GB,
                        micro_batch, micro_batch, MORE_MEMORY)
        elif self._fixed or micro_batch == 1:
            if peak > self._warned_peak * (1 + HIGHER_BY):  # said once, then only for a notably higher peak
                self._warned_peak = peak
                log.warning("memory: %s, at micro-batch %d; %s (said again only for a peak %d%% higher)", past,
                            micro_batch, MORE_MEMORY, 100 * HIGHER_BY)
        else:
            self._halved_at = peak
            log.warning("memory: %s; the next rounds train in micro-batches of %d (was %d)", past, micro_batch // 2,
                        micro_batch)
            micro_batch //= 2
        return peak, micro_batch

    def _report(self) -> None:
        """Once: the first rounds' peak beside the plan's figure for rounds like them, a warning when the peak is
        more than OFF_BY above it: the estimate errs low on this machine, and the plan's headroom is all that
        stands between the node and the out-of-memory killer. Below it is by design (a fixed 1 GB for the
        interpreter and torch, which a tiny model's node does not fill: -51% on tiny-a): said, not warned about.
        Without the rounds' shape, beside the worst round's figure."""
        if not (self.expect and self.longest and self.largest[1]):
            log.info("memory: the first %d rounds peaked at %.2f GB, %.0f%% of the plan's %.2f GB for the worst round",
                     REPORT_AFTER, self.highest / GB, 100 * self.highest / self.planned_bytes, self.planned_bytes / GB)
            return
        positions, rows = self.largest
        expected = self.expect(rows, positions, self.longest)
        off = self.highest / expected - 1
        said = (f"memory: the first {REPORT_AFTER} rounds peaked at {self.highest / GB:.2f} GB, {100 * off:+.0f}% against "
                f"the plan's {expected / GB:.2f} GB for rounds like them (largest micro-batch {rows} rows in {positions} "
                f"positions, completions up to {self.longest} tokens); it reserves {self.planned_bytes / GB:.2f} GB for "
                "the worst round")
        if off <= OFF_BY:
            log.info("%s", said)
        else:
            log.warning("%s. The estimate errs low by more than %d%% on this machine: its figures (trainer/memory.py) "
                        "need calibrating here; please report this line with `sapo doctor`'s output", said, 100 * OFF_BY)
