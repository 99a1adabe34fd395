"""Settings a named real model trains well with, measured on it (docs/models.md, "Real models on a CPU"), applied to
whatever the user left unset: `sapo run --model smollm2-135m` starts from tasks it can learn from,
sampling it stays on topic with and a learning rate its size takes, and every setting can still be
overridden like any other (file, environment or flag).
"""

from __future__ import annotations

from typing import Any

RECIPES: dict[str, dict[str, dict[str, Any]]] = {
    "smollm2-135m": {
        "tasks": {"datasets": [  # pass rates 0.39, 0.52 and 0.25 before training (docs/bench/pass-rates-smollm2-135m-2cpu.json)
            {"name": "rg/basic_arithmetic", "config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1,
                                                       "operators": ["+", "-"], "allow_parentheses": False,
                                                       "allow_negation": False}},
            {"name": "rg/products", "config": {"min_digits": 1, "max_digits": 1}},
            {"name": "arith", "config": {"max_operand": 99, "ops": "+-"}},
        ]},
        "generation": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64},
        "grpo": {"lr": 1e-5},
    },
}


def apply_recipe(cfg: Any) -> None:
    """Fill the fields of `cfg` (a NodeConfig) that its sources did not set from its model's recipe."""
    for section_name, values in RECIPES.get(cfg.model.name, {}).items():
        section = getattr(cfg, section_name)
        for field, value in values.items():
            if field not in section.model_fields_set:
                setattr(section, field, value)
