"""Repetition detection (rollout/repetition.py): the check itself, the default settings on
normal outputs, the config, and the flag's way from the rollout to the rewards and the logs."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.online.rollouts import rollout_metrics
from omegaconf import OmegaConf

from posttrain.data.arithmetic import ALPHABET, ArithmeticTask, Problem
from posttrain.errors import ConfigError
from posttrain.rollout.repetition import RepetitionDetector, RepetitionRule, first_repetition, repetition_rule
from posttrain.conf import CONFIG_DIR

EOS = torch.tensor([1])


def brute_force_first_loop(tokens: list[int], rule: RepetitionRule) -> int:
    """The definition, written out: the first step s at which the last `window` tokens are one
    block of p <= ngram tokens repeated (y_t == y_{t-p} for the last window - p positions t),
    before any EOS; -1 if none."""
    for s in range(len(tokens)):
        if tokens[s] in EOS.tolist():
            return -1
        if s + 1 < rule.window:
            continue
        for p in range(1, rule.ngram + 1):
            if all(tokens[t] == tokens[t - p] for t in range(s - rule.window + p + 1, s + 1)):
                return s
    return -1


def found(sequence, ngram, window) -> int:
    return int(first_repetition(torch.tensor([sequence]), EOS, RepetitionRule(ngram, window))[0])


@pytest.mark.parametrize("period", [1, 2, 3, 4])
def test_loops_of_every_period_up_to_ngram_are_found_when_the_window_fills(period):
    prefix = [2, 3, 4, 5, 6]  # no repeats in it
    block = list(range(10, 10 + period))
    sequence = prefix + block * 10
    # the last 8 tokens are one block repeated once 5 + 8 - 1 = 12 tokens have been sampled
    assert found(sequence, ngram=4, window=8) == len(prefix) + 8 - 1
    assert brute_force_first_loop(sequence, RepetitionRule(4, 8)) == len(prefix) + 8 - 1


def test_near_misses_are_not_found():
    block = [10, 11, 12]
    # one token short of filling the window
    assert found([2, 3] + block * 2 + block[:1], ngram=3, window=8) == -1
    assert found([2, 3] + block * 2 + block[:2], ngram=3, window=8) == 9
    # a period longer than ngram
    assert found(list(range(10, 15)) * 6, ngram=4, window=8) == -1
    assert found(list(range(10, 15)) * 6, ngram=5, window=10) == 9
    # a loop broken by one different token every time the window is almost full
    broken = ([10, 11] * 3 + [12]) * 5
    assert found(broken, ngram=2, window=8) == -1
    assert found(broken, ngram=2, window=6) == 5
    # the same block again, but not back to back
    assert found([10, 11, 12, 2, 10, 11, 12, 3, 10, 11, 12, 4], ngram=4, window=8) == -1


def test_nothing_after_the_first_eos_counts():
    assert found([2, 3, 1, 5, 5, 5, 5, 5, 5], ngram=1, window=4) == -1
    assert found([2, 3, 5, 5, 5, 5, 1, 5, 5], ngram=1, window=4) == 5


def test_the_check_is_its_definition_on_random_sequences():
    """Small vocabularies loop by chance: the replayed incremental check gives the first step
    of the brute-force definition on every row."""
    g = torch.Generator().manual_seed(0)
    for vocab, ngram, window in ((3, 2, 4), (4, 3, 6), (2, 1, 3), (3, 4, 9)):
        tokens = torch.randint(2, vocab + 2, (200, 40), generator=g)
        tokens[torch.rand(tokens.shape, generator=g) < 0.01] = 1  # a few EOS
        rule = RepetitionRule(ngram, window)
        replay = first_repetition(tokens, EOS, rule)
        expected = torch.tensor([brute_force_first_loop(row.tolist(), rule) for row in tokens])
        assert torch.equal(replay, expected)
        assert (expected >= 0).any() and (expected < 0).any()  # both kinds of row were seen


def default_rule() -> RepetitionRule:
    node = OmegaConf.load(f"{CONFIG_DIR}/rollout/fast.yaml").repetition
    for engine in ("hf", "vllm"):  # one setting for every engine
        assert OmegaConf.load(f"{CONFIG_DIR}/rollout/{engine}.yaml").repetition == node
    return repetition_rule(node)


def test_default_settings_never_fire_on_the_tasks_verbose_solutions():
    """Verbose written-carry solutions are full of near-repeats ("1+1=2,1+1=2,...") yet never
    one block filling the window: the default rule is on without touching them."""
    rule = default_rule()
    assert rule is not None
    chars = {c: i + 3 for i, c in enumerate(ALPHABET)}  # ids as the char tokenizer gives them
    rows = []
    for digits in range(1, 9):
        for operands in (2, 3, 4):
            task = ArithmeticTask(seed=digits, min_digits=1, max_digits=digits, num_operands=operands)
            rows += [p.solution("verbose") for p in task.problems("train", 40)]
    # the most repetitive solutions there are: every column the same digits
    rows += [Problem((int("1" * d), int("1" * d))).solution("verbose") for d in range(1, 11)]
    rows += [Problem((int("5" * d), int("5" * d), int("9" * d))).solution("verbose") for d in range(1, 8)]
    width = max(len(r) for r in rows)
    tokens = torch.ones(len(rows), width + 1, dtype=torch.long)  # EOS after each solution
    for i, text in enumerate(rows):
        tokens[i, : len(text)] = torch.tensor([chars[c] for c in text])
    assert (first_repetition(tokens, EOS, rule) == -1).all()
    # the bound of the module docstring: eleven identical columns make a 66-token loop
    eleven = Problem((int("1" * 11), int("1" * 11))).solution("verbose")
    assert found([chars[c] for c in eleven], rule.ngram, rule.window) >= 0


NATURAL_TEXT = """
The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of
times, it was the age of wisdom, it was the age of foolishness, it was the epoch of belief,
it was the epoch of incredulity. Natalia sold clips to 48 of her friends in April, and then
she sold half as many clips in May. How many clips did Natalia sell altogether in April and
May? Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether in April
and May. #### 72 | a | b | c | d | e | f | 1,000,000,000 is a billion; 0.0001 is small.
Step 1: add. Step 2: carry. Step 3: add again. Step 4: check. Step 5: done. Yes, yes, yes.
"""


def test_default_settings_never_fire_on_natural_text():
    rule = default_rule()
    words = NATURAL_TEXT.split()
    vocab = {w: i + 2 for i, w in enumerate(dict.fromkeys(words))}
    by_word = [vocab[w] for w in words]
    by_char = [ord(c) + 2 for c in NATURAL_TEXT]
    assert found(by_word, rule.ngram, rule.window) == -1
    assert found(by_char, rule.ngram, rule.window) == -1
    # ... while the same text stuck in a loop of words is found once it fills the window
    stuck = by_word[:30] + [vocab[w] for w in "it was the age of".split()] * 20
    assert found(stuck, rule.ngram, rule.window) == 30 + rule.window - 1


def test_rule_from_config_and_its_errors():
    assert repetition_rule(None) is None
    assert repetition_rule(OmegaConf.create({"ngram": None, "window": 64})) is None
    assert repetition_rule({"ngram": 4, "window": 8}) == RepetitionRule(4, 8)
    with pytest.raises(ConfigError, match=r"rollout\.repetition\.window=7 .* 2 x rollout\.repetition\.ngram"):
        repetition_rule({"ngram": 4, "window": 7})
    with pytest.raises(ConfigError, match=r"rollout\.repetition\.ngram"):
        repetition_rule({"ngram": 0, "window": 8})
    with pytest.raises(ConfigError, match=r"rollout\.repetition\.window"):
        repetition_rule({"ngram": 2, "window": "64"})


def test_detector_skips_rows_already_done_and_keeps_the_first_detection():
    rule = RepetitionRule(1, 2)
    detector = RepetitionDetector(rule, 2, "cpu")
    done = torch.tensor([False, True])
    for step in range(3):
        looped = detector.update(step, torch.tensor([7, 7]), done)
    assert detector.repeated_at.tolist() == [1, -1] and not looped.any()


def test_flag_reaches_rewards_experience_and_repetition_frac(make_config):
    """A random tiny policy often samples the same character twice in a row: with a rule that
    calls that a loop, those rows stop there, the `repetition` reward gives them -1 and
    rollout/repetition_frac counts them."""
    from conftest import FAST_RUN, module_from_config

    cfg = make_config(*FAST_RUN, "algorithm=grpo", "reward=repetition", "algorithm.prompts_per_step=4",
                      "algorithm.group_size=4", "rollout.max_new_tokens=12", "rollout.repetition.ngram=1",
                      "rollout.repetition.window=2")
    module = module_from_config(cfg)
    generator = torch.Generator().manual_seed(0)
    examples = module.curriculum.next_prompts(4)
    exp, reward_metrics = module.rollouts.sample_and_score(examples, 0, generator)
    repeated = exp.repeated
    assert repeated.any() and not repeated.all()
    lengths = exp.response_mask.sum(1).long()
    for row in torch.nonzero(repeated).flatten().tolist():
        ids = exp.response_ids[row, : lengths[row]].tolist()
        assert ids[-1] == ids[-2] and all(a != b for a, b in zip(ids[:-2], ids[1:-1]))  # cut at the first pair
        assert module.tokenizer.eos_token_id not in ids and not exp.truncated[row]
    # accuracy (0 or 1) + 0.5 x (-1 for a looping row)
    assert torch.equal(exp.scores - exp.correct, -0.5 * repeated.float())
    assert reward_metrics["rewards/repetition/mean"] == pytest.approx(-repeated.float().mean().item())
    metrics = rollout_metrics(exp)
    assert metrics["rollout/repetition_frac"] == pytest.approx(repeated.float().mean().item())
    assert exp.select(torch.tensor([0, 1])).repeated.tolist() == repeated[:2].tolist()
