"""Generation backends behind one interface (trainer/generation/base.py), so the round loop never knows
which engine samples; this module picks the backend.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

from trainer import precision
from trainer.generation.base import (BackendError, Cancel, Cancelled, Completion, Generator, SamplingParams, isolated_rng,
                                     never, to_completion)

if TYPE_CHECKING:
    from trainer.config import GenerationConfig
    from trainer.policy import Policy

__all__ = ["BackendError", "Cancel", "Cancelled", "never", "Completion", "Generator", "SamplingParams", "isolated_rng",
           "to_completion", "vllm_available", "resolve_backend", "make_generator"]

log = logging.getLogger(__name__)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(cfg: "GenerationConfig", policy: "Policy") -> str:
    """`auto` takes vLLM where it is installed and the policy sits on a GPU, else transformers."""
    if cfg.backend != "auto":
        return cfg.backend
    return "vllm" if policy.device.type == "cuda" and vllm_available() else "transformers"


def make_generator(cfg: "GenerationConfig", policy: "Policy") -> Generator:
    backend = resolve_backend(cfg, policy)
    log.info("generation backend: %s%s", backend, " (auto)" if cfg.backend == "auto" else "")
    if backend == "vllm":
        from trainer.generation.vllm_engine import VLLMGenerator

        return VLLMGenerator(policy, cfg.vllm)
    from trainer.generation.hf import TransformersGenerator

    wide = precision.bfloat16_or_own(cfg.sampling_dtype, policy)
    if wide is not None:
        log.info("generation: a %s copy of the weights samples the prompts and wide decoding steps", str(wide).removeprefix("torch."))
    return TransformersGenerator(policy, batch_size=cfg.batch_size, wide_dtype=wide)
