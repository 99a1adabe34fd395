"""Benchmark: the memory and time of the trainer's log-probs with gradients (forward and backward of
`trainer.batch.token_logprobs`), the LM head run in chunks (the trainer's way) against the whole
(rows, tokens, vocab) logits at once (as before chunking). Each mode runs in a fresh process, so its
peak resident memory is its own; the figure is that peak less the process's resident size before the
first step (weights, batch, libraries).

    .venv/bin/python scripts/bench/bench_logprobs.py --model smollm2-135m --rows 16 --tokens 256 --out docs/bench/logprobs-smollm2-135m-2cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from node.argtypes import count, script_parser

MODES = {"chunked": None, "whole": 2**62}  # LOGITS_CHUNK_BYTES: the trainer's default, or one chunk for all


def measure(model: str, rows: int, tokens: int, repeats: int, chunk_bytes: int | None, checkpointing: bool) -> dict:
    """One mode in this process: seconds per forward+backward (median) and the peak memory it added."""
    import torch

    from node.config import NodeConfig
    from trainer import batch as B
    from trainer.config import ModelConfig
    from trainer.presets import load

    if chunk_bytes is not None:
        B.LOGITS_CHUNK_BYTES = chunk_bytes
    torch.manual_seed(0)
    policy = load(ModelConfig(name=model, cache_dir=NodeConfig().model.cache_dir, device="cpu", dtype="float32",
                              gradient_checkpointing=checkpointing))
    policy.model.train(checkpointing)  # checkpointing acts in training mode only
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (32,)).tolist()
    completions = [torch.randint(0, vocab, (tokens,)).tolist() for _ in range(rows)]
    batch = B.collate([prompt] * rows, completions, 0, torch.device("cpu"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for _ in range(repeats):
        policy.model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        B.token_logprobs(policy.model, batch).sum().backward()
        seconds.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": sorted(seconds)[len(seconds) // 2], "added_peak_gb": (peak - before) / 1e9,
            "peak_rss_gb": peak / 1e9, "vocab": vocab, "logits_gb": rows * tokens * vocab * 4 / 1e9,
            "chunk_bytes": B.LOGITS_CHUNK_BYTES}


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=count, default=16, help="completions in the batch")
    parser.add_argument("--tokens", type=count, default=256, help="tokens per completion")
    parser.add_argument("--repeats", type=count, default=3)
    parser.add_argument("--gradient-checkpointing", action="store_true", help="the model's activations recomputed "
                        "in backward too (what the planner picks on a tight budget): the logits then dominate")
    parser.add_argument("--out", type=Path, help="save the results as JSON")
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)  # one mode, in a child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.model, args.rows, args.tokens, args.repeats, MODES[args.mode],
                                 args.gradient_checkpointing)))
        return 0
    results = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--model", args.model, "--rows", str(args.rows), "--tokens", str(args.tokens),
               "--repeats", str(args.repeats), "--mode", mode] + ["--gradient-checkpointing"] * args.gradient_checkpointing
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"bench_logprobs: {mode} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
            return 1
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[mode]
        print(f"{mode:8s} {r['seconds']:6.2f} s per forward+backward, peak +{r['added_peak_gb']:.2f} GB "
              f"(whole logits would be {r['logits_gb']:.2f} GB)")
    record = {"model": args.model, "rows": args.rows, "tokens": args.tokens, "repeats": args.repeats,
              "gradient_checkpointing": args.gradient_checkpointing,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "results": results,
              "command": " ".join(["scripts/bench/bench_logprobs.py", *sys.argv[1:]])}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
