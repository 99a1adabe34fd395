"""Where bfloat16 products pay (trainer/precision.py): the CPU probes and the one rule of the sampling copies and
the training step's autocast."""

import pytest
import torch

from trainer import precision
from trainer.config import GenerationConfig, GRPOConfig, ModelConfig
from trainer.generation import make_generator
from trainer.grpo import GRPOTrainer
from trainer.policy import load_policy


def test_auto_takes_bfloat16_only_on_a_bf16_cpu_for_a_wide_float32_model(tiny_a, monkeypatch):
    policy = load_policy(ModelConfig(name=str(tiny_a), device="cpu", dtype="float32"))
    monkeypatch.setattr(precision, "bf16_cpu", lambda: True)
    assert policy.model.config.hidden_size < precision.WIDE_MIN_HIDDEN
    assert precision.bfloat16_or_own("auto", policy) is None  # a narrow model runs faster in float32
    monkeypatch.setattr(precision, "WIDE_MIN_HIDDEN", policy.model.config.hidden_size)  # as if it were wide enough
    for bf16, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(precision, "bf16_cpu", lambda bf16=bf16: bf16)
        assert precision.bfloat16_or_own("auto", policy) is expected
        assert precision.bfloat16_or_own("model", policy) is None
        assert precision.bfloat16_or_own("bfloat16", policy) is torch.bfloat16
        # both settings follow it: the generator's sampling copy and the trainer's compute dtype
        assert (make_generator(GenerationConfig(backend="transformers"), policy).wide is not None) is bf16
        assert GRPOTrainer(policy, GRPOConfig(), max_new_tokens=8, total_rounds=1).compute_dtype is expected
    monkeypatch.setattr(precision, "bf16_cpu", lambda: True)
    half = load_policy(ModelConfig(name=str(tiny_a), device="cpu", dtype="bfloat16"))
    assert precision.bfloat16_or_own("auto", half) is None  # a 16-bit model runs in its own dtype
    assert make_generator(GenerationConfig(backend="transformers", sampling_dtype="bfloat16"), half).wide is None


@pytest.mark.parametrize("amx, avx512_bf16", [(True, False), (False, True), (False, False), (None, None)])
def test_a_bf16_cpu_has_amx_tiles_or_avx512_bf16(monkeypatch, amx, avx512_bf16):
    for name, has in (("_is_amx_tile_supported", amx), ("_is_avx512_bf16_supported", avx512_bf16)):
        if has is None:  # an older torch without the probe
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda has=has: has)
    assert precision.bf16_cpu() is bool(amx or avx512_bf16)
    assert precision.bf16_features() == {"amx": bool(amx), "avx512_bf16": bool(avx512_bf16)}
