"""The transformers backend: the CPU default, and the reference the other backends must match."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from transformers import GenerationConfig as HFGenerationConfig

from trainer.generation import Completion, SamplingParams, isolated_rng, to_completion
from trainer.policy import Policy, plain_copy


class TransformersGenerator:
    """Samples from its own plain copy of the policy, so training never disturbs an in-flight batch."""

    def __init__(self, policy: Policy, batch_size: int = 256):
        self.model = plain_copy(policy.model).eval().requires_grad_(False)
        # A checkpoint's own generation_config (top_k, repetition penalty, ...) would otherwise fill
        # in whatever a call leaves unset and change what the sampling parameters mean.
        self.model.generation_config = HFGenerationConfig()
        self.tokenizer = policy.tokenizer
        self.device = policy.device
        self.batch_size = batch_size
        self.terminators = set(policy.stop_token_ids) | {self.tokenizer.pad_token_id}
        self.weight_version = 0

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)
        self.weight_version += 1

    def release(self) -> None:
        """Nothing to give back: the copy is as large as the weights and stays put."""

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        flat = [ids for ids in prompt_ids for _ in range(params.n)]
        with isolated_rng(self.device):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            done = [c for i in range(0, len(flat), self.batch_size) for c in self._sample(flat[i : i + self.batch_size], params)]
        return [done[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]

    def _sample(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        enc = self.tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(self.device)
        greedy = params.temperature == 0
        gen_cfg = HFGenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else 0,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=sorted(self.terminators),
            pad_token_id=self.tokenizer.pad_token_id,
            stop_strings=list(params.stop) or None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out = self.model.generate(**enc, generation_config=gen_cfg, tokenizer=self.tokenizer)
        new_tokens = out.sequences[:, enc["input_ids"].shape[1] :]
        logprobs = torch.stack([step.float().log_softmax(-1).gather(-1, tok[:, None])[:, 0]
                                for step, tok in zip(out.logits, new_tokens.T)], dim=1)
        return [to_completion(self.tokenizer, self.terminators, row.tolist(), lp.tolist(), params.stop,
                              self.weight_version) for row, lp in zip(new_tokens, logprobs)]
