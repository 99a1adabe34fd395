"""How a node runs on the machine it finds: backend, dtype, LoRA or full fine-tuning, an NF4 base,
gradient checkpointing, micro-batch and vLLM's share of the card, chosen from the device's free memory and
the model's shape before any weights are loaded (`trainer.memory` holds the estimates).

Every choice the user made stands; the planner fills in the rest, preferring what learns and runs
fastest: full fine-tuning over LoRA, vLLM over the transformers generator (which needs no copy of the
weights), a 16-bit base over an NF4 one, no recomputation over gradient checkpointing, then the fastest
micro-batch that fits (not the largest: the memory it would take is left to the rest of the machine).
A plan that cannot fit is refused with the smallest change that would. Pure code: it is
tested on described cards; only `probe` touches the hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from trainer import memory
from trainer.precision import bf16_cpu, bf16_pays
from trainer.memory import GB, MemoryPlanError, ModelShape, RoundShape

DeviceKind = Literal["cuda", "mps", "cpu"]
CUDA_RESERVE = 1.0e9  # CUDA context, cuBLAS workspaces and allocator fragmentation, beyond the estimate
# transformers' KV cache grows a step at a time, and on a card the caching allocator keeps the outgrown
# blocks: SmolLM2-135M decoding 64 rows to 512 tokens on an H200 reserved 2.6x its cache in float32 and
# 1.9x in bfloat16 above the weights (docs/bench/doctor-bench-h200/long-{full,8gb}.json)
CUDA_CACHE_GROWTH = 2.6
VLLM_OVERHEAD = 1.5e9  # vLLM's activations, sampler and CUDA graphs inside its share
GOOD_MICRO = 8  # a plan with at least this micro-batch (or the whole step) beats one that saves memory below it
# The micro-batch that runs a step fastest, where measured: SmolLM2-135M's step on 2 CPU cores took 47.3 / 28.6 /
# 32.6 s at 4 / 8 / 16 (docs/bench/round-smollm2-135m-2cpu.json): past 8 the activations outgrow the caches. Elsewhere
# (a GPU) the largest that fits, which keeps the device busiest (not measured here).
FASTEST_MICRO = {"cpu": 8}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def article(number: float) -> str:
    """"an" before a number said with a vowel first (8, 11, 18, 80-89, 800...), else "a"."""
    whole = f"{number:g}".split(".")[0]
    return "an" if whole.startswith("8") or whole in ("11", "18") else "a"


@dataclass(frozen=True)
class Device:
    kind: DeviceKind
    name: str
    free_bytes: float  # what the node may use
    total_bytes: float
    bf16: bool = False  # a card with bfloat16 support; a CPU with AMX tiles or AVX512-BF16 (bfloat16 products faster than float32)

    @classmethod
    def card(cls, gb: float, name: str | None = None, bf16: bool = True) -> "Device":
        """A described CUDA card with `gb` GB free (tests, `sapo doctor --card`)."""
        return cls("cuda", name or f"{article(gb)} {gb:g} GB CUDA card", gb * GB, gb * GB, bf16)

    @property
    def bf16_cpu(self) -> bool:
        return self.kind == "cpu" and self.bf16

    def __str__(self) -> str:
        return f"{self.kind} ({self.name}, {self.free_bytes / GB:.1f} GB free)"


@dataclass(frozen=True)
class Wants:
    """The user's settings; None leaves the choice to the planner."""
    backend: str | None = None
    dtype: str | None = None
    lora: bool | None = None
    checkpointing: bool | None = None
    quantize: str | None = None  # "nf4" or "none"; None: the planner's (NF4 only when a 16-bit base does not fit)
    micro_batch: int = 0  # 0: the planner's
    generation_batch: bool = False  # the user set generation.batch_size: the transformers generator's rows stand
    vllm_share: float | None = None
    vllm_sleep: bool = True
    sampling_dtype: str | None = None  # generation.sampling_dtype: "model" or "bfloat16"; None: the planner's
    compute_dtype: str | None = None  # grpo.compute_dtype: "model" or "bfloat16"; None: the planner's
    lora_r: int = 16
    lora_targets: memory.Targets = memory.ALL_LINEAR  # model.lora.target_modules (a list as a tuple)
    vllm_installed: bool = False
    peft_installed: bool = True
    bnb_installed: bool = False


@dataclass(frozen=True)
class Plan:
    device: Device
    backend: str
    dtype: str
    lora: bool
    checkpointing: bool
    nf4: bool  # the frozen base's projections in NF4
    micro_batch: int
    generation_rows: int  # sequences the generator decodes at once (transformers: generation.batch_size)
    vllm_share: float | None  # of the card's total memory; None off CUDA or without vLLM
    vllm_sleep: bool
    sampling_copy: bool  # the transformers generator keeps a bfloat16 copy (and an int8 one) of the weights to sample with
    parts: dict[str, float]  # what the peak is made of
    peak_bytes: float
    budget_bytes: float
    model: ModelShape
    round: RoundShape  # as the generator decodes it
    why: list[str] = field(default_factory=list)
    bf16_step: bool = False  # the training step's products autocast to bfloat16 over float32 weights

    @property
    def sampling_dtype(self) -> str:
        return "bfloat16" if self.sampling_copy else "model"

    @property
    def compute_dtype(self) -> str:
        return "bfloat16" if self.bf16_step else "model"

    @property
    def training(self) -> str:
        return ("LoRA on an NF4 base" if self.nf4 else "LoRA") if self.lora else "full fine-tuning"

    def peak_at(self, rows: int, positions: int, completion_tokens: int) -> float:
        """The expected peak of a round whose largest micro-batch ran `rows` sequences in `positions` positions (a
        group's prompt runs once) and whose longest completion is `completion_tokens` long: what a node's measured
        peak is compared with, since the plan is for the worst round (every row its own prompt, every completion
        at max_new_tokens), which a real one is far below."""
        # decoding the round's own rows (the window a node compares holds no evaluation)
        decoding = replace(self.round, generation_rows=min(self.round.generation_rows, self.round.rows),
                           completion_tokens=completion_tokens)
        parts = estimate(self.device, self.model, decoding, self.backend, self.micro_batch, self.vllm_share, self.vllm_sleep,
                         self.sampling_copy)
        step = replace(self.round, prompt_tokens=0, completion_tokens=max(1, round(positions / rows)))
        parts["training"] = estimate(self.device, self.model, step, self.backend, rows, self.vllm_share,
                                     self.vllm_sleep)["training"]
        return peak(parts)

    def summary(self) -> str:
        how = self.training
        extra = [f"vLLM share {self.vllm_share:.2f}{' with sleep mode' if self.vllm_sleep else ''}"] if self.vllm_share else []
        if self.checkpointing:
            extra.append("gradient checkpointing")
        if self.sampling_copy:
            extra.append("a bfloat16 copy samples")
        if self.bf16_step:
            extra.append("bfloat16 products train")
        return (f"{self.device}: {self.backend} backend, {self.dtype} weights, {how}, micro-batch {self.micro_batch}"
                + "".join(f", {e}" for e in extra) + f"; expected peak {self.peak_bytes / GB:.1f} GB of "
                f"{self.budget_bytes / GB:.1f} GB usable")

    def adapters(self) -> str | None:
        """Under LoRA, the layers that get adapters and the weights they train (None under full fine-tuning): what
        `sapo doctor` and a node's log say, so that a model whose layers are named otherwise is seen to be adapted, and
        a mixture of experts whose experts get none (transformers fuses them into weights that are no linear layers)
        is seen not to train them."""
        if not self.lora:
            return None
        m = self.model
        line = f"adapters on {', '.join(m.adapted)}: {m.trainable:,} trainable weights ({m.trainable / m.parameters:.2%} of the model)"
        if not m.frozen_parts:
            return line
        return (f"{line}; {' and '.join(m.frozen_parts)} ({m.frozen_weights / m.parameters:.1%} of the weights) get "
                f"none and do not train")

    def record(self) -> dict:
        """What the plan chose and expected, in GB, for a run folder's plan.json and `sapo doctor --bench`."""
        adapters = {"lora_targets": list(self.model.adapted), "trainable": self.model.trainable,
                    "frozen": list(self.model.frozen_parts)} if self.lora else {}
        return {"summary": self.summary(), "device": str(self.device), "backend": self.backend, "dtype": self.dtype,
                "lora": self.lora, **adapters, "nf4": self.nf4, "micro_batch": self.micro_batch,
                "generation_rows": self.generation_rows,
                "sampling_dtype": self.sampling_dtype, "compute_dtype": self.compute_dtype,
                "peak_gb": round(self.peak_bytes / GB, 3), "budget_gb": round(self.budget_bytes / GB, 3),
                "parts_gb": {k: round(v / GB, 3) for k, v in self.parts.items()}}


def budget_of(device: Device) -> float:
    """What plans may fill: on a GPU the free memory less a reserve for what the estimate leaves out."""
    return device.free_bytes if device.kind == "cpu" else device.free_bytes * 0.95 - CUDA_RESERVE


def choose_dtype(device: Device, lora: bool, wants: Wants) -> tuple[str, str | None]:
    """The policy's dtype, and why when it is not the obvious one."""
    if wants.dtype is not None:
        if wants.dtype != "float32" and not lora:
            return wants.dtype, (f"{wants.dtype} weights as asked; full fine-tuning in {wants.dtype} loses AdamW "
                                 "updates smaller than 1/256 of a weight (most of them at small learning rates)")
        return wants.dtype, None
    if device.kind == "cuda" and lora and device.bf16:
        return "bfloat16", "LoRA: the frozen base weights in bfloat16, the adapters in float32"
    if device.kind == "cuda" and not lora:
        return "float32", ("full fine-tuning keeps float32 weights: in bfloat16 an AdamW update smaller than 1/256 of "
                           "its weight rounds away")
    return "float32", None


def estimate(device: Device, m: ModelShape, r: RoundShape, backend: str, micro: int, share: float | None,
             sleep: bool, sampling_copy: bool = False) -> dict[str, float]:
    """The peak's parts: what stays resident, plus the larger of training's and generation's extra. The KV cache
    is counted in the weights' dtype, also where a bfloat16 sampling copy writes it in half that."""
    parts = {"weights": memory.weights_bytes(m), "optimizer": memory.optimizer_bytes(m),
             "overhead": memory.HOST_OVERHEAD if device.kind == "cpu" else CUDA_RESERVE}
    training = memory.activation_bytes(m, r, micro)
    if backend == "vllm" and device.kind == "cuda":
        engine = (share or 0.0) * device.total_bytes
        generation, training = engine, training + (0.0 if sleep else engine)
        parts["generator"] = 0.0
    else:  # the transformers generator samples the trainer's own model or its copies; vLLM's CPU build holds a copy
        parts["generator"] = (memory.weights_bytes(m) if backend == "vllm"
                              else _copies_bytes(m) if sampling_copy else 0.0)
        generation = memory.kv_cache_bytes(m, r) * (CUDA_CACHE_GROWTH if device.kind == "cuda" else 1.0)
    parts["training"], parts["generation"] = training, generation
    return parts


def peak(parts: dict[str, float]) -> float:
    return sum(v for k, v in parts.items() if k not in ("training", "generation")) + max(parts["training"], parts["generation"])


def step_peak(config: dict, kind: str, rows: int, positions_per_row: float, prompt_tokens: int,
              targets: memory.Targets = memory.ALL_LINEAR) -> float:
    """The estimated peak of one training step on a CPU (float32, no generator running): a micro-batch of `rows`
    sequences of `positions_per_row` positions each, `prompt_tokens` of them prompt, for `kind` full, lora or nf4
    (LoRA on an NF4 base, adapters on `targets`). What scripts/bench/bench_round.py prints beside the peak it measures."""
    m = shape(config, kind != "full", False, "float32", Wants(lora_targets=targets), nf4=kind == "nf4")
    ran = RoundShape(rows=rows, generation_rows=rows, prompt_tokens=prompt_tokens,
                     completion_tokens=max(1, round(positions_per_row) - prompt_tokens))
    return peak(estimate(Device("cpu", "a measured CPU", float("inf"), float("inf")), m, ran, "transformers", rows, None, False))


def vllm_share_needed(device: Device, m: ModelShape, r: RoundShape) -> float:
    """The share of the card vLLM needs for its weights (in the policy's dtype, as the engine is started),
    the round's sequences' KV cache and its own work."""
    need = memory.weights_bytes(m) + memory.kv_cache_bytes(m, r) + VLLM_OVERHEAD
    return math.ceil(100 * need / device.total_bytes) / 100  # above 0.95 it cannot fit, and the estimate says so


def plan(device: Device, config: dict, r: RoundShape, wants: Wants) -> Plan:
    """The first plan that fits, in order of preference; `MemoryPlanError` with the smallest change when none does."""
    if wants.backend == "vllm" and device.kind == "mps":
        raise MemoryPlanError("generation.backend: vLLM does not run on Apple MPS; use transformers (or auto)")
    found = _first_fit(device, config, r, wants)
    if isinstance(found, Plan):
        return found
    raise MemoryPlanError(_smallest_change(device, config, r, wants, found))


def candidates(device: Device, wants: Wants) -> list[tuple[str, bool, bool, bool, bool]]:
    """(backend, LoRA, checkpointing, NF4 base, bfloat16 sampling copy) in order of preference, within what the
    user set: first the backend of choice, then vLLM's own copy of the weights given up for the transformers
    generator, which samples the trainer's model, last an NF4 base under LoRA (on transformers: vLLM would load
    a 16-bit copy). On a CPU with bfloat16 matrix instructions the transformers generator samples from a bfloat16 copy where it
    fits, else from the trainer's weights; a float32 policy is all it copies (see `_fit`)."""
    loras = [wants.lora] if wants.lora is not None else [False, True] if wants.peft_installed else [False]
    ckpts = [wants.checkpointing] if wants.checkpointing is not None else [False, True]
    if wants.quantize == "nf4":
        return [("transformers", True, ckpt, True, False) for ckpt in ckpts]
    out = [(b, lora, ckpt, False, copy) for b, copies in _backends(device, wants) for lora in loras for ckpt in ckpts
           for copy in copies]
    if wants.quantize is None and wants.bnb_installed and True in loras and wants.backend != "vllm":
        out += [("transformers", True, ckpt, True, False) for ckpt in ckpts]
    return out


def _backends(device: Device, wants: Wants) -> list[tuple[str, list[bool]]]:
    """The backends to try, each with whether its generator keeps a bfloat16 sampling copy, in order of preference:
    the user's choice, else a copy first on a CPU with bfloat16 matrix instructions (a round's sampling measured 1.5-2x there), never unasked
    elsewhere; vLLM holds its own weights."""
    backend = wants.backend or ("vllm" if device.kind == "cuda" and wants.vllm_installed else "transformers")
    backends = [backend, "transformers"] if backend == "vllm" and wants.backend is None else [backend]
    if wants.sampling_dtype is not None:
        copies = [wants.sampling_dtype == "bfloat16"]
    else:
        copies = [True, False] if device.bf16_cpu else [False]
    return [(b, copies if b == "transformers" else [False]) for b in backends]


def _copies_bytes(m: ModelShape) -> float:
    """A bfloat16 sampling copy, and beside it, unless LoRA's adapters are what trains, the int8 copy of the narrow
    tail: a byte a weight, its embeddings kept in bfloat16 (counted as if tied to an int8 output layer; SmolLM2-135M:
    191 MB counted, 192 MB measured)."""
    int8 = 0.0 if m.lora else m.parameters + 2 * m.vocab * m.hidden
    return m.parameters * DTYPE_BYTES["bfloat16"] + int8


def _copies(device: Device, dtype: str, m: ModelShape, wants: Wants) -> bool:
    """Whether a candidate that may keep a bfloat16 sampling copy does for this policy: a 16-bit policy samples
    itself, and unasked the generator's own rule (`bf16_pays`) decides."""
    if wants.sampling_dtype == "bfloat16":
        return dtype == "float32"
    return bf16_pays(device.bf16_cpu, dtype == "float32", m.hidden)


def _bf16_step(device: Device, dtype: str, m: ModelShape, wants: Wants) -> bool:
    """Whether the training step's products autocast to bfloat16: as the user set it, else by the sampling copies'
    rule (`bf16_pays`). Its memory is inside the float32 step's estimate: the bfloat16 weights autocast makes are offset
    by the bfloat16 activations it saves (docs/bench/speed.md, "Training with bfloat16 products on the CPU")."""
    if wants.compute_dtype is not None:
        return wants.compute_dtype == "bfloat16"
    return bf16_pays(device.bf16_cpu, dtype == "float32", m.hidden)


def _first_fit(device: Device, config: dict, r: RoundShape, wants: Wants) -> Plan | tuple[Plan, int]:
    """The preferred plan that fits, or the most memory-saving one tried and the largest micro-batch it fits."""
    fitted = [_fit(device, config, r, wants, *candidate) for candidate in candidates(device, wants)]
    usable = [(c, best) for c, best in fitted if best and (not wants.micro_batch or wants.micro_batch <= best)]
    good = [c for c, best in usable if best >= min(r.rows, GOOD_MICRO)]
    if good:
        return good[0]
    if usable:  # none reaches a good micro-batch: the one that comes closest (the first, on a tie)
        return max(usable, key=lambda cb: cb[1])[0]
    return fitted[-1]


def shape(config: dict, lora: bool, ckpt: bool, dtype: str, wants: Wants, nf4: bool = False) -> ModelShape:
    m = memory.shape_from_config(config, wants.lora_r if lora else None, wants.lora_targets)
    return replace(m, checkpointing=ckpt, weight_bytes=DTYPE_BYTES[dtype], nf4=nf4)


def _fit(device: Device, config: dict, r: RoundShape, wants: Wants, backend: str, lora: bool,
         ckpt: bool, nf4: bool, copy: bool) -> tuple[Plan, int]:
    """This candidate at the micro-batch it would run (the user's, else the fastest that fits), and the
    largest that fits (0: not even one sequence)."""
    dtype, why = choose_dtype(device, lora, wants)
    if nf4:
        why = (f"LoRA on an NF4 base: the projections in 4 bits a weight, the rest of the base in {dtype}, the adapters "
               "in float32" + (": a 16-bit base does not fit" if wants.quantize is None else ""))
    m = shape(config, lora, ckpt, dtype, wants, nf4)
    copy &= _copies(device, dtype, m, wants)
    on_vllm_gpu = backend == "vllm" and device.kind == "cuda"
    sleep = wants.vllm_sleep and on_vllm_gpu
    budget = budget_of(device)
    # vLLM's share, or the transformers generator's batch: room for every sequence of the round (and of the
    # held-out evaluation) at once if that fits, else for fewer, decoded in turns; what the user set stands
    chooses_rows = wants.vllm_share is None if on_vllm_gpu else backend == "transformers" and not wants.generation_batch
    for rows in [r.generation_rows, *_halvings(r.generation_rows)] if chooses_rows else [r.generation_rows]:
        decoding = replace(r, generation_rows=rows)
        share = (wants.vllm_share or vllm_share_needed(device, m, decoding)) if on_vllm_gpu else None
        best = next((b for b in range(max(r.rows, wants.micro_batch), 0, -1)
                     if peak(estimate(device, m, decoding, backend, b, share, sleep, copy)) <= budget), 0)
        if best:
            break
    micro = wants.micro_batch or min(best, r.rows, FASTEST_MICRO.get(device.kind, r.rows)) or 1
    parts = estimate(device, m, decoding, backend, micro, share, sleep, copy)
    reasons = [why] if why else []
    if on_vllm_gpu and wants.vllm_share is None:
        reasons.append(f"vLLM gets {share:.2f} of the card: its weights, the KV cache of {rows} sequences "
                       f"of {r.tokens} tokens at once, and {VLLM_OVERHEAD / GB:.1f} GB for its own work")
    elif rows < r.generation_rows:
        reasons.append(f"the generator decodes {rows} sequences at a time, not all {r.generation_rows}: more would not fit")
    return Plan(device, backend, dtype, lora, ckpt, nf4, micro, rows, share, sleep, copy, parts, peak(parts), budget, m,
                decoding, reasons, _bf16_step(device, dtype, m, wants)), best


def _smallest_change(device: Device, config: dict, r: RoundShape, wants: Wants, tried: tuple[Plan, int]) -> str:
    """What the most memory-saving plan allowed needs, and the first single change (in the order a user would
    rather make them) with which a plan fits."""
    last, best = tried
    gb = lambda x: f"{x / GB:.1f} GB"  # noqa: E731
    how = ", ".join([last.training, f"{last.dtype} weights"]
                    + (["gradient checkpointing"] if last.checkpointing else []) + [f"micro-batch {last.micro_batch}"])
    phase = "generating" if last.parts["generation"] > last.parts["training"] else "training"
    head = (f"{last.backend} backend, {how}: {phase} needs about {gb(last.peak_bytes)}, "
            f"{gb(last.budget_bytes)} usable on {device}")
    if best:  # the user's micro-batch is the only thing too large
        return (f"grpo.micro_batch {wants.micro_batch} needs about {gb(last.peak_bytes)} ({last.backend} backend, {how}), "
                f"{gb(last.budget_bytes)} usable on {device}: set grpo.micro_batch to {best} or less (0 chooses)")
    changes = []
    if last.backend == "transformers" and wants.generation_batch:
        changes += [("generation.batch_size", k, replace(r, generation_rows=k), wants)
                    for k in _halvings(r.generation_rows)]
    changes += [("generation.max_new_tokens", t, replace(r, completion_tokens=t), wants) for t in _halvings(r.completion_tokens, 32)]
    if wants.lora is False:
        changes.append(("model.lora.enabled", "true", r, replace(wants, lora=None)))
    if wants.checkpointing is False:
        changes.append(("model.gradient_checkpointing", "true", r, replace(wants, checkpointing=None)))
    if not last.nf4 and wants.lora is not False and wants.backend != "vllm":  # an NF4 base was not tried
        install = "" if wants.bnb_installed else " (pip install -e '.[quant]')"
        changes.append(("model.quantize", f"nf4{install}", r, replace(wants, quantize="nf4")))
    for knob, value, shape_, wants_ in changes:
        if isinstance(_first_fit(device, config, shape_, wants_), Plan):
            return f"{head}: set {knob} to {value}"
    params = memory.shape_from_config(config).parameters
    smaller = params * last.budget_bytes / last.peak_bytes
    return (f"{head}: use a device with {_smallest_device(device, config, r, wants, last.peak_bytes)} GB free "
            f"or a model of at most about {_count(smaller)} parameters (this one has {_count(params)})")


def _count(parameters: float) -> str:
    return f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M" if parameters >= 1e6 \
        else f"{parameters / 1e6:.2f}M"


def _smallest_device(device: Device, config: dict, r: RoundShape, wants: Wants, peak_bytes: float) -> int:
    """The fewest whole GB free (of the same kind of device) with which a plan fits, searched upwards
    from the estimate (plans are not exactly linear in the device's size: vLLM's share is a fraction)."""
    start = math.ceil(peak_bytes / GB)
    for gb in range(start, 2 * start + 8):
        bigger = replace(device, free_bytes=gb * GB, total_bytes=max(device.total_bytes, gb * GB))
        if isinstance(_first_fit(bigger, config, r, wants), Plan):
            return gb
    return start


def _halvings(start: int, floor: int = 1) -> list[int]:
    out, k = [], start // 2
    while k >= floor:
        out.append(k)
        k //= 2
    return out


def probe(kind: str = "auto", memory_gb: float | None = None) -> Device:
    """The device a node would run on, and what it may use there: its share (`memory_gb`) where one is
    given, else what is free now (on a host, less a margin for the rest of the machine)."""
    import torch

    from trainer.policy import pick_device

    device = pick_device(kind)
    if problem := _missing(device):
        raise MemoryPlanError(f"model.device: {kind} asked for, but {problem}")
    share = memory_gb * GB if memory_gb else None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        _check_share(share, total, name)
        return Device("cuda", name, share or free, total, torch.cuda.is_bf16_supported())
    total = memory.total_bytes()
    _check_share(share, total, "this machine")
    host = share or memory.host_budget()
    if device.type == "mps":  # unified memory: what Metal recommends, within what the host allows
        metal = torch.mps.recommended_max_memory()
        return Device("mps", "Apple GPU", min(host, metal), metal)
    return Device("cpu", f"{torch.get_num_threads()} threads", host, total, bf16_cpu())


def _missing(device) -> str | None:
    """Why this machine has no such device, or None: torch would fail on it with an assertion."""
    import torch

    if device.type == "cuda":
        if not torch.backends.cuda.is_built():
            return "this torch is a CPU build"
        if (device.index or 0) >= torch.cuda.device_count():
            return f"{torch.cuda.device_count()} CUDA device(s) are visible"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "this machine has no MPS device"
    return None


def _check_share(share: float | None, total: float, where: str) -> None:
    if share and share > total:
        raise MemoryPlanError(f"run.memory_gb {share / GB:g} is more than the {total / GB:.1f} GB {where} has")
