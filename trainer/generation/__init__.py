"""Generation backends behind one interface (trainer/generation/base.py), so the round loop never knows
which engine samples; this module picks the backend.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

from trainer.generation.base import (BackendError, Cancel, Cancelled, Completion, Generator, SamplingParams, isolated_rng,
                                     never, to_completion)

if TYPE_CHECKING:
    import torch

    from trainer.config import GenerationConfig
    from trainer.policy import Policy

__all__ = ["BackendError", "Cancel", "Cancelled", "never", "Completion", "Generator", "SamplingParams", "isolated_rng",
           "to_completion", "vllm_available", "WIDE_MIN_HIDDEN", "BF16_PROBES", "bf16_features", "bf16_cpu", "resolve_backend", "copy_pays", "wide_dtype", "make_generator"]

log = logging.getLogger(__name__)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


# a bfloat16 sampling copy pays on models at least this wide: a CPU's bfloat16 products carry a fixed cost a call
# that float32's small ones do not (a 128-wide tiny preset samples slower from a copy; SmolLM2's 576, faster)
WIDE_MIN_HIDDEN = 512


# torch's tests for a CPU's bfloat16 matrix instructions, by the name a benchmark's JSON records them under
BF16_PROBES = {"amx": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}


def bf16_features() -> dict[str, bool]:
    """Which bfloat16 matrix instructions this CPU has, as torch reports them (False where this torch has no probe)."""
    import torch

    return {name: bool(getattr(torch.cpu, probe, lambda: False)()) for name, probe in BF16_PROBES.items()}


def bf16_cpu() -> bool:
    """Whether this CPU has bfloat16 matrix instructions: AMX tiles (Intel Xeon since Sapphire Rapids) or AVX512-BF16
    (AMD Zen 4 and later, Intel Cooper Lake). On both, bfloat16 and int8 copies of the weights sampled a round about
    twice as fast as float32 (docs/bench/README.md, "Sampling on the CPU"); without them a CPU's bfloat16 products are
    slower than its float32 ones."""
    return any(bf16_features().values())


def copy_pays(bf16_cpu: bool, float32: bool, hidden: int) -> bool:
    """`generation.sampling_dtype: auto`'s one rule, for the generator and the planner alike: a bfloat16 sampling
    copy only where it was measured faster, a float32 model at least `WIDE_MIN_HIDDEN` wide on a CPU with bfloat16
    matrix instructions (`bf16_cpu`)."""
    return bf16_cpu and float32 and hidden >= WIDE_MIN_HIDDEN


def wide_dtype(cfg: "GenerationConfig", policy: "Policy") -> "torch.dtype | None":
    """The dtype of the transformers backend's sampling copy (`generation.sampling_dtype`), or None to sample
    the trainer's weights themselves."""
    import torch

    if cfg.sampling_dtype != "auto":
        return torch.bfloat16 if cfg.sampling_dtype == "bfloat16" else None
    float32 = next(policy.model.parameters()).dtype == torch.float32
    hidden = getattr(policy.model.config, "hidden_size", 0)
    return torch.bfloat16 if copy_pays(policy.device.type == "cpu" and bf16_cpu(), float32, hidden) else None


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

    wide = wide_dtype(cfg, policy)
    if wide is not None:
        log.info("generation: a %s copy of the weights samples the prompts and wide decoding steps", str(wide).removeprefix("torch."))
    return TransformersGenerator(policy, batch_size=cfg.batch_size, wide_dtype=wide)
