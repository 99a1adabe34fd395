"""The memory planner on described devices and models: pure arithmetic, no hardware needed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from trainer.memory import GB, MemoryPlanError, ModelShape, RoundShape, shape_from_config
from trainer.plan import FASTEST_MICRO, Device, Wants, article, estimate, peak, plan

# Qwen2.5 Instruct configs as the hub publishes them (only the fields the planner reads)
QWEN = {
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "3B": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
    "14B": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=13824, vocab_size=152064, tie_word_embeddings=False),
}
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,  # Llama-3.1-8B
                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
MODELS = {f"Qwen2.5-{k}": v for k, v in QWEN.items()} | {"Llama-3.1-8B": LLAMA_8B}
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
PAPER_ROUND = RoundShape(rows=64, generation_rows=64, prompt_tokens=250, completion_tokens=512)  # 4+4 groups x 8, 512 new tokens
BENCH_ROUND = RoundShape(rows=64, generation_rows=64, prompt_tokens=57, completion_tokens=128)
CPU = Device("cpu", "a described CPU", 24 * GB, 24 * GB)


def cpu(gb: float) -> Device:
    return Device("cpu", "a described CPU", gb * GB, gb * GB)


def test_parameters_are_counted_from_the_config_alone():
    assert shape_from_config(SMOLLM2).parameters == pytest.approx(134_515_008, rel=1e-3)
    assert shape_from_config(QWEN["0.5B"]).parameters == pytest.approx(494e6, rel=0.01)  # published: 0.49B
    assert shape_from_config(QWEN["1.5B"]).parameters == pytest.approx(1.54e9, rel=0.01)
    assert shape_from_config(QWEN["7B"]).parameters == pytest.approx(7.62e9, rel=0.01)
    assert shape_from_config(QWEN["3B"]).parameters == pytest.approx(3.09e9, rel=0.01)
    assert shape_from_config(QWEN["14B"]).parameters == pytest.approx(14.7e9, rel=0.01)
    assert shape_from_config(LLAMA_8B).parameters == pytest.approx(8.03e9, rel=0.01)
    lora = shape_from_config(QWEN["0.5B"], lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    assert lora.trainable == 24 * 16 * ((896 + 896) + 2 * (896 + 128) + (896 + 896)) and lora.lora


def test_parameters_match_the_real_tiny_models(tiny_a, tiny_b):
    from transformers import AutoModelForCausalLM

    for folder in (tiny_a, tiny_b):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
        assert shape_from_config(json.loads((folder / "config.json").read_text())).parameters == pytest.approx(real, rel=0.02)


@pytest.mark.parametrize("model, run, kind", [("smollm2-135m", "mb8", "full"), ("smollm2-135m", "mb16", "full"),
                                             ("smollm2-135m", "lora-mb8", "lora"), ("smollm2-135m", "nf4-mb8", "nf4"),
                                             ("gemma3-270m", "mb8", "full")])
def test_the_estimate_errs_high_by_less_than_a_fifth_on_the_measured_step(model, run, kind):
    """Peak RSS of a real model's second GRPO step (AdamW's moments resident, every row its own prompt, 2 CPU
    cores), measured by scripts/bench/bench_round.py --own-prompts, one variant per process, against the
    estimate for the largest micro-batch that step ran: its rows, and its positions per row. Gemma 3 270M's
    262,144-entry head is the vocabulary-sized case: without the head's gradient copies it was 20% under. The LoRA
    runs put adapters on the attention's four projections, the default then."""
    from tests.conftest import ROOT
    from trainer.plan import step_peak

    bench = json.loads((ROOT / f"docs/bench/round-{model}-own-prompts-{run}-2cpu.json").read_text())
    (row,) = bench["rows"]
    part = row["largest_part"]
    config = {"smollm2-135m": SMOLLM2, "gemma3-270m": GEMMA3_270M}[model]
    estimate_gb = step_peak(config, kind, part["rows"], part["positions"] / part["rows"],
                            round(bench["prompt_tokens"] / bench["tasks"]), ("q_proj", "k_proj", "v_proj", "o_proj")) / GB
    assert row["variant"] == kind and row["own_prompts"] and part["rows"] <= row["micro_batch"]
    assert row["peak_rss_gb"] <= estimate_gb <= 1.2 * row["peak_rss_gb"]  # high, by less than a fifth


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads the peak resident size from Linux's /proc")
def test_the_head_term_covers_the_gradient_copies_autograd_holds_for_a_tied_head():
    """The backward pass of a tied 65,536 x 256 head, its gradient already resident as in a running node's second
    step: the peak above that is what `head_grad_bytes` plans for (three copies), not one copy. Measured in a fresh
    process: in this one, memory that earlier tests freed lets the backward pass grow the resident size less."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from trainer.memory import head_grad_bytes

    vocab, hidden = 65536, 256
    measure = f"""
import json, torch
from trainer.batch import head_logprobs
from trainer.memory import _kb_fields, peak_rss_bytes
head = torch.nn.Linear({hidden}, {vocab}, bias=False)
embedding = torch.nn.Embedding({vocab}, {hidden})
embedding.weight = head.weight
ids = torch.randint(0, {vocab}, (2, 16), generator=torch.Generator().manual_seed(0))
rises = []
for _ in range(2):  # the first pass allocates the resident gradient
    hidden_states = torch.tanh(embedding(ids))
    resident = _kb_fields("/proc/self/status")["VmRSS"]
    peak_rss_bytes()  # a new window
    head_logprobs(head, hidden_states, ids).sum().backward()
    rises.append(peak_rss_bytes() - resident)
print(json.dumps(rises))
"""
    run = subprocess.run([sys.executable, "-c", measure], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rises = json.loads(run.stdout)
    one_copy = vocab * hidden * 4
    planned = head_grad_bytes(shape_from_config(dict(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4,
                                                     vocab_size=vocab, tie_word_embeddings=True)))
    logits = 3 * 2 * 16 * vocab * 4  # the chunk's logits, log-softmax and gradient (LOGIT_COPIES), counted apart
    assert planned == 3 * one_copy
    # high enough (within a quarter), and above two and a half copies: the estimate before held none
    assert planned + logits >= rises[-1] / 1.25 and rises[-1] > 2.5 * one_copy, rises


@pytest.mark.parametrize("gb, model, how", [
    (8, "0.5B", "lora"), (8, "1.5B", "smaller generation batch"), (8, "7B", None),
    (12, "0.5B", "lora"), (12, "1.5B", "lora"), (12, "7B", "nf4"),
    (16, "0.5B", "full"), (16, "1.5B", "lora"), (16, "7B", "nf4"),
    (24, "0.5B", "full"), (24, "1.5B", "lora"), (24, "7B", "lora, one copy"),
    (80, "0.5B", "full"), (80, "1.5B", "full"), (80, "7B", "lora"),
])
@pytest.mark.parametrize("vllm", [False, True])
def test_home_and_datacenter_cards_get_a_plan_that_fits_or_the_change_that_would(gb, model, how, vllm):
    """The paper's round (4+4 groups of 8, 512 new tokens). "one copy": LoRA on the transformers backend, which
    samples the trainer's own model, where vLLM's copy of the weights would not fit beside it; "nf4": refused
    without bitsandbytes, naming the extra, and planned on a 4-bit base with it."""
    card = Device.card(gb)
    wants = Wants(vllm_installed=vllm)
    if how == "smaller generation batch":  # the generator decodes the round's 64 rows in turns; a user's batch stands
        p = plan(card, QWEN[model], PAPER_ROUND, wants)
        assert p.lora and p.backend == "transformers" and p.generation_rows == 32
        assert "decodes 32 sequences at a time, not all 64" in " ".join(p.why)
        with pytest.raises(MemoryPlanError, match=r"generating needs about .* set generation.batch_size to 32$"):
            plan(card, QWEN[model], PAPER_ROUND, replace(wants, generation_batch=True))
        return
    if how is None:
        with pytest.raises(MemoryPlanError) as refused:
            plan(card, QWEN[model], PAPER_ROUND, wants)
        message = str(refused.value)
        assert f"usable on cuda ({article(gb)} {gb} GB CUDA card" in message and "use a device with " in message
        needed = int(message.split("use a device with ")[1].split(" GB")[0])
        fitted = plan(Device.card(needed), QWEN[model], PAPER_ROUND, wants)  # the device it names would do
        assert fitted.peak_bytes <= fitted.budget_bytes
        return
    if how == "nf4":
        with pytest.raises(MemoryPlanError, match=r"set model.quantize to nf4 \(pip install -e '\.\[quant\]'\)$"):
            plan(card, QWEN[model], PAPER_ROUND, wants)
        p = plan(card, QWEN[model], PAPER_ROUND, replace(wants, bnb_installed=True))
        assert p.nf4 and p.lora and p.backend == "transformers" and p.peak_bytes <= p.budget_bytes
        assert "LoRA on an NF4 base" in p.summary() and p.why[0].endswith("a 16-bit base does not fit")
        return
    p = plan(card, QWEN[model], PAPER_ROUND, wants)
    assert p.peak_bytes <= p.budget_bytes < gb * GB
    assert p.lora == how.startswith("lora") and p.micro_batch >= 1 and not p.nf4
    assert p.dtype == ("bfloat16" if p.lora else "float32")  # full fine-tuning keeps float32 weights
    assert p.backend == ("vllm" if vllm and how != "lora, one copy" else "transformers")
    assert p.parts["generator"] == 0  # vLLM's copy lives inside its share; the transformers generator has none
    if p.backend == "vllm":
        assert p.vllm_sleep and p.vllm_share * card.total_bytes >= shape_from_config(QWEN[model]).parameters * 2
    assert f"expected peak {p.peak_bytes / GB:.1f} GB" in p.summary()


@pytest.mark.parametrize("gb, model", [(4, "Qwen2.5-0.5B"), (6, "Qwen2.5-1.5B"), (12, "Qwen2.5-7B"), (16, "Llama-3.1-8B")])
def test_a_home_card_trains_about_as_many_billion_parameters_as_it_has_gb(gb, model):
    """The targets of a home GPU, the paper's round: with peft and bitsandbytes (the quant extra) installed."""
    p = plan(Device.card(gb), MODELS[model], PAPER_ROUND, Wants(bnb_installed=True))
    assert p.lora and p.peak_bytes <= p.budget_bytes and p.micro_batch >= 1


def test_the_preferred_plan_is_full_fine_tuning_then_no_recomputation_then_the_largest_micro_batch():
    roomy = plan(Device.card(80), QWEN["0.5B"], PAPER_ROUND, Wants())
    assert not roomy.lora and not roomy.checkpointing and roomy.micro_batch >= 8
    tight = plan(Device.card(24), QWEN["0.5B"], PAPER_ROUND, Wants())
    assert not tight.lora and tight.checkpointing  # recomputation before giving up full fine-tuning


def test_what_the_user_set_stands_and_a_refusal_names_the_one_change_that_fits():
    assert plan(Device.card(80), QWEN["0.5B"], PAPER_ROUND, Wants(lora=True)).lora
    assert plan(Device.card(80), QWEN["0.5B"], PAPER_ROUND, Wants(micro_batch=3)).micro_batch == 3
    with pytest.raises(MemoryPlanError, match="set model.lora.enabled to true"):
        plan(Device.card(8), QWEN["0.5B"], PAPER_ROUND, Wants(lora=False))
    with pytest.raises(MemoryPlanError, match=r"grpo.micro_batch 64 needs about .* set grpo.micro_batch to (\d+) or less") as e:
        plan(Device.card(24), QWEN["0.5B"], PAPER_ROUND, Wants(lora=False, checkpointing=False, micro_batch=64))
    fits = int(str(e.value).split("set grpo.micro_batch to ")[1].split()[0])
    assert plan(Device.card(24), QWEN["0.5B"], PAPER_ROUND, Wants(lora=False, checkpointing=False, micro_batch=fits))
    huge = RoundShape(rows=8, generation_rows=4096, prompt_tokens=57, completion_tokens=128)
    with pytest.raises(MemoryPlanError, match=r"set generation.batch_size to (\d+)"):  # the user's batch stands
        plan(cpu(3.3), SMOLLM2, huge, Wants(generation_batch=True))
    assert plan(cpu(3.3), SMOLLM2, huge, Wants()).generation_rows < 4096  # left to it, the planner decodes in turns


def test_a_bf16_cpu_samples_a_wide_model_from_its_copies_counted_in_the_plan_where_they_fit():
    bf16_cpu = replace(CPU, bf16=True)
    with_copy, without = plan(bf16_cpu, SMOLLM2, BENCH_ROUND, Wants()), plan(CPU, SMOLLM2, BENCH_ROUND, Wants())
    assert with_copy.sampling_dtype == "bfloat16" and without.sampling_dtype == "model"
    shape = shape_from_config(SMOLLM2)  # a bfloat16 copy, and an int8 one with bfloat16 embeddings
    assert with_copy.parts["generator"] == pytest.approx(3 * shape.parameters + 2 * shape.vocab * shape.hidden)
    lora = plan(bf16_cpu, SMOLLM2, BENCH_ROUND, Wants(lora=True))  # adapters: the trainer's weights take the narrow tail
    assert lora.sampling_dtype == "bfloat16" and lora.parts["generator"] == pytest.approx(2 * lora.model.parameters)
    assert without.parts["generator"] == 0 and with_copy.peak_bytes > without.peak_bytes
    assert "a bfloat16 copy samples" in with_copy.summary() and with_copy.record()["sampling_dtype"] == "bfloat16"
    # where the copy alone does not fit, the plan samples the trainer's weights rather than lose its micro-batch
    tight = replace(bf16_cpu, free_bytes=without.peak_bytes + with_copy.parts["generator"] / 2)
    assert plan(tight, SMOLLM2, BENCH_ROUND, Wants()).sampling_dtype == "model"
    assert plan(bf16_cpu, SMOLLM2, BENCH_ROUND, Wants(sampling_dtype="model")).sampling_dtype == "model"  # the user's stands
    assert plan(CPU, SMOLLM2, BENCH_ROUND, Wants(sampling_dtype="bfloat16")).sampling_dtype == "bfloat16"
    narrow = dict(SMOLLM2, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=270)  # tiny-a's widths
    assert plan(bf16_cpu, narrow, BENCH_ROUND, Wants()).sampling_dtype == "model"
    assert plan(bf16_cpu, narrow, BENCH_ROUND, Wants(sampling_dtype="bfloat16")).sampling_dtype == "bfloat16"
    on_card = plan(Device.card(24), SMOLLM2, BENCH_ROUND, Wants(backend="transformers", lora=True))
    assert on_card.sampling_dtype == "model"  # a bfloat16 policy samples itself; cards are not measured


def test_a_bf16_cpu_trains_a_wide_float32_model_with_bfloat16_products_by_the_samplers_rule():
    bf16_cpu = replace(CPU, bf16=True)
    on, off = plan(bf16_cpu, SMOLLM2, BENCH_ROUND, Wants()), plan(CPU, SMOLLM2, BENCH_ROUND, Wants())
    assert (on.compute_dtype, off.compute_dtype) == ("bfloat16", "model")
    assert "bfloat16 products train" in on.summary() and on.record()["compute_dtype"] == "bfloat16"
    assert "bfloat16 products train" not in off.summary()
    assert plan(bf16_cpu, SMOLLM2, BENCH_ROUND, Wants(compute_dtype="model")).compute_dtype == "model"  # the user's stands
    assert plan(CPU, SMOLLM2, BENCH_ROUND, Wants(compute_dtype="bfloat16")).compute_dtype == "bfloat16"
    narrow = dict(SMOLLM2, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=270)  # tiny-a's widths
    assert plan(bf16_cpu, narrow, BENCH_ROUND, Wants()).compute_dtype == "model"
    assert plan(Device.card(24), SMOLLM2, BENCH_ROUND, Wants(backend="transformers")).compute_dtype == "model"  # unmeasured


def test_bfloat16_full_fine_tuning_is_allowed_when_asked_with_the_reason_it_is_not_the_default():
    p = plan(Device.card(80), QWEN["0.5B"], PAPER_ROUND, Wants(dtype="bfloat16", lora=False))
    assert p.dtype == "bfloat16" and any("loses AdamW updates" in w for w in p.why)


def test_a_cpu_node_runs_the_fastest_micro_batch_that_fits_not_the_largest_and_a_card_the_largest():
    m = ModelShape(parameters=134_515_008, trainable=134_515_008, layers=30, hidden=576, mlp=1536, vocab=49152, kv_width=192)
    roomy = plan(cpu(200), SMOLLM2, BENCH_ROUND, Wants())
    assert roomy.micro_batch == FASTEST_MICRO["cpu"] == 8  # measured fastest; 64 would fit but leaves others nothing
    assert roomy.peak_bytes < plan(cpu(200), SMOLLM2, BENCH_ROUND, Wants(micro_batch=64)).peak_bytes
    p = plan(cpu(5), SMOLLM2, BENCH_ROUND, Wants(lora=False, checkpointing=False))
    assert 1 <= p.micro_batch < 8 and p.backend == "transformers" and p.dtype == "float32"
    assert peak(estimate(cpu(5), m, BENCH_ROUND, "transformers", p.micro_batch + 1, None, False)) > 5 * GB
    card = plan(Device.card(80), QWEN["0.5B"], PAPER_ROUND, Wants())
    assert card.micro_batch > 8
    assert peak(estimate(Device.card(80), replace(shape_from_config(QWEN["0.5B"]), checkpointing=card.checkpointing),
                         PAPER_ROUND, card.backend, card.micro_batch + 1, None, False)) > card.budget_bytes


@pytest.mark.parametrize("device, model", [(cpu(24), SMOLLM2), (Device.card(24), QWEN["1.5B"])])
def test_the_plan_gives_a_node_its_figure_for_smaller_rounds_than_the_worst(device, model):
    p, r = plan(device, model, PAPER_ROUND, Wants()), PAPER_ROUND
    worst = p.peak_at(p.micro_batch, p.micro_batch * r.tokens, r.completion_tokens)  # every row its own prompt
    assert worst == pytest.approx(p.peak_bytes, rel=0.01)  # as planned, but for the evaluation's decoding rows
    shared = p.peak_at(p.micro_batch, r.prompt_tokens + p.micro_batch * r.completion_tokens, r.completion_tokens)
    shorter = [p.peak_at(p.micro_batch, r.prompt_tokens + p.micro_batch * n, n) for n in (256, 64, 16)]
    assert worst > shared > shorter[0] > shorter[1] > shorter[2] > p.parts["weights"]


def test_gradient_checkpointing_and_lora_lower_the_estimate():
    base = shape_from_config(QWEN["0.5B"])

    def per_row(shape: ModelShape) -> float:
        training = [estimate(CPU, shape, PAPER_ROUND, "transformers", b, None, False)["training"] for b in (8, 9)]
        return training[1] - training[0]

    assert per_row(replace(base, checkpointing=True)) < 0.5 * per_row(base)
    lora = shape_from_config(QWEN["0.5B"], lora_r=16, lora_targets=("q_proj", "v_proj"))
    assert estimate(CPU, lora, PAPER_ROUND, "transformers", 1, None, False)["optimizer"] < 0.01 * \
        estimate(CPU, base, PAPER_ROUND, "transformers", 1, None, False)["optimizer"]


def test_vllm_frees_the_card_while_training_only_with_sleep_mode():
    m = shape_from_config(QWEN["0.5B"])
    card = Device.card(24)
    asleep = estimate(card, m, PAPER_ROUND, "vllm", 4, 0.3, True)
    awake = estimate(card, m, PAPER_ROUND, "vllm", 4, 0.3, False)
    assert awake["training"] - asleep["training"] == pytest.approx(0.3 * card.total_bytes)


def test_apple_mps_plans_transformers_in_float32_and_refuses_vllm():
    mac = Device("mps", "Apple GPU", 16 * GB, 16 * GB)
    p = plan(mac, QWEN["0.5B"], PAPER_ROUND, Wants(vllm_installed=True))
    assert p.backend == "transformers" and p.dtype == "float32" and p.vllm_share is None
    with pytest.raises(MemoryPlanError, match="vLLM does not run on Apple MPS"):
        plan(mac, QWEN["0.5B"], PAPER_ROUND, Wants(backend="vllm"))


@pytest.mark.parametrize("selection, rows", [({}, 64), ({"when_short": "fewer"}, 32), ({"self_external": True}, 96)])
def test_the_plan_counts_every_row_a_round_can_decode(selection, rows):
    """A node alone fills its external slots with local groups: the first GPU run planned 32 rows and decoded 64."""
    from node.config import load_config
    from node.planner import round_shape

    cfg = load_config(overrides={"selection": selection, "tasks": {"eval_size": 8}})
    assert round_shape(cfg, 100).generation_rows == rows  # 4 local groups (+ 4 external slots) of 8 completions


@pytest.mark.parametrize("kind, problem", [("cuda", "this torch is a CPU build"), ("mps", "this machine has no MPS device")])
def test_a_device_this_machine_lacks_is_named_before_torch_asserts(kind, problem):
    """`--model.device cuda` on a CPU build of torch ended in torch's AssertionError traceback."""
    import torch

    from trainer.plan import probe

    if kind == "cuda" and torch.backends.cuda.is_built() or kind == "mps" and torch.backends.mps.is_available():
        pytest.skip(f"this machine has {kind}")
    with pytest.raises(MemoryPlanError) as e:
        probe(kind)
    assert str(e.value) == f"model.device: {kind} asked for, but {problem}"


# Published sizes of the models whose configs transformers' config classes describe by default
FAMILIES = {"GPT2Config": 124.4e6, "OPTConfig": 125.2e6, "FalconConfig": 6.92e9, "MixtralConfig": 46.7e9,
            "Qwen2MoeConfig": 14.3e9}


@pytest.mark.parametrize("family, published", FAMILIES.items())
def test_the_planner_counts_gpt2_opt_falcon_and_mixtures_of_experts_by_their_own_config_names(family, published):
    import transformers

    config = getattr(transformers, family)().to_dict()
    assert shape_from_config(config).parameters == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("family, widths", [
    ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=500)),
    ("OPTConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=256, vocab_size=500,
                       word_embed_proj_dim=64)),
    ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=500)),
    ("MixtralConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=500)),
])
def test_the_count_matches_the_built_model_of_each_family(family, widths):
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, family)(**widths, bos_token_id=0, eos_token_id=0)
    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert shape_from_config(config.to_dict()).parameters == pytest.approx(real, rel=0.02)


def test_a_mixture_of_experts_is_planned_with_every_expert_and_a_config_without_widths_is_named():
    from transformers import MixtralConfig

    from trainer.memory import ShapeError

    mixtral = MixtralConfig().to_dict()
    with pytest.raises(MemoryPlanError):  # 93 GB of 16-bit weights: no 24 GB card holds them, LoRA or not
        plan(Device.card(24), mixtral, PAPER_ROUND, Wants())
    active = shape_from_config(mixtral)
    assert active.mlp == 2 * mixtral["intermediate_size"]  # a token runs through its two routed experts
    with pytest.raises(ShapeError, match="model type 't5': its config gives no hidden size"):
        shape_from_config({"model_type": "t5", "num_layers": 6, "num_heads": 8, "vocab_size": 32128})


PAPER_CONFIG = "docs/configs/paper-qwen2.5-0.5b.toml"
GUIDE_CARDS, GUIDE_MODELS = (8, 12, 16, 24, 80), ("0.5B", "1.5B", "7B")


PUBLISHED = {name: {"model_type": "qwen2"} for name in MODELS} | {  # what the planner reads beside MODELS' fields
    "Llama-3.1-8B": {"model_type": "llama", "max_position_embeddings": 131072}}


@pytest.fixture(scope="module")
def paper_inputs(request, tmp_path_factory):
    """What `sapo doctor --config docs/configs/paper-qwen2.5-0.5b.toml --model <folder>` reads, for each of MODELS:
    the shipped config and the published model config, with SmolLM2's tokenizer and chat template measuring the
    prompts (Qwen's and Llama's cannot be fetched here; all three are byte-level BPE of the same kind)."""
    import shutil

    from node import planner
    from node.config import load_config
    from tests.conftest import ROOT, cached_preset

    smollm2 = cached_preset(request, "smollm2-135m")
    got = {}
    for name, config in MODELS.items():
        folder = tmp_path_factory.mktemp(name.lower())
        shutil.copytree(smollm2, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "sapo_*"))
        (folder / "config.json").write_text(json.dumps({**PUBLISHED[name], **config}))
        cfg = load_config(ROOT / PAPER_CONFIG, {"model": {"name": str(folder)}})
        got[name] = planner.inputs(cfg)
    return got


def guide_plan(device: Device, got):
    """The plan doctor prints for `got` with the quant extra installed and vLLM not."""
    from node.planner import plan_tokens

    return plan_tokens(device, replace(got, wants=replace(got.wants, bnb_installed=True, peft_installed=True,
                                                          vllm_installed=False)))[0]


def guide_cell(device: Device, got) -> str:
    try:
        p = guide_plan(device, got)
    except MemoryPlanError as e:
        why = str(e)
        return (f"no: needs {why.split('use a device with ')[1].split(' GB')[0]} GB" if "use a device with " in why
                else f"no: {why.rsplit(': ', 1)[1]}")
    how = {"LoRA on an NF4 base": "LoRA on NF4", "full fine-tuning": "full"}.get(p.training, p.training)
    rows = f", decoding {p.generation_rows} rows at a time" if p.generation_rows < p.round.rows else ""
    return f"{how}{' + checkpointing' if p.checkpointing else ''}, {p.micro_batch}{rows}"


def test_the_gpu_guides_plan_table_is_what_doctor_plans_for_the_shipped_paper_config(paper_inputs):
    from tests.conftest import ROOT

    guide = (ROOT / "docs" / "gpu.md").read_text()
    prompts = {got.round.prompt_tokens for got in paper_inputs.values()}
    rows = [f"| {gb} GB | " + " | ".join(guide_cell(Device.card(gb), paper_inputs[f"Qwen2.5-{size}"]) for size in GUIDE_MODELS) + " |"
            for gb in GUIDE_CARDS]
    assert all(row in guide.splitlines() for row in rows), "\n".join(rows)
    assert f"prompts up to {max(prompts)} tokens" in guide, prompts
    quoted = next(line for line in guide.splitlines() if line.startswith("no plan fits: "))
    with pytest.raises(MemoryPlanError) as refused:  # the guide's example: 7B on a 12 GB card, without bitsandbytes
        from node.planner import plan_tokens

        got = paper_inputs["Qwen2.5-7B"]
        plan_tokens(Device.card(12), replace(got, wants=replace(got.wants, bnb_installed=False)))
    assert quoted == f"no plan fits: {refused.value}"


def largest_per_card(paper_inputs) -> list[str]:
    """The guide's second table: the largest of MODELS each card size fits, planned as the first table is."""
    rows = []
    for gb in (4, 6, 8, 12, 16, 24):
        fitted = []
        for name, got in paper_inputs.items():
            try:
                fitted.append((shape_from_config(got.model_config).parameters, name, guide_plan(Device.card(gb), got)))
            except MemoryPlanError:
                pass
        _, name, p = max(fitted)
        rows.append(f"| {gb} GB | {name} ({p.training}, micro-batch {p.micro_batch}) | 0.5B-0.6B | about {gb}B |")
    return rows


def test_the_gpu_guide_tables_the_largest_model_each_card_fits_as_doctor_plans_it(paper_inputs):
    """The second table and the figures quoted around it come from the same plans as the first: the shipped paper
    config, its prompts measured (not the 250 tokens of PAPER_ROUND)."""
    from tests.conftest import ROOT

    guide = (ROOT / "docs" / "gpu.md").read_text()
    rows = largest_per_card(paper_inputs)
    assert all(row in guide.splitlines() for row in rows), "\n".join(rows)
    cards: dict[str, list[str]] = {}  # the guide's opening answer: each largest model and the cards it is for
    for row in rows:
        cards.setdefault(row.split(" | ")[1].split(" (")[0], []).append(row.split(" GB")[0].strip("| "))
    said = ", ".join(f"{name} on {' and '.join(gbs)} GB" for name, gbs in cards.items())
    assert f"the largest model a card trains is {said} (" in " ".join(guide.split()), said
    r = paper_inputs["Qwen2.5-7B"].round
    assert f"64 sequences of up to {r.prompt_tokens + r.completion_tokens:,} tokens" in guide, r
    decoding = guide_plan(Device.card(12), paper_inputs["Qwen2.5-1.5B"]).generation_rows
    assert f"1.5B on a 12 GB card decodes {decoding} rows at a time" in guide, decoding
    p = guide_plan(Device.card(12), paper_inputs["Qwen2.5-7B"])  # the 12 GB cell of the first table
    assert (f"7B's training term is {p.parts['training'] / GB:.1f} GB of the {p.peak_bytes / GB:.1f} GB plan; the NF4 "
            f"weights are {p.parts['weights'] / GB:.1f} GB") in " ".join(guide.split()), p.parts


def test_a_described_card_reads_as_english():
    assert [Device.card(gb).name for gb in (8, 11, 12, 18, 24, 80, 0.5)] == [
        "an 8 GB CUDA card", "an 11 GB CUDA card", "a 12 GB CUDA card", "an 18 GB CUDA card", "a 24 GB CUDA card",
        "an 80 GB CUDA card", "a 0.5 GB CUDA card"]


# Gemma 3 270M's config.json as transformers writes it from the registry's GGUF (gemma3-270m), the fields read
GEMMA3_270M = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
               "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 256, "vocab_size": 262144, "tie_word_embeddings": True, "max_position_embeddings": 32768,
               "sliding_window": 512, "dtype": "float32"}


def test_a_262k_vocabulary_is_counted_in_the_weights_and_its_logits_in_chunks():
    """Gemma 3's vocabulary is 63% of its 268M weights; its full logits for one 8-row micro-batch of 200 tokens
    would be 1.7 GB, which the chunked head never holds."""
    from trainer.memory import LOGIT_COPIES, LOGITS_CHUNK_BYTES, activation_bytes, head_grad_bytes, kv_cache_bytes

    m = shape_from_config(GEMMA3_270M)
    assert m.vocab == 262144 and m.kv_width == 256
    assert m.parameters == pytest.approx(268_098_176, rel=1e-3)  # what the converted model counts
    r = RoundShape(rows=32, generation_rows=64, prompt_tokens=136, completion_tokens=64)
    head = head_grad_bytes(m)
    assert head == 3 * 262144 * 640 * 4  # the trained head's gradient copies at the backward's start (2.0 GB)
    logits = activation_bytes(m, r, 8) - activation_bytes(replace(m, vocab=1), r, 8) - (head - head_grad_bytes(replace(m, vocab=1)))
    assert 0.5 * LOGIT_COPIES * LOGITS_CHUNK_BYTES < logits <= LOGIT_COPIES * LOGITS_CHUNK_BYTES * 1.01
    sampling_logits = kv_cache_bytes(m, r) - kv_cache_bytes(replace(m, vocab=0), r)
    assert sampling_logits == 64 * 2 * 262144 * 4  # last-position logits of every decoding row


def smallest_full_fine_tuning_card(got) -> int:
    """The smallest whole-GB card on which the guide's plan fine-tunes every weight (what `Wants(lora=False)` fits)."""
    full = replace(got, wants=replace(got.wants, lora=False))
    return next(gb for gb in range(1, 641) if not _refused(lambda: guide_plan(Device.card(gb), full)))


def _refused(build) -> bool:
    try:
        build()
    except MemoryPlanError:
        return True
    return False


def test_the_gpu_guide_gives_the_smallest_card_for_full_fine_tuning_and_what_runs_without_bitsandbytes(paper_inputs):
    """The answers a user comes for, opening the guide: the smallest card that fine-tunes every weight of each size,
    and what the NF4 cells become without the quant extra (the 8 GB 1.5B cell falls back to plain LoRA; the 12 GB
    7B cell is refused)."""
    from node.planner import plan_tokens
    from tests.conftest import ROOT

    guide = " ".join((ROOT / "docs" / "gpu.md").read_text().split())
    smallest = {size: smallest_full_fine_tuning_card(paper_inputs[f"Qwen2.5-{size}"]) for size in GUIDE_MODELS}
    said = ", ".join(f"Qwen2.5-{size} {gb} GB" for size, gb in smallest.items())
    assert f"fine-tunes every weight from: {said}" in guide, said
    got = paper_inputs["Qwen2.5-1.5B"]
    plain = plan_tokens(Device.card(8), replace(got, wants=replace(got.wants, bnb_installed=False, peft_installed=True,
                                                                    vllm_installed=False)))[0]
    how = f"{plain.training}{' with gradient checkpointing' if plain.checkpointing else ''}, micro-batch {plain.micro_batch}"
    assert f"without bitsandbytes the 8 GB card plans Qwen2.5-1.5B as {how}" in guide, how
