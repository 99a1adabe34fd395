"""Benchmark: rollout throughput, start-up time and weight-sync time of each generation backend.

For every backend installed here (transformers always; vLLM where it imports) it builds the
generator from the same policy, samples `--prompts` x `--n` completions with up to `--new-tokens`
tokens (no stop strings; only EOS ends a completion early), checks the sampling log-probs of up to 64
completions against a transformers forward pass, and pushes the policy's weights `--syncs` times.
Prints a table and saves JSON.

    .venv/bin/python scripts/bench/bench_generation.py --model tiny-a --out docs/bench/generation-tiny-a-2cpu.json
    python scripts/bench/bench_generation.py --model qwen2.5-0.5b-shaped --device cuda   # on a GPU

`qwen2.5-0.5b-shaped` is a randomly initialised model with Qwen2.5-0.5B's shape (494M parameters,
151,936-token vocabulary, tied embeddings), built offline; throughput does not depend on the weights.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from node.argtypes import bounded, count, script_parser
from trainer.batch import sequence_logprobs
from trainer.config import GenerationConfig, ModelConfig, VLLMConfig, default_cache_dir
from trainer.generation import SamplingParams, make_generator, vllm_available
from trainer.policy import encode_prompts
from trainer.presets import load
from rewards import TaskSource
from rewards.config import TasksConfig

SHAPED = "qwen2.5-0.5b-shaped"
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  tie_word_embeddings=True)


def build_shaped(cache_dir: Path, dtype: torch.dtype) -> Path:
    """Qwen2.5-0.5B's architecture with random weights and tiny-a's tokenizer padded to its vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.policy import load_tokenizer
    from trainer.presets import ensure

    path = cache_dir / "bench" / f"{SHAPED}-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").exists():
        return path
    tokenizer = load_tokenizer(str(ensure("tiny-a", cache_dir)))
    tokenizer.add_tokens([f"<x{i}>" for i in range(QWEN25_05B["vocab_size"] - len(tokenizer))])
    config = Qwen2Config(**QWEN25_05B, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def bench_backend(backend: str, policy, args) -> dict:
    cfg = GenerationConfig(backend=backend, batch_size=args.prompts * args.n,
                           vllm=VLLMConfig(gpu_memory_utilization=args.gpu_memory_utilization))
    t0 = time.perf_counter()
    gen = make_generator(cfg, policy)
    startup = time.perf_counter() - t0
    prompts = encode_prompts(policy, [t.prompt for t in TaskSource(TasksConfig().mix(), seed=0).draw(args.prompts)])
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    gen.generate(prompts[:2], params)  # warm-up: first-call compilation and allocation
    times, tokens = [], []
    for rep in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        out = gen.generate(prompts, SamplingParams(**{**params.__dict__, "seed": rep}))
        sync()
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(c.token_ids) for group in out for c in group))
    drift = logprob_drift(policy, prompts, out)
    pushes = []
    for _ in range(args.syncs):
        gen.release()  # as in a round: the trainer steps in between
        sync()
        t0 = time.perf_counter()
        gen.set_weights(policy.model)
        sync()
        pushes.append(time.perf_counter() - t0)
    seconds = sum(times)
    return {
        "backend": backend, "startup_s": startup, "generate_s": times,
        "tokens_per_s": sum(tokens) / seconds, "rollouts_per_s": args.prompts * args.n * args.repeats / seconds,
        "mean_new_tokens": sum(tokens) / (args.prompts * args.n * args.repeats),
        "weight_sync_ms_median": 1000 * statistics.median(pushes), "weight_sync_ms_max": 1000 * max(pushes),
        "max_abs_logprob_diff": drift,
    }


def logprob_drift(policy, prompts, out, rows: int = 64) -> float:
    """Largest gap between the sampling log-probs and a transformers forward pass of the same weights."""
    pairs = [(prompts[i], c) for i, group in enumerate(out) for c in group if c.token_ids][:rows]
    forward = sequence_logprobs(policy.model, [p for p, _ in pairs], [c.token_ids for _, c in pairs],
                                policy.tokenizer.pad_token_id, policy.device)
    return max((f - torch.tensor(c.logprobs)).abs().max().item() for f, (_, c) in zip(forward, pairs))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--model", default="tiny-a", help=f"a tiny preset, a model folder or hub id, or {SHAPED}")
    parser.add_argument("--backends", nargs="+", default=None, help="default: every backend installed")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--prompts", type=count, default=32)
    parser.add_argument("--n", type=count, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=count, default=64)
    parser.add_argument("--repeats", type=count, default=3)
    parser.add_argument("--syncs", type=count, default=5)
    parser.add_argument("--gpu-memory-utilization", type=bounded(float, gt=0, le=1), default=0.3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-generation.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    backends = args.backends or ["transformers"] + (["vllm"] if vllm_available() else [])
    name = args.model
    if args.model == SHAPED:
        on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        name = str(build_shaped(default_cache_dir(), torch.bfloat16 if on_gpu else torch.float32))
    policy = load(ModelConfig(name=name, device=args.device, chat_template=False))
    results = [bench_backend(b, policy, args) for b in backends]

    table = Table(title=f"generation: {args.model}, {args.prompts} prompts x {args.n}, up to {args.new_tokens} new tokens")
    for col in ("backend", "start-up s", "tokens/s", "rollouts/s", "mean new tokens", "sync ms (median)", "sync ms (max)",
                "max |Δ logprob|"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["backend"], f"{r['startup_s']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['rollouts_per_s']:.1f}",
                      f"{r['mean_new_tokens']:.1f}", f"{r['weight_sync_ms_median']:.1f}", f"{r['weight_sync_ms_max']:.1f}",
                      f"{r['max_abs_logprob_diff']:.1e}")
    Console().print(table)
    device = torch.cuda.get_device_name() if policy.device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    report = {"model": args.model, "parameters": sum(p.numel() for p in policy.model.parameters()),
              "dtype": str(next(policy.model.parameters()).dtype), "device": device, "machine": platform.machine(),
              "torch": torch.__version__, "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
