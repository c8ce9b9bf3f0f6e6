"""algorithm=prm: step-labelled rows from the starting policy (data/process.py), the token
classifier and its loss (algorithms/prm.py), and its export scored by the learned PRM."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import compose_config

from posttrain.data.process import StepRow, collate_step_rows, prm_row
from posttrain.prepare.step_rows import build_step_source, monte_carlo_labels
from posttrain.data.sources import build_source
from posttrain.data.steps import split_response
from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.rewards.base import ScoredSample
from posttrain.rewards.prm import ProcessRewardModel
from posttrain.rollout.base import RolloutBatch

SMALL_MODEL = ("model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64")
TINY_ROWS = ("algorithm=prm", "algorithm.warm_start.steps=0", "logger=none", "callbacks.progress_bar=none",
             "algorithm.process_data.num_train_prompts=6", "algorithm.process_data.num_validation_prompts=4",
             "algorithm.process_data.samples_per_prompt=2", "algorithm.process_data.cache=false", *SMALL_MODEL)


def pieces(overrides=()):
    cfg = compose_config([*TINY_ROWS, *overrides])
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    return cfg, source, tokenizer, policy


def test_verifier_rows_hold_the_oracles_prefix_labels_of_the_sampled_steps():
    cfg, task, tokenizer, policy = pieces()
    source = build_step_source(cfg, task, tokenizer, policy)
    oracle = ProcessRewardModel(model="oracle")
    for split, prompts in (("train", 6), ("validation", 4)):
        rows = source.rows(split)
        assert len(rows) == prompts * 2
        for row in rows:
            assert len(row.labels) == len(row.steps) >= 1
            sample = ScoredSample(row.example, "".join(row.steps), 0, not row.ended, 0, steps=row.steps)
            assert row.labels == row.verifier == oracle.oracle(sample, task)
            # prefix form: once a step is wrong, every later one is
            assert row.labels == sorted(row.labels, reverse=True)


class Completer:
    """A stand-in sampler: each completion is `finish(j)` (j: its index in the call) and EOS."""

    def __init__(self, tokenizer, finish):
        self.tokenizer, self.finish, self.calls = tokenizer, finish, 0

    def generate(self, prompt_ids, prompt_mask, temperature, max_new_tokens, generator):
        self.calls += 1
        rows = [self.tokenizer(self.finish(j), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                for j in range(len(prompt_ids))]
        width = max(map(len, rows))
        ids = torch.tensor([row + [self.tokenizer.pad_token_id] * (width - len(row)) for row in rows])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        zeros = torch.zeros(len(rows), dtype=torch.bool)
        return RolloutBatch(prompt_ids, prompt_mask, ids, mask, torch.zeros(ids.shape), zeros, repeated=zeros)


def reference_rows(task, tokenizer, count=3):
    """Rows of the reference solutions, their last answer digit changed so the outcome is wrong."""
    rows, responses = [], []
    for i in range(count):
        example = task.example("train", i)
        wrong = example.response[:-1] + str((int(example.response[-1]) + 1) % 10)
        response = tokenizer(wrong, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        steps = split_response(task.step_rule, tokenizer, response)
        rows.append(StepRow(example, steps.texts, True, [0.5] * len(steps.texts), [0.5] * len(steps.texts)))
        responses.append((response, steps.ends))
    return rows, responses


@pytest.mark.parametrize("hard", [True, False])
def test_monte_carlo_labels_count_the_completions_that_reach_the_answer(hard):
    cfg, task, tokenizer, _ = pieces([f"algorithm.process_data.hard_labels={str(hard).lower()}",
                                      "algorithm.process_data.rollouts_per_step=4"])
    rows, responses = reference_rows(task, tokenizer, count=1)
    answer = rows[0].example.answer
    # of each prefix's 4 completions, only the first reaches the right answer
    completer = Completer(tokenizer, lambda j: ">" + (answer if j % 4 == 0 else "0"))
    monte_carlo_labels(rows, responses, task, tokenizer, completer, cfg, torch.Generator())
    (row,) = rows
    assert len(row.steps) == 4  # 3 columns and the answer (3-digit operands)
    assert row.labels[:-1] == [1.0 if hard else 0.25] * 3  # 1 of 4 completions right from every prefix
    assert row.labels[-1] == 0.0  # the last step is the response's own outcome: its answer is wrong


def test_monte_carlo_labels_are_zero_when_no_completion_is_right_and_batch_many_prefixes():
    cfg, task, tokenizer, _ = pieces()
    rows, responses = reference_rows(task, tokenizer, count=3)
    completer = Completer(tokenizer, lambda j: ">0")
    monte_carlo_labels(rows, responses, task, tokenizer, completer, cfg, torch.Generator())
    assert completer.calls == 1  # 3 rows x 3 prefixes x 4 completions: one generation call
    assert all(row.labels == [0.0] * len(row.steps) for row in rows)


def step_rows(task, count=3):
    """Rows of reference solutions cut after 1..count steps, with soft labels."""
    rows = []
    for i in range(count):
        example = task.example("validation", i)
        steps = [part + "," for part in example.response.split(",")[:-1]][: i + 1] or [example.response]
        rows.append(StepRow(example, steps, i % 2 == 0, [0.9 - 0.3 * k for k in range(len(steps))],
                            [1.0 - k % 2 for k in range(len(steps))]))
    return rows


def test_the_loss_is_binary_cross_entropy_at_each_steps_last_token():
    from conftest import module_from_config

    module = module_from_config(compose_config(list(TINY_ROWS)))
    rows = step_rows(module.source)
    batch = collate_step_rows(rows, module.tokenizer)
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, value)
    loss = module.training_step(batch, 0)
    # by hand: each row alone (no padding), the logit at each step's last token of prm_row's layout
    terms = []
    for row in rows:
        ids, ends = prm_row(module.tokenizer, row.example, row.steps, row.ended)
        logits = module.policy(input_ids=torch.tensor([ids])).logits[0, :, 0]
        for end, label in zip(ends, row.labels):
            p = 1 / (1 + math.exp(-logits[end].item()))
            terms.append(-(label * math.log(p) + (1 - label) * math.log(1 - p)))
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert logged["train/loss"].item() == pytest.approx(loss.item(), rel=1e-6)


def test_a_bad_label_source_is_refused_naming_the_key():
    from posttrain.config.check import check_config

    with pytest.raises(ConfigError, match=r"algorithm\.labels='outcome' is not valid"):
        check_config(compose_config([*TINY_ROWS, "algorithm.labels=outcome"]))
    cfg, task, tokenizer, policy = pieces()
    cfg.algorithm.labels = "outcome"
    with pytest.raises(ConfigError, match=r"algorithm\.labels='outcome' is not one of"):
        build_step_source(cfg, task, tokenizer, policy)


def test_a_short_run_evaluates_steps_and_exports_a_prm_that_scores_as_it_did(tmp_path):
    from posttrain.prepare.step_rows import read_cached_rows
    from posttrain.rewards.prm import load_prm
    from posttrain.train import run

    run_dir = tmp_path / "run"
    summary = run(compose_config([*TINY_ROWS, "algorithm.process_data.cache=true", f"paths.cache_dir={tmp_path}",
                                  "algorithm.labels=monte_carlo", "algorithm.batch_size=4", "trainer.max_steps=3",
                                  "trainer.val_check_interval=3", "callbacks.checkpoint.every_n_train_steps=3",
                                  "eval.batch_size=3"], run_dir))
    for key in ("eval/step_accuracy", "eval/step_accuracy_start", "eval/first_error_accuracy", "eval/outcome_accuracy",
                "eval/loss", "eval/label_agreement", "process/train/rows", "process/validation/steps"):
        assert key in summary, key
    assert json.loads((run_dir / "summary.json").read_text())["eval/step_accuracy"] == summary["eval/step_accuracy"]
    model, _ = load_prm(str(run_dir / "hf_model"), "prm.path")
    assert type(model).__name__.endswith("ForTokenClassification") and model.config.num_labels == 1
    # the learned PRM (the lead's scorer) scores the held-out rows: its step accuracy is the run's
    (cached,) = (tmp_path / "process_rows").glob("*.json")
    task = build_source(compose_config(list(TINY_ROWS)).data)
    rows = [row for _, row in read_cached_rows(cached, task)["validation"]]
    samples = [ScoredSample(row.example, "".join(row.steps), 0, not row.ended, 0, steps=row.steps) for row in rows]
    prm = ProcessRewardModel(model="learned", path=str(run_dir / "hf_model"), batch_size=5)
    scores = prm.step_scores(samples, None)
    right = [(score >= 0.5) == (truth >= 0.5) for row, row_scores in zip(rows, scores)
             for score, truth in zip(row_scores, row.verifier)]
    assert sum(right) / len(right) == pytest.approx(summary["eval/step_accuracy"], abs=1e-6)
