"""What every generation backend shares: the sampling parameters, a completion, the `Generator` interface,
and the one rule that cuts a completion at its end. The backends import this, never the package that
chooses among them.

Log-probs returned with a completion are those of the unmodified model distribution (before
temperature and top-p), the quantity a trainer's forward pass reproduces.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from trainer.config import GenerationConfig


class BackendError(RuntimeError):
    """The configured generation backend cannot run here; the message says what to install or change."""


class Cancelled(Exception):
    """A stop request ended a generation call early; nothing it sampled is returned."""


Cancel = Callable[[], bool]  # asked between decoding steps: True ends the call with `Cancelled`


def never() -> bool:
    return False


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

    def generate(self, prompt_ids: Sequence[list[int]], params: SamplingParams,
                 cancel: Cancel = never) -> list[list[Completion]]:
        """`params.n` completions for each tokenized prompt, in prompt order; `Cancelled` once `cancel()` says so
        (a node asked to stop mid-evaluation is not held for minutes)."""
        ...

    def set_weights(self, model: "torch.nn.Module") -> None:
        """Sample from `model`'s weights as they are now (LoRA adapters on) and bump `weight_version`."""
        ...

    def release(self) -> None:
        """Give accelerator memory back until the next call, so the trainer can use it (may do nothing)."""
        ...


def to_completion(tokenizer: "PreTrainedTokenizerBase", terminators: set[int], tokens: list[int],
                  logprobs: list[float], stop: Sequence[str], weight_version: int) -> Completion:
    """One rule for every backend: where a completion ends, what text it has, and why it ended.

    The text runs to the first stop string (kept) or terminator; the token ids keep the EOS token
    (the model must learn to stop) and drop anything sampled after the end.
    """
    end = next((i for i, t in enumerate(tokens) if t in terminators), len(tokens))
    text = tokenizer.decode(tokens[:end], skip_special_tokens=True)
    hit = [text.index(s) + len(s) for s in stop if s in text]
    if hit:  # generation halts on the token that completes a stop string: tokens past `end` are padding
        text, keep, finish = text[: min(hit)], end, "stop"
    elif end < len(tokens):
        keep, finish = end + 1, "stop"
    else:
        keep, finish = end, "length"
    return Completion(text=text, token_ids=tokens[:keep], logprobs=logprobs[:keep], finish_reason=finish,
                      weight_version=weight_version)


@contextlib.contextmanager
def isolated_rng(device: "torch.device") -> Iterator[None]:
    """Engines seed and draw from the global RNGs; the node's own streams must not notice."""
    import numpy as np
    import torch

    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:  # a cancelled call too
        random.setstate(python)
        np.random.set_state(numpy)
