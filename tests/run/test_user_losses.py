"""A researcher's own policy loss, advantage estimator and KL estimator through config alone
(issue 42, item 3): the example of docs/extending.md, a file beside the config with a function
declared by the same decorator as the built-ins, named by `_target_`. The loss trains a real
`posttrain` run launched from that directory; a bad value of its own option is refused at
start-up naming `algorithm.policy_loss.<key>`, before anything trains."""

import json
import sys
import textwrap

import pytest
import torch
from test_input_checks import assert_clean_failure
from test_user_components import SHORT_RUN, posttrain_from

from posttrain import core
from posttrain.algorithms.formulas import check_formulas, loss_keys, resolve_formulas
from posttrain.config.check import check_config
from posttrain.errors import ConfigError

# docs/extending.md, "A policy loss of your own": my_losses.py beside the config
MY_LOSSES = '''
import torch

from posttrain.core import policy_loss
from posttrain.core.options import POSITIVE, Option


@policy_loss("soft_clip", uses=("log_ratio_clamp",),
             options=(Option("softness", 1.0, POSITIVE, "how far off-policy the ratio's weight halves"),))
def soft_clip(logp, old_logp, a, mask, used, o):
    """l_t = -A r / (1 + |r - 1| / softness): the ratio's pull fades off-policy, no hard clip."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -o.log_ratio_clamp, o.log_ratio_clamp))
    loss_mat = -a * ratio / (1.0 + (ratio - 1.0).abs().detach() / o.softness)
    far = ((ratio.detach() - 1.0).abs() > o.softness).to(logp.dtype)
    return loss_mat, {"far_frac": (far * used).sum() / used.sum().clamp_min(1)}
'''

# docs/extending.md, "An advantage or a KL estimator of your own"
MY_ESTIMATORS = '''
import torch

from posttrain.core import advantage_estimator, kl_estimator
from posttrain.core.options import POSITIVE, Option, optional


@advantage_estimator("median_baseline", options=(Option("scale", 1.0, POSITIVE, "multiplies every advantage"),))
@torch.no_grad()
def median_baseline(token_rewards, mask, group_index, values=None, *, scale=1.0):
    """A_i = scale * (R_i - the median score of i's group), at each of i's tokens."""
    scores = (token_rewards * mask).sum(-1)
    medians = torch.stack([scores[group_index == g].median() for g in group_index])
    advantages = scale * (scores - medians).unsqueeze(-1) * mask
    return advantages, advantages.clone()


@kl_estimator("k2_capped", options=(Option("cap", 5.0, optional(POSITIVE), "largest value of a token's term"),))
def k2_capped(logp, ref_logp, old_logp=None, *, cap=5.0):
    """min(0.5 (log pi - log pi_ref)^2, cap)."""
    k2 = 0.5 * (logp - ref_logp.detach()) ** 2
    return k2 if cap is None else torch.clamp(k2, max=cap)
'''

USER_LOSS = "algorithm.policy_loss={_target_:my_losses.soft_clip,softness:0.5}"
RUN = (*SHORT_RUN, "experiment=grpo_tiny", "algorithm.warm_start.steps=0", "algorithm.prompts_per_step=2",
       "algorithm.group_size=4", "rollout.max_new_tokens=8", "eval.num_prompts=8", "logger=csv")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The researcher's directory with my_losses.py and my_estimators.py; what importing them
    registered is taken out again, so the built-in registries stay as they were."""
    directory = tmp_path / "project"
    directory.mkdir()
    (directory / "my_losses.py").write_text(textwrap.dedent(MY_LOSSES))
    (directory / "my_estimators.py").write_text(textwrap.dedent(MY_ESTIMATORS))
    monkeypatch.syspath_prepend(str(directory))
    yield directory
    for module in ("my_losses", "my_estimators"):
        sys.modules.pop(module, None)
    core.POLICY_LOSSES.pop("soft_clip", None)
    core.ADVANTAGE_ESTIMATORS.pop("median_baseline", None)
    core.KL_ESTIMATORS.pop("k2_capped", None)


def test_a_user_loss_trains_a_real_run_launched_beside_it(project, tmp_path):
    result = posttrain_from(project, *RUN, USER_LOSS, log_dir=tmp_path / "outputs")
    assert result.returncode == 0, result.stderr + result.stdout
    records = [json.loads(line) for path in (tmp_path / "outputs").rglob("metrics.jsonl")
               for line in path.read_text().splitlines()]
    assert any("policy/far_frac" in record for record in records), records  # a stat only the user's loss returns
    summary = json.loads(next((tmp_path / "outputs").rglob("summary.json")).read_text())
    assert summary["global_step"] == 2


def test_a_bad_value_of_the_user_losss_own_option_is_refused_at_start_up(project, tmp_path):
    log_dir = tmp_path / "outputs"
    result = posttrain_from(project, *RUN, "algorithm.policy_loss={_target_:my_losses.soft_clip,softness:-1}",
                            log_dir=log_dir)
    assert_clean_failure(result, log_dir, "posttrain: error:", "algorithm.policy_loss.softness=-1 is not valid: "
                         "expected a number > 0 (how far off-policy the ratio's weight halves)")


def test_the_user_loss_is_resolved_like_a_built_in(project, make_config):
    cfg = make_config("experiment=grpo_tiny", USER_LOSS)
    formulas = resolve_formulas(cfg.algorithm, cfg.advantage, cfg.kl_estimator, 8)
    check_formulas(formulas)
    assert formulas.policy_loss_name == "soft_clip" and formulas.loss_options["softness"] == 0.5
    logp, old, adv, mask = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3)
    loss, stats = formulas.policy_loss(logp, old, adv, mask, **formulas.loss_options, **formulas.aggregation)
    assert loss.item() == pytest.approx(-1.0) and stats["far_frac"].item() == 0.0
    assert "policy_loss" in loss_keys(cfg.algorithm) and "clip_high" in loss_keys(cfg.algorithm)
    for override, named in (
        ("algorithm.policy_loss={_target_:my_losses.soft_clip,sofness:1}",
         "algorithm.policy_loss: unknown key(s) ['sofness']; valid keys: softness"),
        ("algorithm.policy_loss={_target_:my_losses.soft_clip}", None),  # softness at its declared default
        ("algorithm.policy_loss={_target_:my_losses.nothing}", "algorithm.policy_loss._target_='my_losses.nothing'"),
        ("algorithm.policy_loss={_target_:torch.exp}", "is not declared with @posttrain.core.policy_loss"),
    ):
        if named is None:
            check_config(make_config("experiment=grpo_tiny", override))
        else:
            with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
                check_config(make_config("experiment=grpo_tiny", override))


def test_a_user_loss_refuses_a_shared_option_it_does_not_read(project, make_config):
    with pytest.raises(ConfigError, match=r"policy loss 'soft_clip' does not use clip_high \(got 0.3\)"):
        check_config(make_config("experiment=grpo_tiny", USER_LOSS, "algorithm.clip_high=0.3"))


def test_a_user_advantage_and_kl_estimator_are_named_by_target_and_checked(project, make_config):
    advantage = ("advantage=none", "advantage.name=median_baseline",
                 "+advantage._target_=my_estimators.median_baseline", "+advantage.scale=2.0")
    kl = ("kl_estimator=none", "kl_estimator.name=k2_capped", "+kl_estimator._target_=my_estimators.k2_capped",
          "kl_estimator.coef=0.01", "kl_estimator.placement=as_loss", "+kl_estimator.cap=3.0")
    cfg = make_config("experiment=grpo_tiny", *advantage, *kl)
    check_config(cfg)
    formulas = resolve_formulas(cfg.algorithm, cfg.advantage, cfg.kl_estimator, 8)
    assert (formulas.advantage_name, formulas.advantage_options) == ("median_baseline", {"scale": 2.0})
    assert (formulas.kl_name, formulas.kl_options) == ("k2_capped", {"cap": 3.0})
    rewards = torch.tensor([[1.0], [0.0], [3.0]])
    advantages, _ = formulas.advantage(rewards, torch.ones(3, 1), torch.tensor([0, 0, 0]), **formulas.advantage_options)
    assert advantages.flatten().tolist() == [0.0, -2.0, 4.0]  # the median 1 is the baseline
    logp = torch.tensor([[0.0, -4.0]])
    assert formulas.kl(logp, torch.zeros(1, 2), **formulas.kl_options).tolist() == [[0.0, 3.0]]
    for overrides, named in (
        ((*advantage[:3], "+advantage.scale=0"), "advantage.scale=0 is not valid: expected a number > 0"),
        ((*kl[:5], "+kl_estimator.cap=-1"), "kl_estimator.cap=-1 is not valid"),
        ((*kl[:5], "+kl_estimator.value_clamp=1"), "kl_estimator: unknown key(s) ['value_clamp']"),
        (("advantage=none", "advantage.name=median", "+advantage._target_=my_estimators.median_baseline"),
         "advantage.name='median', but advantage._target_='my_estimators.median_baseline' is declared as "
         "'median_baseline'"),
    ):
        with pytest.raises(ConfigError) as caught:
            check_config(make_config("experiment=grpo_tiny", *overrides))
        assert named in str(caught.value)


def test_the_examples_are_those_of_the_docs():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    for example in (MY_LOSSES, MY_ESTIMATORS):
        assert textwrap.dedent(example).strip() in docs
