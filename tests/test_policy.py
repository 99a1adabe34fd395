"""Device, dtype and prompt formatting choices of the policy loader."""

import pytest
import torch

from trainer import policy as policy_module
from rewards.tasks import task_prompt
from trainer.config import ModelConfig
from trainer.policy import encode_prompts, format_prompt, pick_device, pick_dtype, prompt_example


def test_auto_device_prefers_cuda_then_mps_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert pick_device("auto").type == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert pick_device("auto").type == "cpu"
    assert pick_device("cpu").type == "cpu"


def test_auto_dtype_is_bf16_only_on_gpus_that_support_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert pick_dtype("auto", torch.device("cuda")) == torch.float32
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("float16", torch.device("cpu")) == torch.float16


def test_prompts_use_the_chat_template_when_the_tokenizer_has_one(policy):
    plain = encode_prompts(policy, ["2+2=?"])[0]
    assert policy.tokenizer.decode(plain) == "2+2=?"
    policy.tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<bot>"
    policy.use_chat_template = True
    assert policy.format_prompt("2+2=?") == "<user>2+2=?</user><bot>"
    assert policy.tokenizer.decode(encode_prompts(policy, ["2+2=?"])[0]) == "<user>2+2=?</user><bot>"


def test_a_chat_example_comes_before_the_task_as_one_worked_exchange(policy):
    policy.tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}<assistant>"
    policy.use_chat_template = True
    policy.chat_example = ("1+1?", "<answer>2</answer>")
    assert policy.format_prompt("2+2=?") == (
        f"<user>{task_prompt('1+1?')}|<assistant><answer>2</answer>|<user>2+2=?|<assistant>")
    assert ModelConfig().chat_example is not None and ModelConfig(chat_example=None).chat_example is None


def test_a_saved_tokenizer_is_loaded_as_saved(tiny_a):
    """transformers would rebuild this Qwen2 tokenizer with Qwen2's own pre-tokenizer."""
    from trainer.tiny import PRESETS, train_tokenizer

    text = "reverse abcde\nReply with <answer>final answer</answer>.\n"
    loaded = policy_module.load_tokenizer(str(tiny_a))
    assert loaded(text)["input_ids"] == train_tokenizer(PRESETS["tiny-a"])(text)["input_ids"]


def test_apple_mps_is_planned_in_float32_within_what_metal_recommends(monkeypatch):
    """No Mac runs this suite: the MPS branch of the device probe and dtype choice, with torch's MPS calls faked."""
    from trainer import plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12 * 2**30)
    monkeypatch.setattr(plan.memory, "total_bytes", lambda: 128e9)  # a Mac with 128 GB: a 64 GB share is allowed
    assert pick_dtype("auto", pick_device("auto")) == torch.float32  # bf16 autocast on MPS is not relied on
    device = plan.probe("auto", memory_gb=64)
    assert device.kind == "mps" and device.total_bytes == 12 * 2**30
    assert device.free_bytes <= 12 * 2**30 and not device.bf16
    assert plan.probe("auto", memory_gb=1).free_bytes == 1e9  # a cap the user sets holds on unified memory too


def test_loading_lora_adapters_prints_no_warning(tiny_a):
    """peft reads a property transformers 5 deprecated: the node filters that one upstream FutureWarning."""
    import warnings

    import pytest

    pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        loaded = policy_module.load_policy(ModelConfig(name=str(tiny_a), lora={"enabled": True}))
    assert hasattr(loaded.model, "disable_adapter")


def test_a_model_with_no_chat_template_gets_the_worked_example_as_plain_text_only_when_asked():
    """A base model (Gemma 3 270M) sees the answer format once, one-shot; a tiny model's prompts stay bare."""
    task = task_prompt("What is 3 + 4?")
    assert prompt_example(ModelConfig(), use_chat_template=False) is None
    example = prompt_example(ModelConfig(plain_example=True), use_chat_template=False)
    text = format_prompt(None, task, False, example)
    assert text == f"{task_prompt('What is 12 + 9?')}12 + 9 = 21.\n<answer>21</answer>\n\n{task}"
    assert prompt_example(ModelConfig(), use_chat_template=True) == ModelConfig().chat_example
    assert prompt_example(ModelConfig(chat_example=None, plain_example=True), use_chat_template=False) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finite_weights_finds_one_bad_element_and_passes_weights_whose_sum_alone_overflows(bad):
    from trainer.policy import finite_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(3e38)  # finite, but its sum is not
        assert finite_weights(model)
        model[1].bias[2] = bad
        assert not finite_weights(model)
        model[1].requires_grad_(False)  # only trained weights are checked
        assert finite_weights(model)
