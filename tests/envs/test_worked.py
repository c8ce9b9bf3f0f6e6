"""SFT on an environment's worked episodes (envs/worked.py): the calculator's calls made from a
reference solution, rows laid out token for token as the collector lays out an episode, the
tool's replies masked, and `algorithm=sft env=calculator` / `algorithm.warm_start.with_env`
through the CLI."""

from __future__ import annotations

import string
from functools import partial

import pytest

from posttrain.data.datamodule import fit_prompts, sft_row_length
from posttrain.data.examples import Example, ListSource
from posttrain.errors import DataError
from posttrain.envs.base import Reply, Turn, observation_ids
from posttrain.envs.guess_number import GuessNumber
from posttrain.envs.tools import Calculator, ToolEnvironment, parse_tool_calls
from posttrain.envs.worked import IGNORED, collate_worked_episodes, worked_episode_row, worked_row_length
from posttrain.models.tiny import build_char_tokenizer
from test_tools import SMOLLM2_TEMPLATE

SOLUTION = "12 + 3 × 4 = 24\n24 - 5 = 19\nso she has 19\n19 ÷ 2 = 9\n#### 19"


def test_the_calculator_reads_the_lines_it_agrees_with():
    # "19 ÷ 2 = 9" is wrong (9.5) and the prose line has no operator: both are left out
    assert Calculator().worked_steps(SOLUTION) == [("12 + 3 * 4", "24"), ("24 - 5", "19")]
    assert Calculator().worked_steps("36 ÷ 4 = 9\n2 × 3 − 1 = 5") == [("36 / 4", "9"), ("2 * 3 - 1", "5")]
    assert Calculator().worked_steps("#### 19\n19 = 19") == []


def test_a_worked_episode_calls_once_a_turn_then_answers_with_the_reference():
    example = Example("q", SOLUTION, "19")
    messages = ToolEnvironment(max_turns=4).worked_episode(example)
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    calls = [parse_tool_calls(m["content"], ["calculator"]) for m in messages if m["role"] == "assistant"][:2]
    assert [[(c.name, c.arguments) for c in turn] for turn in calls] == [
        [("calculator", {"expression": "12 + 3 * 4"})], [("calculator", {"expression": "24 - 5"})]]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["24", "19"]
    assert messages[-1] == {"role": "assistant", "content": SOLUTION}


def test_steps_beyond_the_turns_go_together_into_the_last_turn_that_may_call():
    solution = "1 + 2 = 3\n3 + 4 = 7\n7 * 2 = 14\n#### 14"
    messages = ToolEnvironment(max_turns=3).worked_episode(Example("q", solution, "14"))
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "tool", "assistant"]
    assert len(parse_tool_calls(messages[2]["content"], ["calculator"])) == 2
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["3", "7", "14"]


def test_the_calls_are_answered_as_the_episode_answers_them():
    """Each worked call, played through the environment's own episode, gets the worked reply."""
    env = ToolEnvironment(max_turns=4)
    messages = env.worked_episode(Example("q", SOLUTION, "19"))
    episode = env.start(env.prepare(Example("q", SOLUTION, "19")))
    policy_turns = [m for m in messages if m["role"] == "assistant"]
    replies = [episode.step(Turn(m["content"], [], True, i)) for i, m in enumerate(policy_turns)]
    assert [r.messages for r in replies[:-1]] == [[{"role": "tool", "content": "24"}], [{"role": "tool", "content": "19"}]]
    assert replies[-1].done and replies[0].metrics["tool_errors"] == 0.0


def test_no_worked_episode_without_arithmetic_a_calculator_or_a_turn_to_call_in():
    assert ToolEnvironment().worked_episode(Example("q", "the answer is 4\n#### 4", "4")) is None
    assert ToolEnvironment(tools=["python"]).worked_episode(Example("q", SOLUTION, "19")) is None
    assert ToolEnvironment(max_turns=1).worked_episode(Example("q", SOLUTION, "19")) is None
    assert GuessNumber().worked_episode(Example("guess:", "4", "4")) is None


@pytest.fixture(scope="module")
def chatml_tokenizer():
    tokenizer = build_char_tokenizer(list(string.printable) + ["×", "÷", "<|im_start|>", "<|im_end|>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    return tokenizer


def test_a_row_is_the_chat_of_the_episode_and_only_the_policys_turns_are_labelled(chatml_tokenizer):
    tokenizer, env = chatml_tokenizer, ToolEnvironment(max_turns=4)
    example = Example("Mia has 12 apples...", SOLUTION, "19", messages=[{"role": "user", "content": "Mia has 12 apples..."}])
    ids, labels = worked_episode_row(env, example, tokenizer)

    # the whole row is the chat template's rendering of prompt + worked episode, token for token
    chat = env.prepare(example).messages + env.worked_episode(example)
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    # (the template's newline after the last <|im_end|> is not the policy's)
    assert ids == tokenizer(rendered.rstrip("\n"), add_special_tokens=False)["input_ids"]

    # labelled: each policy turn and its <|im_end|>, nothing else (the tools' replies, the prompt)
    labelled = [t for t, label in zip(ids, labels) if label != IGNORED]
    assert [t for t, label in zip(ids, labels) if label != IGNORED] == [label for label in labels if label != IGNORED]
    turns = [m["content"] for m in env.worked_episode(example) if m["role"] == "assistant"]
    assert tokenizer.decode(labelled) == "".join(turn + "<|im_end|>" for turn in turns)

    # the masked span after the first turn is exactly what the collector appends for its reply
    first_turn = tokenizer(turns[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt_len = labels.index(next(label for label in labels if label != IGNORED))
    after = prompt_len + len(first_turn)
    observed = observation_ids(Reply(messages=[{"role": "tool", "content": "24"}]), tokenizer)
    assert ids[after:after + len(observed)] == observed and set(labels[after:after + len(observed)]) == {IGNORED}


def test_without_a_worked_episode_the_row_is_the_reference_after_the_prepared_prompt(chatml_tokenizer):
    tokenizer, env = chatml_tokenizer, ToolEnvironment()
    example = Example("q", "the answer is 4\n#### 4", "4", messages=[{"role": "user", "content": "q"}])
    ids, labels = worked_episode_row(env, example, tokenizer)
    response = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[-len(response):] == response and labels[-len(response):] == response
    assert set(labels[:-len(response)]) == {IGNORED}
    assert "# Tools" in tokenizer.decode(ids)  # the prompt is the environment's


def test_the_batch_is_right_padded_with_masked_labels(chatml_tokenizer):
    env = ToolEnvironment()
    examples = [Example("a", SOLUTION, "19", messages=[{"role": "user", "content": "a"}]),
                Example("b", "1 + 1 = 2\n#### 2", "2", messages=[{"role": "user", "content": "b"}])]
    batch = collate_worked_episodes(examples, chatml_tokenizer, env)
    rows = [worked_episode_row(env, e, chatml_tokenizer) for e in examples]
    for i, (ids, labels) in enumerate(rows):
        assert batch["input_ids"][i, :len(ids)].tolist() == ids and batch["labels"][i, :len(ids)].tolist() == labels
        assert batch["attention_mask"][i].sum() == len(ids) and (batch["labels"][i, len(ids):] == IGNORED).all()


def test_a_worked_row_longer_than_the_context_is_refused_before_training(chatml_tokenizer):
    """The data module checks the rows SFT trains on: with an environment, the worked episode's
    (its tool prompt, calls and replies), not the prompt + reference row plain SFT would train."""
    env, tokenizer = ToolEnvironment(max_turns=4), chatml_tokenizer
    source = ListSource()
    source.examples["train"] = [Example("Mia has 12 apples...", SOLUTION, "19",
                                        messages=[{"role": "user", "content": "Mia has 12 apples..."}])]
    source.origins["train"] = ["train.jsonl:1"]
    worked, plain = (worked_row_length(source.example("train", 0), tokenizer, env=env),
                     sft_row_length(source.example("train", 0), tokenizer))
    assert plain < worked
    tokenizer.model_max_length = (plain + worked) // 2  # the plain row fits, the worked one does not
    fit_prompts(source, tokenizer, {"train": 1}, sft_row_length=sft_row_length)
    with pytest.raises(DataError, match=rf"train\.jsonl:1: its training row .* is {worked} tokens, more than "
                                        rf"the model's context of {tokenizer.model_max_length} tokens"):
        fit_prompts(source, tokenizer, {"train": 1}, sft_row_length=partial(worked_row_length, env=env))


# --- through the CLI -------------------------------------------------------------------------

TINY_WORD_PROBLEMS = ("data=word_problems", "model=hf", "data.max_steps=2", "data.max_response_tokens=96",
                      "logger=none", "callbacks.progress_bar=none", "eval.num_prompts=4", "eval.batch_size=4",
                      "eval.max_new_tokens=96", "eval.at_start=false")


def test_sft_with_the_calculator_trains_on_worked_episodes_and_evaluates_episodes(tmp_path):
    from conftest import compose_config
    from hf_models import make_tiny_hf_model
    from posttrain.train import run

    # the calculator's system prompt alone is about 800 tokens: the rows need a longer context
    # than the session's 512-position model (the data module refuses them there)
    model = make_tiny_hf_model(tmp_path / "tiny-qwen2-2k", "qwen2", max_positions=2048)
    cfg = compose_config([*TINY_WORD_PROBLEMS, f"model.name_or_path={model}", "algorithm=sft",
                          "env=calculator", "env.max_turns=3", "algorithm.batch_size=4", "trainer.max_steps=2",
                          "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2"], tmp_path)
    summary = run(cfg, announce=False)
    assert summary["global_step"] == 2 and summary["train/loss"] == summary["train/loss"]  # finite
    # held-out prompts were played as episodes: their counts are the environment's
    assert "eval/episode/tool_calls" in summary and "eval/episode/turns" in summary


def test_an_online_run_warm_starts_a_pretrained_policy_on_worked_episodes(make_config, tiny_hf_model):
    from posttrain.prepare.warm_start import warm_start_plan

    base = [*TINY_WORD_PROBLEMS, f"model.name_or_path={tiny_hf_model('qwen2')}", "algorithm=grpo", "env=calculator",
            "algorithm.warm_start.steps=3", "algorithm.warm_start.lr=1e-4"]
    assert warm_start_plan(make_config(*base)) is None  # a pretrained policy starts from itself
    sft_cfg, target = warm_start_plan(make_config(*base, "algorithm.warm_start.pretrained=true"))
    assert sft_cfg.env._target_ is None  # the reference responses, by default
    with_env, with_env_target = warm_start_plan(make_config(*base, "algorithm.warm_start.pretrained=true",
                                                            "algorithm.warm_start.with_env=true"))
    assert with_env.env._target_ == "posttrain.envs.tools.ToolEnvironment" and with_env.algorithm.name == "sft"
    assert with_env_target != target  # its own cache entry


def test_env_stays_refused_for_the_preference_family(tmp_path):
    from conftest import compose_config
    from posttrain.config.check import check_config
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="env=calculator has no effect"):
        check_config(compose_config(["algorithm=dpo", "env=calculator"], tmp_path))
