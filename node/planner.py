"""The node's side of the memory planner: read what the user left to it ("auto") and the model's
config.json and tokenizer (never its weights), ask `trainer.plan`, and write the plan back into the
config the node then runs, so that config.json records what actually ran."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

from node.config import NodeConfig
from rewards import TaskSource
from trainer import memory
from trainer.plan import Device, Plan, Wants, plan, probe
from trainer.policy import ModelLoadError, format_prompt, load_tokenizer, resolve_model_path, uses_chat_template

log = logging.getLogger(__name__)
PROMPTS_MEASURED = 64  # held-out prompts tokenized to find the longest


@dataclass
class Fitted:
    plan: Plan
    cfg: NodeConfig  # with every "auto" the plan decides replaced by its choice
    tokenizer: object
    source: str  # the folder or hub id the model loads from


def wants_of(cfg: NodeConfig) -> Wants:
    m, g = cfg.model, cfg.generation
    return Wants(
        backend=None if g.backend == "auto" else g.backend, dtype=None if m.dtype == "auto" else m.dtype,
        lora=None if m.lora.enabled == "auto" else m.lora.enabled,
        checkpointing=None if m.gradient_checkpointing == "auto" else m.gradient_checkpointing,
        micro_batch=cfg.grpo.micro_batch,
        vllm_share=None if g.vllm.gpu_memory_utilization == "auto" else g.vllm.gpu_memory_utilization,
        vllm_sleep=g.vllm.sleep_mode, lora_r=m.lora.r, lora_targets=tuple(m.lora.target_modules),
        vllm_installed=importlib.util.find_spec("vllm") is not None,
        peft_installed=importlib.util.find_spec("peft") is not None)


def round_shape(cfg: NodeConfig, prompt_tokens: int) -> memory.RoundShape:
    g = cfg.generation.completions_per_group
    return memory.RoundShape(
        rows=-(-(cfg.run.local_groups + cfg.selection.external_groups) * g // cfg.grpo.minibatches),
        generation_rows=min(cfg.generation.batch_size, max(cfg.run.local_groups * g, cfg.tasks.eval_size)),
        prompt_tokens=prompt_tokens, completion_tokens=cfg.generation.max_new_tokens)


def fit(cfg: NodeConfig, device: Device | None = None) -> Fitted:
    """The plan for `cfg` on `device` (default: the device this machine would run it on)."""
    from transformers import AutoConfig

    source = resolve_model_path(cfg.model)
    try:
        model_config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code).to_dict()
        tokenizer = load_tokenizer(source, cfg.model.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - model files are input: any failure to read them is the user's to fix
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"cannot read model {source!r}: {first_line}") from None
    template = uses_chat_template(cfg.model, tokenizer)
    prompts = [format_prompt(tokenizer, t.prompt, template, cfg.model.chat_example)
               for t in TaskSource(cfg.tasks.mix(), seed=cfg.tasks.eval_seed).draw(min(cfg.tasks.eval_size, PROMPTS_MEASURED))]
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=not template)["input_ids"])
    device = device or probe(cfg.model.device, cfg.run.memory_gb)
    chosen = plan(device, model_config, round_shape(cfg, longest + longest // 4), wants_of(cfg))
    return Fitted(chosen, applied(cfg, chosen), tokenizer, source)


def applied(cfg: NodeConfig, p: Plan) -> NodeConfig:
    """`cfg` with the plan's choices in place of "auto" (what the user set is already what the plan holds)."""
    lora = cfg.model.lora.model_copy(update={"enabled": p.lora})
    model = cfg.model.model_copy(update={"device": p.device.kind, "dtype": p.dtype, "gradient_checkpointing": p.checkpointing,
                                         "lora": lora})
    vllm = cfg.generation.vllm.model_copy(update={} if p.vllm_share is None else {"gpu_memory_utilization": p.vllm_share})
    generation = cfg.generation.model_copy(update={"backend": p.backend, "vllm": vllm})
    grpo = cfg.grpo.model_copy(update={"micro_batch": p.micro_batch})
    return cfg.model_copy(update={"model": model, "generation": generation, "grpo": grpo})


def log_plan(p: Plan) -> None:
    log.info("plan: %s", p.summary())
    for reason in p.why:
        log.info("plan: %s", reason)
