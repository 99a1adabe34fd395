"""The step-size controller: the rate follows the KL each step measured (trainer/step_size.py, GRPOTrainer._step_kl)."""

import math

import pytest

from tests.test_grpo import GOOD, group, seq_logprob
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer
from trainer.step_size import INITIAL_SCALE, MAX_CUT, STEP_FACTOR, StepSize


def test_the_factor_falls_over_twice_the_target_rises_under_half_and_holds_between():
    s = StepSize(target_kl=0.01, low=0.01, high=4.0, scale=1.0, steps=1)  # past Adam's first step
    assert s.update(0.015) == 1.0 and s.update(0.006) == 1.0  # within [target / 2, 2 x target]
    assert s.update(0.021) == pytest.approx(1 / STEP_FACTOR)  # just over: at least the rl_games cut
    s.scale = 1.0
    assert s.update(0.25) == pytest.approx(1 / 5)  # 25 x the target: sqrt(25) aims at it in one cut
    s.scale = 1.0
    assert s.update(100.0) == pytest.approx(1 / MAX_CUT) and s.update(math.nan) == pytest.approx(0.01)  # the low bound
    assert s.update(0.001) == pytest.approx(0.01 * STEP_FACTOR)
    s.scale = 2.0
    assert s.update(0.0) == 3.0  # a step that moved nothing measurable is too small
    assert s.update(0.001) == 4.0  # the high bound


def test_the_first_step_starts_below_the_rate_and_its_kl_moves_the_rate_only_when_not_finite():
    first = StepSize(0.01, 0.01, 4.0)
    assert first.scale == INITIAL_SCALE
    assert first.update(0.12) == INITIAL_SCALE  # Adam's sign-like first step: 0.10-0.13 measured at a tenth of a good rate
    assert first.update(0.12) == pytest.approx(INITIAL_SCALE / math.sqrt(12))  # the second step's KL is acted on
    assert StepSize(0.01, 0.01, 4.0).update(math.inf) == pytest.approx(INITIAL_SCALE / MAX_CUT)


def test_a_restored_factor_is_kept_within_this_runs_bounds():
    assert StepSize(0.01, 0.5, 4.0).scale == 0.5  # a user's narrower range holds from the first step
    s = StepSize(0.01, 0.01, 4.0)
    s.load_state_dict({**StepSize(0.01, 0.01, 4.0, scale=2.5).state_dict()})
    assert s.scale == 2.5
    s = StepSize(0.01, 0.01, 2.0)
    s.load_state_dict({"scale": 2.5, "target_kl": 0.01, "low": 0.01, "high": 4.0})
    assert s.scale == 2.0 and s.steps == 1  # a checkpoint from before the count was kept had stepped


@pytest.mark.parametrize("lr, moves", [(3e-2, "down"), (1e-7, "up")])
def test_a_step_measures_how_far_it_moved_the_policy_and_the_next_rate_follows(policy, lr, moves):
    trainer = GRPOTrainer(policy, GRPOConfig(lr=lr, target_kl=1e-3, lr_range=(0.01, 100.0)), max_new_tokens=16,
                          total_rounds=10)
    first = trainer.optimizer.param_groups[0]["lr"]
    assert first == pytest.approx(lr * INITIAL_SCALE)  # the first step is taken below the rate
    assert trainer.step([group([1, 0, 1, 0])]).lr_next == pytest.approx(first)  # Adam's first step: measured, not acted on
    before = seq_logprob(policy, GOOD)
    stats = trainer.step([group([1, 0, 1, 0])])
    assert stats.lr == pytest.approx(first) and stats.step_kl is not None and stats.step_kl >= 0
    moved = abs(seq_logprob(policy, GOOD) - before)
    if moves == "down":
        assert stats.step_kl > 2e-3 and moved > 0.1
        assert stats.lr_next < first and trainer.optimizer.param_groups[0]["lr"] == pytest.approx(stats.lr_next)
    else:
        assert stats.step_kl < 5e-4
        assert stats.lr_next == pytest.approx(first * STEP_FACTOR)


def test_the_measured_kl_is_the_k3_estimate_over_the_steps_local_rows_at_the_policy_after_it(policy, monkeypatch):
    """Shifting the policy's log-probs after the step by a known amount gives the k3 value of that shift; before and
    after are computed alike (a no-grad forward of the same rows), so a step that changes nothing measures 0."""
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-12, target_kl=1e-3), max_new_tokens=16, total_rounds=10)
    batches = [group([1, 0, 1, 0]), group([0, 1, 1, 1], source="peer")]
    assert trainer.step(batches).step_kl == 0.0
    real, calls = trainer._logprobs, []

    def shifted_after_the_update(model, batch):
        calls.append(len(batch.input_ids))
        return real(model, batch) - (0.5 if len(calls) == 2 else 0.0)  # every token 0.5 nats down after it

    monkeypatch.setattr(trainer, "_logprobs", shifted_after_the_update)
    stats = trainer.step(batches)
    assert calls == [4, 4]  # the probe: the local group's rows, not the peer's
    assert stats.step_kl == pytest.approx(math.exp(-0.5) - 1 + 0.5, rel=1e-3)  # r - 1 - log r at log r = -0.5


def test_an_external_only_step_measures_nothing_and_leaves_the_rate(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-3, target_kl=1e-3), max_new_tokens=16, total_rounds=10)
    stats = trainer.step([group([1, 0, 1, 0], source="peer")])
    assert stats.optimizer_steps == 1 and stats.step_kl is None and stats.lr_next == pytest.approx(stats.lr)


def test_without_a_target_the_rate_is_the_configs_and_no_kl_is_measured(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-3), max_new_tokens=16, total_rounds=10)
    stats = trainer.step([group([1, 0, 1, 0])])
    assert trainer.step_size is None and stats.step_kl is None and stats.lr == stats.lr_next == pytest.approx(1e-3)
