"""The arithmetic task in the r1 template (data.template=r1): its reference form, answer check,
format score, and the embedded tokenizer's one token per tag."""

import pytest

from posttrain.data.arithmetic import Problem, r1_format_score, r1_solution
from posttrain.data.examples import Example
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_char_tokenizer


def test_the_r1_form_holds_the_column_steps_and_the_sum():
    assert r1_solution(Problem((347, 185))) == "<think>7+5=12,4+8+1=13,3+1+1=5</think><answer>532</answer>"
    source = ArithmeticSource(1, 1, style="verbose", template="r1")
    example = source.example("train", 0)
    assert example.response.startswith("<think>") and source.has_style(example.response)
    assert source.is_correct(example, example.response) and source.final_answer(example.response) == example.answer
    assert source.end_of_thinking == "</think>"


def test_the_answer_is_read_from_the_last_answer_tags():
    source = ArithmeticSource(1, 1, style="verbose", template="r1")
    example = Example("7+5=", "", "12")
    assert source.is_correct(example, "<think>7+5=12</think><answer> 12 </answer>")
    assert source.is_correct(example, "<answer>3</answer><answer>12</answer>")
    assert not source.is_correct(example, "<think>7+5=12</think>12")  # the answer must be in its tags
    assert not source.is_correct(example, "<answer>1 2</answer>")
    assert source.final_answer("no tags") is None


@pytest.mark.parametrize("response, score", [
    ("<think>7+5=12</think><answer>12</answer>", 1.0),
    ("<think>7+5=12</think> <answer>99</answer>", 1.0),     # the form, whatever the answer
    ("<think>1</think><answer>2</answer></answer>", 0.8),   # something after the form
    ("<think>7+5=12</think><answer>12", 0.6),               # the answer never closed
    ("<think>7+5=12</think>12", 0.4),
    ("<think>7+5=12", 0.2),
    ("<think></think><answer>12</answer>", 0.2),            # no reasoning
    ("<think><answer>5</answer></think><answer>5</answer>", 0.2),  # a tag inside the reasoning
    ("12</answer>", 0.0),
    ("</think>", 0.0),
    ("12", 0.0),
])
def test_the_format_score_counts_the_stages_of_the_form_in_order(response, score):
    assert r1_format_score(response) == score
    source = ArithmeticSource(1, 1, style="verbose", template="r1")
    assert source.format_score(response) == score and source.has_style(response) == (score == 1.0)


def test_each_tag_is_one_token_of_the_embedded_tokenizer():
    source = ArithmeticSource(1, 1, style="verbose", template="r1")
    tokenizer = build_char_tokenizer(source.alphabet)
    text = "<think>7+5=12</think><answer>12</answer>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 12 and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == len(build_char_tokenizer(ArithmeticSource().alphabet)) + 4
    # without words the tokenizer is the one every other task has, token for token
    plain = build_char_tokenizer(ArithmeticSource().alphabet)
    assert plain("7+5=12,>", add_special_tokens=False)["input_ids"] == tokenizer("7+5=12,>", add_special_tokens=False)[
        "input_ids"]


def test_r1_asks_for_verbose_steps_and_the_arithmetic_task_has_no_other_template():
    with pytest.raises(ConfigError, match="needs data.style=verbose"):
        ArithmeticSource(style="concise", template="r1")
    with pytest.raises(ConfigError, match="data.template='boxed'"):
        ArithmeticSource(template="boxed")
    assert ArithmeticSource(style="verbose").end_of_thinking == ">"  # the verbose steps end at the answer marker
    assert ArithmeticSource().end_of_thinking is None


def test_an_exported_model_reloads_the_tags_as_one_token_each(tmp_path):
    """transformers reloads the tokenizer of an exported Qwen2 model as a Qwen2Tokenizer, with
    Qwen2's own pre-tokenizer: the tags survive as added tokens, not as words of the vocabulary."""
    from transformers import AutoTokenizer

    from posttrain.models.tiny import build_tiny_model

    tokenizer = build_char_tokenizer(ArithmeticSource(style="verbose", template="r1").alphabet)
    build_tiny_model(len(tokenizer), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                     intermediate_size=32).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<think>7+5=12</think><answer>12</answer>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert reloaded(text, add_special_tokens=False)["input_ids"] == ids and len(ids) == 12
    assert reloaded.decode(ids, skip_special_tokens=True) == text
