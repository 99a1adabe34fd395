"""The learning rate follows what each step did to the policy, not a table of models.

A rate measured on one model does not carry to the next (Gemma 3 270M at its size's rate of 6.7e-6 lost half its
held-out accuracy in ten rounds, where 1e-6 learned). The control loop of rl_games, rsl_rl (`schedule="adaptive"`)
and skrl's `KLAdaptiveLR` measures the KL between the policy before and after an update and moves the rate toward
a target. Here the KL is measured after the round's update on some of its own rows (`GRPOTrainer._step_kl`); over
twice the target the rate is divided by sqrt(KL / target), at least 1.5 and at most 10 (an Adam step's size is
proportional to the rate, and where a step's KL grows as its square the square root aims at the target in one cut:
SmolLM2's steps at 1e-4 moved it 50-100 times as far as at 1e-5; at rates far below the recipes' the KL fell more
slowly), under half the target it is multiplied by 1.5, and it stays within `lr_range` times the starting rate.

The first steps start at a tenth of the rate and climb: Adam's first step moves every weight by about the rate
whatever its gradient, so a rate too high for the model would do its damage before any measurement could cut it.
For the same reason the first step's KL does not move the rate (unless it is not finite): it measured 0.10-0.13 a
token at a tenth of SmolLM2's and Gemma 3 270M's recipe rates, where their later steps measured 0.0001-0.045, and
acting on it left both training at a fiftieth of their recipes' rates for ten rounds (docs/bench/README.md, "The step
size follows the policy").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

STEP_FACTOR = 1.5  # rl_games', rsl_rl's and skrl's change a step outside the band
INITIAL_SCALE = 0.1  # the factor of the first step (within lr_range)
MAX_CUT = 10.0  # the most one step divides the rate by (and what a non-finite KL divides it by)
BAND = 2.0  # no change while the KL lies within [target / BAND, target * BAND]


@dataclass
class StepSize:
    """The factor on the starting rate, adapted after each step."""

    target_kl: float
    low: float  # the factor's bounds (grpo.lr_range)
    high: float
    scale: float = INITIAL_SCALE
    steps: int = 0  # steps measured

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
            self.scale /= MAX_CUT
        elif kl > self.target_kl * BAND:
            self.scale /= min(MAX_CUT, max(STEP_FACTOR, math.sqrt(kl / self.target_kl)))
        elif kl < self.target_kl / BAND:  # a step that moved nothing measurable included
            self.scale *= STEP_FACTOR
        self.scale = self._bounded(self.scale)
        return self.scale

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """The adapted factor and the steps measured; the target and bounds are this run's config (a resume may change
        them)."""
        self.scale = self._bounded(float(state["scale"]))
        self.steps = int(state.get("steps", 1))
