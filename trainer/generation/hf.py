"""The transformers backend: the CPU default, and the reference the other backends must match.

Its own decode loop rather than `generate`, for two savings a GRPO round lives on: each prompt runs
once and its n completions decode on copies of its KV cache, and rows leave the batch as they
finish (`generate` keeps every row until the longest one stops, and a round's lengths vary widely).
"""

from __future__ import annotations

from typing import Sequence

import torch

from trainer.batch import kv_cache_name
from trainer.generation.base import Completion, SamplingParams, isolated_rng, to_completion
from trainer.policy import Policy

COMPACT_SHARE = 0.25  # drop finished rows from the batch once they are this share of it (a copy of the cache)
NUCLEUS_K = 64  # top-p looks at this many most likely tokens first; a row whose nucleus is wider sorts the vocabulary


class TransformersGenerator:
    """Samples from the trainer's own model, LoRA adapters on: no second copy of the weights. A round
    generates, then trains, never both at once, so nothing disturbs an in-flight batch; each step leaves
    the model in eval mode (dropout off, LoRA's included)."""

    def __init__(self, policy: Policy, batch_size: int = 256):
        self.model = policy.model
        self.tokenizer = policy.tokenizer
        self.device = policy.device
        self.batch_size = batch_size
        self.terminators = set(policy.stop_token_ids) | {self.tokenizer.pad_token_id}
        self.weight_version = 0

    def set_weights(self, model: torch.nn.Module) -> None:
        """Nothing to copy: the model is sampled in place from now on."""
        self.model = model
        self.weight_version += 1

    def release(self) -> None:
        """Nothing to give back: the weights are the trainer's."""

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        per_batch = max(1, self.batch_size // params.n)  # prompts whose rows decode together
        with isolated_rng(self.device):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            done = [c for i in range(0, len(prompt_ids), per_batch)
                    for c in self._sample(list(prompt_ids[i : i + per_batch]), params)]
        return [done[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]

    def _sample(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """`params.n` completions of each prompt, in prompt order."""
        enc = self.tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(self.device)
        attn = enc["attention_mask"]
        out = self.model(input_ids=enc["input_ids"], attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                         use_cache=True, logits_to_keep=1)
        copies = torch.arange(len(prompts), device=self.device).repeat_interleave(params.n)
        name = kv_cache_name(self.model)
        cache, logits, attn = getattr(out, name), out.logits[copies, -1], attn[copies]
        cache.batch_select_indices(copies)
        rows = list(range(len(copies)))  # the output row of each batch row
        finished = [False] * len(rows)
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        window = max((len(s) for s in params.stop), default=0)  # tokens that can hold a stop string
        for step in range(params.max_new_tokens):
            chosen = self._choose(logits, params)
            chosen_logps = logits.gather(-1, chosen[:, None])[:, 0] - logits.logsumexp(-1)
            for i, (row, tok, lp) in enumerate(zip(rows, chosen.tolist(), chosen_logps.tolist())):
                if finished[i]:
                    continue
                tokens[row].append(tok)
                logprobs[row].append(lp)
                finished[i] = tok in self.terminators or (window > 0 and self._stopped(tokens[row][-window:], params.stop))
            if all(finished) or step == params.max_new_tokens - 1:
                break
            if sum(finished) >= COMPACT_SHARE * len(finished):
                keep = [i for i, f in enumerate(finished) if not f]
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                attn, chosen = attn[index], chosen[index]
                rows, finished = [rows[i] for i in keep], [False] * len(keep)
            attn = torch.cat([attn, attn.new_ones(len(attn), 1)], dim=1)
            out = self.model(input_ids=chosen[:, None], attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                             use_cache=True, **{name: cache})
            logits = out.logits[:, -1]
        return [to_completion(self.tokenizer, self.terminators, t, lp, params.stop, self.weight_version)
                for t, lp in zip(tokens, logprobs)]

    def _stopped(self, tail: list[int], stop: Sequence[str]) -> bool:
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return any(s in text for s in stop)

    @staticmethod
    def _choose(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The next token of each row: argmax at temperature 0, else a draw from the tempered nucleus (the
        most likely tokens until their mass covers top_p). The nucleus of a sharpened model is a handful of
        tokens: it is looked for among the NUCLEUS_K most likely first, and the whole vocabulary is sorted
        (and sampled) only for rows whose nucleus is wider."""
        if params.temperature == 0:
            return logits.argmax(-1)
        scaled = logits.float() / params.temperature
        if params.top_p >= 1:
            return torch.multinomial(scaled.softmax(-1), 1)[:, 0]
        top, order = scaled.topk(min(NUCLEUS_K, scaled.shape[-1]), dim=-1)
        ranked = (top - scaled.logsumexp(-1, keepdim=True)).exp()  # the true probabilities of the top tokens
        chosen = order.gather(-1, _nucleus_draw(ranked, params.top_p))[:, 0]
        wide = ranked.sum(-1) <= params.top_p  # the nucleus reaches past the top tokens: sort them all
        if wide.any():
            full, full_order = scaled[wide].softmax(-1).sort(-1, descending=True)
            chosen[wide] = full_order.gather(-1, _nucleus_draw(full, params.top_p))[:, 0]
        return chosen


def _nucleus_draw(ranked: torch.Tensor, top_p: float) -> torch.Tensor:
    """One position per row of `ranked` (probabilities in descending order), drawn within the nucleus."""
    ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked > top_p, 0)  # the mass before them already covers top_p
    return torch.multinomial(ranked, 1)
