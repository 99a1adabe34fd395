"""The sampling copies' decode step for Llama and Qwen2 models, written out as tensor operations.

A decode step computes one token for each of a few dozen rows, so on a CPU its matrix products are short and
what surrounds them counts: transformers' forward calls some fifteen modules, wrappers and hooks a layer and
builds a mask each step, where this step runs the same arithmetic as a plain loop over each layer's weights,
with the query, key and value projections multiplied as one matrix and the gate and up projections as another
(their weights concatenated once; the copy's own layers keep views into them, so its prefill and its refresh
from the trainer's weights are unchanged and nothing is held twice). Other architectures, and a copy whose
cache holds a sliding-window layer, decode through transformers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2")  # pre-norm decoders whose layers are attention and a gated SiLU MLP, with rotary positions

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Layer:
    """One decoder layer's weights, as the step multiplies them."""
    norm_in: torch.Tensor
    qkv: Linear
    out: Linear
    norm_mlp: torch.Tensor
    gate_up: Linear
    down: Linear


class DecodeStep:
    """`step(ids, attn, cache)`: the next-token logits (float32) of each row, one new token a row, its keys and
    values written into `cache` (whose full-attention layers are `SplitLayer` or `GrowingLayer`: the attention
    over them is the generator's own, `attend`)."""

    def __init__(self, model: torch.nn.Module, join: Callable[[list[torch.nn.Module]], torch.nn.Module],
                 attend: Callable[..., torch.Tensor]):
        """`join`: one linear layer for several of the same input; `attend(cache_layer, query, key, value, mask,
        scaling)`: a decode step's attention, query heads folded by key-value head."""
        config, body = model.config, model.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.width = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps, self.scaling = config.rms_norm_eps, self.width ** -0.5
        self.embed, self.rotary, self.norm = body.embed_tokens.weight, body.rotary_emb, body.norm.weight
        self.head = model.get_output_embeddings()
        self.attend = attend
        attention = [layer.self_attn for layer in body.layers]
        self.layers = [Layer(layer.input_layernorm.weight, join([a.q_proj, a.k_proj, a.v_proj]).forward, a.o_proj.forward,
                             layer.post_attention_layernorm.weight, join([layer.mlp.gate_proj, layer.mlp.up_proj]).forward,
                             layer.mlp.down_proj.forward) for layer, a in zip(body.layers, attention)]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The RMS norm as Llama computes it: in float32, scaled by the weight in the hidden states' dtype."""
        return weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)

    def __call__(self, ids: torch.Tensor, attn: torch.Tensor, cache) -> torch.Tensor:
        rows = len(ids)
        positions = attn.sum(-1, keepdim=True) - 1
        mask = None if bool(attn.all()) else attn.bool()[:, None, None, :]  # the prompts' left padding
        x = F.embedding(ids, self.embed)  # (rows, hidden)
        cos, sin = (t[:, :, None, :] for t in self.rotary(x[:, None], positions))  # (rows, 1, 1, width)
        turned, half = self.heads + self.kv_heads, self.width // 2  # the query and key heads, rotated together
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(x, layer.norm_in)).view(rows, -1, 1, self.width)  # (rows, heads, 1, width)
            qk = qkv[:, :turned]
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
            query, (key, value) = qk[:, : self.heads], cache.layers[i].update(qk[:, self.heads :], qkv[:, turned:])
            x = x + layer.out(self.attend(cache.layers[i], query, key, value, mask, self.scaling).reshape(rows, -1))
            gate, up = layer.gate_up(self._norm(x, layer.norm_mlp)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return self.head(self._norm(x, self.norm)).float()


def fits(model: torch.nn.Module) -> bool:
    """Whether `DecodeStep` computes what `model`'s own forward does (over a cache of full-attention layers)."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in FAMILIES and getattr(config, "hidden_act", None) == "silu"
            and not hasattr(model, "peft_config") and not getattr(config, "mlp_bias", False)
            and getattr(config, "pretraining_tp", 1) <= 1)
