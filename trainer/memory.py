"""A round's peak memory, estimated from the model's shape, so a config that cannot fit is refused
with the change that would fit instead of being killed by the kernel halfway through a round.

The estimate is deliberately simple and errs high: fp32 weights for the policy and the generator's
copy, gradients and two AdamW moments for every trainable weight, the KV cache of a generation
batch, and per training token the activations autograd keeps (per layer, a multiple of the hidden
and MLP widths) plus the vocabulary-wide logits of completion tokens. The multiples are calibrated
on SmolLM2-135M on this project's CPU machine: peak RSS 5.56 GB at micro-batch 8 and 8.64 GB at 16,
with every row running its own prompt (docs/bench/round-smollm2-135m-2cpu.json as of commit a08e13a;
shared prompts need less, so the estimate stays high).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BYTES = 4  # float32
ACT_PER_HIDDEN, ACT_PER_MLP = 14, 5  # activations kept per layer and token, in units of each width
LOGIT_COPIES = 3  # logits, their float log-softmax and its gradient, per completion token
OVERHEAD = 1.0e9  # the interpreter, torch, tokenizer, node state


class MemoryPlanError(ValueError):
    """The configured round cannot fit in this machine's memory; the message names a change that would."""


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    trainable: int
    layers: int
    hidden: int
    mlp: int
    vocab: int
    kv_width: int  # key (= value) width per token and layer
    checkpointing: bool = False  # activations recomputed in backward: each layer keeps only its input


def shape_of(model) -> ModelShape:
    c = model.config
    c = getattr(c, "text_config", None) or c
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return ModelShape(parameters=sum(p.numel() for p in model.parameters()),
                      trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                      layers=c.num_hidden_layers, hidden=c.hidden_size, mlp=c.intermediate_size, vocab=c.vocab_size,
                      kv_width=kv_heads * head_dim,
                      checkpointing=any(getattr(mod, "gradient_checkpointing", False) for mod in model.modules()))


@dataclass(frozen=True)
class RoundShape:
    rows: int  # sequences per optimizer step
    generation_rows: int  # sequences decoding at once
    prompt_tokens: int  # the longest prompt
    completion_tokens: int  # max_new_tokens


def fixed_bytes(m: ModelShape) -> float:
    return 2 * m.parameters * BYTES + 3 * m.trainable * BYTES + OVERHEAD


def training_bytes(m: ModelShape, r: RoundShape, micro_batch: int) -> float:
    tokens = r.prompt_tokens + r.completion_tokens
    layer = ACT_PER_HIDDEN * m.hidden + ACT_PER_MLP * m.mlp
    kept = m.layers * m.hidden + layer if m.checkpointing else m.layers * layer
    per_row = (tokens * kept + r.completion_tokens * m.vocab * LOGIT_COPIES) * BYTES
    return fixed_bytes(m) + micro_batch * per_row


def generation_bytes(m: ModelShape, r: RoundShape) -> float:
    tokens = r.prompt_tokens + r.completion_tokens
    return fixed_bytes(m) + r.generation_rows * (tokens * m.layers * 2 * m.kv_width + 2 * m.vocab) * BYTES


def available_bytes() -> float:
    """What this process may use: the cgroup's limit where one is set, else the memory available now."""
    limit = Path("/sys/fs/cgroup/memory.max")
    text = limit.read_text().strip() if limit.exists() else "max"
    cgroup = float("inf") if text == "max" else float(text)
    meminfo = Path("/proc/meminfo")
    lines = dict(line.split(":", 1) for line in meminfo.read_text().splitlines()) if meminfo.exists() else {}
    free = float(lines["MemAvailable"].split()[0]) * 1024 if "MemAvailable" in lines else float("inf")
    return min(cgroup, free)


def plan_micro_batch(m: ModelShape, r: RoundShape, configured: int, budget: float) -> int:
    """The micro-batch to train with: the configured one, or for 0 (auto) the whole step's rows or the
    largest share of them that fits. Raises `MemoryPlanError` when the configured one, or none, fits."""
    gb = 1e9
    if generation_bytes(m, r) > budget:
        raise MemoryPlanError(
            f"generating {r.generation_rows} sequences of up to {r.prompt_tokens + r.completion_tokens} tokens needs "
            f"about {generation_bytes(m, r) / gb:.1f} GB, {budget / gb:.1f} GB is available: lower generation.batch_size "
            "or generation.max_new_tokens")
    fits = [b for b in range(r.rows, 0, -1) if training_bytes(m, r, b) <= budget]
    if not fits:
        raise MemoryPlanError(
            f"training one sequence of up to {r.prompt_tokens + r.completion_tokens} tokens needs about "
            f"{training_bytes(m, r, 1) / gb:.1f} GB, {budget / gb:.1f} GB is available: lower generation.max_new_tokens, "
            "turn on model.gradient_checkpointing or model.lora.enabled, or use a smaller model")
    if configured == 0:
        return fits[0]
    if configured > fits[0]:
        raise MemoryPlanError(
            f"grpo.micro_batch {configured} needs about {training_bytes(m, r, configured) / gb:.1f} GB, "
            f"{budget / gb:.1f} GB is available: set grpo.micro_batch to {fits[0]} or less (0 chooses)")
    return configured
