"""LoRA adapters on whatever linear layers a model has, counted by the planner from its config alone; the model's
context bounding a round's tokens; and only causal LMs planned. Tiny models with random weights, built from configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from node.config import ConfigError, load_config
from tests.conftest import run_sapo
from tests.test_grpo import group
from trainer.config import GRPOConfig, ModelConfig
from trainer.memory import ALL_LINEAR, adapted, config_linear_layers, shape_from_config
from trainer.policy import ModelLoadError, Policy, adapter_targets, export_weights

peft = pytest.importorskip("peft")

TINY = dict(bos_token_id=1, eos_token_id=1, pad_token_id=0)
# family: (config class, widths, the last names of the layers adapters go on, the linear layers per block)
FAMILIES = {
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4), {"c_attn", "c_proj", "c_fc"}, 4),
    "falcon-multi-query": ("FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
                           {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}, 4),
    "falcon-new-decoder": ("FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                                                new_decoder_architecture=True),
                           {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}, 4),
    "phi3": ("Phi3Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=64), {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, 4),
    "opt": ("OPTConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32),
            {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}, 6),
}


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.tiny import PRESETS, train_tokenizer

    return train_tokenizer(PRESETS["tiny-a"])


def family_config(family: str, vocab: int):
    import transformers

    name, widths, _, _ = FAMILIES[family]
    return getattr(transformers, name)(**widths, vocab_size=vocab, **TINY)


def adapted_layers(model) -> dict[str, int]:
    """peft's adapted layers (base-model names) and the adapter weights each holds."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: sum(p.numel() for n, p in layer.named_parameters() if "lora_" in n)
            for name, layer in base.named_modules() if isinstance(layer, LoraLayer)}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_gets_adapters_on_its_own_linear_layers_as_counted_and_takes_a_step(family, tokenizer):
    from transformers import AutoModelForCausalLM

    from trainer.grpo import GRPOTrainer
    from trainer.policy import _with_lora

    config = family_config(family, len(tokenizer))
    torch.manual_seed(0)
    model = _with_lora(AutoModelForCausalLM.from_config(config), ModelConfig(lora={"enabled": True, "r": 4}), None)
    got = adapted_layers(model)
    _, _, names, per_block = FAMILIES[family]
    counted = shape_from_config(config.to_dict(), lora_r=4)  # what the planner reads: the config alone
    assert {n.rsplit(".", 1)[-1] for n in got} == names == set(counted.adapted)
    assert len(got) == per_block * 2 and not any("lm_head" in n for n in got)  # every block's layers, not the head
    assert set(got) == set(adapted(config_linear_layers(config.to_dict()), ALL_LINEAR))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    assert sum(got.values()) == sum(p.numel() for p in trainable.values()) == counted.trainable

    policy = Policy(model=model, tokenizer=tokenizer, device=torch.device("cpu"), use_chat_template=False)
    before = {n: p.detach().clone() for n, p in trainable.items()}
    GRPOTrainer(policy, GRPOConfig(lr=1e-2), max_new_tokens=16, total_rounds=10).step([group([1, 0, 0, 1])])
    moved = [n for n, p in trainable.items() if not torch.equal(before[n], p)]
    assert moved and all("lora_B" in n or "lora_A" in n for n in moved)
    # the weights a generator is sent hold the adapters' delta in the base's layout (GPT-2's Conv1D is transposed)
    sent = export_weights(model)
    merged = model.merge_and_unload().state_dict()
    assert all(torch.allclose(sent[k], merged[k], atol=1e-6) for k in merged)


# mixtures of experts: (config class, widths, what the plan names as adapted); transformers 5 fuses each block's experts
# into two 3-D weights and its router is no linear layer, so all-linear reaches neither
MOE = {
    "mixtral": ("MixtralConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
                {"q_proj", "k_proj", "v_proj", "o_proj"}),
    "qwen2-moe": ("Qwen2MoeConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=64,
                                         num_experts=4, num_experts_per_tok=2),
                  {"q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                   "shared_expert.down_proj", "shared_expert_gate"}),
}


@pytest.mark.parametrize("family", MOE)
def test_the_plan_says_a_mixtures_experts_and_router_get_no_adapters_as_peft_builds_it(family, tokenizer):
    import transformers
    from transformers import AutoModelForCausalLM

    from tests.test_plan import BENCH_ROUND, CPU
    from trainer.plan import Wants, plan
    from trainer.policy import _with_lora

    name, widths, labels = MOE[family]
    config = getattr(transformers, name)(**widths, vocab_size=len(tokenizer), **TINY)
    model = _with_lora(AutoModelForCausalLM.from_config(config), ModelConfig(lora={"enabled": True, "r": 4}), None)
    counted = shape_from_config(config.to_dict(), lora_r=4)
    assert set(counted.adapted) == labels and sum(adapted_layers(model).values()) == counted.trainable
    # the experts' fused weights and the router: frozen, and counted as the plan says
    untouched = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n or n.endswith(".mlp.gate.weight")}
    assert len(untouched) == 3 * 2 and not any(p.requires_grad for p in untouched.values())
    assert sum(p.numel() for p in untouched.values()) == counted.frozen_weights
    line = plan(CPU, config.to_dict(), BENCH_ROUND, Wants(lora=True, lora_r=4)).adapters()
    share = counted.frozen_weights / counted.parameters
    assert line.startswith(f"adapters on {', '.join(sorted(labels))}: {counted.trainable:,} trainable weights")
    assert line.endswith(f"; the 4 routed experts and the router ({share:.1%} of the weights) get none and do not train")


def test_a_mixture_whose_experts_are_linear_layers_is_said_to_train_them():
    """A remote-code mixture (DeepSeek's) keeps one linear layer per expert and a linear router: adapters reach both."""
    from trainer.memory import _unadapted_moe

    layers = {"0.mlp.experts.0.gate_proj": (8, 4), "0.mlp.gate": (8, 4), "0.self_attn.q_proj": (8, 8)}
    assert _unadapted_moe(layers, 4, 100, 10) == {}
    assert _unadapted_moe({"0.self_attn.q_proj": (8, 8)}, 4, 100, 10) == {"the 4 routed experts": 100, "the router": 10}


def test_a_list_of_names_matching_no_layer_is_refused_naming_the_layers_the_model_has(tokenizer):
    from transformers import AutoModelForCausalLM

    phi3 = AutoModelForCausalLM.from_config(family_config("phi3", len(tokenizer)))
    with pytest.raises(ModelLoadError, match=r"q_proj, k_proj, v_proj match no linear layer of the model \(its linear "
                                             r"layers: down_proj, gate_up_proj, o_proj, qkv_proj\)"):
        adapter_targets(phi3, ["q_proj", "k_proj", "v_proj", "o_proj"])  # the old default: o_proj alone, silently
    assert adapter_targets(phi3, ["self_attn.qkv_proj"]) == {"target_modules": ["self_attn.qkv_proj"], "fan_in_fan_out": False}
    gpt2 = AutoModelForCausalLM.from_config(family_config("gpt2", len(tokenizer)))
    assert adapter_targets(gpt2, ALL_LINEAR) == {"target_modules": ["c_attn", "c_fc", "c_proj"], "fan_in_fan_out": True}


def test_a_user_list_is_counted_as_peft_matches_it():
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64).to_dict()
    mlp_only = shape_from_config(config, lora_r=4, lora_targets=("mlp.c_proj",))
    assert mlp_only.trainable == 2 * 4 * (4 * 32 + 32) and mlp_only.adapted == ("c_proj",)
    both = shape_from_config(config, lora_r=4, lora_targets=("c_proj",))  # attention's and the MLP's
    assert both.trainable == 2 * 4 * ((32 + 32) + (4 * 32 + 32))


def test_a_described_config_with_no_model_type_is_counted_by_its_widths_as_the_built_model_would_be():
    from tests.test_plan import QWEN

    widths = QWEN["0.5B"]  # Qwen2.5-0.5B: r 16 on all seven projections of 24 layers is 8,798,208 (peft prints it)
    described, built = shape_from_config(widths, lora_r=16), shape_from_config({"model_type": "qwen2", **widths}, lora_r=16)
    assert described.trainable == built.trainable == 8_798_208 and described.adapted == built.adapted
    assert set(built.adapted) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def model_folder(tmp_path: Path, tiny_a: Path, config: dict, name: str = "model") -> Path:
    """A folder with a config.json and tiny-a's tokenizer but no weights: all that planning reads, and what
    loading would fail on."""
    folder = tmp_path / name
    shutil.copytree(tiny_a, folder, ignore=shutil.ignore_patterns("*.safetensors", "sapo_preset.json"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def gpt2_config(**widths) -> dict:
    from transformers import GPT2Config

    return GPT2Config(**widths).to_dict()


def test_targets_matching_nothing_are_refused_by_doctor_and_run_before_weights_load(tiny_a, tmp_path):
    """The folder has no weights: a refusal that came from loading them would say so instead."""
    folder = model_folder(tmp_path, tiny_a, gpt2_config(n_embd=32, n_layer=2, n_head=4, n_positions=256))
    line = ("sapo: config error: model.lora.target_modules ['q_proj', 'v_proj']: q_proj, v_proj match no linear layer "
            "of the model (its linear layers: c_attn, c_fc, c_proj); name some of those, or all-linear")
    targets = ("--model.lora.target_modules", '["q_proj", "v_proj"]')
    doctor = run_sapo("doctor", "--model", str(folder), *targets)
    assert doctor.returncode == 2 and doctor.stderr.strip() == line, doctor.stderr[-2000:]
    ran = run_sapo("run", "--model", str(folder), "--out", str(tmp_path / "out"), "--p2p.enabled", "false", *targets)
    assert ran.returncode == 2 and ran.stderr.strip().splitlines()[-1] == line, ran.stderr[-2000:]
    assert "Traceback" not in ran.stderr


def test_doctor_shows_the_adapters_it_plans(tiny_a, tmp_path):
    folder = model_folder(tmp_path, tiny_a, gpt2_config(n_embd=32, n_layer=2, n_head=4, n_positions=256))
    r = run_sapo("doctor", "--model", str(folder), "--model.lora.enabled", "true", "--model.lora.r", "4",
                 env={"COLUMNS": "400"})
    trainable = shape_from_config(json.loads((folder / "config.json").read_text()), lora_r=4).trainable
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"  adapters on c_attn, c_fc, c_proj: {trainable:,} trainable weights" in r.stdout


def planned(folder: Path, **settings):
    from node import planner

    return planner.inputs(load_config(None, {"model": {"name": str(folder)}, **settings}))


def test_a_derived_max_new_tokens_is_cut_to_the_models_context_and_a_users_is_refused(tiny_a, tmp_path):
    """GPT-2 sized (124M: the pretrained profile's 256 new tokens) with 400 positions: a longer sequence indexes its
    position table past the end (IndexError, mid-run). tiny-a's tokenizer makes the prompts about 200 tokens."""
    folder = model_folder(tmp_path, tiny_a, gpt2_config(n_positions=400))
    got = planned(folder)
    prompt, room = got.round.prompt_tokens, 400 - got.round.prompt_tokens
    assert got.settled.profile == "pretrained" and 64 <= room < 256
    assert got.round.completion_tokens == got.settled.cfg.generation.max_new_tokens == room
    assert got.settled.sources["generation.max_new_tokens"] == (
        f"pretrained, cut to the model's context (400 positions, prompts up to about {prompt} tokens)")
    assert planned(folder, generation={"max_new_tokens": room}).round.completion_tokens == room  # the user's, when it fits
    with pytest.raises(ConfigError, match=rf"^generation.max_new_tokens 256 and prompts of up to about {prompt} tokens "
                                          rf"need {256 + prompt} positions, past the model's context of 400: set "
                                          rf"generation.max_new_tokens to {room} or less$"):
        planned(folder, generation={"max_new_tokens": 256})
    short = model_folder(tmp_path, tiny_a, gpt2_config(n_positions=prompt + 32), "short")
    with pytest.raises(ConfigError, match=rf"past the model's context of {prompt + 32}: set generation.max_new_tokens to 32"):
        planned(short)  # the derived length fits only below the planner's minimum


@pytest.mark.parametrize("kind", ["t5", "bert"])
def test_doctor_refuses_a_model_that_is_not_a_causal_lm_in_one_line(kind, tiny_a, tmp_path):
    from transformers import BertConfig, T5Config

    config = {"t5": T5Config(), "bert": BertConfig(architectures=["BertForMaskedLM"])}[kind].to_dict()
    folder = model_folder(tmp_path, tiny_a, config)
    why = {"t5": "an encoder-decoder model", "bert": "an encoder (a masked language model)"}[kind]
    r = run_sapo("doctor", "--model", str(folder))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == (f"sapo: config error: model.name: cannot train model {str(folder)!r}: model type "
                                f"{kind!r} is {why}: sapo trains causal (decoder-only) language models")
