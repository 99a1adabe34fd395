"""Benchmark: one SAPO round's compute on a model preset, phase by phase, against what the CPU can do.

Samples T tasks x G completions of up to N new tokens with the node's own generator and prompt (the
model's recipe, node/recipes.py, gives the tasks and sampling settings unless flags do), then runs
two GRPO steps on them (rewards replaced by coin flips, so that every group carries a gradient whatever
the model answers) for each training variant asked for: full fine-tuning or LoRA, and a micro-batch
size. The second step is timed: like a running node's, it finds AdamW's moments resident. Prints a table and saves JSON: seconds and tokens per phase, peak memory, rounds
per minute, and the physical budget: the round's model FLOPs against the GFLOP/s this machine
reaches in a large float32 matrix product. FLOPs count what the round must compute: each distinct
prompt once and each completion token, at 2 x parameters per token forward and 3x that for a
training token (2x with LoRA, where frozen weights take no gradient); one forward per training token
more when the step needs a separate old-policy pass (epochs or minibatches above 1). `train_positions`
counts what the step's forwards actually run (prompts once per micro-batch, completions padded to the
longest of theirs), against those tokens: the padding it pays; `largest_part` is the micro-batch that runs
the most positions, what the step's activation peak is made of (the step cuts its rows where padding costs
least, so parts may hold fewer rows than the micro-batch size), and `estimate_gb` the memory planner's
estimated peak for that micro-batch: run one variant per process to compare it with `peak_rss_gb`.

    .venv/bin/python scripts/bench/bench_round.py --variants full:8 full:16 lora:16 --out docs/bench/round-smollm2-135m-2cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from node.argtypes import bounded, count
from node.config import load_config
from node.recipes import with_recipe
from node.selection import rows_to_gate
from rewards import TaskSource
from trainer.groups import RolloutGroup
from trainer import plan
from trainer.config import GRPOConfig, LoraConfig, ModelConfig
from trainer.generation import SamplingParams
from trainer.generation.hf import TransformersGenerator
from trainer.grpo import GRPOTrainer
from trainer.memory import GB, shape_from_config
from trainer.policy import encode_prompts
from trainer.presets import load
from trainer.rollout import rollout


def matmul_gflops(seconds: float = 2.0, n: int = 2048) -> float:
    """What this machine's torch reaches in a float32 matrix product: the ceiling for dense model compute."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - started) / 1e9


def variant_model(model: ModelConfig, kind: str) -> ModelConfig:
    return model.model_copy(update={"lora": LoraConfig(enabled=kind != "full"), "quantize": "nf4" if kind == "nf4" else "none"})


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", type=count, default=8)
    parser.add_argument("--completions", type=count, default=8)
    parser.add_argument("--max-new-tokens", type=count, help="default: the model's recipe")
    parser.add_argument("--variants", nargs="+", default=["full:8"],
                        help="training variants, full:MICRO, lora:MICRO or nf4:MICRO (LoRA on an NF4 base; MICRO 0: the "
                        "whole batch in one pass); the first variant's model samples the round")
    parser.add_argument("--temperature", type=bounded(float, ge=0), help="default: the model's recipe")
    parser.add_argument("--top-p", type=bounded(float, gt=0, le=1), help="default: the model's recipe")
    parser.add_argument("--no-example", action="store_true", help="no worked exchange in the prompt")
    parser.add_argument("--own-prompts", action="store_true", help="every row runs its own prompt in training (no shared "
                        "prompt KV cache): the worst case the memory planner assumes (trainer/memory.py)")
    parser.add_argument("--seed", type=bounded(int, ge=0), default=0)
    parser.add_argument("--out", type=Path, help="save the JSON here")
    args = parser.parse_args()
    for v in args.variants:
        kind, _, micro = v.partition(":")
        if kind not in ("full", "lora", "nf4") or not (micro == "" or micro.isdigit()):
            parser.error(f"--variants: {v!r} is not full:MICRO, lora:MICRO or nf4:MICRO")
    return args


@dataclass
class Round:
    """One sampled round, its rewards replaced by coin flips so that every group carries a gradient."""
    groups: list[RolloutGroup]
    generate_s: float
    prompt_tokens: int
    completion_tokens: int


def sample_round(policy, node, sampling: SamplingParams, args: argparse.Namespace) -> Round:
    tasks = TaskSource(node.tasks.mix(), seed=args.seed).draw(args.tasks)
    started = time.perf_counter()
    groups = rollout(TransformersGenerator(policy), policy, tasks, sampling)
    generate_s = time.perf_counter() - started
    prompt_tokens = sum(len(ids) for ids in encode_prompts(policy, [t.prompt for t in tasks]))
    coin = random.Random(args.seed)
    for g in groups:
        g.rewards = [float(coin.random() < 0.5) for _ in g.rewards]
        g.rewards[0], g.rewards[1] = 0.0, 1.0  # never a group without signal
        g.truncated = [False] * len(g.rewards)  # every row takes part in the loss
    return Round(groups, generate_s, prompt_tokens, sum(len(c) for g in groups for c in g.completion_ids))


def measure_variant(variant: str, policy, node, config: dict, params: int, sampled: Round, gflops: float,
                    args: argparse.Namespace) -> dict:
    """The second of two GRPO steps on the round (a running node's steps find AdamW's moments resident: the
    first allocates them), its memory planner estimate and its share of the machine's matmul peak."""
    kind, _, micro = variant.partition(":")
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-7, micro_batch=int(micro or 0)), args.max_new_tokens, total_rounds=1)
    trainer.share_prompts &= not args.own_prompts
    trainer.step(sampled.groups)
    started = time.perf_counter()
    stats = trainer.step(sampled.groups)
    train_s = time.perf_counter() - started
    batch = trainer._tensors(sampled.groups)[0]
    rows_run = trainer._micro(torch.arange(len(batch.input_ids)), batch)
    positions = sum(trainer._tokens(part, batch) for part in rows_run)  # what the step's forwards run, padding included
    largest_positions, largest_rows = stats.largest_part  # what the activations' peak is made of
    tokens = sampled.prompt_tokens + sampled.completion_tokens  # each distinct prompt runs once, in sampling and training
    flops = 2 * params * tokens + (6 if kind == "full" else 4) * params * tokens
    round_s = sampled.generate_s + train_s
    return {"variant": kind, "micro_batch": int(micro or 0), "own_prompts": args.own_prompts,
            "generate_s": round(sampled.generate_s, 1), "train_s": round(train_s, 1), "round_s": round(round_s, 1),
            "rounds_per_minute": round(60 / round_s, 3), "peak_rss_gb": round(peak_rss_gb(), 2),
            "round_gflop": round(flops / 1e9, 1), "train_positions": positions,
            "largest_part": {"rows": largest_rows, "positions": largest_positions},
            "estimate_gb": round(plan.step_peak(config, kind, largest_rows, largest_positions / largest_rows,
                                                round(sampled.prompt_tokens / args.tasks)) / GB, 2),
            "train_padding": round(positions / tokens - 1, 3),
            "share_of_matmul_peak": round(flops / 1e9 / gflops / round_s, 3)}


def gate_seconds(policy, node, groups: list[RolloutGroup], args: argparse.Namespace) -> tuple[float, int]:
    """The guarded rule's support gate: this node's log-probs of the rows it would push up in J = 4 external
    groups (text, re-tokenized)."""
    external = [RolloutGroup(g.task, g.completions, g.rewards, g.truncated, source="peer") for g in groups[:4]]
    gate = GRPOTrainer(policy, GRPOConfig(), args.max_new_tokens, total_rounds=1, stop=tuple(node.generation.stop))
    started = time.perf_counter()
    gate.sequence_logprobs([rows_to_gate(g) for g in external])
    return time.perf_counter() - started, len(external)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=None if sys.stdout.isatty() else 200)

    node = with_recipe(load_config(overrides={"model": {"name": args.model, **({"chat_example": None} if args.no_example else {})}}))
    temperature = node.generation.temperature if args.temperature is None else args.temperature
    top_p = node.generation.top_p if args.top_p is None else args.top_p
    args.max_new_tokens = args.max_new_tokens or node.generation.max_new_tokens
    torch.manual_seed(args.seed)
    kinds = [v.partition(":")[0] for v in args.variants]
    policy = load(variant_model(node.model, kinds[0]))
    config = json.loads((Path(policy.source) / "config.json").read_text())
    params = shape_from_config(config).parameters  # an NF4 model's tensors hold two weights a byte
    sampling = SamplingParams(n=args.completions, temperature=temperature, top_p=top_p,
                              max_new_tokens=args.max_new_tokens, stop=tuple(node.generation.stop), seed=args.seed)
    sampled = sample_round(policy, node, sampling, args)
    gflops = matmul_gflops()
    rows = [measure_variant(variant, policy if kind == kinds[0] else load(variant_model(node.model, kind)), node,
                            config, params, sampled, gflops, args)
            for variant, kind in zip(args.variants, kinds)]
    gate_s, gated = gate_seconds(policy, node, sampled.groups, args)

    table = Table(title=f"one round on {args.model}: {args.tasks} tasks x {args.completions} completions x "
                        f"<= {args.max_new_tokens} new tokens ({sampled.completion_tokens} generated)")
    for key in rows[0]:
        table.add_column(key.replace("_", " "), justify="right")
    for r in rows:
        table.add_row(*map(str, r.values()))
    console.print(table)
    console.print(f"{params / 1e6:.1f}M parameters; float32 matrix product: {gflops:.0f} GFLOP/s on "
                  f"{torch.get_num_threads()} threads (peak RSS is the process's, cumulative over the rows); "
                  f"the support gate over {gated} external groups: {gate_s:.2f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "model": args.model, "parameters": params, "tasks": args.tasks, "completions": args.completions,
            "task_mix": [d.model_dump() for d in node.tasks.datasets], "chat_example": node.model.chat_example,
            "max_new_tokens": args.max_new_tokens, "temperature": temperature, "top_p": top_p,
            "prompt_tokens": sampled.prompt_tokens, "completion_tokens": sampled.completion_tokens,
            "matmul_gflops": round(gflops, 1), "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "rows": rows, "support_gate_s": round(gate_s, 2), "support_gate_groups": gated,
        }, indent=2))
        console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
