"""Best-of-N in `posttrain-eval` (src/posttrain/best_of_n.py): the accuracies of each selector on
hand-made scores, the oracle PRM on hand-written responses, and the command line end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from posttrain.rewards.samples import rollout_samples
from posttrain.eval.best_of_n import (Judged, Judges, best_of_n_accuracies, best_of_n_table, build_judges,
                                 check_best_of_n, check_source_for_prm, judge)
from posttrain.run.console import render
from posttrain.data.arithmetic import ALPHABET
from posttrain.data.sources import ArithmeticSource
from posttrain.data.steps import StepRule
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_char_tokenizer
from posttrain.rewards.prm import ProcessRewardModel

from forked_cli import run_command
from conftest import rollout_batch
from conftest import make_reward_model_dir

# --- the accuracies of each selector, on hand-made judgements (no model) ----------------------------

# Two prompts, four responses each. Prompt 0: the PRM's favourite (0.9) is wrong, the one right
# response is its second choice. Prompt 1: two right responses, the PRM ties one of them with a wrong one.
CORRECT = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
PRM_LAST = torch.tensor([[0.9, 0.5, 0.1, 0.1], [0.2, 0.8, 0.8, 0.1]])
ANSWERS = [["7", "8", "7", "9"], ["5", "5", None, "6"]]
ORM_PERFECT = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 4.0, -1.0, 0.0]])  # every right response above every wrong one


def hand_made(orm=None) -> Judged:
    return Judged(CORRECT, ANSWERS, {"last": PRM_LAST}, orm)


def test_each_selector_matches_its_hand_computed_expectation():
    results = best_of_n_accuracies(hand_made(ORM_PERFECT), [1, 2, 4])
    # prm_last@2 over the 6 pairs: prompt 0 is right on {1,2}, {1,3} (2/6); prompt 1 on {0,1}, {0,3},
    # {1,3} and half of {1,2}, the tie (3.5/6)
    assert results["bon/prm_last@2"] == pytest.approx((2 / 6 + 3.5 / 6) / 2)
    assert results["bon/prm_last@4"] == pytest.approx((0.0 + 0.5) / 2)  # prompt 1: the tie at 0.8, half right
    # majority@2: prompt 0 is right in half of the ties {0,1}, {1,2}, {1,3} (1.5/6); prompt 1 on {0,1},
    # {0,2} and {1,2} (None casts no vote), and in half of the ties {0,3}, {1,3} (4/6)
    assert results["bon/majority@2"] == pytest.approx((1.5 / 6 + 4 / 6) / 2)
    assert results["bon/majority@4"] == pytest.approx((0.0 + 1.0) / 2)  # "7" outvotes "8"; "5" outvotes "6"
    # oracle = pass@n: 1 - C(N - c, n) / C(N, n)
    assert results["bon/oracle@2"] == pytest.approx((1 - 3 / 6 + 1 - 1 / 6) / 2)
    assert results["bon/oracle@4"] == 1.0
    for n in (1, 2, 4):
        assert results[f"bon/random@{n}"] == pytest.approx(3 / 8)  # one sample's accuracy, whatever n
        # a scorer that ranks every right response first picks a right one whenever the n hold one
        assert results[f"bon/orm@{n}"] == pytest.approx(results[f"bon/oracle@{n}"])
    for method in ("prm_last", "majority", "orm", "oracle"):  # choosing from one response is no choice
        assert results[f"bon/{method}@1"] == pytest.approx(results["bon/random@1"])


def test_without_an_orm_there_is_no_orm_column_and_the_table_has_a_row_per_n():
    results = best_of_n_accuracies(hand_made(), [1, 4])
    assert not any(key.startswith("bon/orm") for key in results)
    table = best_of_n_table(results, [1, 4], title="t")
    assert [column.header for column in table.columns] == ["n", "prm_last", "majority", "oracle", "random"]
    rows = [line.split("│")[1:-1] for line in render(table, width=120).splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["1", "37.5%", "37.5%", "37.5%", "37.5%"],
        ["4", "25.0%", "50.0%", "100.0%", "37.5%"],  # prm_last@4 = (0 + 0.5) / 2; majority@4 = (0 + 1) / 2
    ]


def test_n_above_the_samples_is_refused():
    with pytest.raises(ConfigError, match="n=8"):
        best_of_n_accuracies(hand_made(), [1, 8])


# --- the oracle PRM on hand-written responses to 51+53= (truth: 1+3=4,5+5=10>104) ------------------

TOKENIZER = build_char_tokenizer(ALPHABET)
RULE = StepRule((",", ">"))
RIGHT = "1+3=4,5+5=10>104"
LUCKY = "1+3=5,5+5=10>104"        # a wrong column, yet the right answer: the verifier says correct
WRONG_ANSWER = "1+3=4,5+5=10>105"  # every column right, the answer wrong
GARBAGE = "99"


def verbose_source() -> ArithmeticSource:
    source = ArithmeticSource(style="verbose", min_digits=2, max_digits=2)
    source.step_rule = RULE
    return source


def judged_responses(texts: list[str], oracle_score: str) -> Judged:
    """One prompt's responses, tokenised, split into steps and judged by the oracle PRM."""
    source = verbose_source()
    example = source.example("validation", 0)
    assert example.prompt == "51+53=" and example.response == RIGHT
    responses = [TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id] for text in texts]
    samples, _ = rollout_samples(TOKENIZER, rollout_batch(responses, TOKENIZER.pad_token_id), [example] * len(texts),
                                 [0] * len(texts), RULE)
    for sample in samples:  # split at each column's separator; together the steps are the response
        assert "".join(sample.steps) == sample.response
        assert sample.response != RIGHT or sample.steps == ["1+3=4,", "5+5=10>", "104"]
    return judge(samples, source, Judges(prm=ProcessRewardModel("oracle", oracle_score=oracle_score)), num_prompts=1)


def test_prefix_oracle_matches_pass_at_n_only_without_lucky_answers():
    # The prefix oracle's last score is 1 only when every step and the answer are right. A right
    # answer after a wrong step (LUCKY) scores 0, so best-of-n by it can miss what pass@n counts.
    with_lucky = judged_responses([RIGHT, LUCKY, WRONG_ANSWER, GARBAGE], "prefix")
    assert with_lucky.correct.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert with_lucky.prm["last"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    results = best_of_n_accuracies(with_lucky, [1, 2, 4])
    # pairs: RIGHT in 3 of 6; else {LUCKY, WRONG}, {LUCKY, GARBAGE} tie at 0: half right each
    assert results["bon/prm_last@2"] == pytest.approx(4 / 6)
    assert results["bon/oracle@2"] == pytest.approx(5 / 6)
    assert results["bon/prm_last@4"] == results["bon/oracle@4"] == 1.0
    for n in (1, 2, 4):  # prefix scores fall 1 -> 0 once: last, min and product agree
        assert results[f"bon/prm_min@{n}"] == results[f"bon/prm_product@{n}"] == results[f"bon/prm_last@{n}"]

    without_lucky = best_of_n_accuracies(judged_responses([WRONG_ANSWER, RIGHT, GARBAGE, GARBAGE], "prefix"), [1, 2, 4])
    for n in (1, 2, 4):
        assert without_lucky[f"bon/prm_last@{n}"] == pytest.approx(without_lucky[f"bon/oracle@{n}"])


def test_step_oracles_last_score_is_the_verifiers_outcome():
    judged = judged_responses([RIGHT, LUCKY, WRONG_ANSWER, GARBAGE], "step")
    assert judged.prm["last"].tolist() == judged.correct.tolist()  # the last step carries the outcome
    assert judged.prm["min"].tolist() == [[1.0, 0.0, 0.0, 0.0]]  # LUCKY's wrong column shows in the min
    results = best_of_n_accuracies(judged, [1, 2, 3, 4])
    for n in (1, 2, 3, 4):
        assert results[f"bon/prm_last@{n}"] == pytest.approx(results[f"bon/oracle@{n}"])


def test_majority_votes_on_the_final_answers():
    judged = judged_responses([LUCKY, WRONG_ANSWER, WRONG_ANSWER, RIGHT], "prefix")
    assert judged.answers == [["104", "105", "105", "104"]]
    assert best_of_n_accuracies(judged, [4])["bon/majority@4"] == 0.5  # a 2-2 tie: half right


def test_a_majority_answer_judged_both_ways_counts_by_the_share_of_its_right_verdicts():
    """Responses with one final answer can get different verdicts (a verifier timeout): the vote
    does not crash; the winning answer is right as often as its responses were judged right."""
    correct = torch.tensor([[1.0, 0.0, 1.0, 0.0]])  # "7" judged right twice, wrong once (a timeout)
    judged = Judged(correct, [["7", "7", "7", "8"]], {}, None)
    results = best_of_n_accuracies(judged, [1, 4])
    assert results["bon/majority@4"] == pytest.approx(2 / 3)  # "7" wins every vote of the 4
    # one vote is one response: its answer's share of right verdicts, on average the random pick's accuracy
    assert results["bon/majority@1"] == pytest.approx(results["bon/random@1"])


def make_prm_dir(directory: Path, tokenizer) -> Path:
    """A tiny one-label Qwen2 token classifier over `tokenizer` (what algorithm=prm exports), random weights."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForTokenClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # step scores spread over (0, 1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_learned_prm_ranks_by_the_aggregates_of_its_own_step_scores(tmp_path):
    prm_dir = make_prm_dir(tmp_path / "prm", TOKENIZER)
    best_of_n = best_of_n_cfg(prm=str(prm_dir), prm_batch_size=3).best_of_n
    source = verbose_source()
    example = source.example("validation", 0)
    texts = [RIGHT, LUCKY, WRONG_ANSWER, GARBAGE]
    responses = [TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id] for text in texts]
    samples, _ = rollout_samples(TOKENIZER, rollout_batch(responses, TOKENIZER.pad_token_id), [example] * 4, [0] * 4, RULE)
    judged = judge(samples, source, build_judges(best_of_n, policy=None), num_prompts=1)
    own = ProcessRewardModel("learned", path=str(prm_dir)).step_scores(samples, source)  # the PRM itself
    # batches of 3 rows against one of 4: float32 sums over other paddings differ in the 7th digit
    close = dict(rel=1e-5)
    assert judged.prm["last"][0].tolist() == pytest.approx([steps[-1] for steps in own], **close)
    assert judged.prm["min"][0].tolist() == pytest.approx([min(steps) for steps in own], **close)
    assert judged.prm["product"][0].tolist() == pytest.approx([math.prod(steps) for steps in own], **close)
    assert len(own[0]) == 3 and len(own[3]) == 1  # three steps in RIGHT, one in GARBAGE


# --- config checks ---------------------------------------------------------------------------------

def best_of_n_cfg(**best_of_n):
    node = {"n": [1, 4], "prm": None, "oracle_score": "prefix", "orm": None, "prm_batch_size": 64, **best_of_n}
    return OmegaConf.create({"temperature": 1.0, "best_of_n": node})


@pytest.mark.parametrize("n", [[0, 4], [2.5], ["4"], [], [True]])
def test_n_must_be_positive_integers(n):
    with pytest.raises(ConfigError, match="best_of_n.n="):
        check_best_of_n(best_of_n_cfg(n=n))


def test_off_by_default_and_sizes_sorted():
    assert check_best_of_n(best_of_n_cfg(n=None, prm="/not/checked")) == []
    assert check_best_of_n(best_of_n_cfg(n=[16, 1, 4, 4])) == [1, 4, 16]
    assert check_best_of_n(best_of_n_cfg(n=8)) == [8]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    return make_reward_model_dir(tmp_path_factory.mktemp("orm") / "rm", TOKENIZER, seed=0)


def test_a_reward_model_is_not_a_prm_and_a_missing_orm_is_named(reward_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="best_of_n.prm=.* is not a PRM"):
        check_best_of_n(best_of_n_cfg(prm=str(reward_model_dir)))
    with pytest.raises(ConfigError, match="best_of_n.orm=.*no such directory"):
        check_best_of_n(best_of_n_cfg(orm=str(tmp_path / "missing")))
    check_best_of_n(best_of_n_cfg(prm="oracle", orm=str(reward_model_dir)))  # both fine


def test_bad_oracle_score_and_zero_temperature_are_refused():
    with pytest.raises(ConfigError, match="best_of_n.oracle_score="):
        check_best_of_n(best_of_n_cfg(prm="oracle", oracle_score="last"))
    cfg = best_of_n_cfg()
    cfg.temperature = 0.0
    with pytest.raises(ConfigError, match="temperature=0.0"):
        check_best_of_n(cfg)


def test_the_oracle_needs_a_step_verifier_and_a_step_rule():
    class NoStepLabels:  # a source with a verifier but no step_labels (e.g. a jsonl task)
        step_rule = RULE

    with pytest.raises(ConfigError, match="data.source='jsonl'"):
        check_source_for_prm(best_of_n_cfg(prm="oracle").best_of_n, NoStepLabels(), "jsonl")
    source = verbose_source()
    source.step_rule = None
    with pytest.raises(ConfigError, match="data.step_separators"):
        check_source_for_prm(best_of_n_cfg(prm="oracle").best_of_n, source, "arithmetic")


# --- the command line, on the shared briefly-trained tiny policy ------------------------------------

def posttrain_eval(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttrain.eval.evaluate", *args, "num_threads=1", f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=300)


def test_cli_reports_every_selector_for_each_n(sft_start, reward_model_dir, tmp_path):
    result = posttrain_eval(f"checkpoint={sft_start}", "best_of_n.n=[1,2,4]", "best_of_n.prm=oracle",
                            f"best_of_n.orm={reward_model_dir}", "pass_k=[]", "eval.num_prompts=32", log_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "best-of-n accuracy" in result.stdout and "prm_product" in result.stdout  # the table
    (path,) = tmp_path.glob("eval/runs/*/eval.json")
    results = json.loads(path.read_text())
    assert 0 < results["bon/random@1"] < results["bon/oracle@4"]  # sampled responses differ: a choice to make
    for n in (1, 2, 4):
        # the task is concise (one step, the answer): the prefix oracle's score is the verifier's outcome
        assert results[f"bon/prm_last@{n}"] == pytest.approx(results[f"bon/oracle@{n}"])
        assert results[f"bon/prm_min@{n}"] == results[f"bon/prm_product@{n}"] == results[f"bon/prm_last@{n}"]
        assert results[f"bon/orm@{n}"] <= results[f"bon/oracle@{n}"] + 1e-9
        assert results[f"bon/majority@{n}"] <= results[f"bon/oracle@{n}"] + 1e-9
    for method in ("prm_last", "majority", "orm", "oracle"):
        assert results[f"bon/{method}@1"] == pytest.approx(results["bon/random@1"])
    assert results["best_of_n_samples"] == 4 and results["best_of_n_prm"] == "oracle"


def test_cli_refuses_a_bad_n_before_loading(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")  # refused before anything loads
    result = posttrain_eval(f"checkpoint={model_dir}", "best_of_n.n=[0,4]", log_dir=tmp_path / "out")
    assert result.returncode != 0
    assert "posttrain-eval: error: best_of_n.n=" in result.stderr and "Traceback" not in result.stderr
