"""Process rewards in online RL: the step split, the oracle PRM, step rewards through the
composite, `advantage=prm_step` credit, the PRM early stop, and the config errors."""

from __future__ import annotations

import random

import pytest
import torch

from posttrain.algorithms.online.rollouts import rollout_metrics

from conftest import FAST_RUN, module_from_config, rollout_batch
from posttrain import core
from posttrain.data.arithmetic import ALPHABET, label_steps
from posttrain.data.examples import Example
from posttrain.data.sources import ArithmeticSource
from posttrain.data.steps import StepRule, split_response, split_text, step_token_row
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_char_tokenizer
from posttrain.rewards import ScoredSample, build_reward
from posttrain.rewards.prm import ProcessRewardModel

RULE = StepRule((",", ">"))
PROMPT = "347+185="
RIGHT = "7+5=12,4+8+1=13,3+1+1=5>532"
WRONG_SECOND = "7+5=12,4+8+1=14,3+1+1=5>532"  # column 2 wrong, yet the answer right


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


def ids_of(tokenizer, text: str, ended: bool = True) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if ended else [])


# --- the split ------------------------------------------------------------------------------

def test_a_step_ends_at_each_separator_and_at_the_last_token(tokenizer):
    steps = split_response(RULE, tokenizer, ids_of(tokenizer, RIGHT))
    assert steps.texts == ["7+5=12,", "4+8+1=13,", "3+1+1=5>", "532"]
    assert steps.ends == [6, 15, 23, 27]  # the last step ends at the EOS (index 27)
    cut = split_response(RULE, tokenizer, ids_of(tokenizer, "7+5=12,4+", ended=False))
    assert cut.texts == ["7+5=12,", "4+"] and cut.ends == [6, 8]
    assert split_response(RULE, tokenizer, ids_of(tokenizer, "12,", ended=False)).ends == [2]  # no empty last step
    assert RULE.step_ends([]) == []


def test_text_split_matches_the_token_split_on_the_embedded_tokenizer(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 20)))
        assert split_text(RULE, text) == split_response(RULE, tokenizer, ids_of(tokenizer, text, ended=False)).texts


def test_prm_rows_put_each_step_end_on_its_last_token(tokenizer):
    row, ends = step_token_row(tokenizer, [1, 2], ["7+5=12,", "532"], ended=True)
    assert row[:2] == [1, 2] and row[-1] == tokenizer.eos_token_id
    assert ends == [8, len(row) - 1]
    assert tokenizer.decode(row[2:ends[0] + 1]) == "7+5=12,"
    _, open_ends = step_token_row(tokenizer, [1, 2], ["7+5=12,", "53"], ended=False)
    assert open_ends == [8, 10]


def test_bad_separators_are_refused():
    with pytest.raises(ConfigError, match="step_separators"):
        StepRule(())
    with pytest.raises(ConfigError, match="step_separators"):
        StepRule(("",))


# --- the oracle -----------------------------------------------------------------------------

def test_step_labels_check_each_column_and_give_the_last_step_the_outcome():
    assert label_steps(PROMPT, split_text(RULE, RIGHT)) == [True, True, True, True]
    assert label_steps(PROMPT, split_text(RULE, WRONG_SECOND)) == [True, False, True, True]
    assert label_steps(PROMPT, split_text(RULE, RIGHT[:-1] + "3")) == [True, True, True, False]
    assert label_steps(PROMPT, ["532"]) == [True]  # concise: one step, the answer
    assert label_steps(PROMPT, ["7+5=12,"]) == [False]  # cut after a right column: no answer
    assert label_steps(PROMPT, ["7+5=12,", "4+8+1=13,", "3+1+1=5>", "53,", "2"]) == [True, True, True, False, False]
    # the task's own verbose solutions are right at every step
    for index in range(50):
        problem = ArithmeticSource(style="verbose").task.problem("train", index)
        assert all(label_steps(problem.prompt, split_text(RULE, problem.solution("verbose"))))


def sample(text: str, truncated: bool = False, group: int = 0) -> ScoredSample:
    return ScoredSample(Example(PROMPT, RIGHT, "532"), text, len(text) + 1, truncated, group)


def test_oracle_scores_prefixes_or_single_steps():
    source = ArithmeticSource(style="verbose")
    source.step_rule = RULE
    samples = [sample(WRONG_SECOND), sample(RIGHT)]
    assert ProcessRewardModel("oracle").step_scores(samples, source) == [[1, 0, 0, 0], [1, 1, 1, 1]]
    assert ProcessRewardModel("oracle", oracle_score="step").step_scores(samples, source) == [[1, 0, 1, 1], [1, 1, 1, 1]]
    with pytest.raises(ConfigError, match="prm.path"):
        ProcessRewardModel("learned")
    with pytest.raises(ConfigError, match="prm.model"):
        ProcessRewardModel("magic")


@pytest.mark.parametrize("form, expected", [
    ("marginal", [[1.0, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]),
    ("raw", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]),
    ("min", [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]),
])
def test_the_composite_passes_weighted_step_rewards_and_their_sum(form, expected):
    source = ArithmeticSource(style="verbose")
    source.step_rule = RULE
    reward = build_reward({"components": {"prm": {"weight": 2.0, "step_reward": form}, "accuracy": {"weight": 0.5}}},
                          source, 32)
    out = reward([sample(WRONG_SECOND), sample(RIGHT)], source)
    assert out.step_rewards == [[2 * r for r in row] for row in expected]
    assert out.components["prm"].tolist() == [sum(row) for row in expected]
    # the accuracy component is the outcome: both answers are right
    assert out.total.tolist() == pytest.approx([2 * sum(row) + 0.5 for row in expected])
    assert build_reward({"components": {"accuracy": {"weight": 1.0}}}, source, 32)([sample(RIGHT)], source).step_rewards is None


def test_reward_options_are_checked_when_built():
    source = ArithmeticSource(style="verbose")
    with pytest.raises(ConfigError, match="step_reward"):
        build_reward({"components": {"prm": {"step_reward": "sum"}}}, source, 32)
    with pytest.raises(ConfigError, match="prm.path"):
        build_reward({"components": {"prm": {"model": "oracle", "path": "/somewhere"}}}, source, 32)


# --- in the online module -------------------------------------------------------------------

def scripted_module(make_config, texts: list[str], *overrides: str):
    """A PRM-RL module whose `generate` returns `texts` (each ended with EOS) for the prompt
    `PROMPT`, so the steps and their labels are known."""
    cfg = make_config(*FAST_RUN, "experiment=prm_rl", "algorithm.prompts_per_step=1",
                      f"algorithm.group_size={len(texts)}", *overrides)
    module = module_from_config(cfg)
    tok = module.tokenizer

    def generate(prompt_ids, prompt_mask, params, generator=None):
        return rollout_batch([ids_of(tok, text) for text in texts], tok.pad_token_id, prompt_ids, prompt_mask)

    module.sampler.generate = generate
    return module


EXAMPLE = Example(PROMPT, RIGHT, "532")
TEXTS = [RIGHT, WRONG_SECOND, "7+5=13,4+8+1=13,3+1+1=5>532", "7+5=12,4+8+1=13,3+1+1=5>533"]


def test_prm_step_advantages_credit_each_step_at_its_last_token(make_config):
    module = scripted_module(make_config, TEXTS, "reward.components.accuracy.weight=0.5")
    exp, _ = module.rollouts.sample_and_score([EXAMPLE], 0, torch.Generator())
    # prefix-oracle marginal rewards: +1 at the first right step, -1 at the first wrong one
    per_step = [[1, 0, 0, 0], [1, -1, 0, 0], [0, 0, 0, 0], [1, 0, 0, -1]]
    ends = [6, 15, 23, 27]
    for row, rewards in enumerate(per_step):
        assert torch.nonzero(exp.step_mask[row]).flatten().tolist() == ends
        assert exp.step_rewards[row, ends].tolist() == rewards
    outcome = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the answer alone is right in the first three
    assert torch.allclose(exp.scores, exp.step_rewards.sum(1) + 0.5 * outcome)
    exp, _ = module.compute_advantages(exp.without_trailing_padding())
    expected_rewards = exp.step_rewards.clone()
    expected_rewards[:, 27] += 0.5 * outcome  # the outcome joins the last step
    assert torch.equal(exp.token_rewards, expected_rewards)
    expected, _ = core.prm_step_advantages(expected_rewards, exp.response_mask, exp.group_index, step_mask=exp.step_mask)
    assert torch.allclose(exp.advantages, expected)
    # a wrong step lowers the advantage of the tokens before it, relative to the all-right row
    assert exp.advantages[1, 7] < exp.advantages[0, 7]


def test_prm_early_stop_cuts_after_the_first_low_step(make_config):
    module = scripted_module(make_config, TEXTS, "rollout.prm_stop_below=0.5")
    exp, _ = module.rollouts.sample_and_score([EXAMPLE], 0, torch.Generator())
    assert exp.prm_stopped.tolist() == [False, True, True, False]  # the last row's only low step is the last
    assert exp.response_mask.sum(1).tolist() == [28, 16, 7, 28]    # cut after the first wrong step
    assert module.tokenizer.decode(exp.response_ids[1, :16]) == "7+5=12,4+8+1=14,"
    assert not exp.truncated.any()
    assert exp.step_mask[1].nonzero().flatten().tolist() == [6, 15]
    assert rollout_metrics(exp)["rollout/prm_stop_frac"] == 0.5


def test_step_options_without_a_process_reward_are_refused(make_config):
    from posttrain.config.check import check_config

    for overrides, culprit in (
        (["algorithm=grpo", "advantage=prm_step"], "advantage=prm_step"),
        (["experiment=prm_rl", "reward=accuracy"], "advantage=prm_step"),
    ):
        with pytest.raises(ConfigError, match=culprit):
            check_config(make_config(*overrides), {})
    with pytest.raises(ConfigError, match="prm_stop_below"):
        module_from_config(make_config(*FAST_RUN, "algorithm=grpo", "rollout.prm_stop_below=0.5"))
    with pytest.raises(ConfigError, match="placement"):
        module_from_config(make_config(*FAST_RUN, "experiment=prm_rl", "kl_estimator=k1",
                                       "kl_estimator.placement=in_reward"))
