"""The GRPO-family loss on small cases computed by hand, one per mode and knob."""

import math

import pytest
import torch

from trainer.config import GRPOConfig
from trainer.loss import aggregate, group_advantages, grpo_loss


def cfg(**kw) -> GRPOConfig:
    return GRPOConfig(**{"dual_clip": None, **kw})


def one_token(ratio: float, adv: float, **kw) -> float:
    """Loss of a single token with the given importance ratio and advantage."""
    logps = torch.tensor([[math.log(ratio)]])
    loss, _ = grpo_loss(logps, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), cfg(**kw), max_tokens=1)
    return loss.item()


def test_group_advantages_scaled_by_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, groups, "group")
    # group 0: mean 0.5, std 0.5 -> +-1; group 1: mean 0.75, std sqrt(3)/4
    s1 = math.sqrt(3) / 4
    expected = [1, -1, -1, 1, 0.25 / s1, 0.25 / s1, 0.25 / s1, -0.75 / s1]
    assert adv.tolist() == pytest.approx(expected, abs=1e-4)


def test_group_advantages_scaled_by_batch_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1]), "batch")
    batch_std = math.sqrt(3) / 4  # rewards 1,0,1,1: mean .75
    assert adv.tolist() == pytest.approx([0.5 / batch_std, -0.5 / batch_std, 0, 0], abs=1e-4)


def test_group_advantages_unscaled():
    adv = group_advantages(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), "none")
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_uniform_group_has_zero_advantage_in_every_mode():
    for scale in ("group", "batch", "none"):
        adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), scale)
        assert adv[:2].tolist() == [0.0, 0.0]


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def test_token_aggregation_averages_over_all_tokens_of_the_batch():
    assert aggregate(PER_TOKEN, MASK, "token", max_tokens=4).item() == pytest.approx(10 / 4)


def test_sequence_aggregation_averages_per_sequence_means():
    assert aggregate(PER_TOKEN, MASK, "sequence", max_tokens=4).item() == pytest.approx((2 + 4) / 2)


def test_constant_aggregation_divides_by_sequences_times_max_tokens():
    assert aggregate(PER_TOKEN, MASK, "constant", max_tokens=4).item() == pytest.approx(10 / (2 * 4))


def test_sequence_aggregation_skips_fully_masked_sequences():
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert aggregate(PER_TOKEN, mask, "sequence", max_tokens=4).item() == pytest.approx(2.0)


def test_positive_advantage_is_clipped_above_at_eps_high():
    assert one_token(1.5, +1.0, clip_eps_low=0.2, clip_eps_high=0.28) == pytest.approx(-1.28)
    assert one_token(1.1, +1.0, clip_eps_low=0.2, clip_eps_high=0.28) == pytest.approx(-1.1)
    # below 1 - eps the unclipped term is the smaller one and is kept (pessimistic bound)
    assert one_token(0.5, +1.0, clip_eps_low=0.2, clip_eps_high=0.28) == pytest.approx(-0.5)


def test_negative_advantage_is_clipped_below_at_eps_low():
    assert one_token(0.5, -1.0, clip_eps_low=0.2, clip_eps_high=0.28) == pytest.approx(0.8)
    assert one_token(0.5, -1.0, clip_eps_low=0.4, clip_eps_high=0.28) == pytest.approx(0.6)


def test_dual_clip_bounds_the_loss_for_negative_advantages():
    assert one_token(5.0, -1.0) == pytest.approx(5.0)  # plain clip: grows with the ratio
    assert one_token(5.0, -1.0, dual_clip=3.0) == pytest.approx(3.0)
    assert one_token(2.0, -1.0, dual_clip=3.0) == pytest.approx(2.0)  # below the bound: unchanged
    assert one_token(5.0, +1.0, dual_clip=3.0) == pytest.approx(-1.28)  # positive advantages untouched


def test_dual_clipped_tokens_get_no_gradient():
    logps = torch.tensor([[math.log(5.0)]], requires_grad=True)
    loss, _ = grpo_loss(logps, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), cfg(dual_clip=3.0), 1)
    loss.backward()
    assert logps.grad.item() == 0.0


def test_kl_penalty_uses_the_k3_estimator():
    ref = torch.tensor([[math.log(2.0)]])
    loss, stats = grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([0.0]), torch.ones(1, 1),
                            cfg(kl_coef=0.1), 1, ref_logps=ref)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert stats["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3)


def test_kl_is_ignored_when_its_weight_is_zero():
    ref = torch.tensor([[math.log(2.0)]])
    loss, _ = grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([0.0]), torch.ones(1, 1),
                        cfg(kl_coef=0.0), 1, ref_logps=ref)
    assert loss.item() == 0.0


def test_masked_tokens_do_not_contribute():
    logps = torch.tensor([[0.0, math.log(3.0)]])
    loss, stats = grpo_loss(logps, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), cfg(), 2)
    assert loss.item() == pytest.approx(-1.0)
    assert stats["clip_frac"] == 0.0


def test_on_policy_gradient_points_towards_high_advantage_tokens():
    logps = torch.zeros(2, 1, requires_grad=True)
    loss, _ = grpo_loss(logps, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1), cfg(), 1)
    loss.backward()
    assert logps.grad[0].item() < 0 < logps.grad[1].item()


def test_a_shaped_row_takes_luffys_weight_unclipped_and_the_other_rows_keep_the_clipped_ratio():
    """f(pi) = pi / (pi + gamma): d(-A f)/d log pi = -A gamma pi / (pi + gamma)^2, largest (A / 4) at pi = gamma and
    about A pi / gamma on a token far less likely than gamma; the clip does not apply (the ratio is 1.5 here)."""
    gamma = 0.1
    pis = [0.001, 0.1, 0.9]
    logps = torch.tensor([[math.log(p) for p in pis], [math.log(1.5)] * 3], requires_grad=True)
    old = torch.tensor([[math.log(p) for p in pis], [0.0] * 3])
    loss, _ = grpo_loss(logps, old, torch.tensor([2.0, 1.0]), torch.ones(2, 3), cfg(shaping_gamma=gamma), 3,
                        shaped=torch.tensor([True, False]))
    loss.backward()
    expected = [-2.0 * gamma * p / (p + gamma) ** 2 / 6 for p in pis]  # token aggregation over 6 tokens
    assert logps.grad[0].tolist() == pytest.approx(expected)
    assert expected[1] == pytest.approx(-2.0 / 4 / 6) and abs(expected[0]) < abs(expected[1]) / 20
    assert logps.grad[1].tolist() == [0.0] * 3  # the unshaped row: ratio 1.5 is past the clip, no gradient
    plain, _ = grpo_loss(logps.detach(), old, torch.tensor([2.0, 1.0]), torch.ones(2, 3), cfg(shaping_gamma=gamma), 3)
    assert loss.item() != pytest.approx(plain.item())  # the flag changes the loss, and only for its row
