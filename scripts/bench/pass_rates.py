"""Calibration: how a model does on candidate datasets before it trains, to choose tasks it can learn from.

A dataset teaches GRPO something only where the model's groups disagree: a pass rate of 0 or 1 gives
groups with equal rewards and no gradient, and a format the model never closes scores 0 whatever it
knows. For each candidate dataset and each sampling setting this samples T tasks x G completions with
the node's own prompt and generator and records the share of completions that close the answer tag,
the pass rate, the share of informative groups (rewards not all equal), completion length and time.

    .venv/bin/python scripts/bench/pass_rates.py --model smollm2-135m --out docs/bench/pass-rates-smollm2-135m-2cpu.json
    .venv/bin/python scripts/bench/pass_rates.py --model gemma3-270m --accept-license gemma --sampling 0.7:0.9 \
        --out docs/bench/pass-rates-gemma3-270m-2cpu.json
    .venv/bin/python scripts/bench/pass_rates.py --datasets '[{"name": "arith", "config": {"max_operand": 9, "max_second": 99, "ops": "*"}}]'
    .venv/bin/python scripts/bench/pass_rates.py --mix paper --tasks 12 --max-new-tokens 256 --sampling 0.7:0.9 \
        --out docs/bench/pass-rates-paper-smollm2-135m-2cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from node.argtypes import bounded, count, script_parser
from rewards import TaskSource
from rewards.config import TasksConfig
from rewards.mixes import MIXES
from rewards.scoring import CLOSE
from rewards.source import DatasetMix
from trainer.config import ModelConfig
from trainer.generation import SamplingParams

if TYPE_CHECKING:
    from trainer.generation.hf import TransformersGenerator

CANDIDATES = [
    DatasetMix("arith", {"max_operand": 9, "ops": "+-"}),
    DatasetMix("arith", {"max_operand": 99, "ops": "+-"}),
    DatasetMix("arith", {"max_operand": 9, "ops": "*"}),
    DatasetMix("reverse", {"min_len": 3, "max_len": 5}),
    DatasetMix("count", {}),
    DatasetMix("rg/basic_arithmetic", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1,
                                       "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}),
    DatasetMix("rg/chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
    DatasetMix("rg/leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 3}),
    DatasetMix("rg/letter_counting", {"min_words": 3, "max_words": 5}),
    DatasetMix("rg/spell_backward", {"min_word_len": 3, "max_word_len": 5}),
    DatasetMix("rg/gcd", {"min_value": 1, "max_value": 30}),
    DatasetMix("rg/products", {"min_digits": 1, "max_digits": 1}),
    DatasetMix("rg/simple_equations", {"min_terms": 2, "max_terms": 2, "min_value": 1, "max_value": 10,
                                       "operators": ["+", "-"], "operators_weights": [0.5, 0.5]}),
]


def dataset_list(text: str) -> list[DatasetMix]:
    """`--datasets`: read as the node reads --tasks (each dataset checked to regenerate)."""
    try:
        return TasksConfig(datasets=text).mix()
    except ValidationError as e:
        raise argparse.ArgumentTypeError(e.errors()[0]["msg"].removeprefix("Value error, ")) from None


def measure(generator: TransformersGenerator, policy, mix: DatasetMix, sampling: SamplingParams, tasks: int,
            seed: int) -> dict:
    from trainer.rollout import rollout

    drawn = TaskSource([mix], seed=seed).draw(tasks)
    started = time.perf_counter()
    groups = rollout(generator, policy, drawn, sampling)
    seconds = time.perf_counter() - started
    completions = [c for g in groups for c in g.completions]
    return {
        "dataset": mix.name, "config": mix.config, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "closed": round(sum(CLOSE in c for c in completions) / len(completions), 3),
        "pass_rate": round(sum(sum(g.correct) for g in groups) / len(completions), 3),
        "informative": round(sum(len(set(g.rewards)) > 1 for g in groups) / len(groups), 3),
        "mean_tokens": round(sum(len(c) for g in groups for c in g.completion_ids) / len(completions), 1),
        "seconds": round(seconds, 1),
        "example": f"{drawn[0].question[:60]!r} -> {groups[0].completions[0][:60]!r}",
    }


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--accept-license", nargs="*", default=[], metavar="TERMS",
                        help="terms of use you accept for a preset under them (gemma for gemma3-270m; nothing accepts them for you)")
    parser.add_argument("--tasks", type=count, default=16, help="tasks per dataset (T)")
    parser.add_argument("--completions", type=count, default=8, help="completions per task (G)")
    parser.add_argument("--max-new-tokens", type=count, default=64)
    parser.add_argument("--sampling", nargs="+", default=["1.0:1.0", "0.7:0.9"], help="temperature:top_p settings")
    parser.add_argument("--only", nargs="*", default=[], help="dataset names to keep (default: every candidate)")
    parser.add_argument("--mix", choices=sorted(MIXES), help="measure a named task mix's datasets instead of the candidates")
    parser.add_argument("--datasets", type=dataset_list, help="measure these datasets instead of the candidates, in the "
                        "forms of the node's --tasks (JSON list, or 'arith,rg/leg_counting')")
    parser.add_argument("--no-example", action="store_true", help="send the task alone (model.chat_example = null)")
    parser.add_argument("--sampling-dtype", choices=["model", "bfloat16"], default="model",
                        help="sample the model's own weights, or a bfloat16 copy as a node on a CPU with AMX tiles does")
    parser.add_argument("--seed", type=bounded(int, ge=0), default=0)
    parser.add_argument("--out", type=Path, help="save the JSON here")
    args = parser.parse_args()
    import torch  # the model stack loads once the flags are checked: --help or a bad flag costs no 8 s of imports
    from trainer.generation.hf import TransformersGenerator
    from trainer.policy import ModelLoadError
    from trainer.presets import load

    logging.basicConfig(level=logging.WARNING)
    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: the full table, unsqueezed

    # the worked example as a node's profile gives it: in the chat template, or as plain text for a base model
    try:
        cfg = ModelConfig(name=args.model, plain_example=True, accept_license=args.accept_license,
                          **({"chat_example": None} if args.no_example else {}))
        policy = load(cfg)
    except ValidationError as e:
        parser.error(f"argument --accept-license: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
    except ModelLoadError as e:
        parser.error(f"argument --model: {e}")
    generator = TransformersGenerator(policy, wide_dtype=torch.bfloat16 if args.sampling_dtype == "bfloat16" else None)
    rows = []
    for setting in args.sampling:
        temperature, top_p = map(float, setting.split(":"))
        sampling = SamplingParams(n=args.completions, temperature=temperature, top_p=top_p,
                                  max_new_tokens=args.max_new_tokens, stop=(CLOSE,), seed=args.seed)
        candidates = args.datasets or ([DatasetMix(d["name"], d.get("config", {})) for d in MIXES[args.mix]] if args.mix
                                       else CANDIDATES)
        for mix in candidates:
            if args.only and mix.name not in args.only:
                continue
            rows.append(measure(generator, policy, mix, sampling, args.tasks, args.seed))
            console.print(f"{mix.name} {json.dumps(mix.config)} t={temperature} p={top_p}: "
                          f"closed {rows[-1]['closed']}, pass {rows[-1]['pass_rate']}, "
                          f"informative {rows[-1]['informative']} ({rows[-1]['seconds']} s)")
            if args.out:  # after every row: a long survey that stops keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({
                    "model": args.model, "mix": args.mix, "tasks": args.tasks, "completions": args.completions,
                    "max_new_tokens": args.max_new_tokens, "chat_example": cfg.chat_example, "seed": args.seed,
                    "sampling_dtype": args.sampling_dtype,
                    "threads": torch.get_num_threads(), "rows": rows}, indent=2))

    table = Table(title=f"{args.model}: {args.tasks} tasks x {args.completions} completions, <= {args.max_new_tokens} "
                        f"new tokens, chat example {'off' if args.no_example else 'on'}")
    for key in ("dataset", "config", "temperature", "top_p", "closed", "pass_rate", "informative", "mean_tokens", "seconds"):
        table.add_column(key.replace("_", " "), overflow="fold")
    for r in rows:
        table.add_row(r["dataset"], json.dumps(r["config"]), *(str(r[k]) for k in
                      ("temperature", "top_p", "closed", "pass_rate", "informative", "mean_tokens", "seconds")))
    console.print(table)
    if args.out:
        console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
