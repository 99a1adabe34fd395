"""Benchmark: what giving the heap's freed memory back before a step costs that step (trainer/allocator.py).

A CPU node keeps the memory sampling frees, so that the next phase reuses its pages instead of faulting them in;
a node past its memory plan gives it back before each step (node/pressure.py). This samples a round of T tasks x G
completions with the node's own generator and recipe, then takes a GRPO step on it (rewards replaced by coin flips,
so that every group trains), alternating steps with and without `give_back_freed_memory` before them. Saves each
step's seconds, the page faults it took, its peak resident size and the seconds of the give-back itself, and the
machine's cost of one page fault (a fresh 1 GB mapping written a byte a page), so that the faults read as seconds
whatever else runs beside the benchmark.

    .venv/bin/python scripts/bench/bench_heap.py --rounds 8 --out docs/bench/heap-step-smollm2-135m-2cpu.json
"""

from __future__ import annotations

import json
import mmap
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from node.argtypes import count, script_parser
from node.config import load_config
from node.recipes import with_recipe
from rewards import TaskSource
from trainer import allocator
from trainer.config import GRPOConfig
from trainer.generation import SamplingParams
from trainer.generation.hf import TransformersGenerator
from trainer.grpo import GRPOTrainer
from trainer.memory import GB, peak_rss_bytes
from trainer.presets import load
from trainer.rollout import rollout

PAGE = 4096
FRESH = 2**30  # bytes mapped afresh to time a page fault


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fault_seconds() -> float:
    """Seconds one minor page fault takes here: a fresh anonymous GiB, one byte written a page."""
    started, before = time.perf_counter(), faults()
    with mmap.mmap(-1, FRESH) as fresh:
        for offset in range(0, FRESH, PAGE):
            fresh[offset] = 1
    return (time.perf_counter() - started) / max(1, faults() - before)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", type=count, default=4)
    parser.add_argument("--completions", type=count, default=8)
    parser.add_argument("--rounds", type=count, default=8, help="steps, alternating without and with the give-back")
    parser.add_argument("--threads", type=count, default=1)
    parser.add_argument("--out", type=Path, help="save the JSON here")
    args = parser.parse_args()
    if not allocator.keep_freed_memory():
        raise SystemExit("bench_heap: glibc's allocator is needed (this process could not set it to keep freed memory)")
    torch.set_num_threads(args.threads)
    node = with_recipe(load_config(overrides={"model": {"name": args.model, "lora": {"enabled": False}}}))
    policy = load(node.model)
    generator = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-7, micro_batch=8, target_kl=0.005), node.generation.max_new_tokens,
                          total_rounds=args.rounds)
    source, coin, steps = TaskSource(node.tasks.mix(), seed=0), random.Random(0), []
    for i in range(args.rounds):
        sampling = SamplingParams(n=args.completions, temperature=node.generation.temperature, top_p=node.generation.top_p,
                                  max_new_tokens=node.generation.max_new_tokens, stop=tuple(node.generation.stop), seed=i)
        groups = rollout(generator, policy, source.draw(args.tasks), sampling)
        for g in groups:
            g.rewards = [float(coin.random() < 0.5) for _ in g.rewards]
            g.rewards[0], g.rewards[1] = 0.0, 1.0
            g.truncated = [False] * len(g.rewards)
        generator.release()
        give_back = i % 2 == 1
        started = time.perf_counter()
        if give_back:
            allocator.give_back_freed_memory()
        stepped, before = time.perf_counter(), faults()
        trainer.step(groups)
        done, after = time.perf_counter(), faults()
        generator.set_weights(policy.model)
        steps.append({"step": i, "given_back": give_back, "give_back_s": round(stepped - started, 4),
                      "step_s": round(done - stepped, 3), "faults": after - before, "peak_gb": round(peak_rss_bytes() / GB, 3)})
        print(json.dumps(steps[-1]), flush=True)
    per_fault = fault_seconds()
    measured = steps[1:]  # the first step allocates AdamW's moments
    extra = (statistics.mean(s["faults"] for s in measured if s["given_back"])
             - statistics.mean(s["faults"] for s in measured if not s["given_back"]))
    result = {"model": args.model, "tasks": args.tasks, "completions": args.completions, "threads": args.threads,
              "steps": steps, "fault_us": round(per_fault * 1e6, 3), "extra_faults_per_step": round(extra),
              "extra_fault_s_per_step": round(extra * per_fault, 3),
              "step_s_kept": statistics.median(s["step_s"] for s in measured if not s["given_back"]),
              "command": " ".join(sys.argv[1:])}
    print(f"giving back costs a step {extra:,.0f} more page faults, {extra * per_fault:.2f} s at {per_fault * 1e6:.2f} us each "
          f"(the kept steps' median: {result['step_s_kept']:.1f} s)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
