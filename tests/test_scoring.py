from rewards import TaskRef, extract_answer, regenerate, score_completion


def task(dataset="arith", **config):
    return regenerate(TaskRef(dataset, config, seed=3, index=5))


def test_exact_answer_earns_full_reward():
    t = task()
    s = score_completion(t, f"<answer>{t.answer}</answer>")
    assert (s.reward, s.correct, s.formatted) == (1.0, True, True)


def test_reasoning_before_the_answer_is_allowed_and_whitespace_ignored():
    t = task()
    assert score_completion(t, f"Let me think: easy.\n<answer> {t.answer} </answer>\n").correct


def test_wrong_answer_earns_nothing():
    t = task()
    assert score_completion(t, f"<answer>{int(t.answer) + 1}</answer>").reward == 0.0


def test_answer_stuffing_earns_nothing():
    t = task()
    stuffed = " ".join(str(int(t.answer) + k) for k in range(-3, 4))
    assert score_completion(t, f"<answer>{stuffed}</answer>").reward == 0.0


def test_repeated_answer_blocks_earn_nothing():
    t = task()
    s = score_completion(t, f"<answer>{t.answer}</answer><answer>{t.answer}</answer>")
    assert (s.reward, s.formatted) == (0.0, False)


def test_several_answers_earn_nothing():
    t = task()
    assert score_completion(t, f"<answer>{t.answer}</answer> or maybe <answer>0</answer>").reward == 0.0


def test_oracle_hidden_in_long_answer_earns_nothing():
    t = task()
    assert score_completion(t, f"<answer>I am not sure, it could be {t.answer} or so</answer>").reward == 0.0


def test_reasoning_gym_partial_credit_is_not_paid():
    t = task("rg/basic_arithmetic", min_terms=2, max_terms=2)
    assert score_completion(t, f"<answer>{t.answer}</answer>").reward == 1.0
    # reasoning-gym itself gives len(oracle)/len(answer) for an answer that contains the oracle
    assert score_completion(t, f"<answer>{t.answer} 7</answer>").reward == 0.0


def test_junk_after_the_answer_block_earns_nothing():
    t = task()
    assert score_completion(t, f"<answer>{t.answer}</answer> junk").reward == 0.0


def test_extraction_rejects_malformed_blocks():
    assert extract_answer("no tags at all") is None
    assert extract_answer("<answer></answer>") is None
    assert extract_answer("</answer>5<answer>") is None
    assert extract_answer("<answer>" + "9" * 300 + "</answer>") is None
    assert extract_answer("<answer>5") is None
    assert extract_answer("x <answer>5</answer>  \n") == "5"


def test_format_reward_has_its_own_weight_and_default_off():
    t = task()
    wrong = f"<answer>{int(t.answer) + 1}</answer>"
    assert score_completion(t, wrong).reward == 0.0
    assert score_completion(t, wrong, format_weight=0.1).reward == 0.1
    assert score_completion(t, f"<answer>{t.answer}</answer>", format_weight=0.1).reward == 1.1
    assert score_completion(t, t.answer, format_weight=0.1).reward == 0.0
