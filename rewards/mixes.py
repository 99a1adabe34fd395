"""Task mixes known by name: `--tasks NAME` (alone or beside other datasets) stands for the mix's datasets."""

from __future__ import annotations

from typing import Any

MIXES: dict[str, list[dict[str, Any]]] = {
    # what a 0.1B instruct model passes often enough to learn from: SmolLM2-135M passes 0.39, 0.52 and 0.25 before
    # training (docs/bench/pass-rates-smollm2-135m-2cpu.json)
    "arithmetic": [
        {"name": "rg/basic_arithmetic", "config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1,
                                                   "operators": ["+", "-"], "allow_parentheses": False,
                                                   "allow_negation": False}},
        {"name": "rg/products", "config": {"min_digits": 1, "max_digits": 1}},
        {"name": "arith", "config": {"max_operand": 99, "ops": "+-"}},
    ],
    # the nine ReasoningGYM specialties of the SAPO paper (arXiv 2509.08721) with the difficulty Gensyn's own swarm
    # gives them (rl-swarm's rgym_exp/src/datasets.yaml; seeds and sizes are each node's own); SmolLM2-135M's pass
    # rates on each: docs/bench/pass-rates-paper-smollm2-135m-2cpu.json
    "paper": [
        {"name": "rg/arc_1d", "config": {"min_size": 10, "max_size": 30, "num_train": 3}},
        {"name": "rg/basic_arithmetic", "config": {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 4,
                                                   "operators": ["+", "-", "*", "/"], "allow_parentheses": True,
                                                   "allow_negation": True, "format_style": "natural",
                                                   "whitespace": "single"}},
        {"name": "rg/base_conversion", "config": {"min_base": 2, "max_base": 16, "min_value": 0, "max_value": 1000}},
        {"name": "rg/bf", "config": {"difficulty": 1}},
        {"name": "rg/binary_matrix", "config": {"min_n": 3, "max_n": 10, "p_zero": 0.25}},
        {"name": "rg/calendar_arithmetic", "config": {"year": 2023, "offset_upper_bound": 100, "leap_year_range": 200,
                                                      "tasks": ["count_days", "weekday_of_date", "is_leap_year",
                                                                "recurring_event_day"]}},
        {"name": "rg/decimal_arithmetic", "config": {"min_terms": 2, "max_terms": 6, "min_num_decimal_places": 1,
                                                     "max_num_decimal_places": 3, "precision": 5}},
        {"name": "rg/fraction_simplification", "config": {"min_value": 1, "max_value": 100, "min_factor": 2,
                                                          "max_factor": 100,
                                                          "styles": ["plain", "latex_frac", "latex_dfrac"]}},
        {"name": "rg/propositional_logic", "config": {"min_vars": 2, "max_vars": 4, "min_statements": 2,
                                                      "max_statements": 4, "min_complexity": 1, "max_complexity": 3}},
    ],
}


def expand(name: str, weight: float = 1.0) -> list[dict[str, Any]] | None:
    """The datasets of mix `name`, each weight scaled by `weight`; None when no mix has that name."""
    if name not in MIXES:
        return None
    return [{**spec, "weight": spec.get("weight", 1.0) * weight} for spec in MIXES[name]]
