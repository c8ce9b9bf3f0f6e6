"""algorithm.micro_batch_tokens: micro-batches packed by a token budget, each trimmed to its own
rows' width. The plan (algorithms/online/micro_batches.py), the trimming
(`Experience.without_padding`: no log-prob moves, on the embedded model and on SmolLM2's
architecture, through both forwards), the gradient (the whole minibatch's, in every loss
aggregation) and the option's check. Uneven ranks: tests/distributed/test_uneven_ranks.py
(the grpo_tokens case)."""

import random

import pytest
import torch
from omegaconf import OmegaConf

from posttrain.algorithms.experience import PER_PROMPT, PER_TOKEN, Experience
from posttrain.algorithms.online.micro_batches import plan_micro_batches
from posttrain.config.check import check_config
from posttrain.conf import CONFIG_DIR
from posttrain.core import AGGREGATION_MODES
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import ConfigError
from posttrain.models import forward
from posttrain.models.loading import load_tokenizer_and_model

from conftest import compose_config
from gguf_files import tiny_llama
from test_online import random_online_module

# --- the plan ---------------------------------------------------------------------------------


def test_rows_are_packed_shortest_first_within_the_budget_and_a_row_over_it_is_alone():
    # lengths (prompt + response): 8, 3, 6, 16, 4, 3; budget 12 padded tokens
    plan = plan_micro_batches([2, 2, 3, 2, 2, 2], [6, 1, 3, 14, 2, 1], max_tokens=12)
    # 1, 5, 4: 3 rows x (2 + 2) = 12; + row 2 would be 4 x (3 + 3) = 24. Row 2 alone: with row 0,
    # 2 x (3 + 6) = 18. Row 0 alone: with row 3, 2 x (2 + 14). Row 3 (16 > 12): alone.
    assert plan == [[1, 4, 5], [2], [0], [3]]


def test_the_budget_counts_the_widest_prompt_plus_the_widest_response():
    """Two rows of 7 tokens, one with the long prompt, the other with the long response: trimmed
    together they are 6 + 6 columns wide (24 tokens), more than twice the longest row (14)."""
    assert plan_micro_batches([6, 1], [1, 6], max_tokens=14) == [[0], [1]]
    assert plan_micro_batches([6, 1], [1, 6], max_tokens=24) == [[0, 1]]


def test_with_both_caps_a_micro_batch_closes_at_the_first_one_reached():
    rows_cap = plan_micro_batches([2] * 5, [1] * 5, max_rows=2, max_tokens=100)
    assert rows_cap == [[0, 1], [2, 3], [4]]
    tokens_cap = plan_micro_batches([2] * 5, [1, 1, 1, 7, 7], max_rows=4, max_tokens=10)
    assert tokens_cap == [[0, 1, 2], [3], [4]]  # 3 x 3 <= 10; with row 3: 4 x 9


def test_without_a_token_budget_the_plan_is_runs_of_consecutive_rows():
    assert plan_micro_batches([3, 1, 2], [9, 1, 5], max_rows=2) == [[0, 1], [2]]
    assert plan_micro_batches([3, 1, 2], [9, 1, 5]) == [[0, 1, 2]]
    assert plan_micro_batches([], [], max_tokens=10) == plan_micro_batches([], []) == []


def padded_size(rows, prompts, responses) -> int:
    return len(rows) * (max(prompts[r] for r in rows) + max(responses[r] for r in rows))


@pytest.mark.parametrize("seed", range(20))
def test_every_plan_holds_each_row_once_within_the_caps_shortest_first_and_greedy(seed):
    draw = random.Random(seed)
    num_rows = draw.randint(1, 40)
    prompts = [draw.randint(0, 12) for _ in range(num_rows)]
    responses = [draw.randint(0, 30) for _ in range(num_rows)]
    budget, max_rows = draw.randint(1, 200), draw.choice([None, 1, 3, 7])
    plan = plan_micro_batches(prompts, responses, max_rows=max_rows, max_tokens=budget)
    assert sorted(row for rows in plan for row in rows) == list(range(num_rows))
    length = [p + r for p, r in zip(prompts, responses)]
    for rows, following in zip(plan, plan[1:] + [None]):
        assert rows == sorted(rows)  # batch order inside a micro-batch
        assert len(rows) == 1 or padded_size(rows, prompts, responses) <= budget
        assert max_rows is None or len(rows) <= max_rows
        if following is not None:
            assert max(length[r] for r in rows) <= min(length[r] for r in following)  # shortest first
            # greedy: the next row in length order did not fit
            next_row = min(following, key=lambda r: (length[r], r))
            over_rows = max_rows is not None and len(rows) == max_rows
            assert over_rows or padded_size(rows + [next_row], prompts, responses) > budget


# --- trimming -----------------------------------------------------------------------------------

# Pairs of rows share a prompt (a group of 2); every prompt is left-padded to PROMPT_WIDTH and
# every response right-padded to RESPONSE_WIDTH: one column of each is padding in every row.
PROMPT_LENGTHS = [2, 2, 6, 6, 4, 4, 3, 3]
RESPONSE_LENGTHS = [3, 1, 7, 2, 5, 4, 2, 6]
PROMPT_WIDTH, RESPONSE_WIDTH = 7, 9


def synthetic_experience(vocab_size: int, seed: int = 0) -> Experience:
    """A rollout batch of PROMPT_LENGTHS / RESPONSE_LENGTHS rows of random tokens (ids >= 3: no
    special token), pad id 0; every optional per-token field filled with random values."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(PROMPT_LENGTHS)
    prompt_ids = torch.zeros(rows, PROMPT_WIDTH, dtype=torch.long)
    prompt_mask = torch.zeros(rows, PROMPT_WIDTH, dtype=torch.long)
    response_ids = torch.zeros(rows, RESPONSE_WIDTH, dtype=torch.long)
    response_mask = torch.zeros(rows, RESPONSE_WIDTH)
    for row in range(0, rows, 2):  # a group's rows share their prompt
        length = PROMPT_LENGTHS[row]
        prompt_ids[row:row + 2, PROMPT_WIDTH - length:] = torch.randint(3, vocab_size, (length,), generator=generator)
        prompt_mask[row:row + 2, PROMPT_WIDTH - length:] = 1
    for row, length in enumerate(RESPONSE_LENGTHS):
        response_ids[row, :length] = torch.randint(3, vocab_size, (length,), generator=generator)
        response_mask[row, :length] = 1
    per_row = dict(truncated=torch.zeros(rows, dtype=torch.bool), scores=torch.randn(rows, generator=generator),
                   correct=torch.zeros(rows), group_index=torch.arange(rows) // 2)
    return Experience(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                      response_mask=response_mask, rollout_logprobs=torch.zeros(rows, RESPONSE_WIDTH), **per_row)


def with_every_per_token_field(exp: Experience) -> Experience:
    generator = torch.Generator().manual_seed(1)
    for name in PER_TOKEN:
        if getattr(exp, name) is None:
            setattr(exp, name, torch.randn(exp.response_mask.shape, generator=generator))
    exp.env_mask = torch.zeros_like(exp.response_mask)
    return exp


def test_trimming_drops_exactly_the_columns_that_are_padding_in_every_selected_row():
    exp = with_every_per_token_field(synthetic_experience(vocab_size=20))
    exp.env_mask[1, 4] = 1.0  # an environment's token after row 1's last policy token: read, so kept
    rows = torch.tensor([0, 1, 6, 7])
    selected = exp.select(rows)
    trimmed = selected.without_padding()
    prompt_width, response_width = 3, 6  # rows 6, 7's prompt; row 7's response (row 1's read token: 5)
    assert trimmed.prompt_ids.shape == (4, prompt_width) and trimmed.response_ids.shape == (4, response_width)
    for name in PER_PROMPT:  # prompts are left-padded: their leading columns go
        torch.testing.assert_close(getattr(trimmed, name), getattr(selected, name)[:, -prompt_width:], rtol=0, atol=0)
    for name in PER_TOKEN:  # responses are right-padded: their trailing columns go
        torch.testing.assert_close(getattr(trimmed, name), getattr(selected, name)[:, :response_width], rtol=0, atol=0)
    for name in ("truncated", "scores", "correct", "group_index"):  # per row: untouched
        torch.testing.assert_close(getattr(trimmed, name), getattr(selected, name), rtol=0, atol=0)
    assert trimmed.prompt_mask.sum() == selected.prompt_mask.sum()  # no real token dropped
    assert trimmed.sequence_mask().sum() == selected.sequence_mask().sum()
    assert [lengths.tolist() for lengths in trimmed.row_widths()] == [[2, 2, 3, 3], [3, 5, 2, 6]]


def embedded_model():
    """The embedded tiny model (model=tiny: Qwen2-style, tied embeddings), random weights."""
    torch.manual_seed(0)
    _, model = load_tokenizer_and_model(OmegaConf.load(f"{CONFIG_DIR}/model/tiny.yaml"), ArithmeticSource().alphabet)
    return model


MODELS = {"embedded": embedded_model, "smollm2_architecture": lambda: tiny_llama(vocab_size=64)}


@pytest.mark.parametrize("path", ["grouped", "model_forward"])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("rows", [[0, 1, 6, 7], [1, 4, 7]], ids=["whole_groups", "mixed_rows"])
def test_a_trimmed_selection_has_the_training_logprobs_of_the_untrimmed_one(model_name, path, rows, monkeypatch):
    """Positions count real tokens only, so dropping leading prompt padding moves no token: the
    log-probs and entropies of the real tokens are the untrimmed batch's, in the grouped forward
    and in the model's own forward (its position ids and 4-D mask)."""
    model = MODELS[model_name]().float().train()
    if path == "model_forward":
        monkeypatch.setattr(forward, "grouped_forward_unsupported_reason", lambda model: "the test's choice")
    else:
        assert forward.grouped_forward_unsupported_reason(model) is None
    exp = synthetic_experience(model.config.vocab_size).select(torch.tensor(rows))
    trimmed = exp.without_padding()
    assert trimmed.prompt_ids.shape[1] < exp.prompt_ids.shape[1]
    assert trimmed.response_ids.shape[1] < exp.response_ids.shape[1]
    width = trimmed.response_ids.shape[1]
    full = forward.sequence_logprobs(model, *exp.model_inputs(), with_entropy=True)
    short = forward.sequence_logprobs(model, *trimmed.model_inputs(), with_entropy=True)
    real = trimmed.response_mask.bool()
    assert real.sum() == exp.response_mask.sum()
    for untrimmed, kept in zip(full, short):
        torch.testing.assert_close(kept[real], untrimmed[:, :width][real], rtol=1e-5, atol=1e-6)


# --- the gradient -------------------------------------------------------------------------------

TOKEN_BUDGET = 18  # 5 micro-batches of PROMPT_LENGTHS / RESPONSE_LENGTHS, 6 to 13 columns wide


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_by_tokens_give_the_whole_minibatchs_loss_and_gradient(mode, make_config, monkeypatch):
    module = random_online_module(make_config, f"algorithm.loss_agg_mode={mode}", "rollout.max_new_tokens=12")
    module.policy.train()
    exp = module.annotate(synthetic_experience(len(module.tokenizer)))  # the reference's log-probs (k3 as a loss)
    with torch.no_grad():
        exp.rollout_logprobs = module.scoring.logprobs(module.policy, exp)
    generator = torch.Generator().manual_seed(0)
    exp.advantages = torch.randn(len(exp), 1, generator=generator) * exp.response_mask  # both signs
    params = [p for p in module.policy.parameters() if p.requires_grad]
    forwards = []  # (rows, columns) of each micro-batch the learner ran
    run_forward = module.learner.training_forward
    monkeypatch.setattr(module.learner, "training_forward", lambda part, with_values: forwards.append(
        (len(part), part.prompt_ids.shape[1] + part.response_ids.shape[1])) or run_forward(part, with_values))

    def step(micro_batch_tokens):
        module.learner.micro_batch_tokens = micro_batch_tokens
        module.policy.zero_grad(set_to_none=True)
        forwards.clear()
        stats = module.learner.accumulate_gradients(exp)
        return stats, [p.grad.clone() for p in params], list(forwards)

    whole_stats, whole, whole_forwards = step(None)
    split_stats, split, split_forwards = step(TOKEN_BUDGET)
    assert whole_forwards == [(len(exp), max(PROMPT_LENGTHS) + max(RESPONSE_LENGTHS))]  # one, trimmed
    plan = plan_micro_batches(PROMPT_LENGTHS, RESPONSE_LENGTHS, max_tokens=TOKEN_BUDGET)
    assert split_forwards == [(len(rows), max(PROMPT_LENGTHS[r] for r in rows) + max(RESPONSE_LENGTHS[r] for r in rows))
                              for rows in plan]
    assert len(split_forwards) >= 3 and len({width for _, width in split_forwards}) >= 3
    assert all(rows * width <= TOKEN_BUDGET for rows, width in split_forwards)
    assert any(g.abs().sum() > 0 for g in whole)
    for name in ("policy/loss", "policy/kl", "policy/entropy"):
        assert split_stats[name] == pytest.approx(whole_stats[name], rel=1e-5, abs=1e-7), name
    for g, h in zip(whole, split):  # fp32 sums in another order: differences of ~1e-7 of the largest entry
        torch.testing.assert_close(h, g, rtol=1e-5, atol=1e-6 * float(g.abs().max()))


# --- the option ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -64])
def test_a_token_budget_below_one_is_refused_naming_the_key(value, make_config):
    cfg = compose_config(["algorithm=grpo", f"algorithm.micro_batch_tokens={value}"])
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError, match=rf"algorithm\.micro_batch_tokens={value} is not valid: expected null or "
                                          r"a positive integer"):
        check_config(cfg, {})
    with pytest.raises(ConfigError, match=rf"algorithm\.micro_batch_tokens={value} is not valid"):  # a module built
        random_online_module(make_config, f"algorithm.micro_batch_tokens={value}")  # without the start-up check


def test_a_token_budget_reaches_the_learner(make_config):
    module = random_online_module(make_config, "algorithm.micro_batch_tokens=512", "algorithm.micro_batch_size=4")
    assert (module.learner.micro_batch_tokens, module.learner.micro_batch_size) == (512, 4)
