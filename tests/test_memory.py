"""The round's memory estimate and the micro-batch it plans: pure arithmetic on described models."""

import pytest

from trainer.memory import MemoryPlanError, ModelShape, RoundShape, generation_bytes, plan_micro_batch, training_bytes

SMOLLM2 = ModelShape(parameters=134_515_008, trainable=134_515_008, layers=30, hidden=576, mlp=1536, vocab=49152, kv_width=192)
BENCH_ROUND = RoundShape(rows=64, generation_rows=64, prompt_tokens=57, completion_tokens=128)
GB = 1e9


def test_the_estimate_errs_high_but_close_on_the_measured_smollm2_step():
    """Measured peak RSS of a GRPO step on SmolLM2-135M, 2 CPU cores: 5.56 GB at micro-batch 8, 8.64 GB at 16."""
    for micro, measured in ((8, 5.56), (16, 8.64)):
        assert measured * GB <= training_bytes(SMOLLM2, BENCH_ROUND, micro) <= 1.5 * measured * GB


def test_auto_takes_the_whole_step_when_it_fits_and_the_largest_share_that_fits_otherwise():
    assert plan_micro_batch(SMOLLM2, BENCH_ROUND, 0, budget=200 * GB) == 64
    micro = plan_micro_batch(SMOLLM2, BENCH_ROUND, 0, budget=8 * GB)
    assert 1 <= micro < 64
    assert training_bytes(SMOLLM2, BENCH_ROUND, micro) <= 8 * GB < training_bytes(SMOLLM2, BENCH_ROUND, micro + 1)
    assert plan_micro_batch(SMOLLM2, BENCH_ROUND, 4, budget=8 * GB) == 4  # a configured size that fits stands


def test_a_configured_micro_batch_that_cannot_fit_is_refused_with_one_that_does():
    with pytest.raises(MemoryPlanError, match=r"grpo.micro_batch 32 needs about .* set grpo.micro_batch to \d+ or less"):
        plan_micro_batch(SMOLLM2, BENCH_ROUND, 32, budget=8 * GB)


def test_a_round_where_not_even_one_sequence_fits_names_what_to_change():
    with pytest.raises(MemoryPlanError, match="training one sequence .* lower generation.max_new_tokens"):
        plan_micro_batch(SMOLLM2, RoundShape(rows=64, generation_rows=8, prompt_tokens=57, completion_tokens=128), 0,
                         budget=4.0 * GB)
    huge_batch = RoundShape(rows=64, generation_rows=4096, prompt_tokens=512, completion_tokens=2048)
    with pytest.raises(MemoryPlanError, match="generating 4096 sequences .* lower generation.batch_size"):
        plan_micro_batch(SMOLLM2, huge_batch, 0, budget=20 * GB)
    assert generation_bytes(SMOLLM2, BENCH_ROUND) < 20 * GB


def test_gradient_checkpointing_and_lora_lower_the_estimate():
    from dataclasses import replace

    def per_row(shape):
        return training_bytes(shape, BENCH_ROUND, 9) - training_bytes(shape, BENCH_ROUND, 8)

    assert per_row(replace(SMOLLM2, checkpointing=True)) < 0.5 * per_row(SMOLLM2)  # keeps one layer's activations
    assert training_bytes(replace(SMOLLM2, trainable=1_000_000), BENCH_ROUND, 8) < training_bytes(SMOLLM2, BENCH_ROUND, 8) - 1.5 * GB
