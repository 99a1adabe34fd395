"""Where bfloat16 matrix products pay, and the one rule both of their users follow: the transformers generator's
sampling copies (`generation.sampling_dtype`) and the training step's autocast (`grpo.compute_dtype`).

On a CPU with bfloat16 matrix instructions a wide model's bfloat16 products run 2-4x faster than float32's; without
them they are slower; on a narrow model their fixed cost a call outweighs the gain (docs/bench/speed.md,
"Sampling on the CPU" and "Training with bfloat16 products on the CPU"). torch is imported late: the CLI's start
stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from trainer.policy import Policy

# bfloat16 products pay on models at least this wide: a CPU's bfloat16 products carry a fixed cost a call that
# float32's small ones do not (a 128-wide tiny preset samples and trains slower in bfloat16; SmolLM2's 576, faster)
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
    twice as fast as float32; without them a CPU's bfloat16 products are slower than its float32 ones."""
    return any(bf16_features().values())


def bf16_pays(bf16_cpu: bool, float32: bool, hidden: int) -> bool:
    """The one rule of both `auto`s, for the generator, the trainer and the planner alike: bfloat16 products beside
    float32 weights only where they were measured faster, a model at least `WIDE_MIN_HIDDEN` wide on a CPU with
    bfloat16 matrix instructions (`bf16_cpu`). Elsewhere (GPUs included: unmeasured) the weights' own dtype."""
    return bf16_cpu and float32 and hidden >= WIDE_MIN_HIDDEN


def bfloat16_or_own(setting: str, policy: "Policy") -> "torch.dtype | None":
    """A setting of `auto`, `model` or `bfloat16` (`generation.sampling_dtype`, `grpo.compute_dtype`) for this policy:
    torch.bfloat16, or None for the weights' own dtype."""
    import torch

    if setting != "auto":
        return torch.bfloat16 if setting == "bfloat16" else None
    float32 = next(policy.model.parameters()).dtype == torch.float32
    hidden = getattr(policy.model.config, "hidden_size", 0)
    return torch.bfloat16 if bf16_pays(policy.device.type == "cpu" and bf16_cpu(), float32, hidden) else None
