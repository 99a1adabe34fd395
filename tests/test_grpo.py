"""The GRPO update step: batch building, knobs that act outside the loss, and learning direction."""

import copy

import pytest
import torch

import trainer.grpo as grpo_module
from rewards import TaskRef, regenerate
from trainer.groups import RolloutGroup
from trainer.config import GRPOConfig, LoraConfig, ModelConfig
from trainer.grpo import GRPOTrainer, make_scheduler

TASK = regenerate(TaskRef("arith", {}, seed=0, index=0))
GOOD, BAD = f"<answer>{TASK.answer}</answer>", "<answer>x</answer>"


def group(rewards, texts=None, truncated=None, ids=None, source="local"):
    texts = texts or [GOOD if r > 0 else BAD for r in rewards]
    return RolloutGroup(task=TASK, completions=texts, rewards=list(rewards),
                        truncated=truncated or [False] * len(rewards), completion_ids=ids, source=source)


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(before, model):
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def seq_logprob(policy, text):
    from trainer.batch import collate, token_logprobs
    from trainer.policy import encode_prompts

    ids = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    batch = collate(encode_prompts(policy, [TASK.prompt]), [ids], policy.tokenizer.pad_token_id, policy.device)
    with torch.no_grad():
        return token_logprobs(policy.model, batch).sum().item()


def test_a_step_raises_rewarded_and_lowers_unrewarded_completions(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-3), max_new_tokens=16, total_rounds=10)
    good, bad = seq_logprob(policy, GOOD), seq_logprob(policy, BAD)
    for _ in range(3):
        stats = trainer.step([group([1, 0, 1, 0])])
    assert stats.optimizer_steps == 1 and stats.groups_used == 1
    assert seq_logprob(policy, GOOD) > good
    assert seq_logprob(policy, BAD) < bad


def test_uniform_groups_are_dropped_and_an_empty_batch_takes_no_step(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(), max_new_tokens=16, total_rounds=10)
    before = params(policy.model)
    stats = trainer.step([group([1, 1, 1, 1]), group([0, 0, 0, 0])])
    assert (stats.groups_used, stats.groups_dropped_uniform, stats.optimizer_steps) == (0, 2, 0)
    assert unchanged(before, policy.model)
    stats = trainer.step([group([1, 1, 1, 1]), group([1, 0, 0, 0])])
    assert (stats.groups_used, stats.groups_dropped_uniform, stats.sequences) == (1, 1, 4)


def test_uniform_groups_can_be_kept(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(drop_uniform_groups=False), max_new_tokens=16, total_rounds=10)
    assert trainer.step([group([1, 1]), group([1, 0])]).groups_used == 2


def test_truncated_completions_are_masked_out_of_the_loss(policy):
    # Only the truncated pair carries signal: masked, the step has zero gradient and Adam moves nothing.
    g = group([1, 0], truncated=[True, True])
    masked = GRPOTrainer(policy, GRPOConfig(mask_truncated=True, weight_decay=0.0), 16, 10)
    before = params(policy.model)
    masked.step([g])
    assert unchanged(before, policy.model)
    GRPOTrainer(policy, GRPOConfig(mask_truncated=False), 16, 10).step([g])
    assert not unchanged(before, policy.model)


@pytest.fixture
def loss_calls(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(log-probs, old log-probs) of every loss evaluation in the test."""
    calls = []
    real = grpo_module.grpo_loss

    def spy(logps, old_logps, *args, **kwargs):
        calls.append((logps.detach().clone(), old_logps.clone()))
        return real(logps, old_logps, *args, **kwargs)

    monkeypatch.setattr(grpo_module, "grpo_loss", spy)
    return calls


def test_every_epoch_uses_the_pre_update_policy_as_old_logprobs(policy, loss_calls):
    calls = loss_calls
    trainer = GRPOTrainer(policy, GRPOConfig(epochs=3, lr=1e-3), max_new_tokens=16, total_rounds=10)
    stats = trainer.step([group([1, 0, 0, 1])])
    assert stats.optimizer_steps == 3 and len(calls) == 3
    (new0, old0), (new1, old1), (new2, old2) = calls
    assert torch.allclose(new0, old0, atol=1e-6)  # first pass: ratio 1
    rows = lambda t: t.sum(-1).sort().values  # noqa: E731 - epochs visit the rows in a new order
    assert torch.equal(rows(old0), rows(old1)) and torch.equal(rows(old0), rows(old2))  # fixed for the round
    assert not torch.allclose(new1, old1, atol=1e-6)  # later passes see the updated policy


def test_minibatches_split_the_batch_into_optimizer_steps(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(minibatches=2, epochs=2), max_new_tokens=16, total_rounds=10)
    assert trainer.step([group([1, 0, 0, 1])]).optimizer_steps == 4


def test_kl_penalty_loads_a_frozen_reference(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(kl_coef=0.5, lr=1e-3), max_new_tokens=16, total_rounds=10)
    ref_before = params(trainer.reference)
    trainer.step([group([1, 0, 0, 1])])
    stats = trainer.step([group([1, 0, 0, 1])])
    assert stats.kl > 0
    assert unchanged(ref_before, trainer.reference)
    assert GRPOTrainer(policy, GRPOConfig(kl_coef=0.0), 16, 10).reference is None


def test_text_from_elsewhere_is_retokenized_and_local_ids_are_reused(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(), max_new_tokens=16, total_rounds=10)
    text_only = group([1, 0])
    batch, *_ = trainer._tensors([text_only])
    expected = policy.tokenizer(GOOD, add_special_tokens=False)["input_ids"]
    assert batch.input_ids[0, batch.prompt_len : batch.prompt_len + len(expected)].tolist() == expected
    with_ids = group([1, 0], ids=[[5, 6, 7], [8]])
    batch, *_ = trainer._tensors([with_ids])
    assert batch.input_ids[0, batch.prompt_len :].tolist() == [5, 6, 7]
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_external_text_longer_than_max_new_tokens_is_cut_and_counts_as_truncated(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(), max_new_tokens=4, total_rounds=10)
    long_text = "<answer>" + "9" * 30 + "</answer>"
    batch, _, _, truncated, external, *_ = trainer._tensors([group([1, 0], texts=[GOOD, long_text], source="peer")])
    assert batch.completion_mask.shape[1] == 4
    assert truncated.tolist() == [len(policy.tokenizer(GOOD, add_special_tokens=False)["input_ids"]) >= 4, True]
    _, _, _, truncated, *_ = GRPOTrainer(policy, GRPOConfig(), max_new_tokens=64, total_rounds=10)._tensors(
        [group([1, 0], texts=[GOOD, long_text], source="peer")])
    assert truncated.tolist() == [False, False]
    assert external.tolist() == [True, True]


def test_external_completions_off_this_policys_support_are_masked_and_local_ones_never(policy):
    """Untrained policy: every completion has a mean token log-prob near -log(vocab) ~ -6."""
    strict = GRPOConfig(external_min_logprob=-1.0, weight_decay=0.0)
    before = params(policy.model)
    stats = GRPOTrainer(policy, strict, 16, 10).step([group([1, 0, 1, 0], source="12D3KooWpeer")])
    assert (stats.external_groups_used, stats.external_masked) == (1, 4)
    assert unchanged(before, policy.model)  # everything masked: zero gradient
    stats = GRPOTrainer(policy, strict, 16, 10).step([group([1, 0, 1, 0])])
    assert stats.external_masked == 0 and not unchanged(before, policy.model)


@pytest.mark.parametrize("negatives", [True, False])
def test_external_completions_below_their_group_mean_leave_the_loss_only_when_external_negatives_is_off(
        policy, monkeypatch, negatives):
    seen = []
    real = grpo_module.grpo_loss

    def spy(logps, old_logps, advantages, mask, *args, **kwargs):
        seen.append((advantages.clone(), mask.clone()))
        return real(logps, old_logps, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(grpo_module, "grpo_loss", spy)
    cfg = GRPOConfig(external_min_logprob=None, external_negatives=negatives)
    GRPOTrainer(policy, cfg, 16, 10).step([group([1, 0, 0, 0]), group([1, 0, 0, 0], source="12D3KooWpeer")])
    advantages, mask = seen[0]  # rows in the step's shuffled order
    kept = mask.sum(-1) > 0
    assert (advantages < 0).sum() == 6 and kept[advantages > 0].all()
    assert int(kept[advantages < 0].sum()) == (6 if negatives else 3)  # off: the local group's three stay


def test_rows_a_selection_rule_left_out_take_no_part_in_the_loss(policy):
    """`used` (the guarded rule's support gate) masks rows; the group's advantages still count every reward."""
    cfg = GRPOConfig(external_min_logprob=None, weight_decay=0.0, lr=1e-3)
    before = params(policy.model)
    masked = group([1, 0, 1, 0], source="12D3KooWpeer")
    masked.used = [False, True, False, True]  # the right rows gated, the wrong ones masked as external negatives
    stats = GRPOTrainer(policy, cfg, 16, 10).step([masked])
    assert stats.optimizer_steps == 1 and unchanged(before, policy.model)
    half = group([1, 0, 1, 0], source="12D3KooWpeer")
    half.used = [True, True, False, True]
    good = seq_logprob(policy, GOOD)
    GRPOTrainer(policy, cfg, 16, 10).step([half])
    assert seq_logprob(policy, GOOD) > good


def test_shaped_rows_reach_the_loss_flagged_and_are_counted(policy, monkeypatch):
    """`shaped` (the scoped rule's rows from a stronger peer) reaches the loss as a per-row flag; the rows stay
    in the loss and move the policy towards them, and the step counts them."""
    flags = []
    real = grpo_module.grpo_loss

    def spy(*args, shaped=None, **kwargs):
        flags.append(shaped.tolist())
        return real(*args, shaped=shaped, **kwargs)

    monkeypatch.setattr(grpo_module, "grpo_loss", spy)
    peer = group([1, 0, 1, 0], source="12D3KooWpeer")
    peer.shaped = [True, False, False, False]
    good = seq_logprob(policy, GOOD)
    stats = GRPOTrainer(policy, GRPOConfig(external_min_logprob=None, lr=1e-3), 16, 10).step([peer, group([1, 0, 0, 1])])
    assert sorted(flags[0]) == [False] * 7 + [True] and stats.external_shaped == 1
    assert seq_logprob(policy, GOOD) > good


def test_a_step_reports_its_local_rows_log_probs_as_the_selector_computes_them(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-12, weight_decay=0.0), 16, 10)
    local, peer = group([1, 0, 0, 1]), group([1, 0, 1, 0], source="12D3KooWpeer")
    expected, of_peer = trainer.sequence_logprobs([local, peer])
    assert len(expected) == len(of_peer) == 4 and all(-20 < lp < 0 for lp in expected + of_peer)
    stats = trainer.step([peer, local])
    assert sorted(stats.local_logprobs) == pytest.approx(sorted(expected), abs=1e-5)  # only the local group's four


def test_in_support_external_groups_train_like_local_ones_with_own_logprobs_as_old_policy(policy, loss_calls):
    seen = loss_calls
    trainer = GRPOTrainer(policy, GRPOConfig(external_min_logprob=None, lr=1e-3), 16, 10)
    good = seq_logprob(policy, GOOD)
    stats = trainer.step([group([1, 0, 1, 0], source="12D3KooWpeer")])
    assert (stats.external_groups_used, stats.external_masked, stats.optimizer_steps) == (1, 0, 1)
    new, old = seen[0]
    assert torch.allclose(new, old, atol=1e-6)  # the ratio starts at 1: old = this node's own policy
    assert seq_logprob(policy, GOOD) > good


def test_gradient_clipping_bounds_the_reported_norm(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(max_grad_norm=1e-3, lr=1e-3), max_new_tokens=16, total_rounds=10)
    stats = trainer.step([group([1, 0, 0, 1])])
    assert stats.grad_norm > 1e-3  # reported norm is the pre-clip norm: clipping was needed


@pytest.mark.parametrize("schedule,expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 2 / 3, 1 / 3, 0.0]),
    ("cosine", [0.5, 1.0, 0.75, 0.25, 0.0]),
])
def test_lr_schedules_with_warmup(schedule, expected):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = make_scheduler(opt, GRPOConfig(lr_schedule=schedule, warmup_steps=1), total_steps=4)
    seen = []
    for _ in range(5):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx(expected)


def test_lora_trains_only_adapters_and_the_generator_samples_them_from_the_one_copy_of_the_base(tiny_a, cache_dir):
    """No second copy of the weights: the transformers generator runs the trainer's model, adapters on, and
    what it samples is scored by the merged model as it would be by a copy; the KL reference is the base
    under the adapters, not a copy either."""
    pytest.importorskip("peft")
    from trainer.batch import sequence_logprobs
    from trainer.generation import SamplingParams
    from trainer.generation.hf import TransformersGenerator
    from trainer.policy import encode_prompts
    from trainer.presets import load

    policy = load(ModelConfig(name="tiny-a", cache_dir=cache_dir, lora=LoraConfig(enabled=True, r=4)))
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    gen = TransformersGenerator(policy)
    assert gen.model is policy.model
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-2, kl_coef=0.1), max_new_tokens=16, total_rounds=10)
    assert trainer.reference is None
    trainer.step([group([1, 0, 0, 1])])
    assert trainer.step([group([1, 0, 0, 1])]).kl > 0  # the adapters moved away from the base
    assert all(torch.equal(base[n], p) for n, p in policy.model.named_parameters() if not p.requires_grad)
    gen.set_weights(policy.model)
    assert gen.weight_version == 1 and not policy.model.training
    prompts = encode_prompts(policy, [TASK.prompt] * 2)
    out = gen.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=1))
    merged = copy.deepcopy(policy.model).merge_and_unload()
    completions = [c for g in out for c in g]
    scored = sequence_logprobs(merged, [prompts[0]] * len(completions), [c.token_ids for c in completions],
                               policy.tokenizer.pad_token_id, policy.device)
    for c, want in zip(completions, scored):
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4)
    with policy.model.disable_adapter():  # what the base alone scores differs: the adapters were sampled
        alone = sequence_logprobs(policy.model, [prompts[0]] * len(completions), [c.token_ids for c in completions],
                                  policy.tokenizer.pad_token_id, policy.device)
    assert any(not torch.allclose(a, w, atol=1e-4) for a, w in zip(alone, scored))


def test_gradient_checkpointing_trains(tiny_a, cache_dir):
    from trainer.presets import load

    policy = load(ModelConfig(name="tiny-a", cache_dir=cache_dir, gradient_checkpointing=True))
    assert getattr(policy.model, "is_activation_checkpointing", None) or policy.model.is_gradient_checkpointing
    before = params(policy.model)
    trainer = GRPOTrainer(policy, GRPOConfig(), 16, 10)
    trainer.step([group([1, 0])])
    assert not unchanged(before, policy.model)
    assert not trainer.share_prompts  # checkpointed layers drop the KV cache a shared prompt passes on


TEXTS = [GOOD, BAD, GOOD + " and more words", "<answer>", GOOD, BAD + BAD, "x", GOOD]


def mixed_groups():
    """Texts of different lengths, a truncated row and an external group."""
    return [group([1, 0, 1, 0], texts=TEXTS[:4], truncated=[False, False, True, False]),
            group([1, 0, 0, 1], texts=TEXTS[4:], source="12D3KooWpeer")]


def recorded_steps(policy, cfg: GRPOConfig) -> tuple[list[dict[str, torch.Tensor]], object]:
    """The gradient each optimizer step of one GRPO step on `mixed_groups` applied, and the step's statistics."""
    torch.manual_seed(0)  # the same minibatch split in every run
    model_copy = copy.deepcopy(policy)
    trainer = GRPOTrainer(model_copy, cfg, max_new_tokens=16, total_rounds=10)
    grads, step = [], trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads.append({n: p.grad.clone() for n, p in model_copy.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return grads, trainer.step(mixed_groups())


def assert_same_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and any(g.abs().sum() > 0 for g in a.values())
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-4), name


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
def test_micro_batches_accumulate_the_same_gradient_and_statistics_as_one_pass(policy, aggregation):
    """Some rows masked, a KL term and two minibatches: every optimizer step sees the gradient that
    the whole minibatch in one pass would give."""
    cfg = dict(loss_aggregation=aggregation, minibatches=2, kl_coef=0.1, external_min_logprob=None, external_negatives=True)
    whole, whole_stats = recorded_steps(policy, GRPOConfig(**cfg, micro_batch=0))
    micro, micro_stats = recorded_steps(policy, GRPOConfig(**cfg, micro_batch=3))
    assert len(whole) == len(micro) == 2
    for a, b in zip(whole, micro):
        assert_same_gradients(a, b)
    for key in ("loss", "ratio_mean", "clip_frac", "kl", "grad_norm"):
        assert getattr(micro_stats, key) == pytest.approx(getattr(whole_stats, key), rel=1e-4, abs=1e-7), key


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_a_single_pass_takes_its_old_logprobs_from_itself_and_steps_as_a_separate_old_pass_would(policy, aggregation):
    """epochs = minibatches = 1 skips the old-log-prob forward; its one step must equal the first step
    of a run that makes that forward (two epochs), off-support masking included, in micro-batches."""
    cfg = dict(loss_aggregation=aggregation, external_min_logprob=-4.0, micro_batch=3)
    with_old_pass, _ = recorded_steps(policy, GRPOConfig(**cfg, epochs=2))
    single, stats = recorded_steps(policy, GRPOConfig(**cfg, epochs=1))
    assert len(single) == 1 and stats.ratio_mean == pytest.approx(1.0) and stats.external_masked > 0
    assert_same_gradients(with_old_pass[0], single[0])


def test_log_probs_of_a_few_short_rows_of_a_wide_batch_equal_each_row_alone(policy):
    """The columns that are padding in every selected row are skipped, and nothing else changes."""
    from trainer.batch import collate, token_logprobs
    from trainer.policy import encode_prompts

    prompts = encode_prompts(policy, [TASK.prompt, "7+1=?", TASK.prompt + " and a much longer prompt"])
    completions = [policy.tokenizer(t, add_special_tokens=False)["input_ids"] for t in (GOOD, "x", GOOD * 4)]
    wide = collate(prompts, completions, policy.tokenizer.pad_token_id, policy.device)
    with torch.no_grad():
        short = token_logprobs(policy.model, wide.select(torch.tensor([0, 1])))
        for i in (0, 1):
            alone = token_logprobs(policy.model, collate([prompts[i]], [completions[i]], policy.tokenizer.pad_token_id,
                                                         policy.device))[0]
            n = len(completions[i])
            assert torch.allclose(short[i, :n], alone, atol=1e-5)
    longest = max(len(completions[0]), len(completions[1]))
    assert short.shape[1] == wide.completion_mask.shape[1] > longest and (short[:, longest:] == 0).all()


def test_shared_prompts_give_the_same_log_probs_and_gradients_as_one_forward_per_row(policy):
    """Two groups with prompts of different lengths (left padding), completions of different lengths."""
    from trainer.batch import collate, token_logprobs
    from trainer.policy import encode_prompts

    prompts = encode_prompts(policy, [TASK.prompt, TASK.prompt + " and a longer prompt"])
    completions = [policy.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:6]]
    batch = collate([prompts[0]] * 3 + [prompts[1]] * 3, completions, policy.tokenizer.pad_token_id, policy.device)
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    model = policy.model.train()
    results = []
    for share in (False, True):
        model.zero_grad()
        logps = token_logprobs(model, batch, share_prompts=share)
        (logps * batch.completion_mask).sum().backward()
        results.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    model.eval()
    (plain, plain_grads), (shared, shared_grads) = results
    assert GRPOTrainer(policy, GRPOConfig(), 16, 10).share_prompts
    assert torch.allclose(plain, shared, atol=1e-5)
    assert_same_gradients(plain_grads, shared_grads)


def test_micro_batches_are_cut_where_they_run_the_fewest_positions(policy):
    """Long prompts, even completions: one prompt per micro-batch. Short prompts, ragged completions (each
    group has one long row): rows of similar length together. A long prompt and one long row: that row
    runs alone rather than padding its group's short ones."""
    from trainer.batch import collate

    trainer = GRPOTrainer(policy, GRPOConfig(micro_batch=4), 16, 10)

    def micro(prompt_len, completion_lens, prompts_of=lambda i: i // 4):
        batch = collate([[1 + prompts_of(i)] * prompt_len for i in range(8)], [[5] * n for n in completion_lens], 0,
                        policy.device)
        parts = trainer._micro(torch.arange(8), batch)
        assert sorted(torch.cat(parts).tolist()) == list(range(8)) and all(len(p) <= 4 for p in parts)
        return ([(sorted(set(batch.prompt_index[p].tolist())), sorted(completion_lens[i] for i in p.tolist())) for p in parts],
                sum(trainer._tokens(p, batch) for p in parts))

    assert micro(50, [3, 4, 3, 4, 4, 3, 4, 3]) == ([([0], [3, 3, 4, 4]), ([1], [3, 3, 4, 4])], 132)
    assert micro(2, [1, 40, 1, 40, 1, 40, 1, 40], prompts_of=lambda i: i % 2) == (
        [([0], [1, 1, 1, 1]), ([1], [40, 40, 40, 40])], 2 + 4 + 2 + 160)
    # split by 4 in prompt order this costs 50 + 4 x 40 + 50 + 4 x 4 = 276
    assert micro(50, [3, 4, 3, 40, 4, 3, 4, 3]) == ([([0], [3, 3, 4]), ([0], [40]), ([1], [3, 3, 4, 4])], 218)


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_token_logprobs_equal_a_full_logits_forward_in_value_and_gradient(policy, monkeypatch, share_prompts, chunked):
    """The LM head runs chunk by chunk (one completion position at a time when forced here, each chunk
    recomputed in backward); the log-probs and their gradients are those of the whole logits at once."""
    import torch

    from trainer import batch as B

    if chunked:  # one position per chunk: every chunk boundary and the checkpointed backward are exercised
        monkeypatch.setattr(B, "LOGITS_CHUNK_BYTES", 1)
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11]]
    batch = B.collate(prompts, [[12, 13, 14], [15, 16], [17, 18, 19, 20], [21]], 0, torch.device("cpu"))
    P, C = batch.prompt_len, batch.completion_mask.shape[1]

    def full(model):
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=positions).logits[:, P - 1 : P + C - 1].float()
        return logits.log_softmax(-1).gather(-1, batch.input_ids[:, P:, None])[..., 0] * batch.completion_mask

    model = policy.model
    got = B.token_logprobs(model, batch, share_prompts) * batch.completion_mask
    got.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = full(model)
    want.sum().backward()
    assert torch.allclose(got, want, atol=1e-5)
    for mine, theirs in zip(grads, (p.grad for p in model.parameters())):
        assert torch.allclose(mine, theirs, atol=1e-4)


def test_head_logprobs_apply_a_models_logit_scale_and_soft_cap(monkeypatch):
    import torch

    from trainer import batch as B

    monkeypatch.setattr(B, "LOGITS_CHUNK_BYTES", 1)
    torch.manual_seed(0)
    head, hidden = torch.nn.Linear(8, 11, bias=False), torch.randn(2, 3, 8, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3))
    got = B.head_logprobs(head, hidden, targets, scale=0.5, cap=3.0)
    logits = torch.tanh(head(hidden) * 0.5 / 3.0) * 3.0
    want = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(B.head_logprobs(head, hidden, targets), want, atol=1e-3)  # the scale and cap matter


def test_head_logprobs_keep_the_weights_dtype_under_a_steps_bfloat16_autocast():
    from trainer import batch as B

    torch.manual_seed(0)
    head, hidden = torch.nn.Linear(64, 50, bias=False), torch.randn(2, 3, 64)
    targets = torch.randint(0, 50, (2, 3))
    want, logits = B.head_logprobs(head, hidden, targets), head(hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(B.head_logprobs(head, hidden, targets), want)
        assert not torch.allclose(head(hidden).float(), logits, atol=1e-4)  # what an unguarded head would have given


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_bfloat16_compute_step_runs_the_decoder_in_bfloat16_and_follows_the_float32_gradient(policy):
    """grpo.compute_dtype bfloat16: the decoder's products autocast to bfloat16, the LM head's stay float32; the
    weights, gradients and AdamW's moments stay float32, and the gradient is float32's up to bfloat16's rounding."""
    dtypes: list[tuple[str, torch.dtype]] = []
    first = next(m for m in policy.model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    hooks = [module.register_forward_hook(lambda _m, _a, out, name=name: dtypes.append((name, out.dtype)))
             for name, module in (("decoder", first), ("head", policy.model.get_output_embeddings()))]
    try:
        runs = {}
        for compute in ("model", "bfloat16"):
            dtypes.clear()
            runs[compute] = recorded_steps(policy, GRPOConfig(compute_dtype=compute, micro_batch=3))
            assert set(dtypes) == {("decoder", torch.float32 if compute == "model" else torch.bfloat16), ("head", torch.float32)}
    finally:
        for hook in hooks:
            hook.remove()
    (f32,), _ = runs["model"]
    (bf16,), stats = runs["bfloat16"]
    flat = lambda grads: torch.cat([g.flatten() for g in grads.values()])  # noqa: E731
    assert all(g.dtype == torch.float32 for g in bf16.values()) and stats.ratio_mean == pytest.approx(1.0)
    difference = ((flat(bf16) - flat(f32)).norm() / flat(f32).norm()).item()
    assert 1e-4 < difference < 0.1, difference  # the same gradient to bfloat16's rounding, not the same numbers


def test_a_bfloat16_compute_step_takes_its_old_policy_in_bfloat16_too(policy, loss_calls):
    """A separate old-policy pass (epochs above 1) runs in the step's compute dtype: its first ratio is 1."""
    trainer = GRPOTrainer(policy, GRPOConfig(epochs=2, lr=1e-3, compute_dtype="bfloat16"), max_new_tokens=16, total_rounds=10)
    trainer.step([group([1, 0, 0, 1])])
    (new0, old0), (new1, old1) = loss_calls
    assert torch.allclose(new0, old0, atol=1e-6) and not torch.allclose(new1, old1, atol=1e-6)
    assert all(s.dtype == torch.float32 for state in trainer.optimizer.state.values() for s in state.values() if s.numel() > 1)


def test_a_cpu_step_uses_the_fused_adamw_and_moves_the_weights_as_the_reference_adamw(policy):
    """The trainer's AdamW is torch's fused kernel on a CPU; two of its steps move every weight as the per-tensor
    reference implementation does from the same gradients, and it takes over the reference's saved state (a
    checkpoint written before it resumes)."""
    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-3, weight_decay=0.1), max_new_tokens=16, total_rounds=10)
    assert trainer.optimizer.defaults["fused"] is True
    start = [p.detach().clone() for p in trainer.params]
    weights = [p.clone().requires_grad_() for p in start]
    reference = torch.optim.AdamW(weights, lr=1e-3, betas=trainer.cfg.adam_betas, weight_decay=0.1, foreach=False)
    torch.manual_seed(0)
    for _ in range(2):
        for p, w in zip(trainer.params, weights):
            p.grad = torch.randn_like(p)
            w.grad = p.grad.clone()
        trainer.optimizer.step()
        reference.step()
    assert all(torch.allclose(p, w, rtol=1e-5, atol=1e-7) for p, w in zip(trainer.params, weights))
    assert all(not torch.allclose(p, s, atol=1e-5) for p, s in zip(trainer.params, start))  # the steps moved every weight
    resumed = GRPOTrainer(policy, GRPOConfig(lr=1e-3), max_new_tokens=16, total_rounds=10)
    resumed.optimizer.load_state_dict(reference.state_dict())
    resumed.step([group([1, 0, 0, 1])])
    assert all(int(s["step"]) == 3 for s in resumed.optimizer.state.values())
