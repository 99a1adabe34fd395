"""Contract of the transformers generation backend (the reference every backend must match)."""

import copy

import pytest
import torch

from trainer.batch import collate, token_logprobs
from trainer.generation import SamplingParams
from trainer.generation.hf import TransformersGenerator
from trainer.policy import encode_prompts

PROMPTS = ["7+5=?\nReply with <answer>final answer</answer>.\n", "reverse abcd\nReply with <answer>final answer</answer>.\n"]
LOGPROB_TOLERANCE = 1e-4  # fp32 CPU: KV-cached decoding vs one full forward pass


def sample(gen, policy, **kw):
    params = SamplingParams(**{"n": 4, "temperature": 1.0, "max_new_tokens": 12, "seed": 3, **kw})
    return gen.generate(encode_prompts(policy, PROMPTS), params)


def test_seeded_sampling_is_reproducible_and_seed_dependent(policy):
    gen = TransformersGenerator(policy)
    a, b, c = sample(gen, policy), sample(gen, policy), sample(gen, policy, seed=4)
    ids = lambda out: [x.token_ids for group in out for x in group]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_sampling_does_not_disturb_the_global_rng(policy):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    sample(TransformersGenerator(policy), policy)
    assert torch.equal(torch.rand(3), expected)


def test_returns_n_completions_per_prompt_in_order(policy):
    out = sample(TransformersGenerator(policy), policy, n=3)
    assert [len(g) for g in out] == [3, 3]


def test_logprobs_match_a_forward_pass_of_the_same_weights(policy):
    gen = TransformersGenerator(policy)
    out = sample(gen, policy)
    prompt_ids = encode_prompts(policy, PROMPTS)
    rows = [(prompt_ids[i], c) for i, group in enumerate(out) for c in group]
    batch = collate([p for p, _ in rows], [c.token_ids for _, c in rows], policy.tokenizer.pad_token_id, policy.device)
    with torch.no_grad():
        forward = token_logprobs(policy.model, batch)
    for i, (_, c) in enumerate(rows):
        assert torch.allclose(forward[i, : len(c.token_ids)], torch.tensor(c.logprobs), atol=LOGPROB_TOLERANCE)


def test_max_new_tokens_is_respected_and_reported(policy):
    for group in sample(TransformersGenerator(policy), policy, max_new_tokens=5, stop=()):
        for c in group:
            assert len(c.token_ids) <= 5
            assert c.finish_reason == ("length" if len(c.token_ids) == 5 and c.token_ids[-1] != policy.tokenizer.eos_token_id else "stop")


def test_stop_strings_end_the_text_and_are_kept(policy):
    # an untrained model rarely writes a given string: stop on single characters it will produce
    out = sample(TransformersGenerator(policy), policy, n=8, max_new_tokens=30, stop=("a", "e"))
    stopped = [c for g in out for c in g if c.finish_reason == "stop" and c.text]
    assert stopped
    for c in stopped:
        assert c.text.endswith(("a", "e")) or c.token_ids[-1] == policy.tokenizer.eos_token_id
        assert "a" not in c.text[:-1] and "e" not in c.text[:-1]


def test_greedy_is_deterministic_without_a_seed(policy):
    gen = TransformersGenerator(policy)
    a = sample(gen, policy, n=1, temperature=0.0, seed=None)
    b = sample(gen, policy, n=1, temperature=0.0, seed=None)
    assert [g[0].token_ids for g in a] == [g[0].token_ids for g in b]


def test_checkpoint_generation_defaults_do_not_change_sampling(policy):
    """A model whose generation_config sets top_k=1 would sample greedily; ours must not inherit it."""
    plain = sample(TransformersGenerator(policy), policy, n=8)
    policy.model.generation_config.top_k = 1
    policy.model.generation_config.repetition_penalty = 5.0
    tweaked = sample(TransformersGenerator(policy), policy, n=8)
    assert [c.token_ids for g in plain for c in g] == [c.token_ids for g in tweaked for c in g]


def test_weight_push_changes_outputs_and_logprobs_follow_the_new_weights(policy):
    gen = TransformersGenerator(policy)
    before = sample(gen, policy, n=1, temperature=0.0)
    other = copy.deepcopy(policy.model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    gen.load_weights(other.state_dict())
    assert gen.weight_version == 1
    after = sample(gen, policy, n=1, temperature=0.0)
    assert [g[0].token_ids for g in before] != [g[0].token_ids for g in after]
    assert all(g[0].weight_version == 1 for g in after)
    c = after[0][0]
    batch = collate([encode_prompts(policy, PROMPTS[:1])[0]], [c.token_ids], policy.tokenizer.pad_token_id, policy.device)
    with torch.no_grad():
        forward = token_logprobs(other, batch)[0, : len(c.token_ids)]
    assert torch.allclose(forward, torch.tensor(c.logprobs), atol=LOGPROB_TOLERANCE)


def test_tied_embeddings_stay_tied_after_a_push(policy):
    gen = TransformersGenerator(policy)
    assert policy.model.config.tie_word_embeddings
    other = copy.deepcopy(policy.model)
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(2.0)
    gen.load_weights(other.state_dict())
    head, emb = gen.model.get_output_embeddings().weight, gen.model.get_input_embeddings().weight
    assert head.data_ptr() == emb.data_ptr()
    assert torch.equal(head, other.get_output_embeddings().weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: needs a GPU (CI has none)")
def test_generation_on_cuda_matches_forward_pass(policy):
    policy.model.to("cuda")
    policy.device = torch.device("cuda")
    test_logprobs_match_a_forward_pass_of_the_same_weights(policy)
