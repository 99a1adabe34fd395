"""The learning rate follows what each step did to the policy, not a table of models.

A rate measured on one model does not carry to the next (Gemma 3 270M at its size's rate of 6.7e-6 lost half its
held-out accuracy in ten rounds, where 1e-6 learned). The control loop of rl_games, rsl_rl (`schedule="adaptive"`)
and skrl's `KLAdaptiveLR` measures the KL between the policy before and after an update and moves the rate toward
a target. Here the KL is measured after each update on some of its own rows (`GRPOTrainer._step_kl`), and the rate
moves on the median of `WINDOW` steps taken at the same rate: over twice the target it is divided by
sqrt(KL / target), at least 1.5 and at most 10 (an Adam step's size is proportional to the rate, and where a step's
KL grows as its square the square root aims at the target in one cut: SmolLM2's steps at 1e-4 moved it 50-100 times
as far as at 1e-5), under half the target it is multiplied by 1.5, and it stays within `lr_range` times the starting
rate. One step's KL on a few rows is noisy: at one rate SmolLM2's and Gemma's swung 0.0001-0.045 a token, and
acting on each alone held both at 1/20-1/4 of their recipes' rates. A single step past `SPIKE` times the target
(SmolLM2's steps at the destructive 1e-4 measured 0.24-0.56, its recipe's at most 0.045) is cut at once.

The first steps start at a tenth of the rate and climb: Adam's first step moves every weight by about the rate
whatever its gradient, so a rate too high for the model would do its damage before any measurement could cut it.
For the same reason the first step's KL does not move the rate (unless it is not finite): it measured 0.10-0.13 a
token at a tenth of SmolLM2's and Gemma 3 270M's recipe rates, and acting on it left both training at a fiftieth of
their recipes' rates for ten rounds (docs/bench/learning.md, "The step size follows the policy").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

STEP_FACTOR = 1.5  # rl_games', rsl_rl's and skrl's change a step outside the band
INITIAL_SCALE = 0.1  # the factor of the first step (within lr_range)
MAX_CUT = 10.0  # the most one step divides the rate by (and what a non-finite KL divides it by)
BAND = 2.0  # no change while the KL lies within [target / BAND, target * BAND]
WINDOW = 3  # the steps at one rate whose median KL moves it
SPIKE = 20.0  # one step's KL past this many times the target cuts the rate at once


@dataclass
class StepSize:
    """The factor on the starting rate, adapted after each step."""

    target_kl: float
    low: float  # the factor's bounds (grpo.lr_range)
    high: float
    scale: float = INITIAL_SCALE
    steps: int = 0  # steps measured
    recent: list[float] = field(default_factory=list)  # the KLs measured at the current rate since it last moved

    def __post_init__(self) -> None:
        self.scale = self._bounded(self.scale)

    def _bounded(self, scale: float) -> float:
        return min(self.high, max(self.low, scale))

    def update(self, kl: float) -> float:
        """The factor for the next step after one whose measured KL was `kl`."""
        self.steps += 1
        if self.steps == 1 and math.isfinite(kl):  # Adam's first step: its size says little about the rate's
            return self.scale
        if not math.isfinite(kl):
            self._move(1 / MAX_CUT)
        elif kl > self.target_kl * SPIKE:
            self._move(1 / self._cut(kl))
        else:
            self.recent.append(kl)
            if len(self.recent) == WINDOW:
                mid = statistics.median(self.recent)
                if mid > self.target_kl * BAND:
                    self._move(1 / self._cut(mid))
                elif mid < self.target_kl / BAND:  # steps that moved nothing measurable included
                    self._move(STEP_FACTOR)
                self.recent.clear()
        return self.scale

    def _cut(self, kl: float) -> float:
        return min(MAX_CUT, max(STEP_FACTOR, math.sqrt(kl / self.target_kl)))

    def _move(self, factor: float) -> None:
        """A new rate: the steps measured at the old one no longer describe it."""
        self.scale = self._bounded(self.scale * factor)
        self.recent.clear()

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """The adapted factor and the steps measured; the target and bounds are this run's config (a resume may change
        them)."""
        self.scale = self._bounded(float(state["scale"]))
        self.steps = int(state.get("steps", 1))
        self.recent = [float(kl) for kl in state.get("recent", [])]
