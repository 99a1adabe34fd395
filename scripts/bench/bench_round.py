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

Samplers side by side: `--baseline REV` also samples the round with the transformers generator as it was at
git revision REV, and `--continuous` with transformers' own continuous batching (`generate_batch`, a paged
cache; it has no stop strings, so its completions run to EOS or the cap); the samplers take turns for
`--repeats` rounds on the same tasks and seed, so that the machine's noise falls on all of them. `--seeds N` samples
N rounds of different tasks and seeds in each turn: a round's time hangs on its few longest completions (each
sampler draws its own), so one seed's ratio moves with them; the figures then sum the seeds' tokens and median seconds. The current
sampler is what a node here samples with (`generation.sampling_dtype` auto: a bfloat16 copy on a CPU with AMX
tiles or AVX512-BF16). Each one's median seconds, its seconds against the current sampler's in the same turn (the median of
those ratios: a machine that drifts during the run moves both), the rows its decode steps ran (against the
tokens generated: what finished rows cost),
generated tokens per second and rounds per minute (its sampling plus the first variant's
step; the baseline's plus `--baseline-step`'s, a revision from before bfloat16 training products stepping in
float32, `full:8:model`) are saved beside the sampling FLOPs (2 x parameters per prompt and generated token) and their share
of the matmul peak.

    .venv/bin/python scripts/bench/bench_round.py --variants full:8 full:16 lora:16 --out docs/bench/round-smollm2-135m-2cpu.json
    .venv/bin/python scripts/bench/bench_round.py --baseline 1e47067 --continuous --repeats 5 --out docs/bench/sampling-smollm2-135m-2cpu.json
    .venv/bin/python scripts/bench/bench_round.py --variants full:8 full:8:model --baseline 1e47067 --baseline-step full:8:model --seeds 4 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from node.argtypes import bounded, count, script_parser
from node.config import load_config
from node.recipes import with_recipe
from node.selection import rows_to_gate
from rewards import TaskSource
from trainer.groups import RolloutGroup
from trainer import allocator, plan
from trainer.config import GRPOConfig, LoraConfig, ModelConfig
from trainer.generation import Completion, SamplingParams, to_completion
from trainer.precision import bf16_features, bfloat16_or_own
from trainer.generation.hf import TransformersGenerator
from trainer.grpo import GRPOTrainer
from trainer.memory import GB, shape_from_config
from trainer.policy import encode_prompts
from trainer.presets import load
from trainer.rollout import rollout

ROOT = Path(__file__).resolve().parents[2]


def matmul_gflops(seconds: float = 2.0, n: int = 2048) -> float:
    """What this machine's torch reaches in a float32 matrix product: the ceiling for dense model compute."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - started) / 1e9


COMPUTE = typing.get_args(GRPOConfig.model_fields["compute_dtype"].annotation)  # grpo.compute_dtype's values


def parse_variant(variant: str) -> tuple[str, str, str]:
    """KIND:MICRO[:COMPUTE] as (kind, micro, compute), each "" where absent."""
    kind, _, rest = variant.partition(":")
    micro, _, compute = rest.partition(":")
    return kind, micro, compute


def variant_model(model: ModelConfig, kind: str) -> ModelConfig:
    return model.model_copy(update={"lora": LoraConfig(enabled=kind != "full"), "quantize": "nf4" if kind == "nf4" else "none"})


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", type=count, default=8)
    parser.add_argument("--completions", type=count, default=8)
    parser.add_argument("--max-new-tokens", type=count, help="default: the model's recipe")
    parser.add_argument("--variants", nargs="+", default=["full:8"],
                        help="training variants, full:MICRO, lora:MICRO or nf4:MICRO (LoRA on an NF4 base; MICRO 0: the "
                        "whole batch in one pass), each optionally :COMPUTE, grpo.compute_dtype (auto, model or bfloat16; "
                        "default auto); the first variant's model samples the round")
    parser.add_argument("--temperature", type=bounded(float, ge=0), help="default: the model's recipe")
    parser.add_argument("--top-p", type=bounded(float, gt=0, le=1), help="default: the model's recipe")
    parser.add_argument("--no-example", action="store_true", help="no worked exchange in the prompt")
    parser.add_argument("--own-prompts", action="store_true", help="every row runs its own prompt in training (no shared "
                        "prompt KV cache): the worst case the memory planner assumes (trainer/memory.py)")
    parser.add_argument("--seed", type=bounded(int, ge=0), default=0)
    parser.add_argument("--seeds", type=count, default=1, help="rounds of different tasks and seeds (seed, seed + 1, ...) "
                        "each sampler samples in every turn")
    parser.add_argument("--baseline", metavar="REV", help="also sample with trainer/generation/hf.py as it was at this git revision")
    parser.add_argument("--baseline-step", metavar="VARIANT", help="the training variant (one of --variants) of the "
                        "baseline's round, as its revision trained (default: the first)")
    parser.add_argument("--continuous", action="store_true", help="also sample with transformers' continuous batching")
    parser.add_argument("--repeats", type=count, default=1, help="rounds each sampler samples, taking turns")
    parser.add_argument("--out", type=Path, help="save the JSON here")
    args = parser.parse_args()
    for v in args.variants:
        kind, micro, compute = parse_variant(v)
        if kind not in ("full", "lora", "nf4") or not (micro == "" or micro.isdigit()) or compute not in ("", *COMPUTE):
            parser.error(f"argument --variants: {v!r} is not full:MICRO, lora:MICRO or nf4:MICRO, optionally :{'|'.join(COMPUTE)}")
    if args.baseline_step is not None and args.baseline_step not in args.variants:
        parser.error(f"argument --baseline-step: {args.baseline_step!r} is not one of --variants {' '.join(args.variants)}")
    if args.baseline and subprocess.run(["git", "cat-file", "-e", f"{args.baseline}:trainer/generation/hf.py"], cwd=ROOT,
                                         capture_output=True).returncode:
        parser.error(f"--baseline: this checkout has no trainer/generation/hf.py at revision {args.baseline!r}")
    return args


def generator_at(rev: str, policy, wide: torch.dtype | None) -> "Uncancellable":
    """The transformers generator as it was at git revision `rev` (its imports resolve to today's modules), given
    today's sampling copy `wide` where it takes one (a revision from before it samples as it did)."""
    source = subprocess.run(["git", "show", f"{rev}:trainer/generation/hf.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType(f"hf_at_{rev}")
    exec(compile(source, f"{rev}:trainer/generation/hf.py", "exec"), module.__dict__)
    takes_copy = "wide_dtype" in inspect.signature(module.TransformersGenerator).parameters
    return Uncancellable(module.TransformersGenerator(policy, **({"wide_dtype": wide} if takes_copy else {})))


@dataclass
class Uncancellable:
    """A generator from before `generate` took a cancel (the benchmark never cancels)."""
    inner: object

    def generate(self, prompt_ids, params: SamplingParams, cancel=None) -> list[list[Completion]]:
        return self.inner.generate(prompt_ids, params)


class ContinuousBatching:
    """transformers' own continuous batching behind the generator interface: `generate_batch` with a paged
    cache of one 256-token page per row, at most 256 tokens a step (the fastest of the library's default,
    256 and 1024 on 2 cores)."""

    def __init__(self, policy):
        self.policy, self.weight_version = policy, 0

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, cancel=None) -> list[list[Completion]]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        config = GenerationConfig(do_sample=params.temperature > 0, temperature=params.temperature or None, top_p=params.top_p,
                                  top_k=0, max_new_tokens=params.max_new_tokens, num_return_sequences=params.n,
                                  eos_token_id=self.policy.stop_token_ids, pad_token_id=self.policy.tokenizer.pad_token_id)
        pages = len(prompt_ids) * params.n * -(-(max(map(len, prompt_ids)) + params.max_new_tokens) // 256)
        torch.manual_seed(params.seed or 0)
        out = self.policy.model.generate_batch(list(prompt_ids), generation_config=config, progress_bar=False,
                                               continuous_batching_config=ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=256))
        ordered = sorted(out.values(), key=lambda o: o.request_id)  # req_<prompt>__child#<k>: prompt order, then child
        terminators = set(self.policy.stop_token_ids)
        done = [to_completion(self.policy.tokenizer, terminators, o.generated_tokens, [0.0] * len(o.generated_tokens),
                              params.stop, self.weight_version) for o in ordered]
        return [done[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]


@dataclass
class Round:
    """One sampled round, its rewards replaced by coin flips so that every group carries a gradient."""
    groups: list[RolloutGroup]
    generate_s: float
    prompt_tokens: int
    completion_tokens: int


def sample_round(generator, policy, node, sampling: SamplingParams, args: argparse.Namespace, seed: int) -> Round:
    """The round of `seed`: its tasks and its sampling seed."""
    tasks = TaskSource(node.tasks.mix(), seed=seed).draw(args.tasks)
    started = time.perf_counter()
    groups = rollout(generator, policy, tasks, dataclasses.replace(sampling, seed=seed))
    generate_s = time.perf_counter() - started
    prompt_tokens = sum(len(ids) for ids in encode_prompts(policy, [t.prompt for t in tasks]))
    coin = random.Random(seed)
    for g in groups:
        g.rewards = [float(coin.random() < 0.5) for _ in g.rewards]
        g.rewards[0], g.rewards[1] = 0.0, 1.0  # never a group without signal
        g.truncated = [False] * len(g.rewards)  # every row takes part in the loss
    return Round(groups, generate_s, prompt_tokens, sum(len(c) for g in groups for c in g.completion_ids))


def measure_variant(variant: str, policy, node, config: dict, params: int, sampled: Round, gflops: float,
                    args: argparse.Namespace) -> dict:
    """The second of two GRPO steps on the round (a running node's steps find AdamW's moments resident: the
    first allocates them), its memory planner estimate and its share of the machine's matmul peak."""
    kind, micro, compute = parse_variant(variant)
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-7, micro_batch=int(micro or 0), compute_dtype=compute or "auto"),
                          args.max_new_tokens, total_rounds=1)
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
            "compute_dtype": str(trainer.compute_dtype or next(policy.model.parameters()).dtype).removeprefix("torch."),
            "generate_s": round(sampled.generate_s, 1), "train_s": round(train_s, 1), "round_s": round(round_s, 1),
            "rounds_per_minute": round(60 / round_s, 3), "peak_rss_gb": round(peak_rss_gb(), 2),
            "round_gflop": round(flops / 1e9, 1), "train_positions": positions,
            "largest_part": {"rows": largest_rows, "positions": largest_positions},
            "estimate_gb": round(plan.step_peak(config, kind, largest_rows, largest_positions / largest_rows,
                                                round(sampled.prompt_tokens / args.tasks)) / GB, 2),
            "train_padding": round(positions / tokens - 1, 3),
            "share_of_matmul_peak": round(flops / 1e9 / gflops / round_s, 3)}


def _decode_rows(kwargs: dict) -> int:
    """Rows in a forward of one new position each: a decode step's batch (0 for a prefill)."""
    ids = kwargs.get("input_ids")
    return ids.shape[0] if ids is not None and ids.dim() == 2 and ids.shape[1] == 1 else 0


@contextlib.contextmanager
def counting_decodes(generator, policy, add: typing.Callable[[int], None]) -> typing.Iterator[None]:
    """Calls `add(rows)` for each decode step `generator` runs: forwards of one position a row on the policy's model and
    the generator's copies, and the copies' own decode steps (which call no module)."""
    inner = getattr(generator, "inner", generator)
    models = [m for m in (policy.model, getattr(inner, "wide", None), getattr(inner, "narrow", None)) if m is not None]
    hooks = [m.register_forward_pre_hook(lambda _, a, kw: add(_decode_rows(kw)), with_kwargs=True) for m in models]
    own_steps = getattr(inner, "steps", None)
    if own_steps is not None:
        inner.steps = {m: lambda ids, attn, cache, step=step: add(len(ids)) or step(ids, attn, cache)
                       for m, step in own_steps.items()}
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        if own_steps is not None:
            inner.steps = own_steps


def compare_samplers(policy, node, sampling: SamplingParams, params: int, gflops: float,
                     args: argparse.Namespace) -> tuple[Round, list[dict]]:
    """Each sampler samples the round of each seed `args.repeats` times, taking turns. Returns the current sampler's
    last round of the first seed, timed at its median (the round the training variants step on), and each sampler's
    figures: the seeds' tokens over their median seconds, and each seed's own."""
    wide = bfloat16_or_own(node.generation.sampling_dtype, policy)  # what a node here samples with (generation.sampling_dtype auto)
    samplers = {"current" + (f" ({str(wide).removeprefix('torch.')} copy)" if wide else ""):
                TransformersGenerator(policy, wide_dtype=wide)}
    steps = {}
    if args.baseline:
        name = f"at {args.baseline}"
        samplers[name], steps[name] = generator_at(args.baseline, policy, wide), args.baseline_step or args.variants[0]
    if args.continuous:
        samplers["continuous batching"] = ContinuousBatching(policy)
    seeds = range(args.seed, args.seed + args.seeds)
    rounds: dict[str, dict[int, list[Round]]] = {name: {seed: [] for seed in seeds} for name in samplers}
    decoded = dict.fromkeys(samplers, 0)  # rows the model ran in one-position (decode) forwards
    for _ in range(args.repeats):
        for seed in seeds:
            for name, generator in samplers.items():
                with counting_decodes(generator, policy, lambda rows, name=name: decoded.__setitem__(name, decoded[name] + rows)):
                    rounds[name][seed].append(sample_round(generator, policy, node, sampling, args, seed))
    current = next(iter(rounds.values()))
    rows = [sampler_row(name, by_seed, current, decoded[name] // args.repeats if name != "continuous batching" else None,
                        params, gflops)  # continuous batching's paged forwards are not one position a row
            for name, by_seed in rounds.items()]
    for row in rows:  # the training variant of each sampler's round: the baseline's as its revision trained
        row["step"] = steps.get(row["sampler"], args.variants[0])
    first = current[args.seed]
    return Round(first[-1].groups, statistics.median(r.generate_s for r in first), first[-1].prompt_tokens,
                 first[-1].completion_tokens), rows


def sampler_row(name: str, by_seed: dict[int, list[Round]], current: dict[int, list[Round]], decoded: int | None, params: int,
                gflops: float) -> dict:
    """One sampler's figures over the seeds: their tokens over their median seconds (a round's seconds: the seeds'
    mean), each turn's seconds against the current sampler's in the same turn (the median of those ratios: what the
    machine's drift leaves alone), and each seed's own figures."""
    medians = {seed: statistics.median(r.generate_s for r in sampled) for seed, sampled in by_seed.items()}
    tokens = {seed: sampled[-1].completion_tokens for seed, sampled in by_seed.items()}
    seconds, generated = sum(medians.values()), sum(tokens.values())
    prompt = sum(sampled[-1].prompt_tokens for sampled in by_seed.values())
    paired = [r.generate_s / c.generate_s for seed in by_seed for r, c in zip(by_seed[seed], current[seed])]
    flops = 2 * params * (prompt + generated)
    return {"sampler": name, "generate_s": round(seconds / len(by_seed), 2), "completion_tokens": generated,
            "decoded_rows": decoded, "generated_tokens_per_s": round(generated / seconds, 1),
            "seconds_vs_current_paired": round(statistics.median(paired), 3),
            "sampling_gflop": round(flops / 1e9, 1), "share_of_matmul_peak": round(flops / 1e9 / gflops / seconds, 3),
            "per_seed": [{"seed": seed, "generate_s": round(medians[seed], 2), "completion_tokens": tokens[seed],
                          "generated_tokens_per_s": round(tokens[seed] / medians[seed], 1),
                          "each_s": [round(r.generate_s, 2) for r in by_seed[seed]]} for seed in by_seed]}


def gate_seconds(policy, node, groups: list[RolloutGroup], args: argparse.Namespace) -> tuple[float, int]:
    """The guarded rule's support gate: this node's log-probs of the rows it would push up in J = 4 external
    groups (text, re-tokenized)."""
    external = [RolloutGroup(g.task, g.completions, g.rewards, g.truncated, source="peer") for g in groups[:4]]
    gate = GRPOTrainer(policy, GRPOConfig(), args.max_new_tokens, total_rounds=1, stop=tuple(node.generation.stop))
    started = time.perf_counter()
    gate.sequence_logprobs([rows_to_gate(g) for g in external])
    return time.perf_counter() - started, len(external)


def table_of(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key.replace("_", " "), justify="right")
    for r in rows:
        table.add_row(*map(str, r.values()))
    return table


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    allocator.keep_freed_memory()  # as a node does
    console = Console(width=None if sys.stdout.isatty() else 200)

    node = with_recipe(load_config(overrides={"model": {"name": args.model, **({"chat_example": None} if args.no_example else {})}}))
    temperature = node.generation.temperature if args.temperature is None else args.temperature
    top_p = node.generation.top_p if args.top_p is None else args.top_p
    args.max_new_tokens = args.max_new_tokens or node.generation.max_new_tokens
    torch.manual_seed(args.seed)
    kinds = [parse_variant(v)[0] for v in args.variants]
    policy = load(variant_model(node.model, kinds[0]))
    config = json.loads((Path(policy.source) / "config.json").read_text())
    params = shape_from_config(config).parameters  # an NF4 model's tensors hold two weights a byte
    sampling = SamplingParams(n=args.completions, temperature=temperature, top_p=top_p,
                              max_new_tokens=args.max_new_tokens, stop=tuple(node.generation.stop), seed=args.seed)
    gflops = matmul_gflops()
    sampled, samplers = compare_samplers(policy, node, sampling, params, gflops, args)
    rows = [measure_variant(variant, policy if kind == kinds[0] else load(variant_model(node.model, kind)), node,
                            config, params, sampled, gflops, args)
            for variant, kind in zip(args.variants, kinds)]
    for sampler in samplers:  # a round is its sampling and its step
        sampler["step_s"] = rows[args.variants.index(sampler["step"])]["train_s"]
        sampler["rounds_per_minute"] = round(60 / (sampler["generate_s"] + sampler["step_s"]), 2)
    gate_s, gated = gate_seconds(policy, node, sampled.groups, args)

    console.print(table_of(rows, f"one round on {args.model}: {args.tasks} tasks x {args.completions} completions x "
                                 f"<= {args.max_new_tokens} new tokens ({sampled.completion_tokens} generated)"))
    console.print(table_of([{k: v for k, v in r.items() if k != "per_seed"} for r in samplers],
                           f"sampling the round, median of {args.repeats} of each of {args.seeds} seeds (rounds per "
                           "minute with the step named)"))
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
            "machine": platform.machine(), **bf16_features(), "rows": rows, "samplers": samplers, "repeats": args.repeats,
            "seeds": list(range(args.seed, args.seed + args.seeds)),
            "command": " ".join(sys.argv[1:]), "support_gate_s": round(gate_s, 2), "support_gate_groups": gated,
        }, indent=2))
        console.print(f"saved {args.out}", soft_wrap=True)


if __name__ == "__main__":
    main()
