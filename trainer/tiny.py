"""The offline tiny-model recipe: a locally trained tokenizer, a 2-3 layer causal LM, and a short
supervised warm start on the built-in tasks that stops once held-out accuracy reaches a target,
leaving room for RL to show. `trainer.presets` builds them once into the cache.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rewards import TaskSource
from rewards.scoring import CLOSE, OPEN
from rewards.source import DatasetMix

if TYPE_CHECKING:  # the recipe's own imports wait for a build: the table above it is read before torch loads
    import torch
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

RECIPE_VERSION = 3
PAD, EOS = "<|pad|>", "<|eos|>"
TASK_MIX = (DatasetMix("arith"), DatasetMix("reverse"), DatasetMix("count"))
SFT_SEED, VALIDATION_SEED = 1_000_003, 1_000_033  # disjoint from node seeds used for RL and eval


@dataclass(frozen=True)
class TinyPreset:
    arch: Literal["qwen2", "llama"]
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    # The warm start stops once held-out greedy accuracy reaches `target_accuracy` and every task
    # reaches `min_task_accuracy`: RL needs some correct samples on each task to learn from it.
    target_accuracy: float
    # Pieces the BPE may not merge across: letters stay single characters so that reversing and
    # counting stay learnable; tiny-b lets digit runs merge, tiny-a keeps digits single too.
    split_pattern: str
    min_task_accuracy: float = 0.1
    max_sft_steps: int = 3000
    sft_lr: float = 1e-3
    sft_batch: int = 64
    seed: int = 0


PRESETS: dict[str, TinyPreset] = {
    "tiny-a": TinyPreset(arch="qwen2", vocab_size=512, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256,
                         target_accuracy=0.3, split_pattern=r"</?answer>|[A-Za-z0-9]"),
    "tiny-b": TinyPreset(arch="llama", vocab_size=320, hidden=96, layers=3, heads=4, kv_heads=4, intermediate=192,
                         target_accuracy=0.3, split_pattern=r"</?answer>|[A-Za-z]|[0-9]+"),
}


def target_text(answer: str) -> str:
    return f"{OPEN}{answer}{CLOSE}"


def train_tokenizer(preset: TinyPreset) -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus_tasks = TaskSource(list(TASK_MIX), seed=SFT_SEED).draw(4000)
    corpus = [t.prompt + target_text(t.answer) for t in corpus_tasks]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(preset.split_pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=preset.vocab_size, special_tokens=[PAD, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")


def make_model(preset: TinyPreset, tokenizer: PreTrainedTokenizerFast) -> torch.nn.Module:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=len(tokenizer), hidden_size=preset.hidden, intermediate_size=preset.intermediate,
                  num_hidden_layers=preset.layers, num_attention_heads=preset.heads,
                  num_key_value_heads=preset.kv_heads, max_position_embeddings=256, tie_word_embeddings=True,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(preset.seed)
    if preset.arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return LlamaForCausalLM(LlamaConfig(**common))


def build_preset(name: str, out: Path, preset: TinyPreset | None = None) -> dict:
    """Build preset `name` (or a variant of it) into `out`, which must not exist yet; returns its metadata."""
    import torch

    from trainer.batch import collate, token_logprobs
    from trainer.generation.hf import TransformersGenerator
    from trainer.policy import Policy, encode_prompts
    from trainer.rollout import accuracy, accuracy_by_dataset, evaluate

    preset = preset or PRESETS[name]
    started = time.time()
    tokenizer = train_tokenizer(preset)
    model = make_model(preset, tokenizer)
    policy = Policy(model=model, tokenizer=tokenizer, device=torch.device("cpu"), use_chat_template=False)
    generator = TransformersGenerator(policy)
    source = TaskSource(list(TASK_MIX), seed=SFT_SEED)
    validation = TaskSource(list(TASK_MIX), seed=VALIDATION_SEED).draw(200)
    opt = torch.optim.AdamW(model.parameters(), lr=preset.sft_lr)

    def held_out_accuracy() -> tuple[float, float]:
        """Overall accuracy and that of the weakest task."""
        generator.set_weights(model)
        groups = evaluate(generator, policy, validation, max_new_tokens=16, stop=[CLOSE])
        return accuracy(groups), min(accuracy_by_dataset(groups).values())

    (acc, weakest), step = held_out_accuracy(), 0
    while (acc < preset.target_accuracy or weakest < preset.min_task_accuracy) and step < preset.max_sft_steps:
        tasks = source.draw(preset.sft_batch)
        targets = tokenizer([target_text(t.answer) for t in tasks], add_special_tokens=False)["input_ids"]
        batch = collate(encode_prompts(policy, [t.prompt for t in tasks]), [ids + [tokenizer.eos_token_id] for ids in targets],
                        tokenizer.pad_token_id, policy.device)
        model.train()
        logps = token_logprobs(model, batch)
        loss = -(logps * batch.completion_mask).sum() / batch.completion_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        step += 1
        if step % 10 == 0:
            acc, weakest = held_out_accuracy()
            log.info("%s warm start: step %d, loss %.3f, held-out accuracy %.3f (weakest task %.3f)",
                     name, step, loss.item(), acc, weakest)

    if acc < preset.target_accuracy or weakest < preset.min_task_accuracy:
        log.warning("%s warm start stopped at its step cap (%d) below its target: held-out accuracy %.3f, weakest task %.3f",
                    name, step, acc, weakest)
    meta = {"preset": name, "recipe_version": RECIPE_VERSION, **asdict(preset), "sft_steps": step,
            "held_out_accuracy": acc, "weakest_task_accuracy": weakest, "parameters": sum(p.numel() for p in model.parameters()),
            "build_seconds": round(time.time() - started, 1)}
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Declare the generic fast tokenizer: a Llama folder then loads tokenizer.json as trained. transformers
    # 5 still forces its own class on Qwen2 folders; `trainer.policy.load_tokenizer` corrects that.
    config_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(config_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_cfg, indent=2))
    return meta


def preset_dir(name: str, cache_dir: Path, seed: int = 0) -> Path:
    suffix = f"-s{seed}" if seed else ""
    return Path(cache_dir) / "models" / f"{name}-r{RECIPE_VERSION}{suffix}"
