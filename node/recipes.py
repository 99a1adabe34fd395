"""What a node trains with where the user set nothing, chosen by what its model is, with where each value
came from (`sapo doctor` prints them; a run folder's settings.json keeps them). The config's own defaults are
written for the 0.3M-parameter tiny presets; a real model given by path or hub id with those (learning rate
2e-4, 16 new tokens, temperature 1.0, the tiny task mix) was destroyed by its first step. So:

- a tiny preset, a folder built from one, or any model under `TOY_PARAMETERS`: the config's defaults;
- a preset with a recipe (smollm2-135m, gemma3-270m), as a folder `sapo init-model --out` made, or any folder or hub
  id of the same architecture (`ARCHITECTURES`: a user's own download of Gemma 3 270M): the recipe measured on it;
- any other model: the pretrained profile below, and a learning rate by its size and by full fine-tuning or LoRA
  (`learning_rate`, anchored in docs/models.md).

Every real model (a recipe or the pretrained profile) trains with the step-size controller on (`TARGET_KL`,
trainer/step_size.py): whatever rate it starts from, the rate follows what each step does to the policy.

Every value the user set (file, environment or flag) stands.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards.mixes import MIXES

# The per-token KL a step may move the policy by (trainer/step_size.py), from steps measured at fixed rates on 2 CPU
# cores (docs/bench/step-kl-2cpu.json): after the first step, SmolLM2-135M at its recipe's 1e-5 moved 0.003-0.018 and
# at 1e-4 (which destroyed it) 0.24-0.56; Gemma 3 270M at its recipe's 1e-6 0.001-0.010. The band the rate holds in,
# [target / 2, 2 x target], covers both recipes' steps; rsl_rl's desired_kl is 0.01 per action distribution.
TARGET_KL = 0.005

RECIPES: dict[str, dict[str, dict[str, Any]]] = {
    "smollm2-135m": {
        "tasks": {"datasets": MIXES["arithmetic"]},  # pass rates 0.39, 0.52, 0.25 (docs/bench/pass-rates-smollm2-135m-2cpu.json)
        "generation": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64},
        "grpo": {"lr": 1e-5, "target_kl": TARGET_KL},  # the fastest stable rate of the sweep (docs/bench/learning.md, learning-rate sweep)
        "model": {"plain_example": True},  # it has a chat template: no effect
    },
    "gemma3-270m": {  # the base model, no chat template (docs/bench/pass-rates-gemma3-270m-2cpu.json, one-shot prompts)
        "tasks": {"datasets": MIXES["arithmetic"]},  # pass rates 0.16, 0.38, 0.11, informative groups 0.38-0.88
        "generation": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64},  # 89-99% close the tag, 19-23 tokens
        # measured (docs/bench/learning.md, Gemma's learning rate): its size's 6.7e-6 collapsed it within ten rounds;
        # 1e-6 and 2e-6 both learn (one seed, 40 rounds), 1e-6 ended higher
        "grpo": {"lr": 1e-6, "target_kl": TARGET_KL},
        "model": {"plain_example": True},  # a base model sees the answer format once, as plain text
    },
}
# A model given by path or hub id that is no preset: tasks a small pretrained model passes often enough to learn
# from (SmolLM2's measured mix), sampling that keeps it on topic (measured on SmolLM2: at temperature 1.0 it drifts
# off format, at 0.5 its groups agree and carry no gradient), and room for a worked answer before the tag closes;
# the planner halves max_new_tokens where that does not fit (`fit_tokens`).
PRETRAINED: dict[str, dict[str, Any]] = {
    "tasks": {"datasets": MIXES["arithmetic"]},
    "generation": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 256},
    "grpo": {"target_kl": TARGET_KL},  # the rate by size (`learning_rate`) is where the controller starts
    "model": {"plain_example": True},  # a base model with no chat template sees the answer format once (one-shot)
}
# What a recipe's model is, read from a config.json: a folder or hub id of the same architecture and sizes gets the
# recipe (an instruct or base variant of these shapes included: the recipe was measured on the one it names).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                     "vocab_size": 49152},
    "gemma3-270m": {"model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
                    "vocab_size": 262144},
}
TOY_PARAMETERS = 10e6  # below this a model cannot follow a prompt's format: it gets the tiny presets' settings
MIN_FITTED_TOKENS = 64  # the planner lowers a derived max_new_tokens no further (the recipe's length)
# Learning rates that trained each size with full fine-tuning, in log-log interpolation, flat beyond the ends:
# the tiny presets (measured here), SmolLM2-135M (measured here: learns in 20-80 rounds, 2e-4 destroys it in one
# step) and 7B GRPO runs (DeepSeekMath; TRL's default). LoRA takes ten times full fine-tuning's rate (Schulman et
# al., "LoRA Without Regret", 2025; SmolLM2 under LoRA on an NF4 base learned at 1e-4, docs/bench/nf4-check-2cpu).
LR_ANCHORS = ((0.33e6, 2e-4), (135e6, 1e-5), (7e9, 1e-6))
LORA_LR_FACTOR = 10
KNOBS = {"tasks": ("datasets",), "generation": ("max_new_tokens", "temperature", "top_p"), "grpo": ("lr", "target_kl"),
         "model": ("plain_example",)}  # what a profile sets


def learning_rate(parameters: float, lora: bool) -> float:
    """The AdamW rate for a model of `parameters` weights (`LR_ANCHORS`), times `LORA_LR_FACTOR` under LoRA."""
    (n0, lr0), *rest = LR_ANCHORS
    lr = lr0
    for n1, lr1 in rest:
        if parameters > n0:
            t = min(1.0, math.log(parameters / n0) / math.log(n1 / n0))
            lr = math.exp(math.log(lr0) + t * (math.log(lr1) - math.log(lr0)))
        n0, lr0 = n1, lr1
    return float(f"{lr * (LORA_LR_FACTOR if lora else 1):.2g}")


def preset_of(name: str, source: str, parameters: float, model_config: dict | None = None) -> tuple[str | None, str]:
    """The preset a model is, and why: its name; the one recorded in a folder built by `sapo init-model` whose config
    still has the preset's size (a folder copied from a preset and given another model is not that preset); or the
    recipe whose architecture its config has (`ARCHITECTURES`)."""
    from trainer.presets import META_FILE, names

    if name in names():
        return name, "a preset"
    try:
        meta = json.loads((Path(source) / META_FILE).read_text())
        recorded = float(meta["parameters"])
        if abs(recorded - parameters) <= 0.05 * recorded:
            return meta.get("preset"), "a folder sapo init-model built"
    except (OSError, ValueError, TypeError, KeyError):
        pass
    for preset, arch in ARCHITECTURES.items():
        if model_config and all(model_config.get(k) == v for k, v in arch.items()):
            return preset, (f"its architecture is {preset}'s ({arch['model_type']}, {arch['num_hidden_layers']} layers "
                            f"{arch['hidden_size']} wide, a {arch['vocab_size']:,}-entry vocabulary)")
    return None, ""


@dataclass
class Settled:
    """A config with its model's settings filled in, and where each knob those settings touch came from."""
    cfg: Any  # NodeConfig
    sources: dict[str, str]
    profile: str  # "tiny", "recipe <preset>" or "pretrained"
    parameters: float
    why: str = ""  # how the model was recognised as a recipe's

    def record(self) -> dict:
        """What the model trains with and where each value came from, for a run folder's settings.json."""
        return {"profile": self.profile, "sources": {name: {"value": value, "source": source}
                                                     for name, value, source in self.lines()}}

    def lines(self) -> list[tuple[str, str, str]]:
        """(setting, value, source) for every knob a profile can set, in a stable order."""
        out = []
        for dotted in sorted(self.sources):
            section, field = dotted.split(".")
            value = getattr(getattr(self.cfg, section), field)
            if dotted == "tasks.datasets":
                value = ", ".join(d.name for d in value)
            out.append((dotted, str(value), self.sources[dotted]))
        return out


def settle(cfg: Any, source: str, parameters: float, model_config: dict | None = None) -> Settled:
    """`cfg` (a NodeConfig as its sources gave it) with its model's settings where the user set none.
    The learning rate waits for the plan (`settle_lr`): it depends on full fine-tuning or LoRA."""
    preset, why = preset_of(cfg.model.name, source, parameters, model_config)
    from trainer.pretrained import PRETRAINED as PRETRAINED_PRESETS

    if preset in RECIPES:
        profile, values = f"recipe {preset}", RECIPES[preset]
    elif preset not in PRETRAINED_PRESETS and (preset is not None or parameters < TOY_PARAMETERS):
        profile, values = "tiny", {}
    else:
        profile, values = "pretrained", PRETRAINED
    cfg = cfg.model_copy(deep=True)
    sources = {}
    for section_name, fields in KNOBS.items():
        section = getattr(cfg, section_name)
        user = set(section.model_fields_set)
        for field in fields:
            dotted = f"{section_name}.{field}"
            if field in user:
                sources[dotted] = "user"
            elif field in values.get(section_name, {}):
                setattr(section, field, values[section_name][field])  # validated
                section.model_fields_set.discard(field)  # still the model's choice, not the user's
                sources[dotted] = profile
            else:
                sources[dotted] = "default (tiny presets)" if profile == "tiny" else "default"
    return Settled(cfg, sources, profile, parameters, why if profile.startswith("recipe") else "")


def settle_lr(settled: Settled, lora: bool) -> Settled:
    """The learning rate for a model of this size trained this way (a recipe's, measured with full fine-tuning,
    times `LORA_LR_FACTOR` under LoRA), where the user set none."""
    source = settled.sources["grpo.lr"]
    if source == "user" or settled.profile == "tiny":
        return settled
    if settled.profile == "pretrained":
        lr = learning_rate(settled.parameters, lora)
        source = f"model size ({settled.parameters / 1e6:,.0f}M parameters, {'LoRA' if lora else 'full fine-tuning'})"
    elif lora:  # a recipe's rate was measured with full fine-tuning
        lr, source = float(f"{settled.cfg.grpo.lr * LORA_LR_FACTOR:.2g}"), f"{source}, x{LORA_LR_FACTOR} under LoRA"
    else:
        return settled
    settled.cfg.grpo.lr = lr
    settled.cfg.grpo.model_fields_set.discard("lr")
    settled.sources["grpo.lr"] = source
    return settled


def with_recipe(cfg: Any) -> Any:
    """`cfg` with its preset's settings (a recipe, or the tiny presets' defaults) where the user set none, for
    tools that load a named preset without planning a run (the benchmarks)."""
    return settle(cfg, cfg.model.name, float("inf")).cfg
