"""A round's peak memory, estimated from the model's shape before anything is loaded, so that a node
picks a plan that fits (`trainer.plan`) and refuses one that cannot, instead of being killed halfway
through a round.

The estimate is deliberately simple and errs high: the policy's weights (once: the transformers generator
samples the trainer's own model; vLLM's CPU build holds a copy, counted by the planner), gradients and two
AdamW moments for every trainable weight (in the weights' dtype; LoRA adapters in float32), the KV cache of
a generation batch, and per training token the activations autograd keeps (per layer, a multiple of the
hidden and MLP widths) plus one chunk of completion logits in float32 (the LM head runs in chunks). The
multiples are calibrated on SmolLM2-135M on this project's CPU machine: the peak RSS of a running node's
step (the second, with AdamW's moments resident; every row its own prompt) at micro-batches 8 and 16, with
full fine-tuning, LoRA and LoRA on an NF4 base, is below the estimate by 12-18%
(docs/bench/round-smollm2-135m-own-prompts-*-2cpu.json, held within a fifth by tests/test_plan.py; shared
prompts need less, so the estimate stays high). A trained LM head adds three copies of its gradient, which a
262,144-entry vocabulary makes 2 GB (Gemma 3 270M's step: 7.58 GB measured, 8.10 estimated,
docs/bench/round-gemma3-270m-own-prompts-mb8-2cpu.json). On a GPU, one H200 run of
SmolLM2-135M (docs/bench/doctor-bench-h200) found the transformers generator's cache needs more than its
size on a card (`trainer.plan.CUDA_CACHE_GROWTH`) and no trained round near the training term, which no
worst-case step has yet checked there.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

log = logging.getLogger(__name__)

FLOAT32 = 4
ACT_PER_HIDDEN, ACT_PER_MLP = 14, 5  # activations kept per layer and token, in units of each width
LOGIT_COPIES = 3  # logits, their float log-softmax and its gradient, per completion token
HEAD_GRAD_COPIES = 3  # the LM head's summed gradient, the next contribution and their sum (head_grad_bytes)
# Float32 logits held at once. The LM head runs over a chunk of completion positions at a time and each
# chunk's logits are recomputed in the backward pass instead of kept (trainer.batch.token_logprobs): the
# full (rows, tokens, vocab) logits of a real vocabulary are GBs (SmolLM2's 49,152 x 512 tokens x 16 rows is
# 1.6 GB, and its log-softmax as much again). A tiny model's whole batch fits in one chunk.
LOGITS_CHUNK_BYTES = 128 * 2**20
NF4_BYTES = 0.5 + FLOAT32 / 64  # 4 bits a weight and a float32 scale per block of 64 (no double quantization)
HOST_OVERHEAD = 1.0e9  # a CPU node's interpreter, torch, tokenizer, node state
GB = 1e9


class MemoryPlanError(ValueError):
    """The configured round cannot fit in this machine's memory; the message names a change that would."""


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    trainable: int
    layers: int
    hidden: int
    mlp: int
    vocab: int
    kv_width: int  # key (= value) width per token and layer
    linear: int = 0  # weights of the attention and MLP projections: what NF4 quantizes
    # per layer and token, the widths of projection inputs that no trained weight reads: autograd keeps a
    # linear layer's input only for its weight's gradient, so under LoRA on the attention alone the MLP's
    # two inputs are not kept (measured: SmolLM2's LoRA step peaks 14% lower in activations than full fine-tuning)
    frozen_inputs: int = 0
    checkpointing: bool = False  # activations recomputed in backward: each layer keeps only its input
    weight_bytes: int = FLOAT32  # per weight value of the policy (and of its activations)
    nf4: bool = False  # the projections held in NF4 (NF4_BYTES a weight), the rest in weight_bytes
    adapted: tuple[str, ...] = ()  # under LoRA, the names (last part; a shared expert's named in it) of the adapted layers
    # under LoRA on a mixture of experts, the parts no adapter reaches ("the 8 routed experts", "the router") and their weights
    frozen_parts: tuple[str, ...] = ()
    frozen_weights: int = 0

    @property
    def lora(self) -> bool:
        return self.trainable < self.parameters


class ShapeError(ValueError):
    """The model's config does not say its shape in any of the names the planner knows."""


# What transformers' configs call each width, across families (Llama-style first; GPT-2, OPT, Falcon, T5-style after)
HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
GATED_MLP = ("intermediate_size",)  # Llama, Qwen, Mistral, Gemma: gate, up and down projections (phi and gpt_neox count high)
PLAIN_MLP = ("n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")  # GPT-2, OPT, Falcon: an up and a down projection
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
ACTIVE_EXPERTS = ("num_experts_per_tok", "moe_topk", "num_selected_experts")
LEARNED_POSITIONS = {"gpt2": "n_positions", "gpt_bigcode": "n_positions", "opt": "max_position_embeddings",
                     "gpt_neo": "max_position_embeddings"}  # a table of position embeddings (rotary ones hold no weights)


def _first(c: dict, names: tuple[str, ...]):
    return next((c[n] for n in names if isinstance(c.get(n), int) and c[n] > 0), None)


def _dims(config: dict) -> dict:
    """The widths the estimate needs, under whichever names the model's family uses; `ShapeError` names the
    model type and the width it lacks."""
    c = config.get("text_config") or config
    got = {k: _first(c, names) for k, names in (("hidden", HIDDEN), ("layers", LAYERS), ("heads", HEADS),
                                                ("vocab", ("vocab_size",)))}
    if missing := [k for k, v in got.items() if v is None]:
        names = {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "vocab": ("vocab_size",)}[missing[0]]
        raise ShapeError(f"model type {c.get('model_type') or config.get('model_type') or 'unknown'!r}: its config "
                         f"gives no {missing[0]} size ({', '.join(names)}), so its memory cannot be planned")
    hidden, heads = got["hidden"], got["heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv_heads = 1 if c.get("multi_query") and not c.get("new_decoder_architecture") else _first(c, KV_HEADS) or heads
    gated = _first(c, GATED_MLP) is not None
    mlp = _first(c, GATED_MLP) or _first(c, PLAIN_MLP) or 4 * hidden
    experts, expert_mlp, shared, active = _experts(c, mlp)
    positions = c.get(LEARNED_POSITIONS.get(c.get("model_type") or config.get("model_type"), ""), 0)
    return dict(got, head_dim=head_dim, kv_width=kv_heads * head_dim, gated=gated, mlp=mlp, experts=experts,
                expert_mlp=expert_mlp, shared=shared, active_mlp=active, positions=positions,
                tied=config.get("tie_word_embeddings", c.get("tie_word_embeddings", True)))


def _experts(c: dict, mlp: int) -> tuple[int, int, int, int]:
    """A mixture's routed experts, each one's MLP width, the shared experts' width, and the MLP width a token
    runs through (the routed ones it picks and the shared); a dense model: no experts, `mlp` throughout."""
    experts = _first(c, EXPERTS) or 0
    if not experts:
        return 0, mlp, 0, mlp
    expert_mlp = c.get("moe_intermediate_size") or mlp
    shared = c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * expert_mlp
    return experts, expert_mlp, shared, (_first(c, ACTIVE_EXPERTS) or 1) * expert_mlp + shared


SHARED_EXPERT = "shared_expert"  # how a mixture's always-on expert is named (Qwen2-MoE's; DeepSeek's shared_experts)
ROUTERS = ("gate", "router")  # a mixture's router, where it is a linear layer (transformers 5's are not)
ALL_LINEAR = "all-linear"  # model.lora.target_modules: every linear layer but the output embedding (peft's shorthand)
Targets = Sequence[str] | Literal["all-linear"]
CONTEXT = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length", "n_ctx")


class AdapterError(ValueError):
    """model.lora.target_modules names no layer the model has; the message lists the ones it has."""


def context_length(config: dict) -> int | None:
    """The most positions the model takes, prompt and completion together (GPT-2's table of 1024 position
    embeddings is indexed past its end by a longer sequence); None where its config gives no limit."""
    return _first(config.get("text_config") or config, CONTEXT)


def linear_layers(model) -> dict[str, tuple[int, int]]:
    """Every linear layer of `model` (torch's Linear, bitsandbytes' 4-bit ones among them, and transformers' Conv1D,
    GPT-2's) by full name, with its input and output widths: what LoRA adapts. The output embedding is left out, and
    with it any layer of the same last name: peft is given the targets by their last names."""
    import torch
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    head_name = next((n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head), None) if head is not None else None
    layers = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == head_name:
            continue
        if isinstance(module, torch.nn.Linear):
            layers[name] = (module.in_features, module.out_features)
        elif isinstance(module, Conv1D):
            layers[name] = (module.nx, module.nf)
    return layers


def config_linear_layers(config: dict) -> dict[str, tuple[int, int]] | None:
    """`linear_layers` of the model `config` describes, built on the meta device: no weights, about 0.1 s for a 7B
    model on 2 CPU cores (its family's code imported; 20-100 ms for the next config), once per config (the planner
    asks for every candidate plan). None where transformers cannot build the model from its config alone:
    one with its own code, or a config that names no model type (the planner's tests describe models so)."""
    if not config.get("model_type"):
        return None
    built = _built_layers(json.dumps(config, sort_keys=True, default=str))
    return None if built is None else dict(built)


@functools.lru_cache(maxsize=16)
def _built_layers(config_json: str) -> tuple[tuple[str, tuple[int, int]], ...] | None:
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = json.loads(config_json)
    try:
        described = CONFIG_MAPPING[config["model_type"]].from_dict(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(described)
    except Exception as e:  # noqa: BLE001 - a model transformers cannot build here is read by its widths instead
        log.debug("cannot build %s on the meta device (%s): its linear layers are read from its widths",
                  config.get("model_type"), (str(e).splitlines() or [type(e).__name__])[0])
        return None
    return tuple(linear_layers(model).items())


def adapted(layers: dict[str, tuple[int, int]], targets: Targets) -> dict[str, tuple[int, int]]:
    """The layers that get adapters: every one for all-linear, else those a target names, whole or as the last
    parts of their name (peft's rule); `AdapterError` when the list is empty or one of its names matches none of
    them (the adapters would silently leave out what the user meant), listing the names the model has."""
    if targets == ALL_LINEAR:
        return dict(layers)
    named = lambda name, target: name == target or name.endswith(f".{target}")  # noqa: E731
    missing = [t for t in targets if not any(named(n, t) for n in layers)]
    if missing or not targets:
        have = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in layers})) or "none"
        what = f"{', '.join(missing)} {'matches' if len(missing) == 1 else 'match'}" if missing else "it names"
        raise AdapterError(f"model.lora.target_modules {list(targets)}: {what} no linear layer of the model (its linear "
                           f"layers: {have}); name some of those, or all-linear")
    return {n: s for n, s in layers.items() if any(named(n, t) for t in targets)}


def shape_from_config(config: dict, lora_r: int | None = None, lora_targets: Targets = ALL_LINEAR) -> ModelShape:
    """The shape of a decoder-only transformer from its config.json alone (no weights read): parameters
    counted from the widths (embeddings, attention, the MLP or every expert of a mixture; biases and norms are
    a rounding error), trainable ones, when `lora_r` is given, from the LoRA rank and the linear layers the target
    modules name (`config_linear_layers`, else Llama's projections by the widths). A mixture of experts holds
    every expert's weights but runs only the routed ones per token."""
    d = _dims(config)
    hidden, heads, head_dim, kv_width, layers = d["hidden"], d["heads"], d["head_dim"], d["kv_width"], d["layers"]
    attention = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_width), "v_proj": (hidden, kv_width),
                 "o_proj": (heads * head_dim, hidden)}
    mlp = {"gate_proj": (hidden, d["mlp"]), "up_proj": (hidden, d["mlp"]), "down_proj": (d["mlp"], hidden)}
    if not d["gated"]:
        del mlp["gate_proj"]
    widths = attention | mlp
    routed = router = 0
    if d["experts"]:  # the routed experts (gated), the shared ones and the router, in place of one MLP
        routed, router = d["experts"] * 3 * hidden * d["expert_mlp"], hidden * d["experts"]
        mlp_weights = routed + 3 * hidden * d["shared"] + router
    else:
        mlp_weights = sum(i * o for i, o in mlp.values())
    linear = layers * (sum(i * o for i, o in attention.values()) + mlp_weights)
    embeddings = (d["vocab"] * (1 if d["tied"] else 2) + d["positions"]) * hidden
    parameters = embeddings + linear + layers * 2 * hidden + hidden
    trainable, frozen_inputs, names, labels, frozen = parameters, 0, (), (), {}
    if lora_r is not None:
        built = config_linear_layers(config)
        every = built or {f"{k}.{name}": w for k in range(layers) for name, w in widths.items()}
        chosen = adapted(every, lora_targets)
        trainable = lora_r * sum(i + o for i, o in chosen.values())
        names = tuple(sorted({n.rsplit(".", 1)[-1] for n in chosen}))
        labels = tuple(sorted({_label(n) for n in chosen}))
        if d["experts"] and built:  # a model read by its widths alone: which of its layers are experts is not known
            frozen = _unadapted_moe(chosen, d["experts"], layers * routed, layers * router)
        parameters += trainable
        has = {n.rsplit(".", 1)[-1] for n in every}
        readers = [(hidden, ("q_proj", "k_proj", "v_proj")), (heads * head_dim, ("o_proj",)),
                   (hidden, ("gate_proj", "up_proj")), (d["active_mlp"], ("down_proj",))]  # each input, and the projections reading it
        # counted for Llama's names only: another family's untrained inputs are kept in the estimate (it errs high)
        frozen_inputs = sum(width for width, group in readers if set(group) & has and not set(group) & set(names))
    return ModelShape(parameters=parameters, trainable=trainable, layers=layers, hidden=hidden, mlp=d["active_mlp"],
                      vocab=d["vocab"], kv_width=kv_width, linear=linear, frozen_inputs=frozen_inputs, adapted=labels,
                      frozen_parts=tuple(frozen), frozen_weights=sum(frozen.values()))


def _label(layer: str) -> str:
    """How the plan names an adapted layer: its last name, after the shared expert's where it sits in one (Qwen2-MoE's
    shared_expert.gate_proj, not to be read as the routed experts' gate_proj)."""
    *path, last = layer.split(".")
    shared = next((p for p in path if p.startswith(SHARED_EXPERT)), None)
    return f"{shared}.{last}" if shared else last


def _unadapted_moe(chosen: dict[str, tuple[int, int]], experts: int, routed: int, router: int) -> dict[str, int]:
    """The parts of a mixture of experts that adapters on the `chosen` linear layers leave frozen, with their weights
    (`routed` and `router`, all layers): the routed experts where no layer of theirs is adapted (transformers 5
    holds each block's experts as two 3-D weights, which are no linear layers; a remote-code model's per-expert
    layers are), the router where it is no adapted linear layer."""
    paths = [n.split(".") for n in chosen]
    frozen = {} if any("experts" in p[:-1] for p in paths) else {f"the {experts} routed experts": routed}
    return frozen | ({} if any(p[-1] in ROUTERS for p in paths) else {"the router": router})


@dataclass(frozen=True)
class RoundShape:
    rows: int  # sequences per optimizer step
    generation_rows: int  # sequences decoding at once
    prompt_tokens: int  # the longest prompt
    completion_tokens: int  # max_new_tokens

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def weights_bytes(m: ModelShape) -> float:
    quantized = m.linear if m.nf4 else 0
    return (m.parameters - quantized) * m.weight_bytes + quantized * NF4_BYTES


def optimizer_bytes(m: ModelShape) -> float:
    """Gradients and two AdamW moments per trainable weight: LoRA adapters train in float32 (peft casts
    them), full fine-tuning in the weights' own dtype."""
    return 3 * m.trainable * (FLOAT32 if m.lora else m.weight_bytes)


def activation_bytes(m: ModelShape, r: RoundShape, micro_batch: int) -> float:
    layer = ACT_PER_HIDDEN * m.hidden + ACT_PER_MLP * m.mlp - m.frozen_inputs
    kept = m.layers * m.hidden + layer if m.checkpointing else m.layers * layer
    logits = micro_batch * m.vocab * FLOAT32 * min(r.completion_tokens, max(1, LOGITS_CHUNK_BYTES // (
        micro_batch * m.vocab * FLOAT32)))  # one chunk of positions (at least one) at a time
    # An NF4 projection is dequantized for its matmul, and again for its backward pass (bitsandbytes 0.50 keeps
    # neither copy). Measured on the CPU backend, SmolLM2's step still peaks 0.87 GB above LoRA on a float32 base,
    # beyond the smaller weights: about two float32 copies of every projection, which the allocator holds on to.
    # Counted so, for every layer (one with checkpointing); on a card not yet measured
    dequantized = 2 * (m.linear // m.layers if m.checkpointing else m.linear) * m.weight_bytes if m.nf4 else 0
    return micro_batch * r.tokens * kept * m.weight_bytes + LOGIT_COPIES * logits + dequantized + head_grad_bytes(m)


def head_grad_bytes(m: ModelShape) -> float:
    """The LM head's gradient while the backward pass starts, every activation still kept: autograd sums the
    contributions of the head's uses (each logits chunk, and the input embedding when tied) out of place before
    adding them to the resident gradient, so three vocab x hidden matrices are alive at once, whatever the
    micro-batch. Measured on the CPU: 2.01 GB above the resident gradient for a tied 262,144 x 640 head (Gemma 3
    270M's), 0.69 GB for an untied one in a single chunk. A frozen head (LoRA) has none."""
    return 0.0 if m.lora else HEAD_GRAD_COPIES * m.vocab * m.hidden * m.weight_bytes


def kv_cache_bytes(m: ModelShape, r: RoundShape, rows: int | None = None) -> float:
    """KV cache and last-position logits of `rows` sequences decoding together (default: the round's)."""
    rows = r.generation_rows if rows is None else rows
    return rows * (r.tokens * m.layers * 2 * m.kv_width * m.weight_bytes + 2 * m.vocab * FLOAT32)


HOST_MARGIN = 0.15  # of the machine's memory, kept for the rest of it by a node given no share (at least 1 GB)
UNLIMITED = 2**62  # cgroup v1 spells "no limit" as a page-rounded 2**63 - 1


def _kb_fields(path: str) -> dict[str, float]:
    """The `Key:  N kB` lines of a /proc file, in bytes (empty where the file is not there)."""
    file = Path(path)
    lines = [line.split(":", 1) for line in file.read_text().splitlines() if ":" in line] if file.exists() else []
    return {k: float(v.split()[0]) * 1024 for k, v in lines if v.strip().endswith("kB")}


def _meminfo() -> dict[str, float]:
    return _kb_fields("/proc/meminfo")


def cgroup_limit() -> float:
    """The memory limit of this process's container (cgroup v2 or v1), or infinity."""
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        if path.exists():
            text = path.read_text().strip()
            return float("inf") if text == "max" or int(text) >= UNLIMITED else float(text)
    return float("inf")


def total_bytes() -> float:
    """The memory this process's machine (or container) has in all."""
    return min(cgroup_limit(), _meminfo().get("MemTotal", float("inf")))


def host_budget() -> float:
    """What a node with no share may plan on the host: the container's limit where one is set (a share given
    by whoever set it), else the memory available now less a margin for the rest of the machine, so that
    a node started beside others does not plan for the whole machine."""
    limit, info = cgroup_limit(), _meminfo()
    available = info.get("MemAvailable", float("inf"))
    margin = max(1 * GB, HOST_MARGIN * info.get("MemTotal", 0.0))
    return min(limit, available - margin)


def peak_rss_bytes() -> float | None:
    """This process's peak resident size since the last call (Linux; None elsewhere): each call starts a
    new window, so that each round is measured on its own."""
    peak = _kb_fields("/proc/self/status").get("VmHWM")
    if peak is None:
        return None
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    except OSError:
        pass  # then the window is the process's whole life: still an upper bound
    return peak
