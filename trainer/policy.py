"""Load a causal LM and its tokenizer from a preset, a local folder or a hub id."""

from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rewards.tasks import task_prompt
from trainer.config import ModelConfig
from trainer.memory import ALL_LINEAR, AdapterError, adapted, linear_layers

log = logging.getLogger(__name__)
transformers.utils.logging.disable_progress_bar()


class ModelLoadError(RuntimeError):
    """The model named in the config cannot be loaded; the message says why."""


@dataclass
class Policy:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    use_chat_template: bool
    chat_example: tuple[str, str] | None = None  # (question, reply), see ModelConfig.chat_example
    source: str | None = None  # the folder or hub id it was loaded from; an engine that loads its own copy needs it
    trust_remote_code: bool = False

    def format_prompt(self, prompt: str) -> str:
        return format_prompt(self.tokenizer, prompt, self.use_chat_template, self.chat_example)

    @property
    def stop_token_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])


def format_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, use_chat_template: bool,
                  chat_example: tuple[str, str] | None) -> str:
    """The text a model sees for a task prompt: in the chat template when it has one, else plain; after the
    worked example when one is given (`prompt_example`)."""
    if not use_chat_template:
        return prompt if chat_example is None else f"{task_prompt(chat_example[0])}{chat_example[1]}\n\n{prompt}"
    messages = [{"role": "user", "content": prompt}]
    if chat_example is not None:
        question, reply = chat_example
        messages = [{"role": "user", "content": task_prompt(question)}, {"role": "assistant", "content": reply}, *messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def uses_chat_template(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> bool:
    return cfg.chat_template and bool(getattr(tokenizer, "chat_template", None))


def prompt_example(cfg: ModelConfig, use_chat_template: bool) -> tuple[str, str] | None:
    """The worked example a model's prompts open with: chat prompts carry `chat_example`, plain ones only with
    `plain_example` (a base model's one-shot prompt; a tiny model's prompts stay bare)."""
    return cfg.chat_example if use_chat_template or cfg.plain_example else None


def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_tokenizer(source: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """AutoTokenizer, unless it ignores the folder's own tokenizer.json.

    transformers 5 rebuilds some model types' tokenizers (Qwen2 among them) from vocab and merges
    with the family's pre-tokenizer, whatever tokenizer.json says. A model trained with another
    pre-tokenizer would then see different ids; the saved file is the truth.
    """
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    saved = Path(source) / "tokenizer.json"
    if saved.is_file() and hasattr(tokenizer, "backend_tokenizer"):
        wanted = json.loads(saved.read_text()).get("pre_tokenizer")
        if json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") != wanted:
            log.info("%s: %s would re-tokenize differently from tokenizer.json; loading tokenizer.json as saved",
                     source, type(tokenizer).__name__)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    return tokenizer


def causal_lm_problem(config: dict) -> str | None:
    """Why the model a config.json describes is no causal (decoder-only) language model, all that GRPO here trains,
    or None: an encoder-decoder (T5), a type transformers has no causal LM class for, or an encoder (BERT: the causal
    head transformers puts on one wants `is_decoder`, and its weights learnt to fill in masks, not to continue text).
    `sapo doctor` and `sapo run` both refuse such a model with it before anything loads (node/planner.py)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    kind = config.get("model_type")
    if not kind:
        return None  # a described model (the planner's tests): read as Llama's
    if config.get("is_encoder_decoder"):
        why = "an encoder-decoder model"
    elif kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and "AutoModelForCausalLM" not in (config.get("auto_map") or {}):
        why = "a type transformers has no causal language model for"
    elif kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.get("is_decoder"):
        why = "an encoder (a masked language model)"
    else:
        return None
    return f"model type {kind!r} is {why}: sapo trains causal (decoder-only) language models"


def require_packages(cfg: ModelConfig) -> None:
    """Refuse, naming the extra to install, a config that asks for a package this environment lacks: called
    before the planner plans with it and before a model loads (transformers' own checks name no command)."""
    nf4 = cfg.quantize == "nf4"
    needs = ["peft", "bitsandbytes"] if nf4 else ["peft"] if cfg.lora.enabled is True else []
    missing = [package for package in needs if importlib.util.find_spec(package) is None]
    if missing:
        setting, extra = ("model.quantize nf4", "quant") if nf4 else ("model.lora.enabled", "lora")
        raise ModelLoadError(f"{setting} needs {' and '.join(missing)}: pip install -e '.[{extra}]' in the sapo-node checkout")


def load_policy(cfg: ModelConfig, weights_from: Path | None = None,
                tokenizer: PreTrainedTokenizerBase | None = None, source: str | None = None) -> Policy:
    """Load the policy from `source` (a folder or hub id; default `cfg.name`: presets are resolved to their
    folder above this module, by `trainer.presets`); `weights_from` (a checkpoint's model folder) replaces the
    starting weights. Loading never builds or trains anything."""
    source = source or cfg.name
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    lora = cfg.lora.enabled is True  # "auto" is the node's planner's to decide (trainer/plan.py); elsewhere off
    weights = str(weights_from if weights_from is not None and not lora else source)
    if cfg.quantize == "nf4" and not lora:
        raise ModelLoadError("model.quantize nf4 freezes the base in 4 bits: it trains LoRA adapters only "
                             "(set model.lora.enabled to true)")
    require_packages(cfg)
    quantized = _nf4(device, dtype) if cfg.quantize == "nf4" else {}
    try:
        tokenizer = tokenizer or load_tokenizer(source, cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **quantized)
    except Exception as e:  # noqa: BLE001 - model files are input: any failure to read them is the user's to fix
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"cannot load model {weights!r}: {first_line}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if not quantized:  # a quantized model is placed as it loads and cannot be moved
        model.to(device)
    if cfg.gradient_checkpointing is True:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if lora:
        model = _with_lora(model, cfg, weights_from)
    log.info("loaded %s (%.2fM parameters, %s, %s%s)", source, sum(p.numel() for p in model.parameters()) / 1e6, device,
             dtype, ", base in NF4" if quantized else "")
    template = uses_chat_template(cfg, tokenizer)
    return Policy(model=model, tokenizer=tokenizer, device=device, use_chat_template=template,
                  chat_example=prompt_example(cfg, template), source=source, trust_remote_code=cfg.trust_remote_code)


def _nf4(device: torch.device, dtype: torch.dtype) -> dict:
    """from_pretrained's arguments for a base whose linear weights are held in NF4 and computed in `dtype`.
    Double quantization (the block scales in 8 bits too) saves 0.4 bits a weight, but on the CPU backend of
    bitsandbytes 0.50 it made a forward 9x slower (1.8 s against 15.7 s, SmolLM2-135M, 2 x 32 tokens)."""
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                bnb_4bit_use_double_quant=device.type == "cuda")
    return {"quantization_config": config, "device_map": {"": device}}


def _with_lora(model: PreTrainedModel, cfg: ModelConfig, adapter_from: Path | None) -> PreTrainedModel:
    from peft import LoraConfig, PeftModel, get_peft_model  # present: require_packages

    with warnings.catch_warnings():
        # upstream: peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` as it wraps a model,
        # a FutureWarning on every LoRA load that says nothing about this node
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        if adapter_from is not None:
            return PeftModel.from_pretrained(model, str(adapter_from), is_trainable=True)
        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, task_type="CAUSAL_LM",
                          **adapter_targets(model, cfg.lora.target_modules))
        return get_peft_model(model, lora)


def adapter_targets(model: PreTrainedModel, targets: list[str] | str) -> dict:
    """peft's target_modules for `targets` on this model, found as the planner counts them (`trainer.memory.adapted`):
    for all-linear the last names of its linear layers (GPT-2's c_attn, c_proj, c_fc; a Llama's seven projections),
    a user's list as given; and fan_in_fan_out where they are transformers' Conv1D (GPT-2 stores its weights
    transposed). `ModelLoadError` where a name matches no linear layer."""
    from transformers.pytorch_utils import Conv1D

    try:
        chosen = adapted(linear_layers(model), targets)
    except AdapterError as e:
        raise ModelLoadError(str(e)) from None
    names = sorted({n.rsplit(".", 1)[-1] for n in chosen}) if targets == ALL_LINEAR else list(targets)
    return {"target_modules": names, "fan_in_fan_out": any(isinstance(model.get_submodule(n), Conv1D) for n in chosen)}


def finite_weights(model: PreTrainedModel) -> bool:
    """Whether every trained weight is finite: a diverged step (a NaN gradient, a huge learning rate) leaves
    weights that no later round or resume can recover from. A tensor's sum is finite only if every element is, and
    takes one pass with nothing allocated (0.02 s for SmolLM2-135M on 2 CPU cores, against 0.21 s for an element-wise
    check); only a tensor whose sum is not finite, which finite weights near 1e38 can give too, is checked element by
    element."""
    with torch.no_grad():
        return all(bool(p.sum().isfinite()) or bool(torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)


def export_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The weights a generator needs, under the base model's names.

    With LoRA each adapted weight is W + delta, computed afresh: merging into W and unmerging
    again would leave low-precision rounding in the frozen base weights after every step.
    """
    if not hasattr(model, "get_base_model"):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    weights = {k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k}
    with torch.no_grad():
        for name, layer in base.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            key = f"{name}.weight"
            weights[key] = weights[key] + sum(layer.get_delta_weight(a) for a in layer.active_adapters)
    return weights


def encode_prompts(policy: Policy, prompts: list[str]) -> list[list[int]]:
    """Token ids of formatted prompts; the chat template already carries any special tokens."""
    texts = [policy.format_prompt(p) for p in prompts]
    return policy.tokenizer(texts, add_special_tokens=not policy.use_chat_template)["input_ids"]
