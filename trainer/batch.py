"""The padded tensors the trainer runs on, built from rollout groups (trainer/groups.py).

Prompts are left-padded and completions right-padded, so every completion starts at the same
column and the LM head only runs over the completion region. The G completions of a group share
one prompt, which the trainer can run once per micro-batch instead of once per row.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from trainer.memory import LOGITS_CHUNK_BYTES



@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, P + C)
    attention_mask: torch.Tensor  # (B, P + C)
    completion_mask: torch.Tensor  # (B, C) float, 1 on real completion tokens
    prompt_len: int  # P
    prompt_index: torch.Tensor  # (B,) rows with equal values have equal prompts

    def select(self, rows: torch.Tensor) -> "Batch":
        return Batch(self.input_ids[rows], self.attention_mask[rows], self.completion_mask[rows], self.prompt_len,
                     self.prompt_index[rows])


def collate(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device) -> Batch:
    P = max(len(p) for p in prompts)
    C = max(1, max(len(c) for c in completions))
    ids = torch.full((len(prompts), P + C), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    cmask = torch.zeros((len(prompts), C))
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        ids[i, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, P - len(p) : P + len(c)] = 1
        cmask[i, : len(c)] = 1
    first: dict[tuple[int, ...], int] = {}
    prompt_index = torch.tensor([first.setdefault(tuple(p), len(first)) for p in prompts], dtype=torch.long)
    return Batch(ids.to(device), attn.to(device), cmask.to(device), P, prompt_index.to(device))


def token_logprobs(model: torch.nn.Module, batch: Batch, share_prompts: bool = False) -> torch.Tensor:
    """Log-probs (B, C) of each completion token under `model` (0 past the longest completion); gradients flow if enabled.

    Columns that are padding in every row (left of the longest prompt, right of the longest
    completion) are not run: a subset of a round's rows is often much shorter than the round's longest.
    `share_prompts` runs each distinct prompt once and its completions on the prompt's KV cache
    (gradients flow through the cache); a model with gradient checkpointing drops that cache in
    training, so its trainer leaves this off. The LM head runs in chunks (`LOGITS_CHUNK_BYTES`).
    """
    P, C = batch.prompt_len, batch.completion_mask.shape[1]
    used = batch.attention_mask.any(0).nonzero()
    start = int(used.min()) if len(used) else P
    ends = batch.completion_mask.any(0).nonzero()
    width = int(ends.max()) + 1 if len(ends) else 1
    ids, attn = batch.input_ids[:, start : P + width], batch.attention_mask[:, start : P + width]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    prompt = P - start
    decoder, name = _decoder(model), kv_cache_name(model)
    if share_prompts:
        distinct, rows_of = batch.prompt_index.unique(return_inverse=True)
        # one row of each prompt (any: their prompt columns are equal)
        first = torch.empty_like(distinct).scatter_(0, rows_of, torch.arange(len(rows_of), device=rows_of.device))
        head = decoder(input_ids=ids[first, :prompt], attention_mask=attn[first, :prompt],
                       position_ids=positions[first, :prompt], use_cache=True)
        cache = getattr(head, name)
        cache.batch_select_indices(rows_of)
        tail = decoder(input_ids=ids[:, prompt:], attention_mask=attn, position_ids=positions[:, prompt:],
                       use_cache=True, **{name: cache}).last_hidden_state
        hidden = torch.cat([head.last_hidden_state[rows_of, -1:], tail[:, :-1]], dim=1)
    else:
        hidden = decoder(input_ids=ids, attention_mask=attn, position_ids=positions,
                         use_cache=False).last_hidden_state[:, prompt - 1 : prompt + width - 1]
    config = decoder.config
    logps = head_logprobs(model.get_output_embeddings(), hidden, ids[:, prompt:],
                          scale=getattr(config, "logit_scale", None), cap=getattr(config, "final_logit_softcapping", None))
    return torch.nn.functional.pad(logps, (0, C - width))


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, scale: float | None = None,
                  cap: float | None = None) -> torch.Tensor:
    """log softmax(head(hidden))[targets], (B, W), chunk by chunk over W; with gradients, each chunk's
    logits are recomputed in the backward pass (activation checkpointing) rather than kept. `scale` and
    `cap` are what some model types do to the head's output (Cohere's logit scale, Gemma's soft-capping)."""
    rows, width = targets.shape
    step = max(1, LOGITS_CHUNK_BYTES // (4 * rows * head.weight.shape[0]))
    keep_graph = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    parts = []
    for a in range(0, width, step):
        args = (head, hidden[:, a : a + step], targets[:, a : a + step], scale, cap)
        parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if keep_graph and step < width
                     else _chunk_logprobs(*args))
    return torch.cat(parts, dim=1)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, scale: float | None,
                    cap: float | None) -> torch.Tensor:
    """Under a step's bfloat16 autocast too, the head runs in its weights' dtype: bfloat16 logits of a float32 model
    would move its log-probs by about 0.01 a token, which the off-support gate and the metrics read."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = head(hidden.to(head.weight.dtype)).float()
    if scale:
        logits = logits * scale
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.gather(-1, targets[..., None])[..., 0] - logits.logsumexp(-1)


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer under the LM head (LoRA adapters, injected in place, included)."""
    return _unwrapped(model).get_decoder()


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a PEFT wrapper (whose forward takes **kwargs and has no decoder of its own)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def kv_cache_name(model: torch.nn.Module) -> str:
    """What a forward calls its KV cache, argument and output: `cache` since transformers 5.2x renamed
    `past_key_values` (kept until 5.40 with a warning on every call), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(_unwrapped(model).forward).parameters else "past_key_values"


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                      device: torch.device) -> list[torch.Tensor]:
    """Each completion's token log-probs under `model`, unpadded, on the CPU: what a sampler's own
    log-probs are checked against."""
    forward = token_logprobs(model, collate(prompts, completions, pad_id, device)).float().cpu()
    return [forward[i, : len(c)] for i, c in enumerate(completions)]
