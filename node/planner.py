"""The node's side of the memory planner: read what the user left to it ("auto") and the model's
config.json and tokenizer (never its weights), ask `trainer.plan`, and write the plan back into the
config the node then runs, so that config.json records what actually ran."""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass, replace

from node.config import ConfigError, NodeConfig
from node.recipes import MIN_FITTED_TOKENS, Settled, settle, settle_lr
from rewards import TaskSource
from trainer import memory
from trainer.memory import GB, MemoryPlanError
from trainer.plan import Device, Plan, Wants, plan, probe
from trainer.policy import (ModelLoadError, causal_lm_problem, format_prompt, load_tokenizer, prompt_example, require_packages,
                            uses_chat_template)
from trainer.presets import resolve_model_path

log = logging.getLogger(__name__)
PROMPTS_MEASURED = 64  # held-out prompts tokenized to find the longest


@dataclass
class Fitted:
    plan: Plan
    cfg: NodeConfig  # with every "auto" the plan decides replaced by its choice
    tokenizer: object
    source: str  # the folder or hub id the model loads from
    settled: Settled  # where each of the model's settings came from


def wants_of(cfg: NodeConfig) -> Wants:
    m, g = cfg.model, cfg.generation
    return Wants(
        backend=None if g.backend == "auto" else g.backend, dtype=None if m.dtype == "auto" else m.dtype,
        lora=None if m.lora.enabled == "auto" else m.lora.enabled,
        checkpointing=None if m.gradient_checkpointing == "auto" else m.gradient_checkpointing,
        quantize=None if m.quantize == "auto" else m.quantize,
        micro_batch=cfg.grpo.micro_batch, generation_batch="batch_size" in g.model_fields_set,
        vllm_share=None if g.vllm.gpu_memory_utilization == "auto" else g.vllm.gpu_memory_utilization,
        vllm_sleep=g.vllm.sleep_mode, sampling_dtype=None if g.sampling_dtype == "auto" else g.sampling_dtype,
        compute_dtype=None if cfg.grpo.compute_dtype == "auto" else cfg.grpo.compute_dtype, lora_r=m.lora.r,
        lora_targets=m.lora.target_modules if isinstance(m.lora.target_modules, str) else tuple(m.lora.target_modules),
        vllm_installed=importlib.util.find_spec("vllm") is not None,
        peft_installed=importlib.util.find_spec("peft") is not None,
        bnb_installed=importlib.util.find_spec("bitsandbytes") is not None)


def generated_groups(cfg: NodeConfig) -> int:
    """The most groups a round samples: its local ones, the external slots it fills locally when the pool is
    short (a node alone samples all of them: the first GPU run planned 32 decoding rows and decoded 64), and
    the control experiment's own stand-ins for external groups."""
    s = cfg.selection
    return cfg.run.local_groups + (s.external_groups if s.when_short != "fewer" else 0) + (
        s.external_groups if s.self_external else 0)


def round_shape(cfg: NodeConfig, prompt_tokens: int) -> memory.RoundShape:
    g = cfg.generation.completions_per_group
    return memory.RoundShape(
        rows=-(-(cfg.run.local_groups + cfg.selection.external_groups) * g // cfg.grpo.minibatches),
        generation_rows=min(cfg.generation.batch_size, max(generated_groups(cfg) * g,
                                                              cfg.tasks.eval_size * max(1, cfg.tasks.eval_samples))),
        prompt_tokens=prompt_tokens, completion_tokens=cfg.generation.max_new_tokens)


@dataclass
class Inputs:
    """What the planner reads of a node's config and model, once."""
    model_config: dict
    tokenizer: object
    source: str
    round: memory.RoundShape
    wants: Wants
    settled: Settled  # the config with its model's settings (node/recipes.py)


def inputs(cfg: NodeConfig) -> Inputs:
    """The model's config.json and tokenizer (never its weights), the settings its kind of model trains with
    where the user set none, and the round's shape, its longest held-out prompt measured with a quarter more
    for the longest training prompt."""
    from transformers import AutoConfig

    require_packages(cfg.model)  # before a plan is made with a package that is not there
    source = resolve_model_path(cfg.model)
    try:
        model_config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code).to_dict()
        tokenizer = load_tokenizer(source, cfg.model.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - model files are input: any failure to read them is the user's to fix
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"cannot read model {source!r}: {first_line}") from None
    if problem := causal_lm_problem(model_config):
        raise ModelLoadError(f"cannot train model {source!r}: {problem}")
    try:
        parameters = memory.shape_from_config(model_config).parameters
    except memory.ShapeError as e:
        raise ModelLoadError(f"cannot plan model {source!r}: {e}") from None
    if cfg.model.lora.enabled is not False:
        check_adapters(model_config, cfg.model.lora.target_modules)
    settled = settle(cfg, source, parameters, model_config)
    cfg = settled.cfg
    template = uses_chat_template(cfg.model, tokenizer)
    mixes = [cfg.tasks.mix()] + ([cfg.tasks.eval_mix()] if cfg.tasks.eval_datasets else [])  # trained on, evaluated on
    prompts = [format_prompt(tokenizer, t.prompt, template, prompt_example(cfg.model, template)) for mix in mixes
               for t in TaskSource(mix, seed=cfg.tasks.eval_seed).draw(min(cfg.tasks.eval_size, PROMPTS_MEASURED))]
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=not template)["input_ids"])
    shape = within_context(settled, round_shape(cfg, longest + longest // 4), memory.context_length(model_config))
    return Inputs(model_config, tokenizer, source, shape, wants_of(cfg), settled)


def check_adapters(model_config: dict, targets: memory.Targets) -> None:
    """Refuse, before any weights load, target modules that name no linear layer of the model, listing the ones
    it has (a model transformers cannot build from its config alone is checked as it loads, `trainer.policy`)."""
    layers = memory.config_linear_layers(model_config)
    if layers is not None:
        try:
            memory.adapted(layers, targets)
        except memory.AdapterError as e:
            raise ConfigError(str(e)) from None


def within_context(settled: Settled, r: memory.RoundShape, context: int | None) -> memory.RoundShape:
    """The round with a max_new_tokens the model's settings chose (not the user) cut so that the longest prompt and
    its completion fit the model's context: a position past it indexes nothing (GPT-2's 1024 raised IndexError). A
    length the user set, or a context with room for less than `MIN_FITTED_TOKENS`, is refused naming the numbers."""
    if context is None or r.tokens <= context:
        return r
    room = context - r.prompt_tokens
    if settled.sources.get("generation.max_new_tokens") in ("user", None) or room < MIN_FITTED_TOKENS:
        fix = f"set generation.max_new_tokens to {room} or less" if room > 0 else "the prompts alone fill it"
        raise ConfigError(f"generation.max_new_tokens {r.completion_tokens} and prompts of up to about {r.prompt_tokens} "
                          f"tokens need {r.tokens} positions, past the model's context of {context}: {fix}")
    settled.cfg.generation.max_new_tokens = room
    settled.sources["generation.max_new_tokens"] += (f", cut to the model's context ({context} positions, prompts up "
                                                     f"to about {r.prompt_tokens} tokens)")
    return replace(r, completion_tokens=room)


def plan_tokens(device: Device, got: Inputs) -> tuple[Plan, int]:
    """The plan, and the max_new_tokens it holds: a length the model's settings chose (not the user) is halved
    until the plan fits, down to `MIN_FITTED_TOKENS`; past that the refusal is the planner's."""
    tokens = got.round.completion_tokens
    derived = got.settled.sources.get("generation.max_new_tokens") not in ("user", None)
    while True:
        try:
            return plan(device, got.model_config, replace(got.round, completion_tokens=tokens), got.wants), tokens
        except MemoryPlanError:
            if not derived or tokens // 2 < MIN_FITTED_TOKENS:
                raise
            tokens //= 2


def fit(cfg: NodeConfig, device: Device | None = None) -> Fitted:
    """The plan for `cfg` on `device` (default: the device this machine would run it on, within the node's
    share of it where `run.memory_gb` gives one), and the config with the model's settings and the plan's
    choices in place."""
    device = device or probe(cfg.model.device, cfg.run.memory_gb)  # first: a share too large fails before a preset is built
    got = inputs(cfg)
    chosen, tokens = plan_tokens(device, got)
    settled = settle_lr(got.settled, chosen.lora)
    if tokens != settled.cfg.generation.max_new_tokens:
        chosen.why.append(f"generation.max_new_tokens {tokens}, not {settled.cfg.generation.max_new_tokens}: "
                          "longer completions would not fit")
        settled.cfg.generation.max_new_tokens = tokens
        settled.cfg.generation.model_fields_set.discard("max_new_tokens")
        settled.sources["generation.max_new_tokens"] += ", halved until the plan fits"
    return Fitted(chosen, applied(settled.cfg, chosen), got.tokenizer, got.source, settled)


@dataclass
class Shared:
    machine: Device  # what the machine can give now
    share_gb: float  # each node's share, where it has none of its own
    plans: dict[str, Plan]

    def lines(self) -> list[str]:
        """Each node's plan, and what they add up to."""
        together = sum(p.peak_bytes for p in self.plans.values())
        return [f"{name}: {p.summary()}" for name, p in self.plans.items()] + [
            f"memory: {len(self.plans)} nodes plan {together / GB:.1f} GB together; each may use {self.share_gb:.2f} GB "
            f"of the {self.machine.free_bytes / GB:.1f} GB this {_where(self.machine)} can give now "
            f"({self.machine.total_bytes / GB:.1f} GB in all)"]


def fit_together(nodes: dict[str, NodeConfig]) -> Shared:
    """Plans for nodes that will share this machine: what it can give now, in equal shares (GB) to the nodes
    that have none of their own (`run.memory_gb`). Refused as a whole, before anything starts, when the shares
    do not add up or a node's plan cannot fit its share; the refusal names the node, its planner's smallest
    change, and how many such nodes would fit."""
    cfgs = list(nodes.values())
    machine = probe(cfgs[0].model.device)
    own = sum(c.run.memory_gb * GB for c in cfgs if c.run.memory_gb)
    shared = sum(1 for c in cfgs if not c.run.memory_gb)
    share = math.floor(100 * (machine.free_bytes - own) / max(1, shared) / GB) / 100
    if own > machine.free_bytes or (shared and share <= 0):
        raise MemoryPlanError(f"{len(cfgs)} nodes cannot share the {machine.free_bytes / GB:.1f} GB this {_where(machine)} "
                              f"can give now: their run.memory_gb adds up to {own / GB:.1f} GB")
    plans, read = {}, {}
    for name, cfg in nodes.items():
        key = cfg.model_dump_json(exclude={"run": {"seed", "rounds", "out_dir"}})  # nodes alike but for seed plan alike
        got = read[key] = read.get(key) or inputs(cfg)
        gb = cfg.run.memory_gb or share
        try:
            plans[name] = plan_tokens(replace(machine, free_bytes=gb * GB), got)[0]
        except MemoryPlanError as e:
            hint = ""
            if not cfg.run.memory_gb:  # its share is the machine's divided: fewer nodes get more of it
                fewer = next((k for k in range(len(cfgs) - 1, 0, -1)
                              if _fits(replace(machine, free_bytes=machine.free_bytes / k), got)), 0)
                hint = f"; at most {fewer} such node{'s' if fewer > 1 else ''} would fit" if fewer else "; not even one fits here"
            raise MemoryPlanError(f"{len(cfgs)} nodes cannot share {machine.free_bytes / GB:.1f} GB: {name} in its "
                                  f"{gb:.2f} GB: {e}{hint}") from None
    return Shared(machine, share, plans)


def _where(device: Device) -> str:
    return "card" if device.kind == "cuda" else "machine"


def _fits(device: Device, got: Inputs) -> bool:
    try:
        plan_tokens(device, got)
    except MemoryPlanError:
        return False
    return True


def applied(cfg: NodeConfig, p: Plan) -> NodeConfig:
    """`cfg` with the plan's choices in place of "auto" (what the user set is already what the plan holds)."""
    lora = cfg.model.lora.model_copy(update={"enabled": p.lora})
    model = cfg.model.model_copy(update={"device": p.device.kind, "dtype": p.dtype, "gradient_checkpointing": p.checkpointing,
                                         "quantize": "nf4" if p.nf4 else "none", "lora": lora})
    vllm = cfg.generation.vllm.model_copy(update={} if p.vllm_share is None else {"gpu_memory_utilization": p.vllm_share})
    batch = {} if p.backend == "vllm" else {"batch_size": p.generation_rows}
    generation = cfg.generation.model_copy(update={"backend": p.backend, "vllm": vllm, "sampling_dtype": p.sampling_dtype, **batch})
    grpo = cfg.grpo.model_copy(update={"micro_batch": p.micro_batch, "compute_dtype": p.compute_dtype})
    return cfg.model_copy(update={"model": model, "generation": generation, "grpo": grpo})


def log_plan(p: Plan) -> None:
    log.info("plan: %s", p.summary())
    if adapters := p.adapters():
        log.info("plan: %s", adapters)
    for reason in p.why:
        log.info("plan: %s", reason)


def log_settings(settled: Settled) -> None:
    log.info("settings for %s (%s): %s", settled.cfg.model.name, settled.profile,
             "; ".join(f"{name} {value} ({source})" for name, value, source in settled.lines()))
