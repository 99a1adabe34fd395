"""Generation backends behind one interface, so the round loop never knows which engine samples.

Log-probs returned with a completion are those of the unmodified model distribution (before
temperature and top-p), the quantity a trainer's forward pass reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from trainer.config import GenerationConfig
    from trainer.policy import Policy


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @classmethod
    def from_config(cls, cfg: "GenerationConfig", seed: int | None = None) -> "SamplingParams":
        return cls(
            n=cfg.completions_per_group,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop=tuple(cfg.stop),
            seed=seed,
        )


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    weight_version: int


class Generator(Protocol):
    weight_version: int

    def generate(self, prompt_ids: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions for each tokenized prompt, in prompt order."""
        ...

    def load_weights(self, state_dict: Mapping[str, "torch.Tensor"]) -> None:
        """Replace every weight with the trainer's and bump `weight_version`."""
        ...


def make_generator(cfg: "GenerationConfig", policy: "Policy") -> Generator:
    from trainer.generation.hf import TransformersGenerator

    return TransformersGenerator(policy, batch_size=cfg.batch_size)
