"""The step-size controller: the rate follows the KL each step measured (trainer/step_size.py, GRPOTrainer._step_kl)."""

import math

import pytest

from tests.test_grpo import GOOD, group, seq_logprob
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer
from trainer.step_size import INITIAL_SCALE, MAX_CUT, STEP_FACTOR, WINDOW, StepSize


def test_the_factor_moves_on_the_median_of_a_window_of_steps_at_one_rate():
    s = StepSize(target_kl=0.01, low=0.01, high=4.0, scale=1.0, steps=1)  # past Adam's first step
    assert [s.update(kl) for kl in (0.0002, 0.015, 0.009)] == [1.0] * 3  # median 0.009: within [target / 2, 2 x target]
    assert [s.update(kl) for kl in (0.19, 0.0001, 0.018)] == [1.0, 1.0, 1.0]  # one noisy step either way moves nothing
    assert [s.update(kl) for kl in (0.03, 0.0001, 0.021)][-1] == pytest.approx(1 / STEP_FACTOR)  # just over: rl_games' cut
    s.scale = 1.0
    assert [s.update(kl) for kl in (0.09, 0.16, 0.17)][-1] == pytest.approx(1 / 4)  # 16 x the target: sqrt(16) aims at it
    s.scale = 2.0
    assert [s.update(kl) for kl in (0.0, 0.004, 0.001)][-1] == 3.0  # steps that moved nothing measurable are too small
    assert [s.update(kl) for kl in (0.001, 0.001, 0.001)][-1] == 4.0  # the high bound


def test_a_spike_or_a_non_finite_kl_cuts_at_once_and_restarts_the_window():
    s = StepSize(target_kl=0.01, low=0.01, high=4.0, scale=1.0, steps=1)
    assert [s.update(0.05), s.update(0.05)] == [1.0, 1.0]  # two steps into a window that would cut
    assert s.update(0.25) == pytest.approx(1 / 5) and s.recent == []  # 25 x the target, past SPIKE: sqrt(25) at once
    assert s.update(0.05) == pytest.approx(1 / 5)  # one step at the new rate decides nothing: the old two are gone
    assert s.update(100.0) == pytest.approx(1 / 50)  # at most MAX_CUT
    assert s.update(math.nan) == pytest.approx(0.01) and s.recent == []  # / MAX_CUT, held at the low bound


def test_the_first_step_starts_below_the_rate_and_its_kl_moves_the_rate_only_when_not_finite():
    first = StepSize(0.01, 0.01, 4.0)
    assert first.scale == INITIAL_SCALE
    assert first.update(0.12) == INITIAL_SCALE and first.recent == []  # Adam's sign-like first step: not counted
    assert [first.update(0.12) for _ in range(WINDOW)][-1] == pytest.approx(INITIAL_SCALE / math.sqrt(12))  # the next are
    assert StepSize(0.01, 0.01, 4.0).update(math.inf) == pytest.approx(INITIAL_SCALE / MAX_CUT)


def test_a_restored_factor_is_kept_within_this_runs_bounds():
    assert StepSize(0.01, 0.5, 4.0).scale == 0.5  # a user's narrower range holds from the first step
    s = StepSize(0.01, 0.01, 4.0)
    s.load_state_dict({**StepSize(0.01, 0.01, 4.0, scale=2.5, steps=4, recent=[0.003]).state_dict()})
    assert s.scale == 2.5 and s.steps == 4 and s.recent == [0.003]  # the window in progress survives a resume
    s = StepSize(0.01, 0.01, 2.0)
    s.load_state_dict({"scale": 2.5, "target_kl": 0.01, "low": 0.01, "high": 4.0})
    assert s.scale == 2.0 and s.steps == 1 and s.recent == []  # a checkpoint from before the count was kept had stepped


@pytest.mark.parametrize("lr, moves", [(3e-2, "down"), (1e-7, "up")])
def test_a_step_measures_how_far_it_moved_the_policy_and_the_next_rate_follows(policy, lr, moves):
    trainer = GRPOTrainer(policy, GRPOConfig(lr=lr, target_kl=1e-3, lr_range=(0.01, 100.0)), max_new_tokens=16,
                          total_rounds=10)
    first = trainer.optimizer.param_groups[0]["lr"]
    assert first == pytest.approx(lr * INITIAL_SCALE)  # the first step is taken below the rate
    assert trainer.step([group([1, 0, 1, 0])]).lr_next == pytest.approx(first)  # Adam's first step: measured, not acted on
    before = seq_logprob(policy, GOOD)
    steps = [trainer.step([group([1, 0, 1, 0])]) for _ in range(WINDOW)]  # a window of steps, at one rate unless cut
    assert steps[0].lr == pytest.approx(first) and all(st.step_kl is not None and st.step_kl >= 0 for st in steps)
    moved = abs(seq_logprob(policy, GOOD) - before)
    if moves == "down":
        assert steps[0].step_kl > 2e-3 and moved > 0.1
        assert steps[-1].lr_next < first and trainer.optimizer.param_groups[0]["lr"] == pytest.approx(steps[-1].lr_next)
    else:
        assert max(st.step_kl for st in steps) < 5e-4
        assert [st.lr_next for st in steps] == pytest.approx([first] * (WINDOW - 1) + [first * STEP_FACTOR])


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
