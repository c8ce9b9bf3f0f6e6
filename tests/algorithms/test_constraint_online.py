"""The Lagrangian constraint of the reward (reward.constraint, conf/reward/length_constraint.yaml):
the reward stage stores the cost on the Experience, out of the total; the trainer subtracts
lambda x the cost over its limit and steps lambda from the batch's mean cost over every rank's
rows; lambda is logged and checkpointed; a bad constraint is refused naming its key. The
formulas themselves are tested in tests/core/test_constraint.py."""

import json

import pytest
import torch
from conftest import EASY_TASK, FAST_RUN, compose_config, module_from_config
from omegaconf import OmegaConf

from posttrain import core
from posttrain.algorithms.online.parts import constraint as online
from posttrain.algorithms.experience import Experience
from posttrain.config.check import check_config
from posttrain.errors import ConfigError
from posttrain.train import run

LIMIT, LR = 0.5, 1.0
SMALL_RANDOM_POLICY = ("model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
                       "model.intermediate_size=64", "algorithm.warm_start.steps=0")


def constraint_overrides(*overrides):
    return (*FAST_RUN, *EASY_TASK, *SMALL_RANDOM_POLICY, "algorithm=grpo", "algorithm.prompts_per_step=3",
            "algorithm.group_size=2", "reward=length_constraint", f"reward.constraint.limit={LIMIT}",
            f"reward.constraint.lr={LR}", *overrides)


def constraint_module(make_config, *overrides):
    """A GRPO module on a small random policy, its reward accuracy under the length constraint."""
    return module_from_config(make_config(*constraint_overrides(*overrides)))


def batch(scores, cost) -> Experience:
    """An Experience of len(scores) one-token responses with these rewards and costs."""
    rows = len(scores)
    return Experience(prompt_ids=torch.zeros(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1),
                      response_ids=torch.zeros(rows, 1, dtype=torch.long), response_mask=torch.ones(rows, 1),
                      rollout_logprobs=torch.zeros(rows, 1), truncated=torch.zeros(rows, dtype=torch.bool),
                      scores=torch.tensor(scores), correct=torch.tensor(scores),
                      group_index=torch.zeros(rows, dtype=torch.long),
                      cost=torch.tensor(cost))


def test_the_cost_is_stored_on_the_experience_out_of_the_total(make_config):
    module = constraint_module(make_config)
    exp, metrics, _ = module.collect(step=0)
    lengths = exp.response_mask.sum(dim=1)
    torch.testing.assert_close(exp.cost, lengths / module.rollout_cfg.max_new_tokens)  # response_length's score
    torch.testing.assert_close(exp.scores, exp.correct)  # the total: accuracy alone (the cost has weight 0)
    assert metrics["rewards/response_length/mean"] == pytest.approx(float(exp.cost.mean()))


def test_the_penalty_and_the_dual_step_by_hand(make_config):
    module = constraint_module(make_config)
    module.part("constraint").multiplier = core.Multiplier.start(2.0)
    exp, metrics = module.part("constraint").after_collect(batch([1.0, 0.0, 1.0, 0.0], [0.25, 1.0, 0.75, 0.5]))
    # excess over the limit 0.5: [0, 0.5, 0.25, 0] -> R = r - 2 * excess = [1, -1, 0.5, 0]
    assert exp.scores.tolist() == pytest.approx([1.0, -1.0, 0.5, 0.0])
    # mean cost 0.625: lambda <- 2 + 1.0 * (0.625 - 0.5) = 2.125
    assert module.part("constraint").multiplier.value == pytest.approx(2.125)
    assert metrics == pytest.approx({"rewards/constraint/lambda": 2.125, "rewards/constraint/cost_mean": 0.625,
                                     "rewards/constraint/violation": 0.125,
                                     "rewards/constraint/over_limit_frac": 0.5,   # 1.0 and 0.75
                                     "rewards/constraint/penalty_mean": 0.375})   # (0 + 1 + 0.5 + 0) / 4
    # a batch under the limit: lambda falls by 1.0 * (0.1 - 0.5) = -0.4, and nothing is penalised
    exp, _ = module.part("constraint").after_collect(batch([1.0, 0.0], [0.1, 0.1]))
    assert module.part("constraint").multiplier.value == pytest.approx(1.725) and exp.scores.tolist() == [1.0, 0.0]
    # ... down to 0 and no further
    module.part("constraint").multiplier = core.Multiplier.start(0.3)
    module.part("constraint").after_collect(batch([1.0, 0.0], [0.0, 0.0]))
    assert module.part("constraint").multiplier.value == 0.0


def test_lambda_fixed_by_a_zero_learning_rate(make_config):
    module = constraint_module(make_config, "reward.constraint.lr=0", "reward.constraint.init=0.8")
    assert module.part("constraint").multiplier.value == 0.8
    exp, metrics = module.part("constraint").after_collect(batch([1.0, 1.0], [1.0, 0.0]))
    assert exp.scores.tolist() == pytest.approx([0.6, 1.0])  # 1 - 0.8 * 0.5
    assert module.part("constraint").multiplier.value == metrics["rewards/constraint/lambda"] == 0.8


def test_a_pid_multiplier_steps_from_the_batch_mean_cost(make_config):
    module = constraint_module(make_config, "reward.constraint.kp=2.0", "reward.constraint.kd=4.0",
                               "reward.constraint.init=1.0")
    module.part("constraint").after_collect(batch([1.0, 0.0], [0.75, 0.75]))
    # I = 1 + 1.0 * 0.25 = 1.25; no previous cost: lambda = 2 * 0.25 + 1.25 = 1.75
    assert (module.part("constraint").multiplier.value, module.part("constraint").multiplier.integral) == pytest.approx((1.75, 1.25))
    exp, metrics = module.part("constraint").after_collect(batch([1.0, 0.0], [1.0, 0.8]))
    assert exp.scores.tolist() == pytest.approx([1.0 - 1.75 * 0.5, -1.75 * 0.3])  # this batch pays the old lambda
    # mean 0.9, a rise of 0.15: I = 1.25 + 0.4 = 1.65; lambda = 2 * 0.4 + 1.65 + 4 * 0.15 = 3.05
    assert metrics["rewards/constraint/lambda"] == module.part("constraint").multiplier.value == pytest.approx(3.05)
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    resumed = constraint_module(make_config, "reward.constraint.kp=2.0", "reward.constraint.kd=4.0")
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.part("constraint").multiplier == module.part("constraint").multiplier  # the integral and the last cost too: the next step is the same


def test_a_training_step_trains_on_the_penalised_reward_and_logs_lambda(make_config):
    module = constraint_module(make_config, "reward.constraint.init=1.0")
    seen = {}
    compute_advantages = module.compute_advantages

    def recording(exp):
        seen["exp"] = exp
        return compute_advantages(exp)

    module.compute_advantages = recording
    module.update = lambda exp, has_signal=True: module.learner.accumulate_gradients(exp)  # no optimiser outside a Trainer
    module.log_step_metrics = lambda metrics: seen.update(logged=metrics)
    collected = {}
    collect = module.collect

    def keeping(step):
        collected["exp"], metrics, signal = collect(step)
        collected["scores"] = collected["exp"].scores.clone()
        return collected["exp"], metrics, signal

    module.collect = keeping
    module.training_step(None, 0)
    raw = collected["exp"]
    expected = core.constrained_reward(collected["scores"], raw.cost, 1.0, LIMIT)
    torch.testing.assert_close(seen["exp"].scores, expected)
    logged = seen["logged"]
    mean_cost = float(raw.cost.double().mean())
    assert logged["rewards/constraint/cost_mean"] == pytest.approx(mean_cost)
    assert logged["rewards/constraint/lambda"] == pytest.approx(max(0.0, 1.0 + LR * (mean_cost - LIMIT)))
    assert logged["rollout/reward_mean"] == pytest.approx(float(expected.mean()))  # what was trained on
    assert logged["rewards/total/mean"] == pytest.approx(float(collected["scores"].mean()))  # the reward stage's


def test_lambda_is_checkpointed_and_restored(make_config):
    module = constraint_module(make_config)
    module.part("constraint").multiplier = core.Multiplier.start(0.37)
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["constraint_lambda"] == 0.37
    resumed = constraint_module(make_config)
    assert resumed.part("constraint").multiplier.value == 0.0  # init
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.part("constraint").multiplier.value == 0.37


def test_two_ranks_hold_one_lambda_that_of_their_union(make_config, monkeypatch):
    """Each rank steps lambda from the mean cost of both ranks' rows (all_reduce_sum), so the two
    end with one lambda: that of one process on the union of their batches, not their own."""
    module = constraint_module(make_config)
    ranks = [batch([1.0, 0.0, 1.0], [0.9, 0.8, 1.0]), batch([0.0, 1.0], [0.1, 0.2])]  # mean costs 0.9 and 0.15
    # what each rank contributes to the all-reduce, taken alone
    sums = []
    monkeypatch.setattr(online, "all_reduce_sum", lambda x: sums.append(x.clone()) or x)
    for exp in ranks:
        module.part("constraint").multiplier = core.Multiplier.start(1.0)
        module.part("constraint").after_collect(exp)
    # each rank again, its all-reduce adding the other rank's sums
    lambdas, logged = [], []
    for rank, exp in enumerate(ranks):
        other = sums[1 - rank]
        monkeypatch.setattr(online, "all_reduce_sum", lambda x, other=other: x + other)
        module.part("constraint").multiplier = core.Multiplier.start(1.0)
        logged.append(module.part("constraint").after_collect(exp)[1])
        lambdas.append(module.part("constraint").multiplier.value)
    # the union: mean cost (0.9 + 0.8 + 1.0 + 0.1 + 0.2) / 5 = 0.6 -> lambda = 1 + 1.0 * (0.6 - 0.5) = 1.1
    assert lambdas[0] == lambdas[1] == pytest.approx(1.1)
    assert logged[0] == logged[1]
    monkeypatch.setattr(online, "all_reduce_sum", lambda x: x)
    module.part("constraint").multiplier = core.Multiplier.start(1.0)
    _, union = module.part("constraint").after_collect(Experience.concat(ranks, pad_token_id=0))
    assert union == pytest.approx(logged[0])
    # each rank alone would have moved lambda apart: 1.4 and 0.65
    assert [core.dual_ascent_step(1.0, m, LIMIT, LR) for m in (0.9, 0.15)] == pytest.approx([1.4, 0.65])


@pytest.mark.slow  # 12 s; the cost and lambda are tested in-process above, a producer process in test_async_rollouts.py
def test_a_producer_process_stores_the_cost_and_the_trainer_applies_lambda(tmp_path):
    """rollout.producer=process at staleness 0: the reward is scored in another process, lambda
    stays in the trainer, and every metric (lambda's included) is the synchronous pipeline's."""
    rows = {}
    for producer in ("inline", "process"):
        out = tmp_path / producer
        run(compose_config([*constraint_overrides("trainer.max_steps=3", "eval.at_start=false",
                                                  "reward.constraint.limit=0.1", "eval.num_prompts=8",
                                                  "eval.batch_size=8"), f"rollout.producer={producer}"], out))
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rows[producer] = [{k: v for k, v in line.items() if k.startswith("rewards/")}
                          for line in lines if "rewards/constraint/lambda" in line]
    assert len(rows["inline"]) == 3 and rows["inline"] == rows["process"]
    assert [row["rewards/constraint/lambda"] > 0 for row in rows["inline"]] == [True] * 3  # costs over 0.1


@pytest.mark.parametrize("overrides, named", [
    (["reward.constraint.lr=-1"], "reward.constraint.lr=-1 is not valid: expected a number >= 0"),
    (["reward.constraint.kd=-0.5"], "reward.constraint.kd=-0.5 is not valid: expected a number >= 0"),
    (["reward.constraint.cost=accuracy"], "reward.constraint.cost='accuracy' is a component with weight 1.0"),
    (["reward.constraint.cost=length"], "reward.constraint.cost='length' names no component of reward.components"),
    (["+reward.constraint.rate=1"], r"reward.constraint: unknown key\(s\) \['rate'\]"),
    (["~reward.constraint.limit"], r"reward.constraint: missing key\(s\) \['limit'\]"),
    (["reward.components.response_length.normalize_by=tokens"],
     "reward.components.response_length.normalize_by='tokens' is not valid"),
])
def test_a_bad_constraint_is_refused_naming_its_key(overrides, named):
    cfg = compose_config(["algorithm=grpo", "reward=length_constraint", *overrides])
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError, match=named):
        check_config(cfg, {})


def test_a_module_built_without_the_start_up_check_refuses_a_bad_constraint(make_config):
    with pytest.raises(ConfigError, match="reward.constraint.cost='accuracy' is a component with weight 1.0"):
        constraint_module(make_config, "reward.constraint.cost=accuracy")
