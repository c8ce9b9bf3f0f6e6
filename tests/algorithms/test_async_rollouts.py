"""Asynchronous rollouts (rollout.max_staleness, a producer process) and partial rollouts
(rollout.partial_budget): the collector continues responses across generate calls exactly,
a producer at staleness 0 is the synchronous pipeline to the last digit, a producer ahead of
the trainer lags at most max_staleness versions, and its failures stop the run by name."""

import io
import json
import math

import pytest
import torch
from conftest import EASY_TASK, FAST_RUN, module_from_config

from posttrain.errors import ConfigError, RewardError
from posttrain.rollout import RolloutBatch
from posttrain.rollout.repetition import RepetitionRule, first_repetition
from posttrain.train import run

# each new response's tokens (its EOS appended when it ends before max_new_tokens), by order of appearance
PLANS = [[5, 6], [7, 8, 9, 10, 11], [12, 13, 14], [15] * 9, [16], [17, 18, 19, 20], [21, 22], [23, 24, 25, 26, 27, 28]]
MAX_NEW = 6


class ScriptedSampler:
    """A `generate` that gives the i-th response it meets PLANS[i % len] (then an EOS), at most
    `params.max_new_tokens` tokens per call. A row it has seen before (its prompt followed by the
    tokens it gave so far) continues where it stopped. Log-prob of a plan's k-th token: -k / 100."""

    def __init__(self, eos: int, pad: int):
        self.eos, self.pad = eos, pad
        self.known: dict[tuple, tuple[list[int], int]] = {}  # row seen -> (its plan, tokens given)
        self.started = 0
        self.calls: list[list[tuple]] = []

    def generate(self, prompt_ids, prompt_mask, params, generator=None):
        rows = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(prompt_ids, prompt_mask)]
        self.calls.append(rows)
        width = params.max_new_tokens
        tokens = torch.full((len(rows), width), self.pad)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        logprobs = torch.zeros((len(rows), width))
        truncated = torch.zeros(len(rows), dtype=torch.bool)
        for i, row in enumerate(rows):
            if row in self.known:
                plan, given = self.known.pop(row)
            else:
                plan, given = PLANS[self.started % len(PLANS)] + [self.eos], 0
                self.started += 1
            segment = plan[given:given + width]
            tokens[i, :len(segment)], mask[i, :len(segment)] = torch.tensor(segment), 1
            logprobs[i, :len(segment)] = -torch.arange(given + 1, given + len(segment) + 1) / 100
            truncated[i] = self.eos not in segment
            self.known[row + tuple(segment)] = (plan, given + len(segment))
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=tokens, response_mask=mask,
                            logprobs=logprobs, truncated=truncated, repeated=torch.zeros(len(rows), dtype=torch.bool))


def partial_module(make_config, *extra):
    cfg = make_config(*FAST_RUN, "algorithm=grpo", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
                      f"rollout.max_new_tokens={MAX_NEW}", "rollout.partial_budget=2", *extra)
    module = module_from_config(cfg)
    sampler = ScriptedSampler(module.tokenizer.eos_token_id, module.tokenizer.pad_token_id)
    module.rollouts.collector.sampler = sampler
    return module, sampler


def test_partial_rollouts_continue_each_response_where_it_stopped(make_config):
    module, sampler = partial_module(make_config)
    collector, eos = module.rollouts.collector, module.tokenizer.eos_token_id
    batches = []
    for index in range(3):
        collector.version = index  # as the trainer's updates would advance it
        batches.append(collector.collect(index))
    for batch in batches:
        exp = batch.experience
        assert len(exp) == 4 and exp.group_index.tolist() == [0, 0, 1, 1]  # whole groups, renumbered
        for row in range(len(exp)):
            length = int(exp.response_mask[row].sum())
            tokens = exp.response_ids[row, :length].tolist()
            plan = next(p for p in PLANS if p[:1] == tokens[:1])
            whole = (plan + [eos])[:MAX_NEW]
            assert tokens == whole  # the segments joined are the response sampled in one go
            assert exp.truncated[row] == (len(plan) + 1 > MAX_NEW)
            # the sampler's log-probs follow the tokens across segments
            assert torch.allclose(exp.rollout_logprobs[row, :length], -torch.arange(1, length + 1) / 100)
            assert int(exp.segments[row]) == math.ceil(length / 2)
            # each segment carries the version that sampled it, never newer than the batch's
            versions = exp.policy_version[row, :length]
            assert (versions[1:] >= versions[:-1]).all() and int(versions[-1]) <= batch.index
    # a continued row was sent back as its prompt followed by its tokens so far
    continued = [row for call in sampler.calls[1:] for row in call if len(row) > min(map(len, sampler.calls[0]))]
    assert continued
    assert any((batch.experience.segments > 1).any() for batch in batches)
    # no prompt lost or repeated: every group drawn is in a batch, under way, or waiting
    drawn = collector.curriculum.cursor.position
    pending_groups = {r.group for r in collector.pending}
    waiting = sum(len(exp.group_index.unique()) for exp, _ in collector.ready)
    assert drawn == 3 * 2 + len(pending_groups) + waiting


def test_a_continued_response_stops_at_a_loop_that_spans_segments(make_config):
    module, _ = partial_module(make_config, "rollout.repetition.ngram=1", "rollout.repetition.window=4")
    collector = module.rollouts.collector
    exp = collector.collect(0).experience
    loop_rows = [row for row in range(len(exp)) if int(exp.response_ids[row, 0]) == 15]
    assert loop_rows, "the looping plan was not drawn"
    expected = int(first_repetition(torch.tensor([[15] * MAX_NEW]), collector.eos_ids,
                                    RepetitionRule(ngram=1, window=4))[0]) + 1
    for row in loop_rows:
        assert exp.repeated[row] and not exp.truncated[row]
        assert int(exp.response_mask[row].sum()) == expected  # where one call would have stopped it


def test_partial_rollouts_keep_their_state_through_a_checkpoint(make_config):
    module, _ = partial_module(make_config)
    module.rollouts.collector.collect(0)
    # one more call of a batch under way: its responses have one segment of 2 tokens so far
    module.rollouts.collector.continue_partial(module.rollouts.collector.curriculum.next_prompts(2), torch.Generator())
    state = module.rollouts.collector.state_dict()
    assert state["pending"], "nothing under way to keep"
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as a Lightning checkpoint holds it, loaded back as Lightning loads one
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    fresh, _ = partial_module(make_config)
    fresh.rollouts.collector.load_partial_state(state)
    assert [r.tokens.tolist() for r in fresh.rollouts.collector.pending] == [r.tokens.tolist() for r in module.rollouts.collector.pending]
    assert [r.example for r in fresh.rollouts.collector.pending] == [r.example for r in module.rollouts.collector.pending]
    assert fresh.rollouts.collector.next_group == module.rollouts.collector.next_group


def metric_rows(summary_dir) -> dict[tuple[int, str], float]:
    rows = {}
    for line in (summary_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key not in ("step", "batch") and not key.startswith("perf/"):
                rows[(row["step"], key)] = value
    return rows


# whole: 24 s, slow; a producer of whole responses also runs below (ahead) and in tests/envs/test_episodes.py
@pytest.mark.parametrize("partial", [pytest.param(False, marks=pytest.mark.slow), True], ids=["whole", "partial"])
def test_a_producer_at_staleness_0_is_the_synchronous_pipeline(make_config, sft_start, tmp_path, partial):
    """The producer process draws the same prompts, samples with the same weights and seeds,
    and gets the curriculum's feedback before each batch: every metric equals the trainer's own."""
    overrides = (*FAST_RUN, *EASY_TASK, "algorithm=grpo", f"model.init_from={sft_start}", "algorithm.prompts_per_step=4",
                 "algorithm.group_size=4", "trainer.max_steps=3", "eval.at_start=false",
                 "data_curriculum=dynamic_sampling", *(["rollout.partial_budget=3"] if partial else []))
    run(make_config(*overrides, "rollout.producer=inline", output_dir=tmp_path / "inline"))
    run(make_config(*overrides, "rollout.producer=process", output_dir=tmp_path / "process"))
    inline, process = metric_rows(tmp_path / "inline"), metric_rows(tmp_path / "process")
    # a producer process also logs its staleness (which the synchronous pipeline has none of)
    assert {key for _, key in process.keys() - inline.keys()} <= {"rollout/staleness_mean", "rollout/staleness_max"}
    assert inline.keys() <= process.keys()
    differ = [(key, inline[key], process[key]) for key in inline if inline[key] != process[key]]
    assert not differ, differ[:5]
    staleness = [v for (_, k), v in process.items() if k == "rollout/staleness_max"]
    assert len(staleness) == len([k for _, k in process if k == "rollout/reward_mean"]) > 0
    if not partial:  # continued responses carry the versions of their earlier segments
        assert set(staleness) == {0}


def test_a_producer_ahead_lags_at_most_max_staleness(make_config, sft_start, tmp_path):
    summary = run(make_config(*FAST_RUN, *EASY_TASK, "algorithm=grpo", f"model.init_from={sft_start}",
                              "algorithm.prompts_per_step=4", "algorithm.group_size=4", "trainer.max_steps=6",
                              "eval.at_start=false", "rollout.max_staleness=2", "rollout.correction.tis=token",
                              output_dir=tmp_path))
    assert summary["global_step"] == 6
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "rollout/staleness_max" in row]
    assert [row["rollout/batch"] for row in train] == [1, 2, 3, 4, 5, 6]  # each batch once, in order
    assert all(row["rollout/staleness_max"] <= 2 for row in train)
    assert train[0]["rollout/staleness_max"] == 0  # the first batch: the starting weights, nothing trained yet


def test_a_failing_reward_in_the_producer_stops_the_run_naming_it(make_config, sft_start, tmp_path):
    cfg = make_config(*FAST_RUN, *EASY_TASK, "algorithm=grpo", f"model.init_from={sft_start}",
                      "algorithm.prompts_per_step=2", "algorithm.group_size=2", "trainer.max_steps=2",
                      "eval.at_start=false", "rollout.max_staleness=1",
                      "+reward.components.boom._target_=test_grpo.exploding_reward", output_dir=tmp_path)
    with pytest.raises(RewardError, match="boom"):
        run(cfg)
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("overrides, words", [
    (["rollout.producer=inline", "rollout.max_staleness=1"], "rollout.producer=process"),
    (["rollout.producer=thread"], "rollout.producer='thread'"),
])
def test_a_producer_that_cannot_sample_ahead_is_refused(make_config, overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        module_from_config(make_config(*FAST_RUN, "algorithm=grpo", *overrides))


def test_the_warm_start_of_an_asynchronous_corrected_run_is_a_valid_sft_run(make_config):
    """The SFT warm start made for an RL run samples no rollout batches: the run's producer,
    partial rollouts and corrections are off in its config (which the SFT check would refuse),
    and it is the same cache entry as the synchronous run's."""
    from omegaconf import OmegaConf

    from posttrain.config.check import check_config
    from posttrain.prepare.warm_start import warm_start_plan

    cfg = make_config("algorithm=grpo", "rollout.max_staleness=1", "rollout.partial_budget=4",
                      "rollout.correction.tis=token", "rollout.mismatch_budget.kl=0.1")
    plain = make_config("algorithm=grpo")
    OmegaConf.resolve(cfg), OmegaConf.resolve(plain)
    sft_cfg, target = warm_start_plan(cfg)
    check_config(sft_cfg, {"algorithm": "sft"})
    assert sft_cfg.rollout.max_staleness == 0 and sft_cfg.rollout.correction.tis is None
    assert target == warm_start_plan(plain)[1]
