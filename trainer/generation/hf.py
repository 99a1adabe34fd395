"""The transformers backend: the CPU default, and the reference the other backends must match.

Its own decode loop rather than `generate` (or transformers' continuous batching, `generate_batch`, which
on 2 CPU cores samples a round 3.4-4x slower: docs/bench/speed.md, "Sampling on the CPU"), for what a GRPO
round lives on:
- the prompts' shared head (chat template, system prompt, worked example) runs once for all of them, each
  prompt's own tail once, and its n completions decode on copies of that KV cache;
- rows leave the batch as they finish (`generate` keeps every row until the longest one stops);
- the cache is allocated once for the whole completion and written in place (`GrowingLayer`), which is
  also what the memory planner counts (trainer/memory.py `kv_cache_bytes`);
- optionally (`wide_dtype`, on CPUs with bfloat16 matrix instructions: trainer/precision.py) a bfloat16 copy of the
  weights runs the prompts and every decoding step of more than `NARROW_ROWS` rows, where its matrix products
  are 2-4x faster than float32's; the narrow steps of a batch's tail, where a CPU's bfloat16 products are
  slower than float32's and every step reads all the weights for a few rows, run on an int8 copy (a byte a
  weight, one scale per output channel: 1.5x float32's speed there), or for a LoRA model on the trainer's own
  weights (docs/bench/speed.md, "Sampling on the CPU");
- the wide copy's cache keeps the prompts' shared head once and each row's own prompt and completion in one buffer
  with room (`SplitLayer`), its decode steps attend over them with batched products (the head's for every row at
  once), and the narrow tail's rows run SDPA with the query heads folded (`attend`): SDPA's CPU kernel, one query a
  row, took over a quarter of a 64-row step and, unmasked, a fifth of a narrow one;
- the copies of Llama and Qwen2 models decode through their own step (trainer/generation/decode_step.py), the same
  arithmetic without transformers' modules around it, each layer's query, key and value projections one product.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trainer.batch import kv_cache_name
from trainer.generation.decode_step import DecodeStep, fits
from trainer.generation.base import Cancel, Cancelled, Completion, SamplingParams, isolated_rng, never, to_completion
from trainer.policy import Policy

COMPACT_SHARE = 0.25  # drop finished rows from the batch once they are this share of it (a copy of the cache)
SHARED_HEAD_MIN = 8  # prompts that begin with this many equal tokens run them once, for all of them
NUCLEUS_K = 64  # top-p looks at this many most likely tokens first; a row whose nucleus is wider sorts the vocabulary
NARROW_ROWS = 4  # decoding steps of at most this many rows run on the int8 copy (or the trainer's own weights), never the wide one


class TransformersGenerator:
    """Samples from the trainer's own model, LoRA adapters on: no second copy of the weights. A round
    generates, then trains, never both at once, so nothing disturbs an in-flight batch; each step leaves
    the model in eval mode (dropout off, LoRA's included)."""

    def __init__(self, policy: Policy, batch_size: int = 256, wide_dtype: torch.dtype | None = None):
        self.model = policy.model
        own = next(self.model.parameters()).dtype
        self.wide = _cast_copy(self.model, wide_dtype) if wide_dtype not in (None, own) else None
        # beside a wide copy on the CPU, an int8 one takes the narrow tail, whose steps read every weight for a few
        # rows; a LoRA model's adapters keep it on the trainer's own weights
        int8 = self.wide is not None and policy.device.type == "cpu" and not hasattr(self.model, "peft_config")
        self.narrow = _int8_copy(self.model) if int8 else None
        self.tokenizer = policy.tokenizer
        self.device = policy.device
        self.batch_size = batch_size
        self.terminators = set(policy.stop_token_ids) | {self.tokenizer.pad_token_id}
        self.weight_version = 0
        # a sliding window counts cache slots, padding included: a head shared before left-padded tails would
        # put padding inside the window (Gemma 3, Mistral): such models run each prompt whole
        self.shares_heads = all(type(layer) is DynamicLayer for layer in DynamicCache(config=self.model.config).layers)
        self.steps: dict[torch.nn.Module, DecodeStep] = {}
        self._keep_steps()

    def set_weights(self, model: torch.nn.Module) -> None:
        """The model is sampled in place from now on; a wide copy takes its weights (0.04-0.12 s for 135M on 2 cores)."""
        self.model = model
        if self.wide is not None:
            self.wide = _refreshed(self.wide, model)
        if self.narrow is not None:
            self.narrow = _refreshed_int8(self.narrow, model)
        self._keep_steps()
        self.weight_version += 1

    def _keep_steps(self) -> None:
        """The copies' own decode steps (`DecodeStep`), for the architectures it computes, made once a copy."""
        copies = [m for m in (self.wide, self.narrow) if m is not None and self.shares_heads and fits(m)]
        self.steps = {m: self.steps.get(m) or DecodeStep(m, _joined, attend) for m in copies}

    def release(self) -> None:
        """Nothing to give back: the weights are the trainer's."""

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[list[int]], params: SamplingParams,
                 cancel: Cancel = never) -> list[list[Completion]]:
        per_batch = max(1, self.batch_size // params.n)  # prompts whose rows decode together
        with isolated_rng(self.device):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            done = [c for i in range(0, len(prompt_ids), per_batch)
                    for c in self._sample(list(prompt_ids[i : i + per_batch]), params, cancel)]
        return [done[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]

    def _sample(self, prompts: list[list[int]], params: SamplingParams, cancel: Cancel) -> list[Completion]:
        """`params.n` completions of each prompt, in prompt order."""
        model = self.model if self.wide is None else self.wide  # the wide copy, if any, until the batch narrows
        cache, logits, attn = self._prefill(model, prompts, params)
        copies = torch.arange(len(prompts), device=self.device).repeat_interleave(params.n)
        logits, attn = logits[copies], attn[copies]
        cache.batch_select_indices(copies)
        rows = list(range(len(copies)))  # the output row of each batch row
        finished = [False] * len(rows)
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        window = max((len(s) for s in params.stop), default=0)  # tokens that can hold a stop string
        for step in range(params.max_new_tokens):
            if cancel():
                raise Cancelled
            chosen = self._choose(logits, params)
            chosen_logps = logits.gather(-1, chosen[:, None])[:, 0] - log_normalizer(logits)[:, 0]
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
            model = self._narrowed(model, len(rows), cache)
            attn = torch.cat([attn, attn.new_ones(len(attn), 1)], dim=1)
            if model in self.steps:
                logits = self.steps[model](chosen, attn, cache)
            else:
                logits = self._forward(model, chosen, attn, cache)
        return [to_completion(self.tokenizer, self.terminators, t, lp, params.stop, self.weight_version)
                for t, lp in zip(tokens, logprobs)]

    def _forward(self, model: torch.nn.Module, chosen: torch.Tensor, attn: torch.Tensor, cache) -> torch.Tensor:
        """A decode step through transformers' forward (architectures `DecodeStep` does not compute, the trainer's
        own weights): each row's next-token logits."""
        split = {"split_cache": cache} if model is self.wide else {}  # what `decode_attention` reads the prompts from
        out = model(input_ids=chosen[:, None], attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                    use_cache=True, **{kv_cache_name(self.model): cache}, **split)
        if split:
            _check_split(cache)
        return out.logits[:, -1].float()

    def _narrowed(self, model: torch.nn.Module, rows: int, cache) -> torch.nn.Module:
        """The weights of a step of `rows` rows: the wide copy until the batch narrows, then the int8 copy (else the
        trainer's own weights), the cache handed over to them once (`_hand_over`)."""
        if model is not self.wide or rows > NARROW_ROWS:
            return model
        narrow = self.narrow or self.model
        _hand_over(cache, next(narrow.parameters()).dtype)
        return narrow

    def _prefill(self, model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams):
        """Runs the prompts on `model`: their shared head once, then each one's tail (left-padded, so that every row's
        next token lands in the same column). Returns the KV cache, sized for the completions to come, the
        logits of each prompt's next token and the attention mask over the cache."""
        name = kv_cache_name(self.model)
        head = _shared_head(prompts) if self.shares_heads else 0
        extra = {}
        if head:
            out = model(input_ids=torch.tensor([prompts[0][:head]], device=self.device), use_cache=True, logits_to_keep=1)
            extra[name] = getattr(out, name)
            extra[name].batch_repeat_interleave(len(prompts))
        enc = self.tokenizer.pad({"input_ids": [p[head:] for p in prompts]}, return_tensors="pt").to(self.device)
        attn = torch.cat([enc["attention_mask"].new_ones(len(prompts), head), enc["attention_mask"]], dim=1)
        out = model(input_ids=enc["input_ids"], attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)[:, head:],
                    use_cache=True, logits_to_keep=1, **extra)
        cache = getattr(out, name)
        for i, layer in enumerate(cache.layers):
            if type(layer) is DynamicLayer and model is self.wide:  # sliding-window layers keep their own bounded storage
                cache.layers[i] = SplitLayer(layer.keys, layer.values, params.max_new_tokens, head)
            elif type(layer) is DynamicLayer:
                cache.layers[i] = GrowingLayer(layer.keys, layer.values, params.max_new_tokens)
        return cache, out.logits[:, -1].float(), attn

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
        ranked = (top - log_normalizer(scaled)).exp()  # the true probabilities of the top tokens
        chosen = order.gather(-1, _nucleus_draw(ranked, params.top_p))[:, 0]
        wide = ranked.sum(-1) <= params.top_p  # the nucleus reaches past the top tokens: sort them all
        if wide.any():
            full, full_order = scaled[wide].softmax(-1).sort(-1, descending=True)
            chosen[wide] = full_order.gather(-1, _nucleus_draw(full, params.top_p))[:, 0]
        return chosen


class GrowingLayer(DynamicLayer):
    """A full-attention layer's keys and values in buffers with room for the whole completion: a decode step
    writes its position in place, where `DynamicLayer` copies the layer's cache into a new one (torch.cat, a
    fifth of a 64-row decode step on SmolLM2-135M)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        batch, heads, length, width = keys.shape
        self.device, self.is_initialized, self.length = keys.device, True, length
        # zeros in the room: the wide copy's attention multiplies it (`SplitLayer`), masked
        self.key_buffer = keys.new_zeros(batch, heads, length + room, width)
        self.value_buffer = values.new_zeros(batch, heads, length + room, width)
        self.key_buffer[:, :, :length], self.value_buffer[:, :, :length] = keys, values
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            raise RuntimeError(f"GrowingLayer: {end} positions do not fit the {self.key_buffer.shape[-2]} it was sized for")
        self.key_buffer[:, :, self.length : end], self.value_buffer[:, :, self.length : end] = key_states, value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self._view()

    def cast(self, dtype: torch.dtype) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer.to(dtype), self.value_buffer.to(dtype)
        self._view()


class SplitLayer(GrowingLayer):
    """The wide copy's cache of a full-attention layer, in two parts: the prompts' shared head once (the same keys
    for every row), and each row's own rest of its prompt followed by its completion, a `GrowingLayer`'s buffers
    (zeros until written). The attention (`_split_attention`) multiplies the head for all rows in one product,
    and each row's buffer whole, room included: at a decode step's few queries a row, a batched product's cost is
    the count of its matrices more than their size, and over a part of a buffer it would copy the buffer first
    (over half of a hand-written attention's time at 64 rows of SmolLM2-135M)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int, head: int = 0):
        super().__init__(keys[:, :, head:], values[:, :, head:], room)
        # the shared head, (key-value heads, head, width), or None
        self.head_keys, self.head_values = (t[0, :, :head].contiguous() if head else None for t in (keys, values))
        self.prompt, self.unread = keys.shape[2] - head, False  # each row's own prompt; whether a step left it unread

    def completion(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, self.prompt :], self.values[:, :, self.prompt :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        super().update(key_states, value_states)
        self.unread = True
        return self.completion()

    def heads(self) -> int:
        """Positions in the shared head."""
        return 0 if self.head_keys is None else self.head_keys.shape[1]

    def get_seq_length(self) -> int:
        return self.heads() + self.length

    def grown(self, dtype: torch.dtype) -> GrowingLayer:
        """The whole cache so far in a `GrowingLayer` of `dtype`, with the room that is left: what other weights
        decode on from (their attention reads one tensor)."""
        rows = len(self.keys)
        head_keys, head_values = ([] if self.head_keys is None else [t.expand(rows, *t.shape)]
                                  for t in (self.head_keys, self.head_values))
        return GrowingLayer(torch.cat([*head_keys, self.keys], dim=2).to(dtype),
                            torch.cat([*head_values, self.values], dim=2).to(dtype), self.key_buffer.shape[2] - self.length)


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     split_cache=None, **kwargs) -> tuple[torch.Tensor, None]:
    """The sampling copies' attention inside transformers' forward (registered as `DECODE_ATTENTION`): decode steps
    over a `SplitLayer`, or over any other cache with no padding left, go to `attend`. Everything else (the prompts,
    a layer with a mask) goes to transformers' SDPA."""
    layer = None if split_cache is None else split_cache.layers[module.layer_idx]
    split = isinstance(layer, SplitLayer)
    if query.shape[2] != 1 or dropout or kwargs.get("softcap") is not None or not (split or attention_mask is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows, heads, _, width = query.shape
    out = attend(layer, query, key, value, attention_mask, width ** -0.5 if scaling is None else scaling)
    return out.reshape(rows, 1, heads, width), None


def attend(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scaling: float) -> torch.Tensor:
    """A decode step's attention, one query a row, each key-value head's query heads folded into rows
    (rows, key-value heads, their query heads, width):
    - over a `SplitLayer` (the wide copy's), `_split_attention`: 1.3x SDPA's CPU kernel at 64 rows with the prompt
      apart from the completion, and a further 1.2x (640 -> 520 microseconds a layer) with each row's buffer
      multiplied whole;
    - over any other cache, SDPA on the folded rows, as transformers does itself only when a mask is given; with none
      it asks SDPA for `enable_gqa`, 4x slower on a CPU at one query (200 against 46 microseconds a layer for 3 rows
      of SmolLM2-135M)."""
    rows, heads, _, width = query.shape
    folded = query.reshape(rows, key.shape[1], heads // key.shape[1], width)
    if isinstance(layer, SplitLayer):
        return _split_attention(layer, folded, mask, scaling)
    return torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)


def _split_attention(layer: SplitLayer, query: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """Scores over the shared head and each row's buffer (its room masked), one softmax over them all (in float32,
    as the eager attention does). The head's products take every row's queries at once: (key-value heads, rows x
    query heads, width) against the one copy of its keys."""
    layer.unread = False
    rows, kv_heads, groups, width = query.shape
    head, written = layer.heads(), layer.get_seq_length()
    parts = [query @ layer.key_buffer.transpose(2, 3)]
    if head:
        across = query.transpose(0, 1).reshape(kv_heads, rows * groups, width)  # every row's queries, by key-value head
        parts.insert(0, (across @ layer.head_keys.transpose(1, 2)).view(kv_heads, rows, groups, head).transpose(0, 1))
    scores = torch.cat(parts, dim=-1).float() * scaling
    scores[..., written:] = float("-inf")  # the room not written yet
    if attention_mask is not None:  # (rows, 1, 1, positions): the prompts' padding
        seen = scores[..., :written]
        if attention_mask.dtype == torch.bool:
            seen.masked_fill_(~attention_mask, float("-inf"))
        else:
            seen.add_(attention_mask)
    probs = scores.softmax(-1).to(query.dtype)
    out = probs[..., head:] @ layer.value_buffer
    if head:
        shared = probs[..., :head].transpose(0, 1).reshape(kv_heads, rows * groups, head) @ layer.head_values
        out = out + shared.view(kv_heads, rows, groups, width).transpose(0, 1)
    return out


DECODE_ATTENTION = f"{__name__}.decode_attention"  # per module: a revision's copy of this file (bench_round.py) registers its own
AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


def _check_split(cache) -> None:
    """A model whose attention did not read a `SplitLayer`'s prompt part would have attended to its completion alone."""
    if any(getattr(layer, "unread", False) for layer in cache.layers):
        raise RuntimeError("the bfloat16 copy's attention did not read its prompts' keys (decode_attention not reached)")


def _cast_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` whose parameters are in `dtype` (tied ones stay tied) and whose buffers (rotary
    frequencies) keep theirs, built without a second full-precision copy on the way."""
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in model.parameters()}
    wide = copy.deepcopy(model, memo).eval()
    wide.set_attn_implementation(DECODE_ATTENTION)
    # the prefill's last positions are a strided view: a bfloat16 linear layer on a CPU would multiply them
    # as a batch, copying the output weights once per prompt (0.7 s of a 1.2 s prefill on SmolLM2-135M)
    wide.get_output_embeddings().register_forward_pre_hook(
        lambda _, args: (args[0].clone(memory_format=torch.contiguous_format), *args[1:]))
    return wide


class Int8Linear(torch.nn.Module):
    """A linear layer's weights in int8, one scale per output channel, multiplied with bfloat16 inputs."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.register_buffer("weight", torch.empty(linear.weight.shape, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(linear.out_features, dtype=torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else torch.empty(linear.out_features, dtype=torch.bfloat16))
        self.load(linear)

    @torch.no_grad()
    def load(self, linear: torch.nn.Linear) -> None:
        """Takes `linear`'s weights, in place."""
        w = linear.weight.float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.weight.copy_((w / scale[:, None]).round_().clamp_(-127, 127))
        self.scale.copy_(scale)
        if self.bias is not None:
            self.bias.copy_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.scale)
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _joined(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One linear layer computing what `parts` (linear layers of one input) compute, their outputs side by side: their
    weights (int8 scales, biases) concatenated once, each part's own now a view into them, so that writing the parts
    in place (a refresh) writes this one too and nothing is held twice."""
    if len(parts) == 1:
        return parts[0]
    names = [name for name, t in [*parts[0].named_parameters(recurse=False), *parts[0].named_buffers(recurse=False)]
             if t is not None]
    whole = {name: torch.cat([getattr(part, name) for part in parts]) for name in names}
    params = {name for name, _ in parts[0].named_parameters(recurse=False)}
    as_kept = {name: torch.nn.Parameter(t, requires_grad=False) if name in params else t for name, t in whole.items()}
    joined = copy.deepcopy(parts[0], {id(getattr(parts[0], name)): t for name, t in as_kept.items()})
    start = 0
    for part in parts:
        end = start + part.weight.shape[0]
        for name in names:
            view = whole[name][start:end]
            setattr(part, name, torch.nn.Parameter(view, requires_grad=False) if name in params else view)
        start = end
    return joined


def _int8_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers an int8 copy holds in int8: torch's kernel reads inputs 16 at a time (a layer of 4, 8, 24,
    36 or 40 inputs crashed the process, measured on torch 2.13); the others stay bfloat16."""
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0}


def _int8_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A bfloat16 copy of `model` whose linear layers hold int8 weights (`Int8Linear`) where the kernel takes them."""
    linears = _int8_linears(model)
    tied = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False)}
    memo = {id(p): None for m in linears.values() for p in m.parameters() if id(p) not in tied}  # replaced below
    memo.update({id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False)
                 for p in model.parameters() if id(p) not in memo})
    narrow = copy.deepcopy(model, memo).eval()
    narrow.set_attn_implementation(DECODE_ATTENTION)
    for name, linear in linears.items():
        parent, _, child = name.rpartition(".")
        setattr(narrow.get_submodule(parent) if parent else narrow, child, Int8Linear(linear))
    return narrow


def _refreshed_int8(narrow: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """`narrow` (an `_int8_copy`) holding `model`'s weights now: in place, or a new copy for another architecture."""
    ours = dict(narrow.named_modules())
    linears = _int8_linears(model)
    if not all(isinstance(ours.get(name), Int8Linear) for name in linears):
        return _int8_copy(model)
    for name, linear in linears.items():
        ours[name].load(linear)
    _copy_parameters(narrow, model)
    return narrow


def _refreshed(wide: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """`wide` holding `model`'s weights now: copied in place, or a new copy if `model` is another architecture."""
    if dict(wide.named_parameters()).keys() != dict(model.named_parameters()).keys():
        return _cast_copy(model, next(wide.parameters()).dtype)
    _copy_parameters(wide, model)
    return wide


@torch.no_grad()
def _copy_parameters(copy_: torch.nn.Module, model: torch.nn.Module) -> None:
    """Every parameter of `copy_` takes the value of `model`'s of the same name, in its own dtype."""
    theirs = dict(model.named_parameters())
    for name, p in copy_.named_parameters():
        p.copy_(theirs[name])


def _hand_over(cache, dtype: torch.dtype) -> None:
    """A KV cache written by the wide copy, in the dtype and layout of the weights that decode on from it."""
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, SplitLayer):
            cache.layers[i] = layer.grown(dtype)
        elif isinstance(layer, GrowingLayer):
            layer.cast(dtype)
        else:
            layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)


def _shared_head(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (0 below `SHARED_HEAD_MIN`, or for a single prompt), leaving
    each prompt at least one token of its own: the one whose logits start its completions."""
    if len(prompts) < 2:
        return 0
    head = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        head = next((i for i in range(head) if p[i] != first[i]), head)
    return head if head >= SHARED_HEAD_MIN else 0


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp over the vocabulary (keeping the dimension), twice a decoding step. On 2 cores torch's
    `logsumexp` took three times as long for 64 rows of 49,152 float32 logits (5.2-6.9 ms) as its max, shift, exp and
    sum as four operations (1.7-2.2 ms). A row of -inf stays -inf, one holding +inf is +inf, as in `logsumexp`."""
    top = logits.amax(-1, keepdim=True)
    top = torch.where(top.isinf(), 0.0, top)
    return top + (logits - top).exp_().sum(-1, keepdim=True).log_()


def _nucleus_draw(ranked: torch.Tensor, top_p: float) -> torch.Tensor:
    """One position per row of `ranked` (probabilities in descending order), drawn within the nucleus."""
    ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked > top_p, 0)  # the mass before them already covers top_p
    return torch.multinomial(ranked, 1)
