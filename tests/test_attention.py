"""The trainer's CPU attention: SDPA's results, in float32, with the key-value heads shared."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainer.attention import CPU_ATTENTION, cpu_attention, use_cpu_attention
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer

MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True)


def qkv(dtype, rows=3, queries=5, positions=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 6, queries, 8, generator=g).to(dtype), torch.randn(rows, 2, positions, 8, generator=g).to(dtype),
            torch.randn(rows, 2, positions, 8, generator=g).to(dtype))


def padded_mask(rows=3, queries=5, positions=9):
    mask = torch.ones(rows, 1, queries, positions, dtype=torch.bool).tril(positions - queries)  # a cache before the queries
    mask[1, ..., :3] = False  # left padding
    return mask


@pytest.mark.parametrize("mask", [None, "padded"])
def test_cpu_attention_is_transformers_sdpa_in_float32(mask):
    query, key, value = qkv(torch.float32, positions=9 if mask else 5)
    mask = padded_mask() if mask else None
    got, _ = cpu_attention(MODULE, query, key, value, mask, scaling=0.4)
    want, _ = sdpa_attention_forward(MODULE, query, key, value, mask, scaling=0.4)
    assert got.shape == want.shape == (3, 5, 6, 8) and torch.allclose(got, want, atol=1e-6)


def test_cpu_attention_runs_bfloat16_inputs_in_float32_and_a_decode_step_as_transformers_does():
    query, key, value = qkv(torch.bfloat16, positions=9)
    exact, _ = sdpa_attention_forward(MODULE, query.float(), key.float(), value.float(), padded_mask(), scaling=0.4)
    got, _ = cpu_attention(MODULE, query, key, value, padded_mask(), scaling=0.4)
    assert got.dtype == torch.bfloat16 and torch.equal(got, exact.bfloat16())  # rounded once, at the end
    one = query[:, :, -1:]
    assert torch.equal(cpu_attention(MODULE, one, key, value, padded_mask()[:, :, -1:], scaling=0.4)[0],
                       sdpa_attention_forward(MODULE, one, key, value, padded_mask()[:, :, -1:], scaling=0.4)[0])


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_cpu_trainer_attends_through_it_and_its_step_matches_sdpas(policy):
    """The trainer on a CPU switches its model's attention (not a setting a checkpoint keeps); the loss and
    gradients of a step are SDPA's."""
    from tests.test_grpo import group

    grads = {}
    for impl in ("sdpa", CPU_ATTENTION):
        trainer = GRPOTrainer(policy, GRPOConfig(), max_new_tokens=16, total_rounds=10)
        assert policy.model.config._attn_implementation == CPU_ATTENTION
        policy.model.set_attn_implementation(impl)
        trainer.optimizer.step = lambda: None  # keep the weights: compare the two gradients
        trainer.step([group([1, 0, 0, 1])])
        grads[impl] = torch.cat([p.grad.flatten() for p in trainer.params])
    assert grads["sdpa"].abs().sum() > 0 and torch.allclose(grads["sdpa"], grads[CPU_ATTENTION], rtol=1e-4, atol=1e-7)
    policy.model.set_attn_implementation("eager")  # a model the user set to another attention keeps it
    use_cpu_attention(policy.model)
    assert policy.model.config._attn_implementation == "eager"
    policy.model.set_attn_implementation("sdpa")  # as the fixture's other users find it
